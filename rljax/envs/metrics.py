"""Environment counters -> ``env/*`` metrics for one batch of episodes.

Each step's ``StepResult.info`` holds counters; summed over an episode's steps
(``runner.merge_counters``) they are that episode's counters. For a batch of episodes:

* ``env/tool_calls_mean``: tool calls per episode;
* ``env/tool_errors``, ``env/tool_timeouts`` and ``env/tool:<name>``: totals over the batch (rare
  events are easier to read as counts);
* any other counter an environment reports (``guess_number``: ``guesses``, ``solved``,
  ``invalid_guesses``): ``env/<key>_mean``, the mean per episode.

Turn counts and truncation are the rollout's (``env/turns_mean``, ``env/truncated_frac``).
"""
from __future__ import annotations

from typing import Mapping, Sequence

__all__ = ["env_metrics", "TOTALS"]

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
    return out
