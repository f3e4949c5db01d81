"""Devices: the ``mesh`` section (data, fsdp, expert, tensor axes; the rollout devices of
asynchronous RL and their own axes) and the ``memory`` section (the pre-flight memory check),
with their checks."""
from __future__ import annotations

from typing import Any

from rljax.config.base import ConfigError


AXES = ("data", "fsdp", "expert", "tensor")   # the training mesh's axes (rljax.sharding.MESH_AXES)


def mesh() -> dict[str, Any]:
    return dict(
        data=-1, fsdp=1, tensor=1,   # -1 = the rest of the devices
        expert=1,                    # expert parallelism (mixtures of experts; the batch too)
        # Asynchronous RL (algo.asynchronous; docs/internals.md): the last `rollout_devices`
        # devices sample (several processes: the last rollout_devices / processes of each),
        # on a mesh of their own shaped by `rollout`; the others train on
        # data x fsdp x tensor. 0 = one mesh for both.
        rollout_devices=0,
        rollout=dict(data=-1, fsdp=1, expert=1, tensor=1),
    )


def axis_sizes(mesh_cfg) -> dict[str, int]:
    """``{data, fsdp, expert, tensor}`` of the training mesh (or of ``mesh.rollout``): the axis keys of
    a mesh section, without the split's own keys."""
    return {k: int(mesh_cfg[k]) for k in AXES}


def memory() -> dict[str, Any]:
    return dict(
        check="auto",                # pre-flight memory check in `train` (rljax.plan): "full"
                                     # compiles every phase; "auto" = full on GPU/TPU or when
                                     # device_memory_gb is set, else resident state only; "off"
        device_memory_gb=0.0,        # per-device memory to plan against; 0 = ask the device
    )


SECTIONS = {"mesh": mesh, "memory": memory}

CHOICES = {"memory.check": ("auto", "full", "off")}

RANGES = (("memory.device_memory_gb", 0.0, None), ("mesh.rollout_devices", 0, None))


def _check_axes(sizes: dict, prefix: str) -> None:
    if sum(1 for v in sizes.values() if v == -1) > 1:
        raise ConfigError(f"{prefix}: at most one axis may be -1, got {sizes}")
    for name, size in sizes.items():
        if size != -1 and size < 1:
            raise ConfigError(f"{prefix}.{name}={size} must be >= 1 (or -1 for the rest)")


def check_mesh(cfg) -> None:
    """Axis sizes of both meshes; the split only for asynchronous RL, with a rollout mesh
    whose fixed axes divide its devices (the device count itself is checked by
    ``rljax.train.core.inputs.check_inputs``, which knows it)."""
    _check_axes(axis_sizes(cfg.mesh), "mesh")
    n = int(cfg.mesh.rollout_devices)
    if not n:
        return
    if not cfg.algo.asynchronous:
        raise ConfigError(f"mesh.rollout_devices={n} gives the sampler devices of its own, "
                          "which only asynchronous RL uses: set algo.asynchronous=true (or "
                          "mesh.rollout_devices=0)")
    sizes = axis_sizes(cfg.mesh.rollout)
    _check_axes(sizes, "mesh.rollout")
    fixed = 1
    for v in sizes.values():
        fixed *= 1 if v == -1 else v
    if n % fixed or (-1 not in sizes.values() and fixed != n):
        raise ConfigError(f"mesh.rollout {sizes} does not fit mesh.rollout_devices={n}")

