"""Compile the update step in a background thread while the first rollout samples.

A cold first GRPO iteration is mostly two XLA compilations done one after the other: the
sampler's (needed to sample) and the update step's (needed only once the batch exists). The
update's input shapes are known before sampling (the prompt bucket of the first prompt batch,
the config), so ``AheadOfTime`` lowers and compiles it on those abstract shapes in a thread;
XLA compilation releases the GIL, so it runs on another core while the main thread compiles
and runs the sampler.

The speculation only decides *when* the step compiles, never what it computes: a call whose
arguments match the compiled signature runs that executable (the same program ``jax.jit``
would build), any other call (a different prompt bucket, a failed background compile) goes to
the plain jitted function.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import jax
import numpy as np


def signature(tree: Any) -> tuple:
    """Tree structure plus (shape, dtype) of every leaf: what a compiled executable needs its
    arguments to match (arrays, numpy arrays or ``jax.ShapeDtypeStruct``s alike)."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(np.shape(x)), np.dtype(x.dtype)) for x in leaves)


class AheadOfTime:
    """``jitted`` (a ``jax.jit`` function), compiled now in a daemon thread for arguments
    shaped like ``example_args`` (arrays or ``jax.ShapeDtypeStruct``s).

    Calls with that signature wait for the thread and run the compiled executable; any other
    call, or every call if the background compile failed, runs ``jitted`` itself.
    ``compiled_used`` counts the calls that ran the background executable (for tests)."""

    def __init__(self, jitted: Callable, *example_args):
        self.jitted = jitted
        self._signature = signature(example_args)
        self._compiled = None
        self._error: BaseException | None = None
        self.compiled_used = 0
        self._thread = threading.Thread(target=self._compile, args=(example_args,),
                                        name="rljax-precompile", daemon=True)
        self._thread.start()

    def _compile(self, example_args) -> None:
        try:
            self._compiled = self.jitted.lower(*example_args).compile()
        except BaseException as e:  # noqa: BLE001  (reported through the fallback path)
            self._error = e

    def ready(self) -> bool:
        """Whether the background compile has finished (successfully or not)."""
        return not self._thread.is_alive()

    def __call__(self, *args):
        if signature(args) == self._signature:
            self._thread.join()
            if self._compiled is not None:
                self.compiled_used += 1
                return self._compiled(*args)
        return self.jitted(*args)


def rollout_batch_spec(rollout, prompt_len: int, rows: int) -> dict | None:
    """``jax.ShapeDtypeStruct``s of ``rows`` rows of the batch ``Rollout.__call__`` returns
    when its prompts fall in bucket ``prompt_len`` (layout: ``rljax.train.rollout``'s
    docstring), or None where the layout is not predicted here (multi-turn episodes,
    guidance hints)."""
    from rljax.train.rollout import Rollout   # (import cycle: rollout imports the phases' deps)
    cfg, a = rollout.cfg, rollout.cfg.algo
    if type(rollout) is not Rollout or rollout.guide is not None:
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
