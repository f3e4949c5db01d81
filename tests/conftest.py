"""Test-wide setup: 8 fake CPU devices so sharding tests run without accelerators.

XLA reads XLA_FLAGS once, when the backend starts, so this must run before anything imports jax.
Unsharded tests simply use device 0.
"""
import gc
import os
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

# Tests keep out of the user's cache directory: a developer's old entries must not change what a
# test runs, and a test run must not fill ~/.cache. The persistent compilation cache still works
# within the session (later modules load what earlier ones compiled), in a directory of its own.
os.environ["RLJAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="rljax-tests-cache-")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs_after_each_module():
    """Drops every compiled program when a test module ends. Each XLA:CPU executable keeps its
    machine code in memory mappings of its own; kept for the whole session, they neared the
    kernel's per-process limit (vm.max_map_count, 65,530: ~35,000 mappings at 60% of the
    suite) and loading or compiling one more then failed inside jaxlib, killing the run (twice,
    at ~91%, in `compilation_cache.get_executable_and_time`)."""
    yield
    import jax
    jax.clear_caches()
    gc.collect()
