"""Devices: the ``mesh`` section (data, fsdp, tensor axes) and the ``memory`` section (the
pre-flight memory check), with their checks."""
from __future__ import annotations

from typing import Any

from rljax.config.base import ConfigError


def mesh() -> dict[str, Any]:
    return dict(data=-1, fsdp=1, tensor=1)  # -1 = the rest of the devices


def memory() -> dict[str, Any]:
    return dict(
        check="auto",                # pre-flight memory check in `train` (rljax.plan): "full"
                                     # compiles every phase; "auto" = full on GPU/TPU or when
                                     # device_memory_gb is set, else resident state only; "off"
        device_memory_gb=0.0,        # per-device memory to plan against; 0 = ask the device
    )


SECTIONS = {"mesh": mesh, "memory": memory}

CHOICES = {"memory.check": ("auto", "full", "off")}

RANGES = (("memory.device_memory_gb", 0.0, None),)


def check_mesh(cfg) -> None:
    sizes = dict(cfg.mesh.items())
    if sum(1 for v in sizes.values() if v == -1) > 1:
        raise ConfigError(f"mesh: at most one axis may be -1, got {sizes}")
    for name, size in sizes.items():
        if size != -1 and size < 1:
            raise ConfigError(f"mesh.{name}={size} must be >= 1 (or -1 for the rest)")
