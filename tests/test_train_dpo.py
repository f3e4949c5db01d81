"""Tests for rljax.train.phases.dpo: every loss type runs, sigmoid DPO learns a fixed batch, the step's
loss equals algorithms.dpo_loss on independently computed log-probs, micro-batching and an
8-device sharded step are exact, pair builders, and a 2-step end-to-end run of the configs."""
import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from rljax import algorithms, config, data, models, sharding, tokenizers
from rljax.train.core import optim
from rljax.train.phases import dpo
from rljax.train.core import preference_data
from rljax.train.core.state import create_train_state, eval_state_shape, state_shardings

TOK = tokenizers.CharTokenizer()
PAIRS = [
    {"prompt": "1+2=", "chosen": "3", "rejected": "7"},
    {"prompt": "12+5=", "chosen": "17", "rejected": "71"},
    {"prompt": "9+9=", "chosen": "18", "rejected": "19"},
    {"prompt": "40+2=", "chosen": "42", "rejected": "4"},
]


def _cfg():
    # Small and shallow: these tests are about the step, and compile time dominates on CPU.
    return models.get_preset("tiny", vocab_size=TOK.vocab_size, num_layers=1, hidden_size=32,
                             intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16)


def _algo(**kw):
    a = ml_collections.ConfigDict(dict(beta=0.1, loss_type="sigmoid", label_smoothing=0.0))
    a.update(kw)
    return a


def _batch(pairs=PAIRS):
    return {k: jnp.asarray(v) for k, v in data.encode_preference(TOK, pairs, 8, 4).items()}


def _opt(lr=1e-3):
    return optim.make_optimizer(ml_collections.ConfigDict(dict(
        name="adam", learning_rate=lr, schedule="constant", warmup_steps=0, min_lr_ratio=0.0,
        b1=0.9, b2=0.999, eps=1e-8, momentum=0.0, weight_decay=0.0, max_grad_norm=1.0)), 100)


def _state(cfg, opt, seed=0, ref_seed=None):
    """Policy from ``seed``; reference = a copy of it, or another init (``ref_seed``)."""
    params = models.init_params(cfg, jax.random.key(seed))
    ref = (jax.tree.map(jnp.copy, params) if ref_seed is None
           else models.init_params(cfg, jax.random.key(ref_seed)))
    return create_train_state(params, opt, jax.random.key(1), ref_params=ref)


@functools.cache
def _step(num_micro=1):
    """The sigmoid DPO step used by several tests (built once, so compiled once)."""
    return dpo.build_dpo_step(_cfg(), _algo(beta=0.5), _opt(3e-3), num_micro=num_micro)


def test_every_loss_type_runs():
    cfg = _cfg()
    params = models.init_params(cfg, jax.random.key(0))
    state = create_train_state(params, _opt(), jax.random.key(1),
                               ref_params=models.init_params(cfg, jax.random.key(2)))

    @jax.jit  # one program for all variants: compile once
    def all_types(params, batch):
        out = {}
        for loss_type in algorithms.DPO_LOSS_TYPES:
            def f(p):
                algo = _algo(loss_type=loss_type, label_smoothing=0.1)
                (num, den), m = dpo.dpo_loss(cfg, algo, p, state, batch)
                return num / den, m
            (loss, m), g = jax.value_and_grad(f, has_aux=True)(params)
            out[loss_type] = (loss, optim.optax.tree.norm(g), m["accuracy"][1])
        return out

    out = all_types(params, _batch())
    assert set(out) == {"sigmoid", "ipo", "hinge", "robust", "simpo"}
    for loss_type, (loss, gnorm, count) in out.items():
        assert np.isfinite(float(loss)) and float(gnorm) > 0, loss_type
        assert float(count) == len(PAIRS)
    assert len({round(float(v[0]), 6) for v in out.values()}) == len(out)  # really different


