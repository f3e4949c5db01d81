"""Per-prompt group sizes (``rollout.allocation='knapsack'``): the rollout's round source.

Each step: the prompts' pass rates (posterior means: the MoPPS posterior of
``data.selection.name='predicted'``, else this source's own Beta posteriors,
``rljax.data.allocation.PassRates``) -> group sizes G_i by the knapsack
(``allocation.knapsack_allocate``, sum G_i = the budget) -> each prompt prefilled once and
its G_i rows sampled from it (one sampler program: always ``budget`` rows) -> rewards -> the
posteriors learn the groups' successes. The round carries ``group_sizes``, which the rollout
counts its groups, prompt selection's observations and informative groups by. The update
batch is ``rollout.batch_size`` rows, the groups contiguous; rows past the budget repeat the
last sample and weigh zero. Advantages are the configured GRPO-family estimator over each
group's own rows (``group_ids``). The update computes each prompt once too
(``length_groups.ragged_layout``). The phase checkpoints the posteriors under
``allocation``.

Metrics: ``rollout/group_size_min``/``_mean``/``_max``, ``rollout/pass_rate_est_mean``,
and (every rollout) ``rollout/effective_samples``: samples that train with a non-zero
advantage.
"""
from __future__ import annotations

import time

import numpy as np

from rljax import sampling
from rljax.config.rollout import knapsack_limits
from rljax.data import allocation as alloc
from rljax.data import selection
from rljax.train.core.rollout import RoundSource, encode_prompts, prompt_buckets
from rljax.train.core.sampler import generate


class KnapsackRounds(RoundSource):
    """The ``core.parts.RoundSource`` whose groups have the knapsack's sizes (see the module
    docstring)."""

    def __init__(self, ctx):
        self.ctx, self.cfg = ctx, ctx.cfg
        self.budget, self.lo, self.hi = knapsack_limits(ctx.cfg)
        sel = ctx.cfg.data.selection
        self.threshold, self.fractional = float(sel.threshold), bool(sel.fractional)
        self.rates = alloc.PassRates()

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
        sizes = alloc.knapsack_allocate(p, self.budget, self.lo, self.hi)
        prompt_tokens, prompt_mask = encode_prompts(
            self.ctx.tokenizer, [ex["prompt"] for ex in examples], self.cfg.data.max_prompt_length)
        rnd = self._sample(rollout, params, rng, examples, prompt_tokens, prompt_mask, sizes)
        rnd.update(group_sizes=sizes, indices=indices, pass_rates=p)
        if not isinstance(rollout.selector, selection.Predicted):
            wins = selection.group_successes(rnd["rewards"], sizes, self.threshold,
                                             self.fractional)
            self.rates.observe(indices, wins, sizes)
        return rnd

    def sample_hinted(self, rollout, params, rng, examples, prefixes, sizes) -> dict:
        """Failed groups sampled again with their hint prefixes (token ids after each prompt,
        ``guidance``), each at its own size; the round's rows, group after group."""
        tok = self.ctx.tokenizer
        prompt_tokens, prompt_mask = sampling.pad_to_bucket(
            [tok.encode(ex["prompt"]) + list(p) for ex, p in zip(examples, prefixes)],
            pad_id=tok.pad_id, buckets=prompt_buckets(self.cfg.data.max_prompt_length))
        return self._sample(rollout, params, rng, examples, prompt_tokens, prompt_mask, sizes,
                            prefixes)

    def _sample(self, rollout, params, rng, examples, prompt_tokens, prompt_mask, sizes,
                prefixes=None) -> dict:
        """``sizes[i]`` rows of prompt i sampled (each prompt prefilled once) and scored. The
        sampler always runs ``budget`` rows (one program): rows past the groups repeat the
        last one and are dropped before scoring."""
        cfg, n = self.cfg, int(np.sum(sizes))
        owner = np.repeat(np.arange(len(examples)), sizes).astype(np.int32)   # row -> prompt
        padded = np.concatenate([owner, np.full(self.budget - n, owner[-1], np.int32)])
        t0 = time.perf_counter()
        out = generate(self.ctx, params, prompt_tokens, prompt_mask, rng, num_samples=1,
                       max_new_tokens=cfg.rollout.max_new_tokens,
                       temperature=cfg.rollout.temperature, top_k=cfg.rollout.top_k,
                       top_p=cfg.rollout.top_p, temperatures=rollout.temperatures,
                       prompt_index=padded)
        out = {k: v[:n] if isinstance(v, np.ndarray) and len(v) == self.budget else v
               for k, v in out.items()}
        rows = None if prefixes is None else [prefixes[i] for i in owner]
        return rollout.score_round([examples[i] for i in owner], prompt_tokens[owner],
                                   prompt_mask[owner], out, rows, t0, g=1)

    def assemble(self, rollout, rounds) -> tuple[dict, dict]:
        """All of the one round's rows, padded to ``rollout.batch_size`` (``expand_groups``:
        padding rows repeat the last row, are groups of their own and are not ``real``); the
        estimator gets each row's group (``group_ids``)."""
        (rnd,) = rounds
        n = self.cfg.rollout.batch_size
        _, group_ids, real = alloc.expand_groups(rnd["group_sizes"], n)
        src = np.minimum(np.arange(n), len(rnd["rewards"]) - 1)
        sub = {k: v for k, v in rnd.items() if k != "group_sizes"}   # now rows of one
        sub["prompt_ids"] = [rnd["prompt_ids"][i] for i in src]
        for key in ("tokens", "logps", "mask", "lengths", "truncated", "rewards", "demo"):
            if key in rnd:   # (demo: mixed-policy demonstrations' rows)
                sub[key] = rnd[key][src]
        if "demo" in sub:   # a padding row repeating a demonstration is none
            sub["demo"] = sub["demo"] & real
        batch, rows = rollout._assemble([sub], [(0, i) for i in range(n)], g=1)
        rows.update(real=real, estimator_inputs={"group_ids": group_ids})
        return batch, rows

    def metrics(self, rounds, step: int) -> dict:
        sizes = rounds[0]["group_sizes"]
        return {"rollout/group_size_min": int(sizes.min()),
                "rollout/group_size_mean": float(sizes.mean()),
                "rollout/group_size_max": int(sizes.max()),
                "rollout/pass_rate_est_mean": float(np.mean(rounds[0]["pass_rates"]))}

    def state_dict(self) -> dict:
        return {"pass_rates": self.rates.state()}

    def load_state_dict(self, state: dict) -> None:
        self.rates.restore(state["pass_rates"])
