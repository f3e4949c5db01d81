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


# ---- KeyboardInterrupt / sys.exit from the reward's own code ---------------------------------

def interrupts(prompts, completions):
    raise KeyboardInterrupt


@pytest.mark.parametrize("timeout_s", [None, 5.0])
def test_a_keyboard_interrupt_from_the_function_under_the_trainers_handler_is_its_error(
        timeout_s):
    import signal

    from rljax.train.faults import StopSignal
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
