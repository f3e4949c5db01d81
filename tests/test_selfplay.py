"""Self-play in board games: role-conditioned advantages (RAE) in the trainer, one policy in
every seat, a frozen checkpoint as the opponent, win rates with confidence intervals."""
import jax
import numpy as np
import pytest

from rljax import config as config_lib
from rljax.train import checkpoint, run, setup
from rljax.train.metrics import read_metrics
from rljax.train.phases import grpo
from rljax.train.state import create_train_state
from tests.test_train_loop import StopAfter, comparable

DEVICES = jax.devices()[:1]


def ttt_cfg(**overrides):
    """configs/grpo_tictactoe.py with a 1-layer width-32 model and small batches."""
    cfg = config_lib.load_config("configs/grpo_tictactoe.py", [
        "steps=2", "sft.steps=0", "rollout.batch_size=8", "algo.num_generations=2",
        "eval.num_examples=4", "eval.batch_size=4", "eval_every=0", "checkpoint_every=0",
        "checkpoint.async_save=False", "logging.tensorboard=False", "mesh.data=1",
        "model.overrides.num_layers=1", "model.overrides.hidden_size=32",
        "model.overrides.intermediate_size=64"])
    cfg.update_from_flattened_dict(overrides)
    return config_lib.validate(cfg)


def _phase(cfg, tmp_path):
    setup.check_inputs(cfg, num_devices=1)
    ctx = setup.build_context(cfg, str(tmp_path), devices=DEVICES)
    phase = grpo.GRPOPhase(ctx, int(cfg.steps))
    state = phase.init_state(create_train_state(ctx.params, phase.optimizer, jax.random.key(0)))
    return ctx, phase, state


# ----------------------------------------------------------------------------- RAE


def test_rae_in_the_rollout_is_the_written_out_formula(tmp_path):
    """The trainer's RAE advantages and new baselines on one batch of episodes equal
    b_k <- alpha b_k + (1 - alpha) mean(R | role k), A = R - b_role, written out in numpy."""
    alpha = 0.8
    cfg = ttt_cfg(**{"algo.adv_estimator": "rae", "algo.rae_alpha": alpha})
    ctx, phase, state = _phase(cfg, tmp_path)
    assert state.role_baseline.shape == (4,) and not state.role_baseline.any()
    start = np.array([0.25, -0.5, 0.125, 1.0], np.float32)
    state = state.replace(role_baseline=jax.numpy.asarray(start))
    batch, metrics = phase.rollout(state, 0)
    rows = phase.rollout._turn_rows
    roles, rewards = rows["roles"], rows["rewards"]
    assert set(roles.tolist()) <= {0, 1}   # tictactoe X = 0, O = 1
    expected = start.copy()
    for k in range(4):
        if (roles == k).any():
            expected[k] = alpha * start[k] + (1 - alpha) * rewards[roles == k].mean()
    np.testing.assert_allclose(batch["role_baseline"], expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(batch["advantages"], rewards - expected[roles], rtol=1e-6,
                               atol=1e-6)
    for k in set(roles.tolist()):
        assert metrics[f"rae/baseline_{k}"] == pytest.approx(float(expected[k]))


def _baseline(workdir):
    with checkpoint.CheckpointManager(checkpoint.checkpoint_dir(workdir)) as ckpt:
        state = ckpt.restore().state
    return np.asarray(state["role_baseline"]), jax.tree.map(np.asarray, state["params"])


@pytest.mark.slow
def test_rae_run_checkpoints_its_baselines_and_resumes_exactly(tmp_path):
    """A RAE run stopped after its first iteration and resumed equals the straight run:
    metrics (the baselines' included), parameters and the checkpointed baselines."""
    cfg = ttt_cfg(**{"algo.adv_estimator": "rae", "algo.num_generations": 1})
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    assert run.train(cfg, straight, devices=DEVICES) == 0
    records = read_metrics(straight)
    rl = [r for r in records if "reward/mean" in r]
    assert len(rl) == 2 and any(k.startswith("rae/baseline_") for k in rl[1])
    assert run.train(cfg, resumed, devices=DEVICES, stop=StopAfter(1)) == 0
    assert max(r["step"] for r in read_metrics(resumed)) == 1
    assert run.train(cfg, resumed, devices=DEVICES) == 0
    assert comparable(read_metrics(resumed)) == comparable(records)
    (b1, p1), (b2, p2) = _baseline(straight), _baseline(resumed)
    assert b1.shape == (4,) and np.abs(b1).max() > 0
    np.testing.assert_array_equal(b1, b2)
    jax.tree.map(np.testing.assert_array_equal, p1, p2)


@pytest.mark.parametrize("overrides,needle", [
    ({"env.name": ""}, "needs each episode's role"),
    ({"algo.dynamic_sampling": True}, "algo.dynamic_sampling and rollout.partial"),
    ({"env.turn_discount": 0.9}, "env.turn_discount"),
    ({"algo.rae_alpha": 1.5}, "algo.rae_alpha"),
])
def test_rae_config_errors_are_one_line(overrides, needle):
    with pytest.raises(config_lib.ConfigError, match=needle) as e:
        ttt_cfg(**{"algo.adv_estimator": "rae", **overrides})
    assert "\n" not in str(e.value)
