"""Per-prompt group sizes (``rollout.allocation='knapsack'``): the rollout's round source.

Each step: the prompts' pass rates (posterior means: the MoPPS posterior of
``data.selection.name='predicted'``, else this source's own Beta posteriors,
``rljax.data.allocation.PassRates``) -> group sizes G_i by the knapsack
(``allocation.knapsack_allocate``, sum G_i = the budget) -> each prompt prefilled once and
its G_i rows sampled from it (one sampler program: always ``budget`` rows, or chunks of
``rollout.micro_batch_size`` rows, each row drawing from its own key) -> rewards -> the
posteriors learn the groups' successes. The round carries ``group_sizes``, which the rollout
counts its groups, prompt selection's observations, informative groups and group filters
(dynamic sampling, the online filter) by; an extra round of a filter is a round like the
first, sized over its own prompts. The update batch is ``rollout.batch_size`` rows: the kept
groups that fit, contiguous (``pick_groups``); rows past them repeat the last sample and
weigh zero. Advantages are the configured GRPO-family estimator over each
group's own rows (``group_ids``). The update computes each prompt once too
(``length_groups.ragged_layout``). The phase checkpoints the posteriors under
``allocation``.

Multi-turn episodes (``env.name``): example i's group is G_i episodes (``agent.EpisodeRounds``
plays the ``budget`` episodes, each its own example's), scored as episodes are; the batch
rows carry the episodes' ``row_keys`` for the credit stages (per-turn credit takes each
row's ``group_ids``). The policy against itself in every seat (``env.selfplay.mode='self'``)
is refused: a match gives each seat one row, and the seats' outcomes are one another's.

Partial rollouts (``rollout.partial``): ``KnapsackPartialRounds`` sizes the pool's groups
when their prompt batch is admitted; the round of the first P to complete carries their sizes.
With episodes the pool is ``episode_partial.EpisodePartialRounds`` (a place holds room for
``max_samples`` episodes and plays the first G_i), carried at turn boundaries.

Tree sampling (``rollout.tree.enabled``): the configured tree's subtree below one root
(``branching**depth`` leaves) is the unit; the knapsack sizes groups in multiples of it
(``config.rollout.knapsack_step``) and prompt i grows G_i / unit such trees, whose leaves are
its group. The estimator is a group one (the tree estimators need one tree layout for every
group). With partial rollouts a pool place holds a group's trees (room for ``max_samples``
leaves of roots), and the place grows the roots its size asks for.

Images in the prompt (a vision tower): each prompt's images are decoded once and prefilled
with it (its rows fan out from that prefill; an episode, a group of one, prefills its own),
and the round carries ``pixels`` / ``image_ok`` per row, as its other fields, so the update's
rows carry their prompts' pixels.

Metrics: ``rollout/group_size_min``/``_mean``/``_max``, ``rollout/pass_rate_est_mean``,
and (every rollout) ``rollout/effective_samples``: samples that train with a non-zero
advantage.
"""
from __future__ import annotations

import time

import jax
import numpy as np

from rljax import sampling
from rljax.config.rollout import knapsack_limits, knapsack_step
from rljax.data import allocation as alloc
from rljax.data import selection
from rljax.train.core import image_inputs
from rljax.train.core.partial import PartialRounds
from rljax.train.core.rollout import RoundSource, encode_prompts, prompt_buckets
from rljax.train.core.sampler import generate, rebucket_routes, sampler_kind
from rljax.train.methods import agent
from rljax.train.methods.episode_partial import EpisodePartialRounds


