"""Partial rollouts (``rollout.partial``): groups carried across iterations, as a rollout's round
source.

    rollout = Rollout(ctx, iterator, rounds=PartialRounds(ctx, num_prompts))
    batch, metrics = rollout(state, step)      # as before, plus staleness metrics

A ``sampling.partial.Pool`` of two prompt batches stays in flight: each iteration admits the
iterator's next batch into the places freed by the last one (the first iteration admits two),
then decodes under ``state.params`` (policy version ``step``) until ``rollout.batch_size / G``
groups are complete and trains on those, in the order they completed. The other groups keep
their tokens and continue next iteration under the updated weights.

Tree rollouts (``rollout.tree``): the pool is a ``sampling.tree_partial.TreePool`` of as many
trees (a group is a tree's leaves). A tree is carried at level boundaries: its decoded
segments keep their versions and log-probs, its unfinished paths re-prefill and grow their
next level in the next iteration, and the iteration trains on the trees that completed first.

Every completion token records the version that drew it; the batch's ``sampler_logps`` are
those behaviour log-probs, which the GRPO loss weighs against the proximal policy (the
decoupled objective, ``phases.grpo.grpo_loss``). Metrics, per completion token of the batch:
``rollout/staleness_mean`` / ``_max`` (current version minus the token's); per iteration
``rollout/dropped_stale``: samples discarded because their group held a token more than
``rollout.max_staleness`` versions old (the group restarts from its prompt, keeping its place
in the admission order). ``rollout/carried_groups``: groups left in flight;
``rollout/decoded_tokens``: the tokens this iteration drew, in any group (``rollout/tokens``
counts the trained completions' tokens, whenever drawn).

Images in the prompt (a model with a vision tower): each group keeps its prompt's pixels in
its place while in flight; every iteration the tower embeds them under the current weights for
the pool's prefill, and the round carries the taken groups' ``pixels`` / ``image_ok`` /
``skipped_images`` as ``Rollout.sample_round``'s does.

Prompt selection: each place keeps its group's dataset index, and a round carries its groups'
(``indices``), so MoPPS's posteriors learn a group's rewards for the prompt it was drawn for,
whichever iteration completes it.

The pool's host state is saved with the phase (``state_dict``, the indices too): resume is
exact. The
checkpoint meta is JSON, so the groups' examples go there exactly (arrays and bytes encoded)
and their pixels are decoded again from them on load.
"""
from __future__ import annotations

import base64
import json
import time

import jax
import numpy as np

from rljax import sampling
from rljax.sampling import partial as partial_lib, tree as tree_sampling
from rljax.sampling.tree_partial import TreePool
from rljax.train.core import image_inputs
from rljax.train.core.buckets import encode_prompts, prompt_buckets
from rljax.train.core.rollout import Rollout, rollout_temperatures
from rljax.train.core.rollout_metrics import carried_metrics
from rljax.train.core.sampler import engine_slots, sampling_params, sampling_weights

PARTIAL_STREAM = 8  # rng stream of the pool: fold_in(state.rng, PARTIAL_STREAM), every step


def make_pool(ctx, num_prompts: int, rows: int = 0):
    """The pool of a config: 2 x ``num_prompts`` groups of ``rows`` rows at most (0: G),
    prompts at the longest bucket; with ``rollout.tree``, a ``sampling.tree_partial.TreePool``
    of as many trees (of G leaves; with ``rows``, of ``rows // branching**depth`` roots, each
    group growing the roots its size asks for)."""
    cfg, tok = ctx.cfg, ctx.tokenizer
    r, g = cfg.rollout, int(cfg.algo.num_generations)
    common = dict(max_new_tokens=r.max_new_tokens, groups=2 * num_prompts,
                  prompt_len=prompt_buckets(cfg.data.max_prompt_length)[-1],
                  slots=engine_slots(ctx.cfg, num_prompts * g), chunk_steps=r.chunk_steps,
                  temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
                  eos_id=ctx.stop_ids, pad_id=tok.pad_id,   # (rollout.stop_strings too)
                  temperatures=rollout_temperatures(cfg))
    tree = tree_sampling.options_from_config(r.tree, g)
    if tree is not None:   # groups of ``rows`` leaves at most: room for that many roots' trees
        per_root = int(tree["branching"]) ** int(tree["depth"])
        roots = rows // per_root if rows else tree["roots"]
        return TreePool(ctx.model_cfg, **{**tree, "roots": roots}, **common)
    return partial_lib.Pool(ctx.model_cfg, num_samples=rows or g, **common)


