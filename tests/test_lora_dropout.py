"""LoRA dropout (``model.lora.dropout``): PEFT's dropout on the adapters' inputs, in training
passes only. Rate 0 (or no key) is today's model bit for bit; with a key the forward equals a
written-out reference; the masks are a function of (state.rng, state.step, micro-batch);
sampling and old/ref log-probs ignore the rate; every training loss (SFT, GRPO, PPO policy and
critic, DPO, RM) draws them; a run with dropout stops and resumes exactly; bad rates are one
line, exit 2; the PEFT export writes the rate and ``model.adapter_path`` reads it back."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rljax import models, sampling
from rljax.models import lora
from rljax.train import run
from rljax.train.core import steps as steps_lib
from rljax.train.phases import grpo
from rljax.train.core.metrics import read_metrics
from rljax.train.core.state import create_train_state

from test_lora import lora_cfg, perturbed, saved_state
from test_train_loop import DEVICES, RL_STEPS, StopAfter, comparable

V = 100  # >= the char tokenizer's vocabulary (DPO / RM batches)
CFG = models.get_preset("tiny", num_layers=2, hidden_size=32, intermediate_size=64,
                        num_heads=4, num_kv_heads=2, vocab_size=V, lora_scale=2.0)
RATE = 0.3


def adapted(cfg=CFG, seed=0, targets=lora.ALL_TARGETS):
    """Base + adapters with non-zero B, so that dropping adapter inputs changes outputs."""
    base = models.init_params(cfg, jax.random.key(seed))
    p = {**base, "lora": lora.init_lora(cfg, 4, targets, jax.random.key(seed + 1))}
    return perturbed(p, scale=0.3)


def tokens(b=2, t=7, seed=3):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, V)


# ----------------------------------------------------------------------------- the model

def test_rate_zero_or_no_key_is_the_deterministic_model_bit_for_bit():
    p, t, key = adapted(), tokens(), jax.random.key(9)
    want = models.forward(CFG, p, t)
    # Bit for bit because it is one program: without a rate or without a key no dropout is
    # traced at all (the jaxprs are equal), so the equalities below hold on any CPU.
    jaxpr = lambda c, **kw: str(jax.make_jaxpr(lambda q: models.forward(c, q, t, **kw))(p))
    assert jaxpr(CFG, lora_dropout_rng=key) == jaxpr(CFG) == jaxpr(CFG.replace(lora_dropout=RATE))
    np.testing.assert_array_equal(models.forward(CFG, p, t, lora_dropout_rng=key), want)
    np.testing.assert_array_equal(models.forward(CFG.replace(lora_dropout=RATE), p, t), want)
    # ... and with a key and a rate, it does change (the test above can fail).
    dropped = models.forward(CFG.replace(lora_dropout=RATE), p, t, lora_dropout_rng=key)
    assert np.abs(np.asarray(dropped - want)).max() > 1e-3
    want_lp, _ = models.token_logps(CFG, p, t)
    lp, _ = models.token_logps(CFG, p, t, lora_dropout_rng=key)
    np.testing.assert_array_equal(lp, want_lp)
    # No adapters: a key does nothing.
    base = lora.base_params(p)
    np.testing.assert_array_equal(
        models.forward(CFG.replace(lora_dropout=RATE), base, t, lora_dropout_rng=key),
        models.forward(CFG, base, t))


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def reference_forward(cfg, p, toks, key):
    """The adapted model written out in float64 numpy for an unpadded batch; adapter input of
    projection ``name`` in layer ``l`` is ``x * keep / (1 - rate)`` with ``keep`` drawn by
    ``bernoulli(fold_in(fold_in(key, l), stream[name]), 1 - rate, x.shape)`` (key None: no
    dropout)."""
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    stream = {"q": 0, "k": 1, "v": 2, "o": 3, "gate": 4, "up": 5, "down": 6}
    rate, scale, eps = cfg.lora_dropout, cfg.lora_scale, cfg.rms_norm_eps
    H, K, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    toks = np.asarray(toks)
    b, t = toks.shape
    x = f64(p["embed"])[toks]
    pos = np.arange(t, dtype=np.float64)
    inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, Dh, 2) / Dh)
    ang = pos[:, None] * inv_freq[None]
    cos = np.cos(np.concatenate([ang, ang], -1))[None, :, None]
    sin = np.sin(np.concatenate([ang, ang], -1))[None, :, None]

    def rope(z):
        z1, z2 = z[..., :Dh // 2], z[..., Dh // 2:]
        return z * cos + np.concatenate([-z2, z1], -1) * sin

    for l in range(cfg.num_layers):
        w = {n: f64(a[l]) for n, a in p["layers"].items()}
        ad = {n: {"a": f64(a["a"][l]), "b": f64(a["b"][l])} for n, a in p["lora"]["layers"].items()}

        def proj(z, name, n_in=1):
            a, bb = ad[name]["a"], ad[name]["b"]
            y = np.tensordot(z, w[name], n_in)
            zd = z
            if key is not None and rate > 0:
                k = jax.random.fold_in(jax.random.fold_in(key, l), stream[name])
                keep = np.asarray(jax.random.bernoulli(k, 1.0 - rate, z.shape))
                zd = np.where(keep, z / (1.0 - rate), 0.0)
            return y + scale * np.tensordot(np.tensordot(zd, a, n_in), bb, 1)

        h = _rms(x, w["attn_norm"], eps)
        q, k_, v = rope(proj(h, "q")), rope(proj(h, "k")), proj(h, "v")
        k_ = np.repeat(k_, H // K, axis=2)
        v = np.repeat(v, H // K, axis=2)
        s = np.einsum("bthd,bshd->bhts", q, k_) / np.sqrt(Dh)
        s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s = s / s.sum(-1, keepdims=True)
        attn = np.einsum("bhts,bshd->bthd", s, v)
        x = x + proj(attn, "o", n_in=2)
        h = _rms(x, w["mlp_norm"], eps)
        g, u = proj(h, "gate"), proj(h, "up")
        x = x + proj(g / (1.0 + np.exp(-g)) * u, "down")
    x = _rms(x, f64(p["final_norm"]), eps)
    return x @ f64(p["lm_head"])


def test_forward_with_dropout_equals_a_written_out_reference():
    cfg = CFG.replace(lora_dropout=RATE)
    p, t, key = adapted(cfg), tokens(), jax.random.key(11)
    # The reference itself: without dropout it is the model.
    np.testing.assert_allclose(reference_forward(cfg, p, t, None), models.forward(cfg, p, t),
                               atol=2e-5, rtol=1e-4)
    want = reference_forward(cfg, p, t, key)
    got = np.asarray(models.forward(cfg, p, t, lora_dropout_rng=key))
    assert np.abs(want - reference_forward(cfg, p, t, None)).max() > 1e-3
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
    # Masks are independent across layers and projections: one shared mask is another model.
    keep = jax.random.bernoulli(lora.dropout_key(key, 0, "q"), 0.5, (64,))
    for layer, name in [(0, "k"), (1, "q"), (0, "down")]:
        other = jax.random.bernoulli(lora.dropout_key(key, layer, name), 0.5, (64,))
        assert not np.array_equal(keep, other)


def test_dropout_keeps_the_expected_fraction_and_scales_inverted():
    x = jnp.ones((200, 100), jnp.float32)
    y = np.asarray(lora.dropout(x, 0.25, jax.random.key(0)))
    assert set(np.unique(y).tolist()) == {0.0, np.float32(1 / 0.75)}
    assert abs((y == 0).mean() - 0.25) < 0.01  # 20,000 draws: 4 sigma is 0.012
    assert abs(y.mean() - 1.0) < 0.02          # inverted: the expectation is unchanged


def test_sampling_and_old_ref_logps_ignore_the_rate():
    p = adapted()
    prompt = tokens(2, 5)
    mask = jnp.ones_like(prompt, bool)
    outs = [sampling.generate(c, p, prompt, mask, rng=jax.random.key(4), max_new_tokens=6,
                              temperature=1.0, pad_id=0)
            for c in (CFG, CFG.replace(lora_dropout=0.5))]
    np.testing.assert_array_equal(outs[0].tokens, outs[1].tokens)
    np.testing.assert_array_equal(outs[0].logps, outs[1].logps)
    t = tokens(4, 9)
    batch = {"tokens": t, "mask": jnp.ones_like(t, bool), "loss_mask": jnp.ones((4, 4), bool)}
    for base_only in (False, True):
        a, b = (steps_lib.build_logps_fn(c, base_only=base_only)(p, batch)
                for c in (CFG, CFG.replace(lora_dropout=0.5)))
        np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------- training losses

def _sft_batch(b=4, t=9, n=4):
    toks = tokens(b, t, seed=5)
    return {"tokens": toks, "mask": jnp.ones_like(toks, bool), "loss_mask": jnp.ones((b, n), bool)}


def test_masks_are_a_function_of_rng_step_and_micro_batch():
    cfg = CFG.replace(lora_dropout=RATE)
    state = create_train_state(adapted(cfg), optax.sgd(0.1), jax.random.key(0))
    batch = _sft_batch()
    assert steps_lib.training_dropout_rng(CFG, state, batch) is None        # rate 0: no draw
    assert steps_lib.training_dropout_rng(cfg, None, batch) is None          # evaluation call
    loss = jax.jit(lambda s, b: steps_lib.sft_loss(cfg, s.params, s, b)[0][0])
    ref = float(loss(state, batch))
    assert float(loss(state, batch)) == ref                                     # same step
    assert float(loss(state.replace(step=state.step + 1), batch)) != ref        # next update
    assert float(loss(state.replace(rng=jax.random.key(1)), batch)) != ref     # another seed
    assert float(loss(state, {**batch, steps_lib.MICRO_INDEX: jnp.int32(1)})) != ref
    assert float(loss(state, {**batch, steps_lib.MICRO_INDEX: jnp.int32(0)})) == ref
    no_drop = float(steps_lib.sft_loss(CFG, state.params, state, batch)[0][0])
    assert abs(no_drop - ref) > 1e-4


def test_micro_batches_draw_their_own_masks_in_accumulate():
    """accumulate over 2 micro-batches == the sum of the losses on each micro-batch with its
    own index (so micro-batch m's rows get the key of (step, m))."""
    cfg = CFG.replace(lora_dropout=RATE)
    state = create_train_state(adapted(cfg), optax.sgd(0.1), jax.random.key(0))
    state = state.replace(step=jnp.int32(3))
    batch = _sft_batch(b=4)
    fn = lambda p, s, b: steps_lib.sft_loss(cfg, p, s, b)  # noqa: E731
    grads, num, den, _ = jax.jit(lambda s, b: steps_lib.accumulate(fn, s, b, 2))(state, batch)
    micro = steps_lib.split_micro_batches(batch, 2)
    # One program for both micro-batches: the index is an argument, as in accumulate.
    loss_and_grad = jax.jit(lambda mb: jax.value_and_grad(
        lambda t: fn(lora.with_trainable(state.params, t), state, mb)[0], has_aux=True)(
            lora.trainable(state.params)))
    want_num, want_g = 0.0, None
    for i in range(2):
        mb = {**jax.tree.map(lambda x: x[i], micro), steps_lib.MICRO_INDEX: jnp.int32(i)}
        (n, _), g = loss_and_grad(mb)
        want_num += float(n)
        want_g = g if want_g is None else jax.tree.map(jnp.add, want_g, g)
    np.testing.assert_allclose(float(num), want_num, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 grads, want_g)
    # Micro-batch 1 under index 0 (the key of micro-batch 0) is drawn other masks.
    mb1 = jax.tree.map(lambda x: x[1], micro)
    loss = jax.jit(lambda i: fn(state.params, state, {**mb1, steps_lib.MICRO_INDEX: i})[0][0])
    assert abs(float(loss(jnp.int32(0))) - float(loss(jnp.int32(1)))) > 1e-5


def test_gradients_with_dropout_reach_only_the_adapters():
    cfg = CFG.replace(lora_dropout=0.5)
    p = adapted(cfg, targets=("q", "v", "down"))
    state = create_train_state(p, optax.sgd(0.1), jax.random.key(0))
    batch = _sft_batch()
    fn = lambda c: lambda pp, s, b: steps_lib.sft_loss(c, pp, s, b)  # noqa: E731
    grads_fn = lambda c: jax.jit(lambda s, b: steps_lib.accumulate(fn(c), s, b)[0])  # noqa: E731
    grads, plain = grads_fn(cfg)(state, batch), grads_fn(CFG)(state, batch)
    assert set(grads) == {"lora"}
    diff = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), grads, plain)
    assert max(jax.tree.leaves(diff)) > 1e-4   # the dropped inputs change the gradient
    base_before = jax.tree.map(np.asarray, lora.base_params(p))
    a_before = np.asarray(p["lora"]["layers"]["q"]["a"])
    new, metrics = steps_lib.build_sft_step(cfg, optax.sgd(0.1))(state, batch)  # donates p
    assert int(metrics["skipped"]) == 0
    jax.tree.map(np.testing.assert_array_equal, base_before,
                 jax.tree.map(np.asarray, lora.base_params(new.params)))
    assert not np.array_equal(np.asarray(new.params["lora"]["layers"]["q"]["a"]), a_before)