def test_sigmoid_loss_decreases_and_accuracy_rises():
    cfg, opt = _cfg(), _opt(3e-3)
    step = _step()
    state, batch = _state(cfg, opt), _batch()
    history = []
    for _ in range(15):
        state, m = step(state, batch)
        history.append((float(m["loss"]), float(m["accuracy"]), float(m["rewards/margin"])))
    # Step 0 runs at policy == reference: loss log 2, implicit rewards 0 (up to rounding, so
    # its accuracy is a coin flip per pair; it must end at 1).
    assert history[0][0] == pytest.approx(np.log(2.0), abs=1e-5)
    assert abs(history[0][2]) < 1e-5
    assert history[-1][0] < 0.6 * history[0][0]
    assert history[-1][1] == 1.0 and history[-1][2] > 0.5


def _seq_logps_by_forward(cfg, params, prompt, pmask, comp, cmask):
    """Summed completion log-probs from models.forward + log_softmax (independent path)."""
    seq = jnp.concatenate([prompt, comp], axis=1)
    mask = jnp.concatenate([pmask, cmask], axis=1)
    logits = models.forward(cfg, params, seq, attention_mask=mask)
    p = prompt.shape[1]
    lp = jax.nn.log_softmax(logits[:, p - 1:-1], axis=-1)
    tok = jnp.take_along_axis(lp, comp[..., None], axis=-1)[..., 0]
    return jnp.where(cmask, tok, 0.0).sum(-1), cmask.sum(-1)


@pytest.mark.parametrize("loss_type,smoothing", [("sigmoid", 0.1), ("ipo", 0.0)])
def test_loss_matches_algorithms_dpo_loss(loss_type, smoothing):
    cfg = _cfg()
    params = models.init_params(cfg, jax.random.key(3))
    ref = models.init_params(cfg, jax.random.key(4))  # a different reference: nonzero rewards
    state = create_train_state(params, _opt(), jax.random.key(0), ref_params=ref)
    b = _batch()
    algo = _algo(loss_type=loss_type, label_smoothing=smoothing)
    (num, den), metrics = jax.jit(lambda p, s, b: dpo.dpo_loss(cfg, algo, p, s, b))(
        params, state, b)
    lp = {}
    for name, p_ in (("pol", params), ("ref", ref)):
        for side in ("chosen", "rejected"):
            lp[name, side] = _seq_logps_by_forward(cfg, p_, b["prompt_tokens"], b["prompt_mask"],
                                                   b[f"{side}_tokens"], b[f"{side}_mask"])
    kw = {}
    if loss_type == "ipo":
        kw = dict(chosen_lengths=lp["pol", "chosen"][1], rejected_lengths=lp["pol", "rejected"][1])
    losses, cr, rr = algorithms.dpo_loss(lp["pol", "chosen"][0], lp["pol", "rejected"][0],
                                         lp["ref", "chosen"][0], lp["ref", "rejected"][0],
                                         beta=0.1, loss_type=loss_type,
                                         label_smoothing=smoothing, **kw)
    assert float(den) == len(PAIRS)
    np.testing.assert_allclose(float(num / den), float(losses.mean()), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["rewards/chosen"][0]), float(cr.sum()), rtol=1e-4,
                               atol=1e-6)
    np.testing.assert_allclose(float(metrics["accuracy"][0]), float((cr > rr).sum()))


def test_dpo_default_beta_is_0_1():
    # A DPO config that does not set algo.beta gets DPO's usual 0.1 (not GRPO's KL
    # coefficient 0.04): loss = -log sigmoid(0.1 * ((pi_c - ref_c) - (pi_r - ref_r))).
    algo = config.load_config(None, ["algo.name=dpo"]).algo
    assert algo.beta == 0.1
    cfg = _cfg()
    params = models.init_params(cfg, jax.random.key(3))
    ref = models.init_params(cfg, jax.random.key(4))
    state = create_train_state(params, _opt(), jax.random.key(0), ref_params=ref)
    b = _batch()
    (num, den), _ = jax.jit(lambda p, s, b: dpo.dpo_loss(cfg, algo, p, s, b))(params, state, b)
    lp = {(name, side): np.asarray(_seq_logps_by_forward(
              cfg, p_, b["prompt_tokens"], b["prompt_mask"], b[f"{side}_tokens"],
              b[f"{side}_mask"])[0], np.float64)
          for name, p_ in (("pol", params), ("ref", ref)) for side in ("chosen", "rejected")}
    h = (lp["pol", "chosen"] - lp["ref", "chosen"]) - (lp["pol", "rejected"] - lp["ref", "rejected"])
    want = np.mean(np.log1p(np.exp(-0.1 * h)))
    np.testing.assert_allclose(float(num / den), want, rtol=1e-5)


