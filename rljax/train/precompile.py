"""Compile the GRPO update in a background thread while the first rollout samples.

A cold first GRPO iteration is mostly XLA compilations done one after the other: the
sampler's (needed to sample), then the update's (needed only once the batch exists). The
update's input shapes are known before sampling (the first prompt batch's bucket and the
config), so ``warm_update`` lowers and compiles the update's programs on those shapes in a
thread: ``jit(f).lower(...).compile()`` fills the same in-memory cache a call of ``f`` reads,
so the first real call finds its executable and compiles nothing. XLA compilation releases
the GIL, so it overlaps the sampler's compile and the sampling.

Only *when* a program compiles changes, never what it computes: the first call runs the very
executable ``jax.jit`` would have built. A misprediction (e.g. a different prompt bucket after
dynamic sampling, trimmed columns with ``algo.group_by_length``) costs the wasted compile and
the call compiles as usual; a failed background compile likewise.
"""
from __future__ import annotations

import threading
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from rljax.train import length_groups


def predicts(rollout) -> bool:
    """Whether ``rollout_batch_spec`` knows this rollout's batch layout (the plain
    ``Rollout``: not multi-turn episodes, not guidance hints)."""
    from rljax.train.rollout import Rollout   # (import cycle: rollout imports length_groups)
    return type(rollout) is Rollout and rollout.guide is None


def rollout_batch_spec(rollout, prompt_len: int, rows: int) -> dict | None:
    """``jax.ShapeDtypeStruct``s of ``rows`` rows of the batch ``Rollout.__call__`` returns
    when its prompts fall in bucket ``prompt_len`` (layout: ``rljax.train.rollout``'s
    docstring), or None where the layout is not predicted here (multi-turn episodes,
    guidance hints)."""
    cfg, a = rollout.cfg, rollout.cfg.algo
    if not predicts(rollout):
        return None
    r, n = int(rows), cfg.rollout.max_new_tokens
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, np.float32)  # noqa: E731
    spec = {"tokens": jax.ShapeDtypeStruct((r, prompt_len + n), np.int32),
            "mask": jax.ShapeDtypeStruct((r, prompt_len + n), np.bool_),
            "sampler_logps": f32(r, n),
            "loss_mask": jax.ShapeDtypeStruct((r, n), np.bool_),
            "advantages": f32(r, n) if rollout.token_level else f32(r)}
    if rollout.temperatures is not None:
        spec["temperatures"] = f32(r, n)
    if rollout.old_logps:
        spec["old_logps"] = f32(r, n)
    if rollout.needs_ref and not a.kl_in_reward:
        spec["ref_logps"] = f32(r, n)
    return spec


def host_batch(spec: dict) -> dict:
    """Numpy stand-ins for a batch spec: masks all True (every column real, as the planner
    sees an untrimmed batch), everything else zeros (every group's prompt rows equal)."""
    return {k: (np.ones if s.dtype == np.bool_ else np.zeros)(s.shape, s.dtype)
            for k, s in spec.items()}


def warm_update(step_fn, state, spec: dict) -> None:
    """Compiles the programs ``step_fn(state, batch)`` runs on a batch shaped like ``spec``
    (``steps.build_grpo_step``'s jitted step, or ``length_groups.GroupedUpdate``: one
    micro-step per distinct micro-batch layout, and the optimizer apply), without running
    the update. Fills the jit caches; returns nothing."""
    if not isinstance(step_fn, length_groups.GroupedUpdate):
        step_fn.lower(state, spec).compile()
        return
    batch = host_batch(spec)
    n = batch["loss_mask"].shape[1]
    index = jax.ShapeDtypeStruct((), jnp.int32)
    seen, summed = set(), None
    for _, part in step_fn.planner.parts(batch, n):
        layout = tuple(sorted((k, np.shape(v), np.dtype(v.dtype)) for k, v in part.items()))
        if layout not in seen:
            seen.add(layout)
            zeros = step_fn._zeros(state, part, n)   # (also compiles its zero fills)
            lowered = step_fn._micro.lower(state, zeros, part, index, n)
            lowered.compile()
            # The apply takes the micro-steps' output (its exact avals, not the zeros').
            summed = lowered.out_info
    step_fn._apply.lower(state, summed).compile()


class Background:
    """``fn()`` running in a daemon thread; ``wait()`` joins it. An exception in ``fn`` is
    kept in ``error`` (the work it was doing then simply happens later, on first use)."""

    def __init__(self, fn: Callable[[], None]):
        self.error: BaseException | None = None
        self._fn = fn
        self._thread = threading.Thread(target=self._run, name="rljax-precompile",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._fn()
        except Exception as e:  # noqa: BLE001  (the first real call compiles instead)
            self.error = e

    def wait(self) -> None:
        self._thread.join()
