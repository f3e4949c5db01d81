"""The GRPO rollout with per-prompt group sizes (``rollout.allocation='knapsack'``).

Each step: the prompts' pass rates (posterior means: the MoPPS posterior of
``data.selection.name='predicted'``, else this rollout's own Beta posteriors,
``rljax.data.allocation.PassRates``) -> group sizes G_i by the knapsack
(``allocation.knapsack_allocate``, sum G_i = the budget) -> each prompt prefilled once and
its G_i rows sampled from it (one sampler program: always ``budget`` rows) -> rewards -> the
posteriors learn the groups' successes. The update batch is ``rollout.batch_size`` rows, the
groups contiguous; rows past the budget repeat the last sample and weigh zero. Advantages are
the configured GRPO-family estimator over each group's own rows (``group_ids``). The update
computes each prompt once too (``length_groups.ragged_layout``).

Metrics: ``rollout/group_size_min``/``_mean``/``_max``, ``rollout/pass_rate_est_mean``,
and (every rollout) ``rollout/effective_samples``: samples that train with a non-zero
advantage.
"""
from __future__ import annotations

import time

import jax
import numpy as np

from rljax import algorithms
from rljax.config.rollout import knapsack_limits
from rljax.data import allocation as alloc
from rljax.data import selection
from rljax.train.core.rollout import Rollout, encode_prompts
from rljax.train.core.sampler import generate


class KnapsackRollout(Rollout):
    """``Rollout`` whose groups have the knapsack's sizes (see the module docstring)."""

    def __init__(self, ctx, iterator, old_logps: bool = False, stages=()):
        super().__init__(ctx, iterator, old_logps=old_logps, stages=stages)
        self.budget, self.lo, self.hi = knapsack_limits(ctx.cfg)
        sel = ctx.cfg.data.selection
        self.threshold, self.fractional = float(sel.threshold), bool(sel.fractional)
        self.predicted = isinstance(self.selector, selection.Predicted)
        self.rates = alloc.PassRates()
        self._group_ids = None   # int [batch_size] of the batch being assembled
        self._sizes = None       # int [P], the group sizes of the round being reported

    # -- sampling --------------------------------------------------------------------------

    def pass_rates(self, indices) -> np.ndarray:
        """float [P]: the estimated pass rate of each prompt (posterior means)."""
        if self.predicted:
            ab = np.asarray([self.selector.posterior(i) for i in indices], np.float64)
            return ab[:, 0] / ab.sum(1)
        return self.rates.means(indices)

    def sample_round(self, params, rng, examples=None, prefixes=None) -> dict:
        cfg = self.cfg
        examples = next(self.iterator) if examples is None else examples
        indices = list(self.iterator.last_indices)
        p = self.pass_rates(indices)
        sizes = alloc.knapsack_allocate(p, self.budget, self.lo, self.hi)
        owner = np.repeat(np.arange(len(examples)), sizes).astype(np.int32)   # row -> prompt
        rows = [examples[i] for i in owner]
        prompt_tokens, prompt_mask = encode_prompts(
            self.ctx.tokenizer, [ex["prompt"] for ex in examples], cfg.data.max_prompt_length)
        t0 = time.perf_counter()
        out = generate(self.ctx, params, prompt_tokens, prompt_mask, rng, num_samples=1,
                       max_new_tokens=cfg.rollout.max_new_tokens,
                       temperature=cfg.rollout.temperature, top_k=cfg.rollout.top_k,
                       top_p=cfg.rollout.top_p, temperatures=self.temperatures,
                       prompt_index=owner)
        rnd = self.score_round(rows, prompt_tokens[owner], prompt_mask[owner], out, None, t0,
                               g=1)
        rnd.update(group_sizes=sizes, indices=indices, pass_rates=p)
        return rnd

    def round_groups(self, rnd: dict) -> int:
        return len(rnd["group_sizes"])

    def observe_round(self, rnd: dict) -> None:
        sizes = rnd["group_sizes"]
        if self.selector is not None:   # MoPPS learns each group at its own size
            self.selector.observe(rnd["rewards"], sizes)
        if not self.predicted:
            wins = selection.group_successes(rnd["rewards"], sizes, self.threshold,
                                             self.fractional)
            self.rates.observe(rnd["indices"], wins, sizes)

    # -- the batch -------------------------------------------------------------------------

    def _assemble(self, rounds, groups):
        """All of the one round's rows, padded to ``rollout.batch_size`` (``expand_groups``:
        padding rows repeat the last row, are groups of their own and are not ``real``)."""
        (rnd,) = rounds
        n = self.cfg.rollout.batch_size
        _, self._group_ids, real = alloc.expand_groups(rnd["group_sizes"], n)
        src = np.minimum(np.arange(n), len(rnd["rewards"]) - 1)
        sub = dict(rnd, prompt_ids=[rnd["prompt_ids"][i] for i in src])
        for key in ("tokens", "logps", "mask", "lengths", "truncated", "rewards"):
            sub[key] = rnd[key][src]
        batch, rows = super()._assemble([sub], [(0, i) for i in range(n)], g=1)
        rows["real"] = real
        return batch, rows

    def advantages(self, rewards, mask=None, token_kl=None) -> np.ndarray:
        a = self.cfg.algo
        if self._advantages is None:
            opts = {"scale_rewards": a.scale_rewards} if a.adv_estimator == "grpo" else {}
            est = algorithms.get_advantage_estimator(a.adv_estimator)
            if self.token_level:
                opts.update(kl_coef=float(a.beta) if a.kl_in_reward else 0.0,
                            gamma=float(a.gamma))
                self._advantages = jax.jit(lambda r, ids, m, kl: est(
                    r, 1, group_ids=ids, mask=m, token_kl=kl, **opts))
            else:
                self._advantages = jax.jit(lambda r, ids: est(r, 1, group_ids=ids, **opts))
        rewards = np.asarray(rewards, np.float32)
        if not self.token_level:
            return np.asarray(self._advantages(rewards, self._group_ids), np.float32)
        if token_kl is None:
            token_kl = np.zeros(mask.shape, np.float32)
        return np.asarray(self._advantages(rewards, self._group_ids, np.asarray(mask, bool),
                                           token_kl), np.float32)

    def informative_groups(self, rewards) -> np.ndarray:
        """bool [P]: the round's groups (consecutive, the knapsack's sizes) whose rewards
        are not all equal."""
        r = np.asarray(rewards, np.float64)[:int(self._sizes.sum())]
        starts = np.concatenate([[0], np.cumsum(self._sizes)[:-1]]).astype(np.int64)
        return np.maximum.reduceat(r, starts) != np.minimum.reduceat(r, starts)

    def _metrics(self, rounds, rows, adv, loss_mask, groups, kept, filler) -> dict:
        sizes = rounds[0]["group_sizes"]
        self._sizes = sizes
        m = super()._metrics(rounds, rows, adv, loss_mask, groups, kept, filler)
        m.update({"rollout/group_size_min": int(sizes.min()),
                  "rollout/group_size_mean": float(sizes.mean()),
                  "rollout/group_size_max": int(sizes.max()),
                  "rollout/pass_rate_est_mean": float(np.mean(rounds[0]["pass_rates"]))})
        return m

    def state_dict(self) -> dict:
        return {"pass_rates": self.rates.state()}

    def load_state_dict(self, state: dict) -> None:
        self.rates.restore(state["pass_rates"])