def _loss_cases():
    """name -> (loss(cfg, state) -> (num, metrics)); each a training loss on LoRA params."""
    from test_train_dpo import _algo as dpo_algo, _batch as dpo_batch
    from test_train_ppo import _algo as ppo_algo, _batch as ppo_batch
    from test_train_steps import algo_cfg, make_batch
    from rljax.train.phases import dpo, ppo, rm

    opt = optax.sgd(0.1)
    p = adapted()
    pol = create_train_state(p, opt, jax.random.key(0))
    value = lora.init_value_adapters(CFG, p, jax.random.key(5))  # adapters + head, base shared
    value = {**value, "trunk": {"lora": perturbed(value["trunk"], 0.3)["lora"]}}
    with_critic = create_train_state(p, opt, jax.random.key(0), critic_params=value,
                                     critic_optimizer=opt)
    grpo_b = {k: jnp.asarray(v) for k, v in make_batch().items()}
    pb = {k: jnp.asarray(v) for k, v in ppo_batch().items()}
    m = pb["loss_mask"].astype(jnp.float32)
    pb.update(old_logps=-m, advantages=m * 0.5, old_values=m * 0.1, returns=m * 0.7)
    pref = dpo_batch()

    def ppo_case(cfg, s):
        joint = {"policy": s.params, "critic": s.critic_params}
        (num, _), mets = ppo.ppo_loss(cfg, ppo_algo(), 1.0, joint, s, pb)
        return num, mets["vf_loss"][0]   # the critic's own term: its adapters' dropout

    def rm_case(cfg, s):
        view = lora.value_on_base(s.params, s.critic_params)
        return rm.rm_loss(cfg, view, s, pref)[0][0], None

    return {
        "sft": (lambda c, s: (steps_lib.sft_loss(c, s.params, s, grpo_b)[0][0], None), pol),
        "grpo": (lambda c, s: (grpo.grpo_loss(c, algo_cfg(beta=0.05), 1.0, s.params, s,
                                              grpo_b)[0][0], None), pol),
        "ppo": (ppo_case, with_critic),
        "dpo": (lambda c, s: (dpo.dpo_loss(c, dpo_algo(), s.params, s, pref)[0][0], None), pol),
        "rm": (rm_case, with_critic),
    }


