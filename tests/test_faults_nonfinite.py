"""Non-finite values never reach a checkpoint: config numbers must be finite, and a state whose
parameters went NaN/inf stops the run (one line) instead of rotating the good checkpoints out."""
import json

import jax
import jax.numpy as jnp
import pytest

from rljax import config as config_lib
from rljax.errors import ConfigError, TrainingDiverged
from rljax.train import run
from rljax.train.core import checkpoint
from rljax.train.phases.grpo import GRPOPhase

DEVICES = jax.devices()[:1]


def tiny_cfg(**overrides):
    cfg = config_lib.default_config()
    cfg.update_from_flattened_dict({
        "steps": 3, "eval_every": 0, "checkpoint_every": 1,
        "model.preset": "tiny", "tokenizer.kind": "char", "data.source": "arithmetic",
        "data.max_prompt_length": 8, "rollout.batch_size": 8, "rollout.max_new_tokens": 4,
        "algo.num_generations": 4, "algo.beta": 0.0, "optimizer.learning_rate": 1e-3,
        "eval.num_examples": 8, "eval.batch_size": 8, "logging.tensorboard": False,
        "checkpoint.async_save": False, "memory.check": "off",
    })
    cfg.model.overrides = {"num_layers": 1, "hidden_size": 32, "intermediate_size": 64,
                           "num_heads": 2, "num_kv_heads": 1}
    cfg.data.kwargs = {"digits": 1, "eval_examples": 8}
    cfg.update_from_flattened_dict(overrides)
    return config_lib.validate(cfg)


@pytest.mark.parametrize("text", ["Infinity", "-Infinity", "NaN"])
def test_a_hand_edited_workdir_config_with_a_non_finite_number_is_refused(tmp_path, text):
    path = tmp_path / "config.json"
    data = json.loads(config_lib.to_json(tiny_cfg()))
    data["optimizer"]["learning_rate"] = float(text)
    path.write_text(json.dumps(data))  # json writes Infinity / NaN, as a hand edit would
    with pytest.raises(ConfigError, match=r"optimizer.learning_rate=.* must be a finite number"):
        config_lib.load_config_json(str(path))


def test_non_finite_overrides_are_refused():
    with pytest.raises(ConfigError, match="finite"):
        config_lib.load_config(None, ["optimizer.max_grad_norm=1e999"])


def test_nonfinite_fields_names_the_field():
    from rljax.train.core.state import TrainState, nonfinite_fields
    state = TrainState(step=jnp.int32(0), params={"w": jnp.ones(3)},
                       opt_state=({"mu": jnp.array([0.0, jnp.inf])},), rng=jax.random.PRNGKey(0))
    assert nonfinite_fields(state) == ["opt_state"]
    assert nonfinite_fields(state.replace(opt_state=())) == []


def test_nan_parameters_stop_the_run_before_a_nan_checkpoint_is_saved(tmp_path, monkeypatch):
    real = GRPOPhase.iteration

    def iteration(self, state, step):
        state, metrics = real(self, state, step)
        if step == 1:   # the second update blew the parameters up (e.g. a huge learning rate)
            state = state.replace(params=jax.tree.map(lambda x: x * jnp.nan, state.params))
        return state, metrics

    monkeypatch.setattr(GRPOPhase, "iteration", iteration)
    workdir = str(tmp_path / "run")
    with pytest.raises(TrainingDiverged) as err:
        run.train(tiny_cfg(), workdir, devices=DEVICES)
    message = str(err.value)
    assert "\n" not in message
    assert "params" in message and "not saving checkpoint 2" in message
    assert "last good one is 1" in message
    with checkpoint.CheckpointManager(checkpoint.checkpoint_dir(workdir)) as ckpt:
        assert ckpt.all_steps() == [1]
