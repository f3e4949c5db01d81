"""The verifier: the first reward function, called exactly as training calls rewards, that
scores held-out completions (``evaluate``) and the final answers of episodes (``agent``)."""
from __future__ import annotations

import sys

import jax
import numpy as np

from rljax import rewards
from rljax.train.core.inputs import reward_kwargs


def verifier(ctx):
    """The first reward function (``reward.names[0]`` with its ``reward.kwargs``) wrapped by
    ``rewards.combine`` with the run's ``reward.default_score`` / ``timeout_s`` /
    ``isolation``: the one way rewards are called, in training and eval alike. Built once per
    context (process isolation keeps its worker pool between evals)."""
    cached = getattr(ctx, "_verifier", None)
    if cached is None:
        r, name = ctx.cfg.reward, ctx.cfg.reward.names[0]
        cached = rewards.combine(
            [(name, 1.0, reward_kwargs(ctx.cfg, name))], default_score=r.default_score,
            timeout_s=r.timeout_s or None, isolation=r.isolation,
            should_abort=lambda: getattr(getattr(ctx, "stop", None), "signum", None) is not None)
        ctx._verifier = cached
    return cached


def verify(ctx, prompts: list[str], completions: list[str], fields: dict,
           lengths=None) -> np.ndarray:
    """float64 [N] scores of the verifier on N completions (``fields``: dataset columns, one
    value per completion; ``lengths``: completion tokens). Failed samples score
    ``reward.default_score``; the failure is one warning line on stderr (process 0)."""
    extra = {} if lengths is None else {"completion_lengths": [int(n) for n in lengths]}
    result = verifier(ctx)(prompts, completions, **extra, **fields)
    if result.messages and jax.process_index() == 0:
        for name, why in result.messages.items():
            print(f"rljax: warning: eval: reward {name!r} failed on {result.errors[name]} of "
                  f"{result.num_samples} samples (scored reward.default_score="
                  f"{ctx.cfg.reward.default_score:g}): {why}", file=sys.stderr, flush=True)
    return np.asarray(result.total, np.float64)
