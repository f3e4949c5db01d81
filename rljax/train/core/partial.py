"""Partial rollouts (``rollout.partial``): groups carried across iterations, as a rollout's round
source.

    rollout = Rollout(ctx, iterator, rounds=PartialRounds(ctx, num_prompts))
    batch, metrics = rollout(state, step)      # as before, plus staleness metrics

A ``sampling.partial.Pool`` of two prompt batches stays in flight: each iteration admits the
iterator's next batch into the places freed by the last one (the first iteration admits two),
then decodes under ``state.params`` (policy version ``step``) until ``rollout.batch_size / G``
groups are complete and trains on those, in the order they completed. The other groups keep
their tokens and continue next iteration under the updated weights.

Every completion token records the version that drew it; the batch's ``sampler_logps`` are
those behaviour log-probs, which the GRPO loss weighs against the proximal policy (the
decoupled objective, ``phases.grpo.grpo_loss``). Metrics, per completion token of the batch:
``rollout/staleness_mean`` / ``_max`` (current version minus the token's); per iteration
``rollout/dropped_stale``: samples discarded because their group held a token more than
``rollout.max_staleness`` versions old (the group restarts from its prompt, keeping its place
in the admission order). ``rollout/carried_groups``: groups left in flight;
``rollout/decoded_tokens``: the tokens this iteration drew, in any group (``rollout/tokens``
counts the trained completions' tokens, whenever drawn).

The pool's host state is saved with the phase (``state_dict``): resume is exact.
"""
from __future__ import annotations

import json
import time

import jax
import numpy as np

from rljax import distributed as dist, sampling
from rljax.errors import UserError
from rljax.sampling import partial as partial_lib
from rljax.train.core.buckets import encode_prompts, prompt_buckets
from rljax.train.core.rollout import Rollout, rollout_temperatures, staleness_metrics
from rljax.train.core.sampler import engine_slots, sampling_params

PARTIAL_STREAM = 8  # rng stream of the pool: fold_in(state.rng, PARTIAL_STREAM), every step


def make_pool(ctx, num_prompts: int) -> partial_lib.Pool:
    """The pool of a config: 2 x ``num_prompts`` groups, prompts at the longest bucket."""
    cfg, tok = ctx.cfg, ctx.tokenizer
    r, g = cfg.rollout, int(cfg.algo.num_generations)
    return partial_lib.Pool(
        ctx.model_cfg, num_samples=g, max_new_tokens=r.max_new_tokens, groups=2 * num_prompts,
        prompt_len=prompt_buckets(cfg.data.max_prompt_length)[-1],
        slots=engine_slots(ctx.cfg, num_prompts * g), chunk_steps=r.chunk_steps,
        temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, eos_id=tok.eos_id,
        pad_id=tok.pad_id, temperatures=rollout_temperatures(cfg))


class PartialRounds:
    """A rollout's round source (``Rollout(..., rounds=PartialRounds(ctx, num_prompts))``):
    its rounds come from a pool of groups in flight (module docstring). Any rollout takes it,
    so GRPO, distillation and PPO's reward rollout get partial rollouts alike."""

    def __init__(self, ctx, num_prompts: int):
        if dist.is_multiprocess():
            raise UserError("rollout.partial=true runs in a single process for now; use "
                            "rollout.partial=false on several hosts")
        self.ctx, self.num_prompts = ctx, int(num_prompts)
        self.pool = make_pool(ctx, self.num_prompts)
        self._step = self._version = 0
        self._key, self._taken = None, None
        # Asynchronous RL samples ahead: the version of the parameters it passes (step k's
        # batch drawn by version k - lag); None: ``step`` (the batch trains at once).
        self.params_version: int | None = None

    def begin(self, state, step: int) -> None:
        """Before a rollout call at ``step``: the version drawing and the pool's key."""
        self._step = int(step)
        self._version = self._step if self.params_version is None else int(self.params_version)
        self._key = jax.random.fold_in(state.rng, PARTIAL_STREAM)

    def metrics(self, step: int) -> dict:
        """Staleness of the batch's tokens at the update that trains it (step ``step``),
        stale drops, groups carried, tokens drawn this iteration."""
        t = self._taken
        versions = t.rows["versions"][t.rows["mask"]]
        stale = int(step) - versions if versions.size else np.zeros(1, np.int64)
        return {**staleness_metrics(stale),
                "rollout/dropped_stale": int(t.dropped_stale),
                "rollout/carried_groups": int(self.pool.c - self.pool.free),
                # this iteration's sampling work (carried groups' tokens included)
                "rollout/decoded_tokens": int(t.drawn)}

    def sample_round(self, rollout: Rollout, params) -> dict:
        """The next ``num_prompts`` groups to complete, scored by ``rollout`` (the pool's
        randomness is keyed by each group's admission, ``sampling.partial``)."""
        cfg, pool, g = self.ctx.cfg, self.pool, rollout.g
        while pool.free >= self.num_prompts:   # the first iteration fills both batches
            new = next(rollout.iterator)
            tok, mask = encode_prompts(self.ctx.tokenizer, [ex["prompt"] for ex in new],
                                       cfg.data.max_prompt_length)
            pool.admit([list(r[m]) for r, m in zip(tok, mask)], list(new))
        t0 = time.perf_counter()
        taken = pool.run(sampling_params(self.ctx, params), self._key, version=self._version,
                         want=self.num_prompts, max_staleness=self._staleness_bound())
        self._taken = taken
        out = {k: taken.rows[k] for k in ("tokens", "logps", "mask", "lengths", "truncated")}
        out["decoded"] = out["lengths"].reshape(-1, g).sum(axis=1)
        out["slot_steps"] = (taken.useful_steps, pool.s * taken.decode_steps)
        prompt_tokens, prompt_mask = sampling.pad_to_bucket(
            taken.prompts, pad_id=self.ctx.tokenizer.pad_id,
            buckets=prompt_buckets(cfg.data.max_prompt_length))
        return rollout.score_round(taken.metas, prompt_tokens, prompt_mask, out, None, t0)

    def _staleness_bound(self) -> int:
        """``rollout.max_staleness`` counted at the update: a batch drawn by version v trains
        at ``step``, so the pool may keep tokens up to ``max_staleness - (step - v)`` older
        than v (config checks keep it >= 0)."""
        return int(self.ctx.cfg.rollout.max_staleness) - (self._step - self._version)

    def state_dict(self) -> dict:
        # The groups' examples go into the checkpoint's JSON: numpy values as plain ones.
        return json.loads(json.dumps(self.pool.state_dict(), default=_plain))

    def load_state_dict(self, state: dict) -> None:
        self.pool.load_state_dict(state)


def rounds_of(ctx, num_prompts: int) -> PartialRounds | None:
    """The round source of a config: ``PartialRounds`` with ``rollout.partial``, else None
    (the rollout samples each round itself)."""
    return PartialRounds(ctx, num_prompts) if ctx.cfg.rollout.partial else None


def _plain(x):
    if isinstance(x, (np.generic, np.ndarray)):
        return x.tolist()
    raise TypeError(f"a dataset field of type {type(x).__name__} cannot be saved with the "
                    "partial-rollout pool (checkpoint meta is JSON)")