class PartialRounds:
    """A rollout's round source (``Rollout(..., rounds=PartialRounds(ctx, num_prompts))``):
    its rounds come from a pool of groups in flight (module docstring). Any rollout takes it,
    so GRPO, distillation and PPO's reward rollout get partial rollouts alike."""

    def __init__(self, ctx, num_prompts: int, sizes_of=None, rows: int = 0):
        self.ctx, self.num_prompts = ctx, int(num_prompts)
        # Groups of their own sizes (knapsack allocation): ``sizes_of(rollout, indices) ->
        # int [P]`` sizes each admitted batch, at most ``rows`` rows a group.
        self.sizes_of = sizes_of
        self.pool = make_pool(ctx, self.num_prompts, rows)
        # Each place's dataset index (-1: unknown): prompt selection learns a completed
        # group's rewards for the prompt it was drawn for, iterations ago (``indices``).
        self.indices = np.full(self.pool.c, -1, np.int64)
        # A vision tower: each place's prompt pixels and whether they are usable (a skipped
        # image costs its group's training rows, as in ``Rollout``); None: a text model.
        self.images = image_inputs.place_pixels(ctx, self.pool.c)
        self._step = self._version = 0
        self._key, self._taken = None, None
        self._drawn = []   # per sampling round of this call (metrics)
        # Asynchronous RL samples ahead: the version of the parameters it passes (step k's
        # batch drawn by version k - lag); None: ``step`` (the batch trains at once).
        self.params_version: int | None = None

    def begin(self, state, step: int) -> None:
        """Before a rollout call at ``step``: the version drawing and the pool's key."""
        self._step = int(step)
        self._version = self._step if self.params_version is None else int(self.params_version)
        self._key = jax.random.fold_in(state.rng, PARTIAL_STREAM)
        self._drawn = []

    def metrics(self, rounds, step: int) -> dict:
        """Staleness of the tokens drawn for this call's rounds at the update that trains them
        (step ``step``), stale drops, groups carried, tokens drawn this iteration (the
        pool's, carried groups included): ``carried_metrics``."""
        out = carried_metrics(self._drawn, step, self.pool.c - self.pool.free)
        if self._drawn and self._drawn[0]["swaps"] is not None:   # in-flight weight updates
            out["rollout/weight_swaps"] = sum(d["swaps"] for d in self._drawn)
        return out

    def sample_round(self, rollout: Rollout, params, rng=None) -> dict:
        """The next ``num_prompts`` groups to complete, scored by ``rollout``. ``rng`` is not
        used: the pool's randomness is keyed by each group's admission (``sampling.partial``),
        so a group draws the same tokens whichever iteration it finishes in."""
        cfg, pool, g = self.ctx.cfg, self.pool, rollout.g
        while pool.free >= self.num_prompts:   # the first iteration fills both batches
            new = next(rollout.iterator)
            tok, mask = encode_prompts(self.ctx.tokenizer, [ex["prompt"] for ex in new],
                                       cfg.data.max_prompt_length)
            indices = drawn_indices(rollout.iterator, len(new))
            sizes = None if self.sizes_of is None else self.sizes_of(rollout, indices)
            places = pool.admit([list(r[m]) for r, m in zip(tok, mask)], list(new), sizes)
            self.indices[places] = indices
            if self.images is not None:
                self.images.admit(places, new, rollout._locations(new))
        t0 = time.perf_counter()
        weights, version = None, self._version
        if rollout.weights is not None:   # in-flight weight updates, polled between chunks
            weights = sampling.engine.VersionPolls(sampling_weights(self.ctx, rollout.weights))
            params, version = weights()
        else:
            params = sampling_params(self.ctx, params)
        embeds = None if self.images is None else self.images.embeds(params)
        taken = pool.run(params, self._key, version=version, want=self.num_prompts,
                         max_staleness=self._staleness_bound(), image_embeds=embeds,
                         weights=weights)
        self._taken = taken   # the last round's groups (their rows, places, versions)
        self._drawn.append(dict(versions=taken.rows["versions"][taken.rows["mask"]],
                                dropped=taken.dropped_stale, drawn=taken.drawn,
                                swaps=None if weights is None else taken.swaps))
        out = {k: taken.rows[k] for k in ("tokens", "logps", "mask", "lengths", "truncated")}
        out["slot_steps"] = (taken.useful_steps, pool.s * taken.decode_steps
                             if taken.slot_steps is None else taken.slot_steps)
        prompt_tokens, prompt_mask = sampling.pad_to_bucket(
            taken.prompts, pad_id=self.ctx.tokenizer.pad_id,
            buckets=prompt_buckets(cfg.data.max_prompt_length))
        if self.sizes_of is None:
            out["decoded"] = (out["lengths"].reshape(-1, g).sum(axis=1) if taken.decoded is None
                              else taken.decoded)   # (a tree's shared segments once)
            rnd = rollout.score_round(taken.metas, prompt_tokens, prompt_mask, out, None, t0)
        else:   # groups of their own sizes: every row with its prompt, as the knapsack's
            owner = np.repeat(np.arange(len(taken.sizes)), taken.sizes)
            out["decoded"] = out["lengths"] if taken.decoded is None else taken.decoded
            rnd = rollout.score_round([taken.metas[i] for i in owner], prompt_tokens[owner],
                                      prompt_mask[owner], out, None, t0, g=1)
            rnd["group_sizes"] = np.asarray(taken.sizes, np.int64)
        rnd["indices"] = self.indices[taken.places].tolist()   # each group's own prompt
        if self.images is not None:   # (groups of their own sizes: one entry per row)
            rnd.update(self.images.round_fields(
                taken.places, None if self.sizes_of is None else taken.sizes))
        return rnd

    def _staleness_bound(self) -> int:
        """``rollout.max_staleness`` counted at the update: a batch drawn by version v trains
        at ``step``, so the pool may keep tokens up to ``max_staleness - (step - v)`` older
        than v (config checks keep it >= 0)."""
        return int(self.ctx.cfg.rollout.max_staleness) - (self._step - self._version)

    def state_dict(self) -> dict:
        # The groups' examples go into the checkpoint's JSON, exactly (their images are
        # decoded again from them on load: no pixels in the meta).
        return json.loads(json.dumps({**self.pool.state_dict(), "indices": self.indices.tolist()},
                                     default=json_field))

    def load_state_dict(self, state: dict) -> None:
        self.pool.load_state_dict({**state, "metas": from_json_field(state["metas"])})
        self.indices[:] = state.get("indices", -1)   # (a checkpoint from before they were kept)
        if self.images is not None:   # decoded again from the examples in flight
            places = [int(j) for j in np.flatnonzero(self.pool.serial >= 0)]
            self.images.restore(places, [self.pool.metas[j] for j in places])