def test_pair_mask_and_micro_batches_are_exact():
    cfg, opt = _cfg(), _opt(3e-3)
    mask = [True, True, False, True]
    b = dict(_batch(), pair_mask=jnp.array(mask))
    one = _step()(_state(cfg, opt), b)
    two = _step(num_micro=2)(_state(cfg, opt), b)
    np.testing.assert_allclose(float(one[1]["loss"]), float(two[1]["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(one[1]["grad_norm"]), float(two[1]["grad_norm"]), rtol=1e-5)
    # Adam normalises the step, so compare updated params with an absolute tolerance well
    # below one step (lr 3e-3).
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=3e-5),
                 one[0].params, two[0].params)
    # The masked pair counts for nothing: the loss is the mean over the other three.
    st = _state(cfg, opt)
    loss_of = jax.jit(lambda b: dpo.dpo_loss(cfg, _algo(beta=0.5), st.params, st, b)[0])
    per_pair = []
    for i in range(len(PAIRS)):  # pair i alone, through the same compiled program
        num, den = loss_of(dict(b, pair_mask=jnp.arange(len(PAIRS)) == i))
        assert float(den) == 1.0
        per_pair.append(float(num))
    np.testing.assert_allclose(float(one[1]["loss"]), np.mean(np.array(per_pair)[mask]),
                               rtol=1e-5)


def test_sharded_step_matches_unsharded():
    cfg, opt = _cfg(), _opt(3e-3)
    algo = _algo(beta=0.5)
    b = _batch()
    # A reference unlike the policy, so that rewards and accuracy are not rounding noise.
    base_state, base_m = _step()(_state(cfg, opt, ref_seed=7), b)

    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    state = _state(cfg, opt, ref_seed=7)
    pshard = sharding.logical_to_sharding(models.param_logical_axes(cfg), mesh,
                                          shapes=state.params)
    shape = eval_state_shape(state.params, opt, state.rng, ref_params=state.ref_params)
    sshard = state_shardings(shape, pshard)
    state = jax.device_put(state, sshard)
    step = dpo.build_dpo_step(cfg, algo, opt, state_shardings=sshard, mesh=mesh)
    new_state, m = step(state, sharding.shard_batch(b, mesh))
    assert new_state.params["embed"].sharding.spec == sshard.params["embed"].spec
    for key in ("loss", "accuracy", "rewards/margin", "grad_norm"):
        np.testing.assert_allclose(float(m[key]), float(base_m[key]), rtol=1e-5, atol=1e-7)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y),
                                                         atol=3e-5),
                 new_state.params, base_state.params)


def test_synthetic_pairs_are_right_vs_wrong():
    rng = np.random.default_rng(0)
    examples = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(0, 30, 3)
                for b in (0, 5, 9)]
    pairs = preference_data.synthetic_pairs(examples, rng)
    for ex, p in zip(examples, pairs):
        assert p["chosen"] == ex["answer"] and p["rejected"] != ex["answer"]
        assert int(p["rejected"]) >= 0 and p["prompt"] == ex["prompt"]


def test_best_worst_pairs():
    comps = {"tokens": np.arange(6 * 3).reshape(6, 3), "mask": np.ones((6, 3), bool)}
    prompts = {"prompt_tokens": np.zeros((2, 2), np.int32), "prompt_mask": np.ones((2, 2), bool)}
    out = preference_data.best_worst_pairs(prompts, comps, np.array([0.0, 1.0, 0.5, 1.0, 1.0, 1.0]), 3)
    np.testing.assert_array_equal(out["chosen_tokens"][0], comps["tokens"][1])
    np.testing.assert_array_equal(out["rejected_tokens"][0], comps["tokens"][0])
    np.testing.assert_array_equal(out["pair_mask"], [True, False])  # prompt 1: all tied


