"""Tests for rljax.train.phases.rm: last-token scores, the Bradley-Terry step learns a fixed batch, its
loss equals algorithms.reward_model_loss on independently computed scores, micro-batching and
an 8-device sharded step are exact, and a 2-step end-to-end run of the config."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import algorithms, config, data, models, sharding, tokenizers
from rljax.train.core import optim
from rljax.train.phases import rm
from rljax.train.core.state import create_train_state, eval_state_shape, state_shardings

TOK = tokenizers.CharTokenizer()
PAIRS = [
    {"prompt": "1+2=", "chosen": "3", "rejected": "7"},
    {"prompt": "12+5=", "chosen": "17", "rejected": "71"},
    {"prompt": "9+9=", "chosen": "18", "rejected": "19"},
    {"prompt": "40+2=", "chosen": "42", "rejected": "4"},
]


def _cfg():
    return models.get_preset("tiny", vocab_size=TOK.vocab_size, num_layers=1, hidden_size=32,
                             intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16)


def _opt(lr=3e-3, name="adam"):
    o = config.default_config().optimizer
    o.update(dict(name=name, learning_rate=lr))
    return optim.make_optimizer(o, 100)


# The head's bias has an exactly-zero Bradley-Terry gradient (it cancels in r_w - r_l), so
# Adam would turn its rounding noise into full-size steps: exactness tests use SGD.
SGD = _opt(0.1, "sgd")


def _state(opt=None):
    cfg = _cfg()
    policy = models.init_params(cfg, jax.random.key(0))
    value = models.init_value_params(cfg, jax.random.key(1), from_params=policy)
    return create_train_state(value, opt or _opt(), jax.random.key(2))


def _batch():
    return {k: jnp.asarray(v) for k, v in data.encode_preference(TOK, PAIRS, 8, 4).items()}


@functools.cache
def _step(num_micro=1, sgd=False):
    return rm.build_rm_step(_cfg(), SGD if sgd else _opt(), num_micro=num_micro)


def test_last_token_scores():
    values = jnp.arange(12.0).reshape(3, 4)
    mask = jnp.array([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]], bool)
    np.testing.assert_array_equal(rm.last_token_scores(values, mask), [2.0, 7.0, 0.0])


def test_loss_matches_independent_scores():
    cfg = _cfg()
    state, b = _state(), _batch()
    (num, den), metrics = jax.jit(lambda p, b: rm.rm_loss(cfg, p, None, b))(state.params, b)

    @jax.jit
    def scores(params, side_tokens, side_mask):
        tokens = jnp.concatenate([b["prompt_tokens"], side_tokens], 1)
        mask = jnp.concatenate([b["prompt_mask"], side_mask], 1)
        v = models.value_forward(cfg, params, tokens, attention_mask=mask)
        last = b["prompt_tokens"].shape[1] + side_mask.sum(1) - 1  # right-padded completions
        return v[jnp.arange(v.shape[0]), last]

    c = scores(state.params, b["chosen_tokens"], b["chosen_mask"])
    r = scores(state.params, b["rejected_tokens"], b["rejected_mask"])
    ref_sum, ref_w = algorithms.reward_model_loss(c, r)
    np.testing.assert_allclose(float(num), float(ref_sum), rtol=1e-5)
    assert float(den) == float(ref_w) == len(PAIRS)
    assert float(metrics["accuracy"][0]) == float((c > r).sum())
    np.testing.assert_allclose(float(metrics["score/margin"][0]), float((c - r).sum()),
                               rtol=1e-4, atol=1e-6)


def test_rm_step_learns_fixed_batch():
    state, b = _state(), _batch()
    history = []
    for _ in range(10):
        state, m = _step()(state, b)
        history.append((float(m["loss"]), float(m["accuracy"]), float(m["score/margin"])))
    assert history[-1][0] < 0.5 * history[0][0]
    assert history[-1][1] == 1.0 and history[-1][2] > history[0][2]


def test_micro_batches_and_sharding_are_exact():
    cfg, b = _cfg(), _batch()
    base_state, base_m = _step(sgd=True)(_state(SGD), b)
    two_state, two_m = _step(num_micro=2, sgd=True)(_state(SGD), b)

    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    state = _state(SGD)
    vshard = sharding.logical_to_sharding(models.value_param_logical_axes(cfg), mesh,
                                          shapes=state.params)
    sshard = state_shardings(eval_state_shape(state.params, SGD, state.rng), vshard)
    state = jax.device_put(state, sshard)
    step = rm.build_rm_step(cfg, SGD, state_shardings=sshard, mesh=mesh)
    sh_state, sh_m = step(state, sharding.shard_batch(b, mesh))
    for other in (two_m, sh_m):
        for key in ("loss", "accuracy", "score/margin", "grad_norm"):
            np.testing.assert_allclose(float(other[key]), float(base_m[key]), rtol=1e-5,
                                       atol=1e-6)
    for other in (two_state, sh_state):
        jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y),
                                                             rtol=1e-4, atol=1e-6),
                     other.params, base_state.params)


@pytest.mark.slow
def test_config_runs_two_steps(tmp_path):
    from rljax.train import run
    from rljax.train.core import metrics

    cfg = config.load_config("configs/rm_arithmetic.py", [
        "steps=2", "rollout.batch_size=8", "eval.num_examples=16", "eval.batch_size=8",
        "checkpoint.async_save=False", "logging.tensorboard=False", "mesh.data=1"])
    assert run.train(cfg, str(tmp_path), devices=jax.devices()[:1]) == 0
    records = metrics.read_metrics(str(tmp_path / "metrics.jsonl"))
    train = [r for r in records if "score/margin" in r]
    assert [r["step"] for r in train] == [1, 2] and all(r["rm/pairs"] == 8 for r in train)
    evals = [r for r in records if "eval/accuracy" in r]
    assert len(evals) == 1 and 0.0 <= evals[0]["eval/accuracy"] <= 1.0
    assert "eval/score/margin" in evals[0]


@pytest.mark.slow
def test_eval_and_export_act_on_the_reward_model(tmp_path, capsys):
    import json
    import os

    from rljax.train import run
    from rljax.train.core import checkpoint

    cfg = config.load_config("configs/rm_arithmetic.py", [
        "steps=2", "rollout.batch_size=8", "eval.num_examples=16", "eval.batch_size=8",
        "checkpoint.async_save=False", "logging.tensorboard=False", "mesh.data=1",
        "model.overrides.num_layers=1", "model.overrides.hidden_size=32",
        "model.overrides.intermediate_size=64"])
    devices = jax.devices()[:1]
    workdir = str(tmp_path / "rm")
    assert run.train(cfg, workdir, devices=devices) == 0
    capsys.readouterr()
    assert run.evaluate(cfg, workdir, devices=devices) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["step"] == 2 and 0.0 <= out["eval/accuracy"] <= 1.0
    assert "eval/score/margin" in out and "eval/loss" in out  # pair metrics, not task accuracy

    export_dir = str(tmp_path / "hf")
    assert run.export(cfg, workdir, export_dir, devices=devices) == 0
    assert "reward model" in capsys.readouterr().err
    hf_cfg = json.load(open(os.path.join(export_dir, "config.json")))
    assert hf_cfg["architectures"] == ["LlamaForSequenceClassification"]
    with checkpoint.CheckpointManager(checkpoint.checkpoint_dir(workdir)) as ckpt:
        value_params = ckpt.restore().state["critic_params"]
    model_cfg = models.config_from_hf(hf_cfg)
    ids = [TOK.encode("1+2=", add_bos=True) + TOK.encode("3"), TOK.encode("9-4=5", add_bos=True)]
    width = max(map(len, ids))
    tokens = np.full((2, width), TOK.pad_id, np.int32)
    mask = np.zeros((2, width), bool)
    for i, row in enumerate(ids):  # left padding: the last column is each row's last token
        tokens[i, width - len(row):], mask[i, width - len(row):] = row, True
    expected = np.asarray(models.value_forward(model_cfg, value_params, tokens, mask))[:, -1]
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(export_dir).eval()
    with torch.no_grad():
        got = hf(input_ids=torch.tensor(tokens, dtype=torch.long),
                 attention_mask=torch.tensor(mask, dtype=torch.long)).logits[:, 0].numpy()
    np.testing.assert_allclose(got + hf_cfg["rljax_value_head_bias"], expected, atol=1e-4)
