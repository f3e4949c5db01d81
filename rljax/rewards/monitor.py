"""Reward failures you cannot miss: console warnings and a stop after too many failed steps.

    monitor = RewardMonitor(max_consecutive_error_steps=10)
    result = combined(prompts, completions, **fields)     # a RewardResult
    monitor.observe(result)                               # warns (rate-limited) on failures
    monitor.end_step(step, errors, samples)               # raises RewardFunctionFailed

``observe`` prints ``rljax: warning: reward 'my_fn' failed on 16 of 16 samples: ZeroDivisionError:
division by zero (at my_reward.py:7)`` to stderr the first time a function fails, then at most
once per ``warn_every_s`` per function, summing what happened in between. ``end_step`` takes the
step's counts per function (all sampling rounds; all hosts on a pod, so every host decides the
same) and counts, per function, the consecutive steps in which it failed on *every* sample; at
``max_consecutive_error_steps`` (0 = never) it raises :class:`RewardFunctionFailed` naming the
function and its last error.
"""
from __future__ import annotations

import sys
import time
from typing import Mapping

from rljax.errors import RljaxError

__all__ = ["RewardFunctionFailed", "RewardMonitor"]


class RewardFunctionFailed(RljaxError):
    """A reward function failed on every sample for too many steps in a row (exit code 1)."""


class RewardMonitor:
    """Per-function failure bookkeeping for the trainer; see the module docstring."""

    def __init__(self, max_consecutive_error_steps: int = 10, warn_every_s: float = 60.0,
                 stream=None, clock=time.monotonic):
        self.max_steps = int(max_consecutive_error_steps)
        self.warn_every_s = float(warn_every_s)
        self.stream = stream
        self.clock = clock
        self.streak: dict[str, int] = {}
        self.last_message: dict[str, str] = {}
        self._last_warn: dict[str, float] = {}
        self._pending: dict[str, list[int]] = {}  # name -> [failed samples, samples, calls]

    def observe(self, result) -> None:
        """Records one batch's failures and prints a warning when one is due."""
        n = result.num_samples
        for name, bad in result.errors.items():
            if not bad:
                continue
            message = result.messages.get(name, "")
            self.last_message[name] = message
            pending = self._pending.setdefault(name, [0, 0, 0])
            pending[0] += bad
            pending[1] += n
            pending[2] += 1
            now = self.clock()
            last = self._last_warn.get(name)
            if last is not None and now - last < self.warn_every_s:
                continue
            self._last_warn[name] = now
            bad_total, n_total, calls = self._pending.pop(name)
            if last is None:
                where = (f"; further failures of {name!r} are summarised at most every "
                         f"{self.warn_every_s:g} s (metrics: reward/{name}/errors)")
                text = f"reward {name!r} failed on {bad} of {n} samples: {message}{where}"
            else:
                text = (f"reward {name!r} failed on {bad_total} of {n_total} samples in {calls} "
                        f"batch{'es' if calls > 1 else ''} since the last warning; latest: "
                        f"{message}")
            print(f"rljax: warning: {text}", file=self.stream or sys.stderr, flush=True)

    def end_step(self, step: int, errors: Mapping[str, int], samples: Mapping[str, int]) -> None:
        """Updates the failed-every-sample streaks; raises RewardFunctionFailed at the limit."""
        for name, bad in errors.items():
            n = samples.get(name, 0)
            self.streak[name] = self.streak.get(name, 0) + 1 if n and bad >= n else 0
            if self.max_steps and self.streak[name] >= self.max_steps:
                last = self.last_message.get(name) or "see the other hosts' warnings"
                raise RewardFunctionFailed(
                    f"reward {name!r} failed on every sample for {self.streak[name]} steps in a "
                    f"row; last error: {last}. Fix the function, or set "
                    f"reward.max_consecutive_error_steps=0 to train on regardless")