def rounds_of(ctx, num_prompts: int) -> PartialRounds | None:
    """The round source of a config: ``PartialRounds`` with ``rollout.partial``, else None
    (the rollout samples each round itself)."""
    return PartialRounds(ctx, num_prompts) if ctx.cfg.rollout.partial else None


def drawn_indices(iterator, n: int) -> list[int]:
    """The dataset indices of the ``n`` examples ``iterator`` just drew (-1 each when it
    cannot say): the prompts a carried group's rewards belong to."""
    indices = getattr(iterator, "last_indices", None)
    return [int(i) for i in indices] if indices is not None and len(indices) == n else [-1] * n


def json_field(x):
    """A dataset field JSON cannot hold, exactly (``json.dumps(..., default=json_field)``): a
    numpy array (e.g. an image's uint8 pixels) keeps its dtype and shape, bytes (an encoded
    image) their value; ``from_json_field`` undoes it."""
    if isinstance(x, np.ndarray):
        return {_ARRAY: partial_lib.encode_array(x)}
    if isinstance(x, (bytes, bytearray)):
        return {_BYTES: base64.b64encode(bytes(x)).decode("ascii")}
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"a dataset field of type {type(x).__name__} cannot be saved with the "
                    "partial-rollout pool (checkpoint meta is JSON)")


_ARRAY, _BYTES = "__ndarray__", "__bytes__"


def from_json_field(x):
    """``x`` read back from JSON with ``json_field``'s arrays and bytes decoded."""
    if isinstance(x, dict):
        if len(x) == 1 and _ARRAY in x:
            return partial_lib.decode_array(x[_ARRAY])
        if len(x) == 1 and _BYTES in x:
            return base64.b64decode(x[_BYTES])
        return {k: from_json_field(v) for k, v in x.items()}
    return [from_json_field(v) for v in x] if isinstance(x, list) else x
