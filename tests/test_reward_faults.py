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
    alone = combine([(big, 1.0)])(["p"], ["a"])   # fits float32, but its statistics do not
    assert alone.errors == {"big": 1} and "float32 reward statistics" in alone.messages["big"]
    fine = combine([(lambda p, c: [1e14] * len(c), 1.0)])(["p"], ["a"])
    assert sum(fine.errors.values()) == 0 and fine.total == [1e14]


def test_reward_statistics_of_extreme_scores_stay_finite_or_are_said():
    """+-3e38 passed the float32 check, then every group std was inf, every advantage NaN and
    every step trained nothing, silently. Now such scores fail as the function's error, the
    GRPO advantages of the largest allowed rewards are finite, and a step whose statistics
    are not finite is said in one line."""
    from rljax.algorithms import advantages
    from rljax.train.core.learning_signal import NoSignalHint

    def extreme(prompts, completions):
        return [3e38, -3e38, 3e38, -3e38][:len(completions)]

    result = combine([(extreme, 1.0)])(["p"] * 4, ["a", "b", "c", "d"])
    assert result.errors == {"extreme": 4} and result.total == [0.0] * 4
    limit = 1e15
    adv = np.asarray(advantages.grpo_advantages(
        np.asarray([limit, -limit, limit, -limit] * 64, np.float32), 4, scale_rewards="batch"))
    assert np.isfinite(adv).all() and np.abs(adv).max() > 0.5
    stream = io.StringIO()
    hint = NoSignalHint(1.0, 4, stream=stream)
    assert hint.observe(3, {"reward/mean": 0.0, "reward/std": 1.0, "adv/abs_mean": 0.8}) is None
    line = hint.observe(4, {"reward/mean": 0.0, "reward/std": float("inf"),
                            "adv/abs_mean": float("nan")})
    assert "step 4" in line and "reward/std=inf" in line and "no learning signal" in line
    assert stream.getvalue().splitlines() == [line]


# ---- KeyboardInterrupt / sys.exit from the reward's own code ---------------------------------

def interrupts(prompts, completions):
    raise KeyboardInterrupt


@pytest.mark.parametrize("timeout_s", [None, 5.0])
def test_a_keyboard_interrupt_from_the_function_under_the_trainers_handler_is_its_error(
        timeout_s):
    import signal

    from rljax.train.core.faults import StopSignal
    with StopSignal(quiet=True):   # as during training: Ctrl-C only requests a stop
        result = combine([(interrupts, 1.0)], timeout_s=timeout_s)(["q"], ["a"])
    assert result.errors == {"interrupts": 1}
    assert result.messages["interrupts"].startswith("KeyboardInterrupt")
    assert "test_reward_faults.py" in result.messages["interrupts"]
    assert "not Ctrl-C" in result.messages["interrupts"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_reward_file_that_calls_sys_exit_at_import_is_one_line(tmp_path):
    from rljax import usercode
    from rljax.errors import UserError
    path = tmp_path / "exits_reward.py"
    path.write_text("import sys\nsys.exit(4)\n\ndef score(p, c):\n    return [0.0] * len(c)\n")
    with pytest.raises(UserError) as err:
        usercode.load(f"{path}:score", key="reward.names")
    message = str(err.value)
    assert "\n" not in message and "sys.exit(4)" in message
    assert "exits_reward.py" in message and "reward.names" in message


def test_sys_exit_from_user_code_called_by_the_trainer_is_one_line():
    from rljax import usercode
    from rljax.errors import UserError

    def leaves(x):
        raise SystemExit(5)

    with pytest.raises(UserError, match="data.transform: leaves raised SystemExit: 5"):
        usercode.call(leaves, "data.transform", 1)


# ---- a process-isolated worker that dies -----------------------------------------------------

DYING = '''
import os

def dies(prompts, completions):
    os._exit(7)   # as an OOM kill or a crash in a C extension would

def fine(prompts, completions):
    return [1.0] * len(completions)
'''


def test_a_dead_reward_worker_is_that_calls_error_and_the_pool_restarts(tmp_path):
    path = tmp_path / "dying_reward.py"
    path.write_text(DYING)
    reward = combine([(f"{path}:dies", 1.0), (f"{path}:fine", 1.0)], timeout_s=60.0,
                     isolation="process")
    try:
        for _ in range(2):   # the second batch gets a fresh pool instead of BrokenProcessPool
            result = reward(["q", "q"], ["a", "b"])
            assert result.errors["dies"] == 2
            assert "worker process died (exit code 7)" in result.messages["dies"]
            assert "\n" not in result.messages["dies"]
        path.write_text(DYING.replace("os._exit(7)", "return [0.5] * len(completions)"))
        # (a fresh pool's workers import the file again)
        result = reward(["q", "q"], ["a", "b"])
        assert result.errors == {"dies": 0, "fine": 0} and result.total == [1.5, 1.5]
        worker = reward._workers[0]   # killed between batches (the OOM killer while idle)
        worker.kill()
        worker.join(10)
        result = reward(["q", "q"], ["a", "b"])
        assert result.total == [1.5, 1.5]
    finally:
        reward.close()
