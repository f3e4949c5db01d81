"""Environment counters -> ``env/*`` metrics for one batch of episodes.

Each step's ``StepResult.info`` holds counters; summed over an episode's steps
(``runner.merge_counters``) they are that episode's counters. For a batch of episodes:

* ``env/tool_calls_mean``: tool calls per episode;
* ``env/tool_errors``, ``env/tool_timeouts`` and ``env/tool:<name>``: totals over the batch (rare
  events are easier to read as counts);
* ``env/tool_error_rate``: the share of the batch's tool calls that failed (malformed, unknown
  tool, bad arguments, the tool's own error, over the call limit), when there were calls: a
  count of errors alone rises with the number of calls;
* any other counter an environment reports (``guess_number``: ``guesses``, ``solved``,
  ``invalid_guesses``): ``env/<key>_mean``, the mean per episode.

Games (episodes that count ``wins`` / ``draws`` / ``losses``, one each at most) also get 95%
Wilson score intervals of those rates, ``env/<key>_ci95_low`` / ``_ci95_high`` over the
episodes, and per seat the win rate of the games played in it, ``env/win_rate_<seat>`` (from
``wins_<seat>`` / ``games_<seat>``) with its interval.

Turn counts and truncation are the rollout's (``env/turns_mean``, ``env/truncated_frac``).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import math

__all__ = ["env_metrics", "TOTALS", "wilson_interval", "OUTCOMES"]

OUTCOMES = ("wins", "draws", "losses")   # per-episode 0/1 game outcomes

TOTALS = ("tool_errors", "tool_timeouts")  # reported as batch totals; "tool:<name>" too


def env_metrics(episodes: Sequence[Mapping[str, float]], prefix: str = "env") -> dict[str, float]:
    """Metrics of a batch from its episodes' summed counters (one dict per episode; a key
    missing from an episode counts as 0). Empty batch: no metrics."""
    if not episodes:
        return {}
    keys = sorted({k for counters in episodes for k in counters})
    out = {}
    for key in keys:
        total = float(sum(counters.get(key, 0) for counters in episodes))
        if key in TOTALS or key.startswith("tool:"):
            out[f"{prefix}/{key}"] = total
        else:
            out[f"{prefix}/{key}_mean"] = total / len(episodes)
    calls = sum(counters.get("tool_calls", 0) for counters in episodes)
    if calls:
        errors = sum(counters.get("tool_errors", 0) for counters in episodes)
        out[f"{prefix}/tool_error_rate"] = float(errors) / calls
    if any(k in OUTCOMES or k.startswith("games_") for k in keys):
        n = len(episodes)
        for key in OUTCOMES:
            k = sum(counters.get(key, 0) for counters in episodes)
            out[f"{prefix}/{key}_ci95_low"], out[f"{prefix}/{key}_ci95_high"] = \
                wilson_interval(k, n)
        for key in keys:
            if key.startswith("games_"):
                seat = key[len("games_"):]
                games = sum(c.get(key, 0) for c in episodes)
                wins = sum(c.get(f"wins_{seat}", 0) for c in episodes)
                out[f"{prefix}/win_rate_{seat}"] = wins / games
                out[f"{prefix}/win_rate_{seat}_ci95_low"], \
                    out[f"{prefix}/win_rate_{seat}_ci95_high"] = wilson_interval(wins, games)
    return out


def wilson_interval(successes: float, n: float, z: float = 1.959963984540054
                    ) -> tuple[float, float]:
    """The Wilson score interval of a binomial rate (95% for the default z): ``(low, high)``
    around ``successes / n``, inside [0, 1] and not empty at 0 or n successes (unlike the
    normal approximation). ``(0.0, 1.0)`` for n = 0.

        centre = (p + z^2 / 2n) / (1 + z^2 / n)
        half   = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / 4n^2)      p = successes / n
    """
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= successes <= n:
        raise ValueError(f"wilson_interval: need 0 <= successes <= n, got {successes}, {n}")
    p, z2 = successes / n, z * z
    denom = 1.0 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)
