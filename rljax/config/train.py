"""The run itself: top-level keys (seed, length, cadence, compilation, user code) and the
``checkpoint``, ``logging`` and ``eval`` sections, with their checks."""
from __future__ import annotations

from typing import Any

from rljax.config.base import ConfigError, opt_int

# How XLA:CPU trades compile time against run time (rljax.compilation_cache).
COMPILE_FOR = ("throughput", "startup")


def top_level() -> dict[str, Any]:
    """Keys at the top of the config, in schema order."""
    return dict(
        seed=0,
        steps=100,                   # RL (or SFT/DPO/RM) optimizer steps
        eval_every=0,                # 0 = never (except the final eval)
        eval_at_start=False,         # also evaluate the starting policy (step 0) of a fresh run
        checkpoint_every=50,         # 0 = only on stop/finish
        compilation_cache_dir="auto",  # persistent XLA cache ("auto": ~/.cache/rljax/jax; "" = off)
        # "startup": XLA:CPU compiles ~2x faster, runs ~4% slower (rljax.compilation_cache)
        compile_for="throughput",
        # Python files (path/to/file.py) or modules (package.module) imported before the config
        # is validated, so the names they register (advantage estimators, policy losses,
        # algorithms, rewards, environments, ...) can be chosen by the keys below.
        imports=(),
    )


def logging() -> dict[str, Any]:
    return dict(
        log_every=1,
        console_every_s=10.0,        # console progress line at most this often
        tensorboard=True,
        num_completions_to_print=0,
        wandb=dict(                  # Weights & Biases; off while project is ""
            project="",
            mode="online",           # "online", "offline" (files under WORKDIR/wandb, no
                                     # network; `wandb sync` later) or "disabled"
            entity="",
            name="",                 # "" = the workdir's name
            tags=(),
        ),
    )


def checkpoint() -> dict[str, Any]:
    return dict(
        max_to_keep=3,
        async_save=True,
        save_on_stop=True,           # save when stopped by SIGTERM/SIGINT
        fallback_on_damage=True,     # a damaged latest checkpoint: move it aside, resume from
                                     # the newest readable one (False: stop with an error)
    )


def eval_() -> dict[str, Any]:
    return dict(
        num_examples=256,            # 0 = the whole split
        batch_size=64,
        num_samples=1,               # samples per prompt; pass@k for k <= num_samples
        temperature=0.0,
        max_new_tokens=opt_int(),    # None = rollout.max_new_tokens
    )


SECTIONS = {"logging": logging, "checkpoint": checkpoint, "eval": eval_}

CHOICES = {
    "logging.wandb.mode": ("online", "offline", "disabled"),
    "compile_for": COMPILE_FOR,
}

RANGES = (
    ("steps", 1, None), ("eval_every", 0, None), ("checkpoint_every", 0, None),
    ("logging.log_every", 1, None), ("logging.console_every_s", 0.0, None),
    ("logging.num_completions_to_print", 0, None),
    ("checkpoint.max_to_keep", 1, None),
    ("eval.num_examples", 0, None), ("eval.batch_size", 1, None), ("eval.num_samples", 1, None),
    ("eval.temperature", 0.0, None),
)
# Optional numbers: None (off / derived) or above the bound.
ABOVE = (("eval.max_new_tokens", 0),)


def check_eval(cfg) -> None:
    if cfg.eval.num_samples > 1 and cfg.eval.temperature == 0.0:
        raise ConfigError(f"eval.num_samples={cfg.eval.num_samples} needs eval.temperature > 0 "
                          "(greedy samples are all identical)")