@pytest.mark.slow
@pytest.mark.parametrize("online", [False, True])
def test_config_runs_two_steps(tmp_path, online):
    from rljax import config
    from rljax.train import run
    from rljax.train.core import metrics

    cfg = config.load_config("configs/dpo_arithmetic.py", [
        "steps=2", "sft.steps=0", "rollout.batch_size=8", "eval.num_examples=8",
        "eval.batch_size=8", "checkpoint.async_save=False", "logging.tensorboard=False",
        "mesh.data=1", f"algo.online={online}", f"algo.ref_update_every={int(online)}"])
    assert run.train(cfg, str(tmp_path), devices=jax.devices()[:1]) == 0
    records = metrics.read_metrics(str(tmp_path / "metrics.jsonl"))
    train = [r for r in records if "rewards/margin" in r]
    assert [r["step"] for r in train] == [1, 2]
    # Offline: 8 synthetic pairs per step. Online: 8 samples = 2 prompts x G=4 -> <= 2 pairs.
    assert all(r["dpo/pairs"] == (2 if online else 8) or online and r["dpo/pairs"] < 2
               for r in train)
    if online:
        assert all("reward/mean" in r for r in train)
    (ev,) = [r for r in records if "eval/accuracy" in r]
    # Held-out pair metrics are reported against a frozen reference only (online: it moves).
    assert ("eval/pref_accuracy" in ev) == (not online)


