"""JAX's persistent compilation cache, on by default, so a run compiles each program once ever.

A second ``rljax train`` (or ``eval``/``sample``/``export``/``plan``) of the same config, model
and mesh loads every executable from disk instead of compiling it again. Executables are keyed
by JAX on the program, the backend and the compiler flags, so a stale entry is never used.

``training_compiler_options`` and ``sampler_compiler_options`` pick the XLA options of the
training programs and of the sampler (see there).

Config: ``compilation_cache_dir`` = ``"auto"`` (``$RLJAX_CACHE_DIR/jax`` or
``~/.cache/rljax/jax``), a directory (local or a URL JAX can write), or ``""`` to turn it off;
``compile_for`` = ``"throughput"`` (default) or ``"startup"`` (see ``set_compile_for``).
"""
from __future__ import annotations

import os

import jax

from rljax import cache_dirs


def resolve_dir(setting: str) -> str | None:
    """The cache directory for a ``compilation_cache_dir`` setting (None = off)."""
    if not setting:
        return None
    if setting != "auto":
        return setting
    return os.path.join(cache_dirs.root(), "jax")


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


# The config's compile_for names (rljax.config.train.COMPILE_FOR; a test checks they agree).
COMPILE_FOR = ("throughput", "startup")
_compile_for = "throughput"


def from_config(cfg) -> str | None:
    """``enable(cfg.compilation_cache_dir)`` and ``set_compile_for(cfg.compile_for)``: what a
    run, an eval or a plan of ``cfg`` calls before it compiles. Returns the cache directory."""
    set_compile_for(cfg.get("compile_for", "throughput"))
    return enable(cfg.get("compilation_cache_dir", "auto"))


def set_compile_for(mode: str) -> None:
    """What the sampler and training programs built from now on are compiled for (process-wide,
    like the cache directory).

    ``"throughput"`` (default): XLA:CPU's default elementwise-fusion emitters, whose code runs
    faster. ``"startup"``: on CPU, its older emitters (and LLVM -O1 for the sampler too), which
    compile the update in about half the time and run ~4% slower (``bench/RESULTS.md``:
    the toy GRPO benchmark's cold first iteration 5.65 -> 4.1 s, medians, and 4.8% more
    per iteration: the ~1.5 s come back after ~100 iterations). For short runs and notebooks on
    small models. Results agree to float32 rounding, not bit for bit (the emitters fuse
    differently). Other backends ignore it."""
    global _compile_for
    if mode not in COMPILE_FOR:
        raise ValueError(f"compile_for={mode!r} is not one of: {', '.join(COMPILE_FOR)}")
    _compile_for = mode


def _startup_options() -> dict:
    return {"xla_cpu_use_fusion_emitters": False} if _compile_for == "startup" else {}


def _unless_set_in_xla_flags(options: dict) -> dict | None:
    """``options`` less those the user set in ``XLA_FLAGS``: an explicit flag wins over rljax's
    per-program choice (a program's options would otherwise override it). None when empty."""
    flags = os.environ.get("XLA_FLAGS", "")
    kept = {k: v for k, v in options.items() if f"--{k}=" not in flags}
    return kept or None


def sampler_compiler_options() -> dict | None:
    """XLA compiler options of the sampler's decode program. None = the backend's defaults
    (always, under ``compile_for="throughput"``). Under "startup", on CPU, the elementwise
    programs' options: the older emitters and LLVM -O1, which took another ~0.35 s off the
    toy's first iteration than the emitters alone (``bench/RESULTS.md``)."""
    return elementwise_compiler_options() if _compile_for == "startup" else None


def training_compiler_options() -> dict | None:
    """XLA compiler options for the training programs: loss and gradients, the optimizer step,
    old/reference log-probs. None = the backend's defaults.

    On CPU, XLA's LLVM back end runs at -O1 instead of its default -O3. The matmuls are library
    calls (YNNPACK) either way; what LLVM compiles here are elementwise fusions and reductions.
    They ran as fast at -O1, and the first update (compile + run) took 3.6 s instead of 4.6 s
    (4L-128 toy) and 18.7 s instead of 22.6 s (SmolLM2-135M's shape); ``bench/RESULTS.md`` has
    the measurement. Results agree to float32 rounding: params were bit-identical after six
    GRPO updates at both shapes, and within 2e-5 relative after three AdamW steps at lr 1e-2
    on a 1-layer test model. The sampler keeps -O3: its decode step was ~10% slower at -O1.
    ``compile_for="startup"`` adds the older fusion emitters (``set_compile_for``). An option
    set in ``XLA_FLAGS`` is left to that setting (``--xla_backend_optimization_level=0`` makes
    every program -O0; the test suite runs so)."""
    if jax.default_backend() != "cpu":
        return None
    return _unless_set_in_xla_flags({"xla_backend_optimization_level": 1, **_startup_options()})


def elementwise_compiler_options() -> dict | None:
    """XLA compiler options for programs that are all elementwise work and no matmul (the
    sampler's noise drawn ahead: threefry hashes and logs). None = the backend's defaults.

    On CPU, LLVM at -O1 and XLA:CPU's older elementwise emitters: the toy GRPO iteration's
    noise ([64 tokens, 64 rows, 259] Gumbel) compiled in 0.12 s instead of 0.42 and ran in 6 ms
    instead of 14, to the same bits (``bench/RESULTS.md``)."""
    if jax.default_backend() != "cpu":
        return None
    return _unless_set_in_xla_flags({"xla_backend_optimization_level": 1,
                                     "xla_cpu_use_fusion_emitters": False})