class KnapsackRounds(RoundSource):
    """The ``core.parts.RoundSource`` whose groups have the knapsack's sizes (see the module
    docstring)."""

    def __init__(self, ctx):
        self.ctx, self.cfg = ctx, ctx.cfg
        self.budget, self.lo, self.hi = knapsack_limits(ctx.cfg)
        self.step = knapsack_step(ctx.cfg)   # tree sampling: groups of whole trees
        sel = ctx.cfg.data.selection
        self.threshold, self.fractional = float(sel.threshold), bool(sel.fractional)
        self.rates = alloc.PassRates()
        # Multi-turn episodes (env.name): a group is G_i episodes of its example.
        self.episodes = agent.EpisodeRounds(ctx) if ctx.cfg.env.name else None

    def pass_rates(self, rollout, indices) -> np.ndarray:
        """float [P]: the estimated pass rate of each prompt (posterior means)."""
        if isinstance(rollout.selector, selection.Predicted):
            ab = np.asarray([rollout.selector.posterior(i) for i in indices], np.float64)
            return ab[:, 0] / ab.sum(1)
        return self.rates.means(indices)

    def sample_round(self, rollout, params, rng) -> dict:
        """The iterator's next prompts, sampled with the knapsack's group sizes and scored;
        this source's posteriors learn the round (MoPPS's learns it as the rollout's
        selector)."""
        examples = next(rollout.iterator)
        indices = list(rollout.iterator.last_indices)
        p = self.pass_rates(rollout, indices)
        sizes = alloc.knapsack_allocate(p, self.budget, self.lo, self.hi, self.step)
        locations = rollout._locations(examples)
        if self.episodes is not None:
            rnd = self._play(rollout, params, rng, examples, sizes, locations=locations)
        else:
            prompt_tokens, prompt_mask = encode_prompts(
                self.ctx.tokenizer, [ex["prompt"] for ex in examples],
                self.cfg.data.max_prompt_length)
            rnd = self._sample(rollout, params, rng, examples, prompt_tokens, prompt_mask,
                               sizes, locations=locations)
        rnd.update(group_sizes=sizes, indices=indices, pass_rates=p)
        if not isinstance(rollout.selector, selection.Predicted):
            wins = selection.group_successes(rnd["rewards"], sizes, self.threshold,
                                             self.fractional)
            self.rates.observe(indices, wins, sizes)
        return rnd

    def sample_hinted(self, rollout, params, rng, examples, prefixes, sizes) -> dict:
        """Failed groups sampled again with their hint prefixes (token ids after each prompt,
        ``guidance``), each at its own size; the round's rows, group after group. Episodes:
        played again, each first turn continuing its hint."""
        if self.episodes is not None:
            return self._play(rollout, params, rng, examples, sizes, prefixes)
        tok = self.ctx.tokenizer
        prompt_tokens, prompt_mask = sampling.pad_to_bucket(
            [tok.encode(ex["prompt"]) + list(p) for ex, p in zip(examples, prefixes)],
            pad_id=tok.pad_id, buckets=prompt_buckets(self.cfg.data.max_prompt_length))
        return self._sample(rollout, params, rng, examples, prompt_tokens, prompt_mask, sizes,
                            prefixes)

    def _sample(self, rollout, params, rng, examples, prompt_tokens, prompt_mask, sizes,
                prefixes=None, locations=None) -> dict:
        """``sizes[i]`` rows of prompt i sampled (each prompt prefilled once) and scored
        (``_sample_rows``: ``budget`` rows or chunks of ``rollout.micro_batch_size``; rows
        past the groups repeat the last one and are dropped before scoring). Tree sampling: prompt i grows
        ``sizes[i] / step`` trees of ``step`` leaves, one root each (its prompt prefilled per
        tree), and the padding rows are whole trees. A vision tower: each prompt's images
        (decoded once, ``locations`` naming the examples in warnings) are prefilled with it,
        and every row of the round carries its prompt's (``image_inputs.round_fields``)."""
        cfg, n = self.cfg, int(np.sum(sizes))
        owner = np.repeat(np.arange(len(examples)), sizes).astype(np.int32)   # row -> prompt
        t0 = time.perf_counter()
        images = rollout.images
        pixels = None if images is None else images.pixels(examples, locations)
        opts = dict(max_new_tokens=cfg.rollout.max_new_tokens,
                    temperature=cfg.rollout.temperature, top_k=cfg.rollout.top_k,
                    top_p=cfg.rollout.top_p, temperatures=rollout.temperatures, images=images)
        if rollout.tree is None:
            out = self._sample_rows(params, prompt_tokens, prompt_mask, owner, rng,
                                    dict(opts, pixels=pixels))
        else:   # whole trees of ``step`` leaves, one root each: prompt i's for its group
            roots = owner[::self.step]
            roots = np.concatenate([roots, np.full(self.budget // self.step - len(roots),
                                                   roots[-1], np.int32)])
            micro = int(cfg.rollout.micro_batch_size) // self.step   # trees per chunk
            out = generate(self.ctx, params, prompt_tokens[roots], prompt_mask[roots], rng,
                           num_samples=self.step, tree=dict(rollout.tree, roots=1),
                           micro_prompts=micro,
                           pixels=None if pixels is None else pixels[roots], **opts)
            out["decoded"] = out["decoded"][:n // self.step]   # (padding trees aside)
        out = {k: v[:n] if isinstance(v, np.ndarray) and len(v) == self.budget else v
               for k, v in out.items()}
        rows = None if prefixes is None else [prefixes[i] for i in owner]
        rnd = rollout.score_round([examples[i] for i in owner], prompt_tokens[owner],
                                  prompt_mask[owner], out, rows, t0, g=1)
        if pixels is not None:
            rnd.update(image_inputs.round_fields(pixels, images.usable, sizes))
        return rnd

    def _sample_rows(self, params, prompt_tokens, prompt_mask, owner, rng, opts) -> dict:
        """Rows ``owner`` int [n] (row -> its prompt, of the P prompts [P, L]) sampled in
        chunks of ``rollout.micro_batch_size`` rows (0: one chunk of ``budget`` rows), each
        chunk one sampler call with every prompt prefilled once and the last padded by
        repeating its last row (one program shape); the sampler's outputs, n rows. On the
        static sampler row r draws from its own key ``fold_in(rng, r)`` (``row_keys``), so a
        row's tokens do not depend on the chunking; the slot engine runs each chunk as an
        engine call of its own (key ``fold_in(rng, chunk)``)."""
        n = len(owner)
        chunk = int(self.cfg.rollout.micro_batch_size) or self.budget
        total = -(-n // chunk) * chunk   # chunks of padding only are not sampled
        index = np.concatenate([owner, np.full(total - n, owner[-1], np.int32)])
        keys = _row_keys(rng, np.arange(total)) if sampler_kind(self.cfg) == "static" else None
        outs = [generate(self.ctx, params, prompt_tokens, prompt_mask,
                         jax.random.fold_in(rng, i), num_samples=1,
                         prompt_index=index[start:start + chunk],
                         row_keys=None if keys is None else keys[start:start + chunk], **opts)
                for i, start in enumerate(range(0, total, chunk))]
        out = {k: np.concatenate([o[k] for o in outs])[:n] for k in
               ("tokens", "logps", "mask", "lengths", "truncated", "decoded")}
        if "slot_steps" in outs[0]:   # the slot engine's busy and run slot-steps, summed
            out["slot_steps"] = tuple(map(sum, zip(*(o["slot_steps"] for o in outs))))
        return out

    def _play(self, rollout, params, rng, examples, sizes, prefixes=None,
              locations=None) -> dict:
        """``sizes[i]`` episodes of example i, group after group (``budget`` in all: one
        shape of the episode batches), scored as the episodes' rounds are: each episode is
        played as a group of one of its own example, so every row carries its prompt
        (``prompt_ids``) and, with a vision tower, its prompt's images (prefilled with it).
        ``prefixes``: each example's hint (``sample_hinted``), or None; ``locations``: the
        examples' ``file:line``, for image warnings."""
        owner = np.repeat(np.arange(len(examples)), sizes)
        rows = [examples[i] for i in owner]
        t0 = time.perf_counter()
        eps, rows = self.episodes.play_groups(
            params, rows, rng, 1, rollout.weights,
            None if prefixes is None else [prefixes[i] for i in owner], images=rollout.images,
            locations=None if locations is None else [locations[i] for i in owner])
        rnd = self.episodes.scored_round(rollout, eps, rows, time.perf_counter() - t0, g=1)
        if "image_ok" in rnd:   # skipped images counted per example, not per episode
            rnd["skipped_images"] = int((~rnd["image_ok"][np.cumsum(sizes) - sizes]).sum())
        return rnd

    def pick_groups(self, rounds, kept, dropped) -> tuple[list, int, bool]:
        """``Rollout._pick_groups`` for ragged groups: the kept (round, group) pairs, in order,
        that still fit in the update's ``rollout.batch_size`` rows (first fit), no filler
        (padding rows weigh zero) unless none is kept (then one dropped group that does not
        train); full once the kept groups hold the budget's samples (a round's worth: extra
        rounds of a group filter are each sized by the knapsack over their own prompts)."""
        size = lambda r, i: int(rounds[r]["group_sizes"][i])   # noqa: E731
        groups, rows = [], 0
        for r, i in kept:
            if rows + size(r, i) <= self.cfg.rollout.batch_size:
                groups.append((r, i))
                rows += size(r, i)
        full = sum(size(r, i) for r, i in kept) >= self.budget
        return (groups, 0, full) if groups else (dropped[:1], 1, full)

    def assemble(self, rollout, rounds, groups) -> tuple[dict, dict]:
        """The rows of ``groups`` ((round, group) pairs), padded to ``rollout.batch_size``
        (``expand_groups``: padding rows repeat the last row, are groups of their own and are
        not ``real``); the estimator gets each row's group (``group_ids``)."""
        n = self.cfg.rollout.batch_size
        sizes = np.asarray([rounds[r]["group_sizes"][i] for r, i in groups], np.int64)
        _, group_ids, real = alloc.expand_groups(sizes, n)
        picked = [(r, int(s)) for r, i in groups for s in group_rows(rounds[r], i)]
        picked += [picked[-1]] * (n - len(picked))   # (round, row) of each batch row
        sub = gather_rows(rounds, picked)   # now rows of one
        if "demo" in sub:   # a padding row repeating a demonstration is none
            sub["demo"] = sub["demo"] & real
        batch, rows = rollout._assemble([sub], [(0, i) for i in range(n)], g=1)
        rows.update(real=real, estimator_inputs={"group_ids": group_ids})
        return batch, rows

    def metrics(self, rounds, step: int) -> dict:
        """Group sizes and estimated pass rates over every round of the call."""
        sizes = np.concatenate([r["group_sizes"] for r in rounds])
        m = {"rollout/group_size_min": int(sizes.min()),
             "rollout/group_size_mean": float(sizes.mean()),
             "rollout/group_size_max": int(sizes.max()),
             "rollout/pass_rate_est_mean": float(np.mean(
                 np.concatenate([r["pass_rates"] for r in rounds])))}
        if self.episodes is not None:   # env/*, time/env
            m.update(self.episodes.metrics(rounds, step))
        return m

    def state_dict(self) -> dict:
        return {"pass_rates": self.rates.state()}

    def load_state_dict(self, state: dict) -> None:
        self.rates.restore(state["pass_rates"])


class KnapsackPartialRounds(KnapsackRounds):
    """Knapsack allocation with partial rollouts: the pool's groups (``core.partial``) are
    sized by the knapsack when their prompt batch is admitted, over the pass rates then; the
    round of the first P groups to complete carries their sizes (``group_sizes``), and the
    posteriors learn each group's successes when it completes, for the prompt it was drawn
    for (the pool's ``indices``). The P groups an iteration takes hold at most
    P * ``max_samples`` <= ``rollout.batch_size`` rows (config check), so they always fit the
    update. The pool is checkpointed with the posteriors."""

    def __init__(self, ctx, num_prompts: int):
        super().__init__(ctx)
        # Multi-turn episodes: the groups of episodes carried at turn boundaries.
        pool = EpisodePartialRounds if self.episodes is not None else PartialRounds
        self.partial = pool(ctx, num_prompts, sizes_of=self._sizes, rows=self.hi)

    @property
    def params_version(self) -> int | None:
        """Asynchronous RL: the version of the parameters the pool draws with (the pool's)."""
        return self.partial.params_version

    @params_version.setter
    def params_version(self, version: int | None) -> None:
        self.partial.params_version = version

    def _sizes(self, rollout, indices) -> np.ndarray:
        """int [P]: the knapsack's sizes of a prompt batch being admitted."""
        return alloc.knapsack_allocate(self.pass_rates(rollout, indices), self.budget,
                                       self.lo, self.hi, self.step)

    def begin(self, state, step: int) -> None:
        self.partial.begin(state, step)

    def sample_round(self, rollout, params, rng) -> dict:
        """The first P groups to complete, their sizes the knapsack's at admission; this
        source's posteriors learn them (MoPPS's learns them as the rollout's selector)."""
        rnd = self.partial.sample_round(rollout, params, rng)
        indices, sizes = rnd["indices"], rnd["group_sizes"]
        rnd["pass_rates"] = self.pass_rates(rollout, indices)
        if not isinstance(rollout.selector, selection.Predicted):
            self.rates.observe(indices, selection.group_successes(
                rnd["rewards"], sizes, self.threshold, self.fractional), sizes)
        return rnd

    def metrics(self, rounds, step: int) -> dict:
        return {**super().metrics(rounds, step), **self.partial.metrics(rounds, step)}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "pool": self.partial.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.partial.load_state_dict(state["pool"])


def knapsack_rounds(ctx, num_prompts: int) -> KnapsackRounds:
    """The round source of a knapsack config: with ``rollout.partial`` the pool's groups
    (``KnapsackPartialRounds``), else ``KnapsackRounds``."""
    if ctx.cfg.rollout.partial:
        return KnapsackPartialRounds(ctx, num_prompts)
    return KnapsackRounds(ctx)


# A ragged round's fields with one entry per row (``prompt_ids``, ``examples`` and a vision
# tower's ``pixels`` / ``image_ok`` too).
ROW_KEYS = ("tokens", "logps", "mask", "lengths", "truncated", "rewards", "demo", "versions",
            "prompt_ids", "examples", "pixels", "image_ok")


def group_rows(rnd: dict, i: int) -> range:
    """The rows of group ``i`` of a round with ``group_sizes`` (groups are contiguous)."""
    sizes = rnd["group_sizes"]
    start = int(np.sum(sizes[:i]))
    return range(start, start + int(sizes[i]))


def gather_rows(rounds, picked) -> dict:
    """One round dict of the rows ``picked`` ((round, row) pairs) of ``rounds``: each per-row
    field gathered (routes laid out on the longest prompt bucket), the rest the first
    round's."""
    first = rounds[0]
    out = {k: v for k, v in first.items() if k != "group_sizes"}
    for key in ROW_KEYS + tuple(first.get("row_keys", ())):
        if key in first:
            rows = [rounds[r][key][s] for r, s in picked]
            out[key] = rows if isinstance(first[key], list) else np.stack(rows)
    out["prompt_len"] = max(r["prompt_len"] for r in rounds)
    if "routes" in first:   # routing replay: each round's routes on the longest bucket
        out["routes"] = np.stack([rebucket_routes(rounds[r]["routes"][s:s + 1],
                                                  rounds[r]["prompt_len"], out["prompt_len"])[0]
                                  for r, s in picked])
    return out


@jax.jit
def _row_keys(rng, rows):
    """Keys [R] of rows 0..R-1 (``rows`` int [R]): row r's is ``fold_in(rng, r)``."""
    return jax.vmap(lambda r: jax.random.fold_in(rng, r))(rows)
