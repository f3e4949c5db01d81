"""Reward functions that misbehave in ways a finite check alone misses: scores that overflow
float32, KeyboardInterrupt / sys.exit from the function, a worker process that dies."""
import io

import numpy as np
import pytest

from rljax.rewards.combine import combine
from rljax.rewards.monitor import RewardMonitor


def huge(prompts, completions):
    return [1e308, 1.0]


def test_a_score_beyond_float32_is_that_calls_error_not_an_inf_reward():
    reward = combine([(huge, 1.0)], default_score=0.0)
    result = reward(["p", "q"], ["a", "b"])
    assert result.errors == {"huge": 1}
    assert "too large for float32" in result.messages["huge"]
    total = np.asarray(result.total, np.float32)   # as the trainer casts it
    assert np.isfinite(total).all() and total.tolist() == [0.0, 1.0]
    assert np.isfinite(np.asarray(result.per_function["huge"], np.float32)).all()
    stream = io.StringIO()
    RewardMonitor(stream=stream).observe(result)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and "huge" in lines[0] and "float32" in lines[0]


def test_scores_whose_weighted_sum_overflows_float32_fail_too():
    def big(prompts, completions):
        return [3e38] * len(completions)

    def big2(prompts, completions):
        return [3e38] * len(completions)

    result = combine([(big, 1.0), (big2, 1.0)])(["p"], ["a"])
    assert result.errors == {"big": 1, "big2": 1}
    assert np.isfinite(np.asarray(result.total, np.float32)).all()
    fine = combine([(big, 1.0)])(["p"], ["a"])   # alone, 3e38 fits float32
    assert fine.errors == {"big": 0}