@pytest.mark.slow
def test_hf_example_config_runs_two_steps(tmp_path):
    """The HF recipe on a tiny checkpoint written here (save_hf) and a preference JSONL."""
    import json

    from rljax import config
    from rljax.train import run
    from rljax.train.core import metrics

    model_dir = tmp_path / "model"
    cfg_small = _cfg()
    models.save_hf(cfg_small, models.init_params(cfg_small, jax.random.key(0)), str(model_dir))
    TOK.save(str(model_dir))  # the example takes its tokenizer from model.path
    for name, rows in (("train.jsonl", PAIRS * 2), ("test.jsonl", PAIRS)):
        with open(tmp_path / name, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    cfg = config.load_config("configs/dpo_hf_example.py", [
        f"model.path={model_dir}", "model.dtype=float32", f"data.path={tmp_path}/train.jsonl",
        f"data.eval_path={tmp_path}/test.jsonl", "data.max_prompt_length=32",
        "rollout.max_new_tokens=4", "rollout.batch_size=4", "algo.micro_batch_size=2",
        "steps=2", "optimizer.warmup_steps=0", "eval.batch_size=4", "mesh.fsdp=1",
        "checkpoint.async_save=False", "logging.tensorboard=False"])
    assert run.train(cfg, str(tmp_path / "run"), devices=jax.devices()[:1]) == 0
    records = metrics.read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    train = [r for r in records if "rewards/margin" in r]
    assert [r["step"] for r in train] == [1, 2] and all(r["dpo/pairs"] == 4 for r in train)
    (ev,) = [r for r in records if "eval/pref_accuracy" in r]
    assert "eval/accuracy" not in ev  # preference data has no task answers to check


def test_online_dpo_with_prompt_selection_and_partial_rollouts_resumes_exactly(tmp_path):
    """Online DPO samples its groups as GRPO does: MoPPS picks the prompts (learning from the
    groups' rewards) and partial rollouts carry unfinished groups across iterations on the
    slot engine; pairs are each completed group's best and worst. Stopped after one update
    and resumed (the posteriors and the groups in flight saved), equal to the straight run."""
    from rljax import config
    from rljax.train.core.metrics import read_metrics
    from tests.test_train_loop import resumes_exactly

    cfg = lambda: config.load_config("configs/dpo_arithmetic.py", [  # noqa: E731
        "steps=2", "sft.steps=0", "rollout.batch_size=8", "eval.num_examples=8",
        "eval.batch_size=8", "eval_every=0", "checkpoint.async_save=False",
        "logging.tensorboard=False", "mesh.data=1", "algo.online=True",
        "data.selection.name=predicted", "rollout.engine=slots", "rollout.partial=True",
        "rollout.slots=4", "rollout.chunk_steps=2"])
    straight, _ = resumes_exactly(cfg, tmp_path, stop_after=1, devices=jax.devices()[:1])
    train = [r for r in read_metrics(straight) if "rewards/margin" in r]
    assert len(train) == 2 and any(r["rollout/carried_groups"] > 0 for r in train)
    assert train[-1]["selection/tracked"] > 0 and all(0 <= r["dpo/pairs"] <= 2 for r in train)


def test_asynchronous_online_dpo_resumes_exactly(tmp_path):
    """``algo.asynchronous`` with online DPO: each batch of groups is sampled a version ahead
    and paired when it trains; the batch in flight is saved with the checkpoint, so a run
    stopped after its first update and resumed equals the straight run."""
    from rljax import config
    from rljax.train.core.metrics import read_metrics
    from tests.test_train_loop import resumes_exactly

    cfg = lambda: config.load_config("configs/dpo_arithmetic.py", [  # noqa: E731
        "steps=3", "sft.steps=0", "rollout.batch_size=8", "eval.num_examples=8",
        "eval.batch_size=8", "eval_every=0", "checkpoint.async_save=False",
        "logging.tensorboard=False", "mesh.data=1", "algo.online=True",
        "algo.asynchronous=True"])
    straight, _ = resumes_exactly(cfg, tmp_path, stop_after=1, devices=jax.devices()[:1])
    train = [r for r in read_metrics(straight) if "rewards/margin" in r]
    assert [r["rollout/sample_version"] for r in train] == [0, 0, 1]
    assert all(np.isfinite(r["loss"]) for r in train)


def test_online_dpo_on_episodes_scores_the_models_own_tokens(tmp_path):
    """Online DPO over multi-turn episodes: each group's best and worst episodes are a pair,
    scored on the model's own tokens only (the observations between its turns are context),
    and the run trains; ``env.turn_discount`` has no meaning with pairs of whole episodes."""
    import optax

    from rljax import config as config_lib
    from rljax.train import run
    from rljax.train.core import setup
    from rljax.train.core.metrics import read_metrics
    from rljax.train.core.state import create_train_state
    from rljax.train.phases.dpo import DPOPhase, sequence_logps
    from tests.test_agent_train import agent_cfg

    cfg = agent_cfg(**{"algo.name": "dpo", "algo.online": True, "algo.beta": 0.1,
                       "sft.steps": 0, "sft.env_traces": False, "env.name": "test_echo",
                       "env.tools": (), "rollout.max_new_tokens": 8, "steps": 2})
    cfg.env.kwargs = {}
    ctx = setup.build_context(config_lib.validate(cfg), str(tmp_path / "probe"),
                              devices=jax.devices()[:1])
    phase = DPOPhase(ctx, 2)
    state = create_train_state(ctx.params, optax.sgd(0.1), jax.random.key(0))
    batch, metrics = phase.rollout(state, 0)
    pairs = phase._group_pairs(batch, metrics)
    score, mask = pairs["chosen_score_mask"], pairs["chosen_mask"]
    assert (score <= mask).all() and (mask & ~score).any()   # observations, not scored
    pb = {k: jnp.asarray(v) for k, v in pairs.items()}
    logps, lengths = sequence_logps(ctx.model_cfg, ctx.params, pb)
    plain, _ = sequence_logps(ctx.model_cfg, ctx.params, {
        k: v for k, v in pb.items() if not k.endswith("score_mask")})
    b = len(score)
    np.testing.assert_array_equal(np.asarray(lengths[:b]), score.sum(1))
    assert (np.asarray(logps) > np.asarray(plain)).all()   # fewer tokens scored
    assert run.train(cfg, str(tmp_path / "run"), devices=jax.devices()[:1]) == 0
    train = [r for r in read_metrics(str(tmp_path / "run")) if "rewards/margin" in r]
    assert len(train) == 2 and all(np.isfinite(r["loss"]) and "env/turns_mean" in r
                                   for r in train)
    cfg.env.turn_discount = 0.9
    with pytest.raises(config_lib.ConfigError, match="env.turn_discount has no meaning"):
        config_lib.validate(cfg)
