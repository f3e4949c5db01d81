"""Test-wide setup: 8 fake CPU devices so sharding tests run without accelerators.

XLA reads XLA_FLAGS once, when the backend starts, so this must run before anything imports jax.
Unsharded tests simply use device 0.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
