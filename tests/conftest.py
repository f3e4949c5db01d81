"""Test-wide setup: 8 fake CPU devices so sharding tests run without accelerators.

XLA reads XLA_FLAGS once, when the backend starts, so this must run before anything imports jax.
Unsharded tests simply use device 0.
"""
import gc
import os
import signal
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags = (_flags + " --xla_force_host_platform_device_count=8").strip()
# The suite is mostly XLA:CPU compiling tiny models. LLVM at -O0 and the older elementwise-
# fusion emitters compile them faster: the whole suite took 1,167 s instead of 1,773 (same
# clone, same day; either alone gained 7-18% on a sample of modules). The HLO programs are the
# same; their machine code rounds a few operations differently from the default build, so
# exactness tests compare programs built alike. Users and benchmarks run XLA's defaults;
# RLJAX_TEST_XLA_DEFAULTS=1 runs the suite on them too.
# XLA:CPU also splits each program's LLVM module into up to 32 parts compiled on a thread pool;
# with one test worker per core the parts only contend, and one part compiled test files ~10%
# faster (test_train_ppo 38.5 -> 34.9 s, test_plan_programs 73.7 -> 67.6 s, interleaved runs
# at load ~3). The machine code is the same, in one module.
# Subprocesses that set their own device count pass RLJAX_TEST_COMPILER_FLAGS on.
_compiler = ("" if os.environ.get("RLJAX_TEST_XLA_DEFAULTS") else
             " ".join(f for f in ("--xla_backend_optimization_level=0",
                                  "--xla_cpu_use_fusion_emitters=false",
                                  "--xla_cpu_parallel_codegen_split_count=1")
                      if f.split("=")[0] not in _flags))
os.environ["RLJAX_TEST_COMPILER_FLAGS"] = _compiler
os.environ["XLA_FLAGS"] = (_flags + " " + _compiler).strip()

# Tests keep out of the user's cache directory: a developer's old entries must not change what a
# test runs, and a test run must not fill ~/.cache. The persistent compilation cache still works
# within the run (later modules load what earlier ones compiled) in a directory of the run's
# own, shared by the pytest-xdist workers of one run: JAX's cache keys include the directory's
# path, so with one directory per worker no program compiled by one worker was ever loaded by
# the other. (Both writers are safe side by side: rljax's caches write a temporary and rename
# it; a JAX entry read while the other worker writes it fails to decompress, and JAX then
# compiles the program itself.)
_run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
if _run_id:
    os.environ["RLJAX_CACHE_DIR"] = os.path.join(tempfile.gettempdir(),
                                                 f"rljax-tests-cache-{_run_id}")
    os.makedirs(os.environ["RLJAX_CACHE_DIR"], exist_ok=True)
else:
    os.environ["RLJAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="rljax-tests-cache-")

# Tracing and compiling allocate millions of short-lived objects, and at Python's default
# thresholds (700, 10, 10) the cyclic collector ran a dozen full collections per test file, each
# scanning every object the worker holds (jax, torch, transformers): 1.1 of 27.6 s in
# test_train_ppo. Ten times fewer collections of each generation took it and test_engine ~4%
# faster (interleaved runs); cyclic garbage still goes, later.
gc.set_threshold(10_000, 10, 10)

# A suite started as a background job of a non-interactive shell inherits SIGINT ignored, and
# Python then keeps it ignored; the tests of Ctrl-C handling expect Python's own handler.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _memory_mappings() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:   # not Linux: no count, always release
        return MAX_MAPPINGS + 1


# Well below the kernel's per-process limit (vm.max_map_count, 65,530 by default).
MAX_MAPPINGS = 20_000


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs_when_mappings_pile_up():
    """Drops every compiled program after a test module once the process holds more than
    ``MAX_MAPPINGS`` memory mappings. Each XLA:CPU executable keeps its machine code in
    mappings of its own; kept for the whole session they reached 63,000 of the kernel's
    65,530 near the end of the suite, and loading or compiling one more then failed inside
    jaxlib, killing the run (twice, at ~91%, in `compilation_cache.get_executable_and_time`).
    Releasing only past the threshold keeps the programs later modules share in memory."""
    yield
    if _memory_mappings() > MAX_MAPPINGS:
        import jax
        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="session")
