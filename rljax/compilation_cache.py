"""JAX's persistent compilation cache, on by default, so a run compiles each program once ever.

A second ``rljax train`` (or ``eval``/``sample``/``export``/``plan``) of the same config, model
and mesh loads every executable from disk instead of compiling it again. Executables are keyed
by JAX on the program, the backend and the compiler flags, so a stale entry is never used.

Config: ``compilation_cache_dir`` = ``"auto"`` (``$RLJAX_CACHE_DIR/jax`` or
``~/.cache/rljax/jax``), a directory (local or a URL JAX can write), or ``""`` to turn it off.
"""
from __future__ import annotations

import os

import jax


def resolve_dir(setting: str) -> str | None:
    """The cache directory for a ``compilation_cache_dir`` setting (None = off)."""
    if not setting:
        return None
    if setting != "auto":
        return setting
    root = os.environ.get("RLJAX_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rljax")
    return os.path.join(root, "jax")


def enable(setting: str = "auto") -> str | None:
    """Points JAX's persistent compilation cache at ``resolve_dir(setting)``; returns the
    directory (None when off). Call before the first compilation you want cached; calling it
    again with the same setting is a no-op."""
    path = resolve_dir(setting)
    if path is None:
        return None
    if jax.config.jax_compilation_cache_dir != path:
        jax.config.update("jax_compilation_cache_dir", path)
        # Cache every program, however quick to compile: a run's first iteration compiles
        # dozens of small ones, and together they are most of its start-up time on CPU.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
