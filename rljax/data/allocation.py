"""How many samples each prompt of a step gets (``rollout.allocation``).

``uniform``: G = ``algo.num_generations`` for every prompt. ``knapsack`` (Li et al. 2025,
"Knapsack RL: Unlocking Exploration of LLMs via Optimizing Budget Allocation",
arXiv 2509.25849): the step's sample budget B is split into per-prompt group sizes G_i by an
exact knapsack over estimated pass rates p_i::

    maximise   sum_i Value(G_i, p_i)
    subject to sum_i G_i = B,   lo <= G_i <= hi

    Value(G, p) = ProbNonZeroGradient(G, p) * InfoGain(p)
                = (1 - p^G - (1 - p)^G) * p (1 - p)^2

(the probability that a group of G samples is neither all-right nor all-wrong, so GRPO gets a
gradient from it, times the paper's approximation of the success-rate gain of a step on it).
The pass rates are posterior means of a Beta per prompt (``PassRates``, or the MoPPS
posterior of ``data.selection.name='predicted'``), never exactly 0 or 1, so every prompt
keeps a positive value and the budget is always spent exactly. (The paper estimates p from
the prompt's last epoch and moves the budget of prompts at p in {0, 1} by a fallback rule.)
Host-side numpy; nothing here touches the device.
"""
from __future__ import annotations

import numpy as np

from rljax.data.selection import beta_update

__all__ = ["task_value", "knapsack_allocate", "size_range", "PassRates", "expand_groups",
           "informative_groups"]


def task_value(g, p) -> np.ndarray:
    """Value(G, p) = (1 - p^G - (1-p)^G) * p * (1-p)^2, elementwise (G int, p in [0, 1])."""
    g = np.asarray(g, np.float64)
    p = np.asarray(p, np.float64)
    return (1.0 - p ** g - (1.0 - p) ** g) * p * (1.0 - p) ** 2


def size_range(lo: int, hi: int, step: int = 1) -> tuple[int, int]:
    """(smallest, largest) multiple of ``step`` in [lo, hi]: the group sizes a knapsack with
    that step may give (smallest > largest: none)."""
    return -(-int(lo) // step) * step, int(hi) // step * step


def knapsack_allocate(pass_rates, budget: int, lo: int, hi: int, step: int = 1) -> np.ndarray:
    """Exact group sizes: int [P] maximising ``sum task_value(G_i, p_i)`` with
    ``sum G_i == budget`` and ``lo <= G_i <= hi``, each a multiple of ``step`` (tree
    sampling: whole trees), by dynamic programming over (prompt, samples spent):
    O(P * budget * (hi - lo + 1)).

    Ties go to the smaller G of the earlier prompt (deterministic). Raises ValueError when
    no allocation exists (``P * lo > budget`` or ``P * hi < budget``, counting multiples of
    ``step`` only)."""
    p = np.asarray(pass_rates, np.float64)
    n = p.shape[0]
    if lo < 1 or hi < lo:
        raise ValueError(f"knapsack: need 1 <= min samples <= max samples, got {lo}, {hi}")
    lo, hi = size_range(lo, hi, step)
    if hi < lo or n * lo > budget or n * hi < budget or budget % step:
        raise ValueError(f"knapsack: {n} prompts cannot share a budget of {budget} samples "
                         f"with {lo} to {hi} samples each" + (f" in multiples of {step}"
                                                             if step > 1 else ""))
    sizes = np.arange(lo, hi + 1, step)
    values = task_value(sizes[None, :], p[:, None])            # [P, choices]
    neg = -np.inf
    best = np.full((n + 1, budget + 1), neg)                   # best[i, b]: first i prompts, b spent
    best[0, 0] = 0.0
    choice = np.zeros((n + 1, budget + 1), np.int64)
    for i in range(n):
        for b in range(budget + 1):
            if best[i, b] == neg:
                continue
            for k, s in enumerate(sizes):
                nb = b + s
                if nb > budget:
                    break
                v = best[i, b] + values[i, k]
                if v > best[i + 1, nb] + 1e-15:
                    best[i + 1, nb], choice[i + 1, nb] = v, s
    out = np.zeros(n, np.int64)
    b = budget
    for i in range(n, 0, -1):
        out[i - 1] = choice[i, b]
        b -= choice[i, b]
    return out


class PassRates:
    """A Beta(a, b) posterior of each prompt's pass rate, keyed by dataset index (the same
    update as MoPPS, ``selection.beta_update``, with no decay by default); its mean is the
    rate the knapsack uses. At most ``max_tracked`` prompts are kept (least recent first)."""

    def __init__(self, prior=(1.0, 1.0), decay: float = 1.0, max_tracked: int = 100_000):
        self.prior, self.decay, self.max_tracked = tuple(map(float, prior)), float(decay), max_tracked
        self.posteriors: dict[int, tuple[float, float]] = {}

    def posterior(self, index: int) -> tuple[float, float]:
        return self.posteriors.get(int(index), self.prior)

    def means(self, indices) -> np.ndarray:
        """float [P]: posterior mean a / (a + b) of each prompt."""
        ab = np.asarray([self.posterior(i) for i in indices], np.float64).reshape(-1, 2)
        return ab[:, 0] / ab.sum(1)

    def observe(self, indices, successes, trials) -> None:
        for index, s, t in zip(indices, successes, trials):
            a, b = self.posterior(index)
            self.posteriors.pop(int(index), None)
            self.posteriors[int(index)] = beta_update(a, b, float(s), float(t), decay=self.decay,
                                                      prior_a=self.prior[0],
                                                      prior_b=self.prior[1])
        while len(self.posteriors) > self.max_tracked:
            del self.posteriors[next(iter(self.posteriors))]

    def state(self) -> list:
        return [[i, a, b] for i, (a, b) in self.posteriors.items()]

    def restore(self, state: list) -> None:
        self.posteriors = {int(i): (float(a), float(b)) for i, a, b in state}


def expand_groups(sizes, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The row layout of ragged groups padded to ``rows``: (prompt of each row int [rows],
    group id of each row int [rows], real bool [rows]). Groups are contiguous in prompt order;
    padding rows (``rows - sum(sizes)`` of them) repeat the last prompt, are not real, and
    each is a group of its own (so every group estimator gives them exactly 0)."""
    sizes = np.asarray(sizes, np.int64)
    total = int(sizes.sum())
    if total > rows:
        raise ValueError(f"{total} samples do not fit in {rows} rows")
    prompt = np.repeat(np.arange(len(sizes)), sizes)
    pad = rows - total
    prompt = np.concatenate([prompt, np.full(pad, len(sizes) - 1, np.int64)])
    group = np.concatenate([np.repeat(np.arange(len(sizes)), sizes),
                            len(sizes) + np.arange(pad)])
    real = np.arange(rows) < total
    return prompt, group, real


def informative_groups(rewards, sizes) -> np.ndarray:
    """bool [len(sizes)]: which consecutive groups of ``sizes`` rows of ``rewards`` (rows past
    their sum ignored) have rewards that are not all equal."""
    sizes = np.asarray(sizes)
    r = np.asarray(rewards, np.float64)[:int(sizes.sum())]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    return np.maximum.reduceat(r, starts) != np.minimum.reduceat(r, starts)