def gguf_parsed_once():
    """A context manager under which ``gguf.GGUFReader`` parses each file once per session.

    transformers' GGUF loader parses the file's metadata anew for the config, for the weights
    and for the tokenizer; for Gemma 3's 262,144-token vocabulary each parse takes ~25 s. The
    files do not change during a run, so later loads get the first parse: the reference stays
    transformers' own load of the file."""
    import contextlib

    import gguf

    real, parsed = gguf.GGUFReader, {}

    class ParsedOnce(real):
        def __new__(cls, path, mode="r"):
            stat = os.stat(path)
            key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns, mode)
            if key not in parsed:
                parsed[key] = real(path, mode)
            return parsed[key]   # not a ParsedOnce, so __init__ does not parse it again

    @contextlib.contextmanager
    def once():
        gguf.GGUFReader = ParsedOnce
        try:
            yield
        finally:
            gguf.GGUFReader = real

    return once


# The longest test files, run first (a fresh-clone CI run's per-file seconds, 2026-12-03):
# pytest-xdist hands out whole files (--dist loadfile) in collection order when told
# --no-loadscope-reorder (by default it orders files by their number of tests, which handed out
# the 63 s multi-process test near the end); a long file handed out last leaves the other worker
# idle while it runs. The two real-model files never run side by side (see
# ``one_real_model_file_at_a_time``): the other worker's first files take about as long as
# Gemma's. A file missing here just runs later, in name order.
SLOW_FILES_FIRST = (
    "test_gemma.py", "test_moe_dispatch.py", "test_distill.py", "test_multihost.py",
    "test_real_model.py", "test_plan_programs.py", "test_notebooks.py", "test_async.py",
    "test_lora_dropout.py", "test_vision_run.py", "test_lora.py", "test_qlora.py",
    "test_knapsack.py", "test_shared_prompt.py", "test_selfplay.py", "test_sampling.py",
    "test_plan.py", "test_moe.py", "test_checkpoint_faults.py", "test_train_ppo.py",
    "test_train_tree.py", "test_vineppo.py", "test_train_demo.py", "test_partial.py",
    "test_engine.py", "test_agent_train.py", "test_models.py", "test_length_groups.py",
)


@pytest.fixture(scope="module")
def one_real_model_file_at_a_time():
    """Holds a lock shared by the pytest-xdist workers of one run for a whole test module: a
    real model's module takes several GB (transformers' reference beside rljax's copy), and
    two side by side on a 24 GB machine leave the rest of the suite little room."""
    if not _run_id:          # one process: nothing runs beside it
        yield
        return
    import fcntl
    path = os.path.join(tempfile.gettempdir(), f"rljax-tests-real-model-{_run_id}.lock")
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: order kept within


def pytest_terminal_summary(terminalreporter):
    """The ten test files that took longest (setup, call and teardown of their tests, summed;
    under pytest-xdist each file runs in one worker, so this is that worker's time on it)."""
    per_file: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) in ("setup", "call", "teardown"):
                name = report.nodeid.split("::")[0]
                per_file[name] = per_file.get(name, 0.0) + float(report.duration)
    if not per_file:
        return
    terminalreporter.write_sep("=", "slowest 10 test files")
    for name, seconds in sorted(per_file.items(), key=lambda kv: -kv[1])[:10]:
        terminalreporter.write_line(f"{seconds:8.1f}s {name}")
    terminalreporter.write_line(f"{sum(per_file.values()):8.1f}s in all {len(per_file)} files")
    if os.environ.get("RLJAX_TEST_DURATIONS"):   # every file's seconds, for profiling the suite
        import json
        with open(os.environ["RLJAX_TEST_DURATIONS"], "w") as f:
            json.dump(dict(sorted(per_file.items(), key=lambda kv: -kv[1])), f, indent=0)
