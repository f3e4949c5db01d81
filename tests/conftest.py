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
# test runs, and a test run must not fill ~/.cache. CLI subprocesses share this session's one.
os.environ["RLJAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="rljax-tests-cache-")


@pytest.fixture(autouse=True, scope="session")
def _no_persistent_compilation_cache_in_this_process():
    """The pytest process itself compiles everything afresh instead of loading executables
    from JAX's persistent cache. Twice in a full run (never alone, 30 tries) loading one there
    crashed the whole process inside jaxlib (`get_executable_and_time`, after ~700 tests'
    programs); one crashed test would lose the whole run. The cache itself is tested in fresh
    processes (tests/test_compilation_cache.py and the CLI tests)."""
    from rljax import compilation_cache
    patch = pytest.MonkeyPatch()
    patch.setattr(compilation_cache, "enable", lambda setting="auto": None)
    yield
    patch.undo()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs_after_each_module():
    """Drops every compiled program when a test module ends. Each XLA:CPU executable keeps its
    machine code in memory mappings of its own; kept for the whole session, they neared the
    kernel's per-process limit (vm.max_map_count, 65,530: ~35,000 mappings at 60% of the
    suite) and loading or compiling one more could then fail inside jaxlib, killing the run."""
    yield
    import jax
    jax.clear_caches()
    gc.collect()
