"""Which prompts an RL step trains on: prompt selection by difficulty (``data.selection``).

A selector wraps the run's ``DataIterator`` and is what the rollout draws its prompts from::

    it = selection.make(data_iterator, cfg.data.selection, seed=cfg.seed, group_size=G)
    examples = next(it)                      # this step's prompts
    it.observe(rewards, G)                   # after each sampling round: rewards [B*G]
    it.observe(rewards, G, indices)          # ... of groups drawn earlier: their dataset indices
    keep = it.keep_groups(rewards, G)        # online_filter: bool [B] (None: keep all)
    it.state() / it.restore(state)           # checkpointed with the phase: resume is exact

Methods (``data.selection.name``):

* ``uniform``: the iterator itself, unchanged (``make`` returns it as it is).
* ``online_filter``: groups whose pass rate lies in ``[low, high]`` train; the rollout samples
  more rounds to fill the batch (the DAPO dynamic-sampling loop, ``algo.max_sampling_rounds``),
  and every sampled token counts in ``rollout/tokens`` (Bae et al. 2025, "Online Difficulty
  Filtering for Reasoning Oriented RL").
* ``predicted``: a Beta(a, b) posterior of each prompt's success rate, updated from its
  rollouts with decay toward the prior; each step Thompson-samples a rate for every prompt of
  a candidate pool and trains on the prompts whose sampled rates are nearest ``target``. No
  extra rollouts (Qu et al. 2025, MoPPS, "Can Prompt Difficulty be Online Predicted...").
* ``curriculum``: a built-in task's difficulty knob (``digits``, ``operands``, ...) is raised
  or lowered every ``window`` steps to keep the training accuracy in ``[low, high]``, between
  ``min_level`` and the configured value (which evaluation keeps using).

A sample succeeds when its reward >= ``threshold`` (or, with ``fractional``, counts its reward
clipped to [0, 1]); a group's pass rate is its successes / G.
"""
from __future__ import annotations

import copy

import numpy as np

__all__ = ["SELECTORS", "DIFFICULTY_KNOBS", "make", "Selector", "group_successes",
           "in_band", "beta_update", "thompson_pick", "next_level"]

# Difficulty knobs of the built-in tasks, with their smallest allowed value.
DIFFICULTY_KNOBS: dict[str, dict[str, int]] = {
    "arithmetic": {"digits": 1, "operands": 2},
    "countdown": {"num_numbers": 2, "max_number": 1},
}

_THOMPSON_STREAM = 7  # rng stream of the Thompson draws: default_rng([seed, stream, draw])


# ----------------------------------------------------------------------------- pure pieces

def group_successes(rewards, group_size, threshold: float = 1.0,
                    fractional: bool = False) -> np.ndarray:
    """Successes per group: float [B] from rewards [B*G] (prompt-major groups of G), or,
    with ``group_size`` a sequence of B sizes, from consecutive groups of those sizes.

    A sample counts 1 if its reward >= ``threshold``, or with ``fractional`` its reward
    clipped to [0, 1]."""
    r = np.asarray(rewards, np.float64)
    hits = np.clip(r, 0.0, 1.0) if fractional else (r >= threshold).astype(np.float64)
    if np.ndim(group_size) == 0:
        return hits.reshape(-1, int(group_size)).sum(axis=1)
    starts = np.concatenate([[0], np.cumsum(group_size)[:-1]]).astype(np.int64)
    return np.add.reduceat(hits, starts)


def in_band(pass_rates, low: float, high: float) -> np.ndarray:
    """bool [B]: pass rates inside the closed band ``[low, high]``."""
    p = np.asarray(pass_rates, np.float64)
    return (p >= low) & (p <= high)


def beta_update(a: float, b: float, successes: float, trials: float, *, decay: float,
                prior_a: float, prior_b: float) -> tuple[float, float]:
    """One posterior step of a prompt's success rate (MoPPS):

        a' = decay * a + (1 - decay) * prior_a + successes
        b' = decay * b + (1 - decay) * prior_b + (trials - successes)

    ``decay`` = 1 is the plain Beta-Bernoulli update; < 1 forgets old evidence toward the
    prior, as the policy (and so the prompt's true rate) keeps moving."""
    return (decay * a + (1.0 - decay) * prior_a + successes,
            decay * b + (1.0 - decay) * prior_b + (trials - successes))