@pytest.mark.parametrize("name", ["sft", "grpo", "ppo", "dpo", "rm"])
def test_every_training_loss_draws_dropout_from_the_state(name):
    fn, state = _loss_cases()[name]
    cfg = CFG.replace(lora_dropout=0.5)
    drop = jax.jit(lambda s: fn(cfg, s))
    plain = jax.jit(lambda s: fn(CFG, s))
    a, a_aux = drop(state)
    b, b_aux = drop(state)
    c, _ = drop(state.replace(step=state.step + 1))
    d, d_aux = plain(state)
    assert float(a) == float(b)                     # deterministic in the state
    assert float(a) != float(c)                     # fresh masks at the next update
    assert abs(float(a) - float(d)) > 1e-5          # dropout reaches the model
    if a_aux is not None:                           # PPO: the critic's adapters too
        assert float(a_aux) == float(b_aux) and abs(float(a_aux) - float(d_aux)) > 1e-6


# ----------------------------------------------------------------------------- config, runs

def test_bad_dropout_is_one_line_exit_2(tmp_path, capsys):
    from rljax import cli, config as config_lib
    from rljax.errors import ConfigError
    from test_cli import write_config

    for bad in ("-0.1", "1.0", "1.5"):
        assert cli.main(["train", "--config", write_config(tmp_path),
                         f"--config.model.lora.dropout={bad}", "--config.model.lora.rank=4",
                         "--workdir", str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("rljax: error: ")
        assert f"model.lora.dropout={float(bad)} must be in [0, 1)" in err[0]
    assert not os.path.exists(tmp_path / "run" / "checkpoints")
    cfg = config_lib.load_config(None, ["model.lora.rank=4", "model.lora.dropout=0.05"])
    assert cfg.model.lora.dropout == 0.05
    with pytest.raises(ValueError, match="lora_dropout=1.0 must be in"):
        CFG.replace(lora_dropout=1.0)
    with pytest.raises(ConfigError, match="model.lora.dropout"):  # not a number: named too
        config_lib.load_config(None, ["model.lora.dropout=nan"])


def drop_cfg(**kw):
    # Two micro-batches per update, so the micro-batch index keys masks in the run too. RL from
    # the start: the SFT loss's draws are test_every_training_loss_draws_dropout_from_the_state's.
    return lora_cfg(**{"model.lora.dropout": RATE, "algo.micro_batch_size": 4, "sft.steps": 0,
                       **kw})


@pytest.fixture(scope="module")
def straight_drop(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("lora_dropout_straight"))
    assert run.train(drop_cfg(), workdir, devices=DEVICES) == 0
    return workdir


def test_run_with_dropout_stops_and_resumes_exactly(straight_drop, tmp_path):
    from rljax.train.core import setup

    ctx = setup.build_context(drop_cfg(), str(tmp_path / "ctx"), devices=DEVICES)
    assert ctx.model_cfg.lora_dropout == RATE          # the run trains with dropout on
    records = read_metrics(straight_drop)
    rl = [r for r in records if "reward/mean" in r]
    assert len(rl) == RL_STEPS and all(np.isfinite(r["loss"]) for r in rl)
    workdir = str(tmp_path / "run")
    assert run.train(drop_cfg(), workdir, devices=DEVICES, stop=StopAfter(RL_STEPS // 2)) == 0
    assert len([r for r in read_metrics(workdir) if "reward/mean" in r]) == RL_STEPS // 2
    assert run.train(drop_cfg(), workdir, devices=DEVICES) == 0
    assert comparable(read_metrics(workdir)) == comparable(records)
    jax.tree.map(np.testing.assert_array_equal,
                 jax.tree.map(np.asarray, saved_state(workdir)["params"]),
                 jax.tree.map(np.asarray, saved_state(straight_drop)["params"]))


def test_peft_export_writes_the_rate_and_adapter_path_reads_it(straight_drop, tmp_path):
    from rljax.train.core import setup

    out = str(tmp_path / "ad")
    assert run.export(drop_cfg(), straight_drop, out, devices=DEVICES, adapter=True) == 0
    with open(os.path.join(out, models.peft.ADAPTER_CONFIG)) as f:
        assert json.load(f)["lora_dropout"] == RATE
    assert models.peft.adapter_dropout(out) == RATE
    # model.adapter_path: the adapter's rate, unless model.lora.dropout sets one.
    ctx = setup.build_context(drop_cfg(**{"model.lora.dropout": 0.0, "model.lora.rank": 0,
                                          "model.adapter_path": out}),
                              str(tmp_path / "a"), devices=DEVICES)
    assert ctx.model_cfg.lora_dropout == RATE
    ctx = setup.build_context(drop_cfg(**{"model.lora.dropout": 0.1, "model.lora.rank": 0,
                                          "model.adapter_path": out}),
                              str(tmp_path / "b"), devices=DEVICES)
    assert ctx.model_cfg.lora_dropout == 0.1
    # A merged export is the deterministic model: equal to the adapters applied without a key.
    merged = str(tmp_path / "merged")
    assert run.export(drop_cfg(), straight_drop, merged, devices=DEVICES) == 0
    _, params = models.load_hf(merged)
    from rljax.train import inference
    ictx, state, _ = inference.load_for_inference(drop_cfg(), straight_drop, devices=DEVICES)
    t = tokens(2, 6) % ictx.model_cfg.vocab_size
    np.testing.assert_allclose(models.forward(ictx.model_cfg, params, t),
                               models.forward(ictx.model_cfg, state.params, t), atol=1e-5)
    # A hand-edited rate out of range is one line naming the key.
    cfg_path = os.path.join(out, models.peft.ADAPTER_CONFIG)
    with open(cfg_path) as f:
        config = json.load(f)
    with open(cfg_path, "w") as f:
        json.dump({**config, "lora_dropout": 1.0}, f)
    with pytest.raises(ValueError, match="lora_dropout=1.0 in adapter_config.json"):
        models.peft.adapter_dropout(out)


def test_peft_loads_an_adapter_with_dropout_and_evaluates_without_it(tmp_path):
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    cfg = CFG.replace(lora_dropout=RATE)
    p = adapted(cfg)
    base_dir, ad_dir = str(tmp_path / "base"), str(tmp_path / "adapter")
    models.save_hf(cfg, lora.base_params(p), base_dir)
    models.peft.save_adapter(cfg, p["lora"], ad_dir, base_model_name_or_path=base_dir)
    hf = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(hf, ad_dir).eval()
    assert hf.peft_config["default"].lora_dropout == RATE
    t = tokens(2, 7)
    with torch.no_grad():
        ref = hf(torch.tensor(np.asarray(t))).logits.numpy()
    # PEFT in eval mode and rljax without a key: the same deterministic model.
    np.testing.assert_allclose(np.asarray(models.forward(cfg, p, t)), ref, atol=2e-5, rtol=1e-4)
