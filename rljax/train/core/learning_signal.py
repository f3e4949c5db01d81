"""A hint when a run cannot learn: every group's completions got the same reward.

GRPO-style advantages are rewards relative to their group (the G completions of one prompt).
When all G rewards of every group are equal, every advantage is 0, the policy loss is 0 and
nothing changes: ``rollout/informative_groups_frac`` is 0 and so is ``adv/abs_mean``. (With
G=1, or advantages that are not 0 anyway, e.g. a critic's, there is no hint.) ``NoSignalHint.observe(step,
metrics)`` counts such iterations in a row and, at ``after`` of them, prints one console line
saying so and what to check. Once per run: a run that keeps going is the user's choice.
A batch whose reward or advantage statistics are not finite (NaN: nothing trains) is said at
once, one line per such step.
"""
from __future__ import annotations

import math
import sys
from typing import Mapping

KEY = "rollout/informative_groups_frac"
ADV = "adv/abs_mean"
AFTER = 5  # consecutive iterations without one informative group before the hint


def non_finite(metrics: Mapping) -> str | None:
    """The first reward or advantage statistic of ``metrics`` that is NaN or infinite, as
    ``key=value``; None when all are finite."""
    for key in ("reward/mean", "reward/std", "adv/mean", "adv/std", ADV):
        value = metrics.get(key)
        if value is not None and not math.isfinite(float(value)):
            return f"{key}={float(value)}"
    return None


class NoSignalHint:
    """Counts iterations whose groups all had equal rewards; prints the hint once.

    ``temperature`` and ``num_generations`` (rollout.temperature, algo.num_generations) are
    quoted in the line."""

    def __init__(self, temperature: float, num_generations: int, after: int = AFTER,
                 stream=None, enabled: bool = True):
        self.temperature, self.g, self.after = float(temperature), int(num_generations), after
        self.stream, self.enabled = stream, enabled
        self.streak, self.said = 0, False

    def observe(self, step: int, metrics: Mapping) -> str | None:
        """Updates the streak from one iteration's metrics (phases without ``KEY``, such as
        SFT, leave it as it is); returns the line when it is printed now."""
        bad = non_finite(metrics)
        if bad:   # a NaN advantage trains nothing: said at once, every time
            line = (f"rljax: warning: step {step}: {bad} is not finite: this batch has no "
                    "learning signal (check the reward's scale)")
            if self.enabled:
                print(line, file=self.stream or sys.stderr, flush=True)
            return line
        frac = metrics.get(KEY)
        if frac is None or self.g < 2:  # G=1 (PPO's critic): groups say nothing
            return None
        # Advantages that are not all 0 (a critic's, a KL folded into the reward) still train.
        still = abs(float(metrics.get(ADV, 0.0) or 0.0)) > 0.0
        self.streak = self.streak + 1 if float(frac) == 0.0 and not still else 0
        if self.said or self.streak < self.after:
            return None
        self.said = True
        line = self.message(step, metrics.get("reward/mean"))
        if self.enabled:
            print(line, file=self.stream or sys.stderr, flush=True)
        return line

    def message(self, step: int, reward_mean) -> str:
        """The hint, naming the reward level (all 0: nothing ever matches; all 1: too easy)."""
        level = "" if reward_mean is None else f" (reward/mean {float(reward_mean):.3g})"
        return (f"rljax: hint: no learning signal for {self.streak} iterations in a row (up to "
                f"step {step}): in every group all G={self.g} completions got the same "
                f"reward{level}, so every advantage and the loss are 0 "
                f"({KEY} 0). Check the reward function (does it score a right answer 1? try it "
                "on `rljax sample` output), the data's answers (the fields it reads), "
                f"rollout.temperature={self.temperature:g} (too low: identical samples) and "
                f"algo.num_generations={self.g} (more: more chances of a different score)")