def thompson_pick(a, b, k: int, target: float, rng: np.random.Generator):
    """Thompson choice of ``k`` of ``n`` candidates: one rate ~ Beta(a_i, b_i) each, the
    ``k`` nearest ``target`` (ties: earlier candidate first).

    a, b: float [n] (> 0). Returns (int [k] candidate positions, float [n] sampled rates)."""
    rates = rng.beta(np.asarray(a, np.float64), np.asarray(b, np.float64))
    order = np.argsort(np.abs(rates - target), kind="stable")
    return order[:k], rates


def next_level(level: int, accuracy: float, low: float, high: float, lowest: int,
               highest: int) -> int:
    """Curriculum step: one level harder above ``high``, easier below ``low``, clipped to
    ``[lowest, highest]``."""
    if accuracy > high:
        level += 1
    elif accuracy < low:
        level -= 1
    return int(min(max(level, lowest), highest))


# ----------------------------------------------------------------------------- selectors

class Selector:
    """Base: draws from ``iterator`` as it is; subclasses override the hooks.

    ``filters``: whether ``keep_groups`` filters (the rollout then samples extra rounds)."""

    name = "uniform"
    filters = False

    def __init__(self, iterator, options: dict, seed: int):
        self.iterator, self.options, self.seed = iterator, options, int(seed)
        self.threshold = float(options.get("threshold", 1.0))
        self.fractional = bool(options.get("fractional", False))

    def __iter__(self):
        return self

    def __next__(self) -> list[dict]:
        return next(self.iterator)

    def __getattr__(self, name):  # scan, source, num_dropped, ...: the wrapped iterator's
        if name == "iterator":
            raise AttributeError(name)
        return getattr(self.iterator, name)

    def successes(self, rewards, group_size: int) -> np.ndarray:
        return group_successes(rewards, group_size, self.threshold, self.fractional)

    def observe(self, rewards, group_size: int, indices=None) -> None:
        """Called with each sampling round's rewards [B*G]: of the last ``next`` prompts, or
        (``indices``) of the groups of those dataset indices, whenever they were drawn
        (partial rollouts complete a group iterations after its prompt was drawn)."""

    def keep_groups(self, rewards, group_size):
        """bool [B]: which of the round's groups may train (None: all); ``group_size`` G, or
        int [B] sizes of consecutive groups."""
        return None

    def metrics(self) -> dict:
        return {}

    def state(self) -> dict:
        return {"method": self.name, "data": self.iterator.state(), "selection": self._state()}

    def restore(self, state: dict) -> None:
        if state.get("method") != self.name:
            raise ValueError(f"checkpoint has data.selection.name={state.get('method')!r} "
                             f"state; this run uses {self.name!r}")
        self.iterator.restore(state["data"])
        self._restore(state["selection"])

    def _state(self) -> dict:
        return {}

    def _restore(self, state: dict) -> None:
        pass


class OnlineFilter(Selector):
    """Trains on the groups whose pass rate is in ``[low, high]`` (rollout re-samples)."""

    name = "online_filter"
    filters = True

    def __init__(self, iterator, options, seed):
        super().__init__(iterator, options, seed)
        self.low, self.high = float(options["low"]), float(options["high"])
        self.seen = self.kept = 0  # groups, over the whole run

    def keep_groups(self, rewards, group_size):
        keep = in_band(self.successes(rewards, group_size) / group_size, self.low, self.high)
        self.seen += keep.size
        self.kept += int(keep.sum())
        return keep

    def metrics(self):
        return {"selection/in_band_frac": self.kept / max(self.seen, 1)}

    def _state(self):
        return {"seen": self.seen, "kept": self.kept}

    def _restore(self, state):
        self.seen, self.kept = int(state["seen"]), int(state["kept"])


class Predicted(Selector):
    """MoPPS: per-prompt Beta posteriors, Thompson-sampled toward ``target`` from a pool of
    ``pool_factor`` x batch candidates. Posteriors are keyed by dataset index; at most
    ``max_tracked`` are kept (the least recently updated go first)."""

    name = "predicted"

    def __init__(self, iterator, options, seed):
        super().__init__(iterator, options, seed)
        o = options
        self.target, self.decay = float(o["target"]), float(o["decay"])
        self.prior = (float(o["prior_a"]), float(o["prior_b"]))
        self.pool_factor, self.max_tracked = int(o["pool_factor"]), int(o["max_tracked"])
        self.posteriors: dict[int, tuple[float, float]] = {}  # insertion order = recency
        self.draws = 0
        self.last_indices: list[int] = []
        self._picked_rates = self._pool_means = np.zeros(1)

    def posterior(self, index: int) -> tuple[float, float]:
        return self.posteriors.get(int(index), self.prior)

    def __next__(self):
        pool, indices = [], []
        for _ in range(self.pool_factor):
            pool += next(self.iterator)
            indices += self.iterator.last_indices
        ab = np.asarray([self.posterior(i) for i in indices], np.float64)
        rng = np.random.default_rng([self.seed, _THOMPSON_STREAM, self.draws])
        self.draws += 1
        k = self.iterator.batch_size
        picked, rates = thompson_pick(ab[:, 0], ab[:, 1], k, self.target, rng)
        self.last_indices = [indices[i] for i in picked]
        self._picked_rates = rates[picked]
        self._pool_means = ab[:, 0] / ab.sum(1)
        return [pool[i] for i in picked]

    def observe(self, rewards, group_size, indices=None):
        wins = self.successes(rewards, group_size)
        trials = np.broadcast_to(np.asarray(group_size, np.float64), wins.shape)
        indices = self.last_indices if indices is None else [int(i) for i in indices]
        for index, s, n in zip(indices, wins, trials):
            a, b = self.posterior(index)
            self.posteriors.pop(index, None)  # re-insert: most recent last
            self.posteriors[index] = beta_update(a, b, float(s), float(n),
                                                 decay=self.decay, prior_a=self.prior[0],
                                                 prior_b=self.prior[1])
        while len(self.posteriors) > self.max_tracked:
            del self.posteriors[next(iter(self.posteriors))]

    def metrics(self):
        return {"selection/sampled_rate_mean": float(np.mean(self._picked_rates)),
                "selection/pool_mean_rate": float(np.mean(self._pool_means)),
                "selection/tracked": len(self.posteriors)}

    def _state(self):  # a list keeps the recency order; JSON floats round-trip exactly
        return {"draws": self.draws, "last_indices": list(self.last_indices),
                "posteriors": [[i, a, b] for i, (a, b) in self.posteriors.items()]}

    def _restore(self, state):
        self.draws, self.last_indices = int(state["draws"]), list(state["last_indices"])
        self.posteriors = {int(i): (float(a), float(b)) for i, a, b in state["posteriors"]}


class Curriculum(Selector):
    """Moves a task knob between ``min_level`` and the configured level to keep the training
    accuracy (mean success over ``window`` steps) in ``[low, high]``. Starts at ``min_level``."""

    name = "curriculum"

    def __init__(self, iterator, options, seed):
        super().__init__(iterator, options, seed)
        self.low, self.high = float(options["low"]), float(options["high"])
        self.knob, self.window = str(options["knob"]), int(options["window"])
        self.base_task = iterator.source.task
        self.highest = int(getattr(self.base_task, self.knob))
        self.lowest = int(options["min_level"])
        self.level = self.lowest
        self.recent: list[float] = []  # training accuracy of each round at this level
        self.accuracy = 0.0             # of the last round (for the metrics)
        self._set_level(self.level)

    def _set_level(self, level: int) -> None:
        """Examples drawn from now on have this difficulty (the eval source is separate)."""
        task = copy.copy(self.base_task)
        setattr(task, self.knob, int(level))
        self.iterator.source.task = task
        self.level = int(level)

    def observe(self, rewards, group_size, indices=None):
        self.accuracy = float(self.successes(rewards, group_size).sum() /
                              np.asarray(rewards).size)
        self.recent.append(self.accuracy)
        if len(self.recent) >= self.window:
            self._set_level(next_level(self.level, float(np.mean(self.recent)), self.low,
                                       self.high, self.lowest, self.highest))
            self.recent = []

    def metrics(self):
        return {"selection/level": self.level, "selection/accuracy": self.accuracy}

    def _state(self):
        return {"level": self.level, "recent": list(self.recent), "accuracy": self.accuracy}

    def _restore(self, state):
        self._set_level(int(state["level"]))
        self.recent = [float(x) for x in state["recent"]]
        self.accuracy = float(state["accuracy"])


SELECTORS = {"uniform": Selector, "online_filter": OnlineFilter, "predicted": Predicted,
             "curriculum": Curriculum}


def make(iterator, options, seed: int = 0):
    """The selector ``options["name"]`` over ``iterator``; ``uniform`` returns the iterator
    itself (today's behaviour and checkpoint format, bit for bit)."""
    options = options.to_dict() if hasattr(options, "to_dict") else dict(options)
    name = options.get("name", "uniform")
    if name not in SELECTORS:
        raise ValueError(f"data.selection.name={name!r} is not one of: {', '.join(SELECTORS)}")
    if name == "uniform":
        return iterator
    return SELECTORS[name](iterator, options, seed)
