"""LoRA: adapters on a frozen base (step 0 == base, gradients only to adapters, exact resume,
the reference policy for free, PEFT round trip, sharded == unsharded)."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import models
from rljax.models import lora
from rljax.train import run
from rljax.train.core import checkpoint
from rljax.train.core.metrics import read_metrics
from rljax.train.core.state import create_train_state
from rljax.train.core import steps as steps_lib
from rljax.train.phases import grpo

from test_train_loop import DEVICES, RL_STEPS, StopAfter, comparable, tiny_cfg

CFG = models.get_preset("tiny", num_layers=2, hidden_size=32, intermediate_size=64,
                        num_heads=4, num_kv_heads=2, vocab_size=64)


def lora_params(cfg=CFG, rank=4, targets=lora.ALL_TARGETS, seed=0):
    base = models.init_params(cfg, jax.random.key(seed))
    return {**base, "lora": lora.init_lora(cfg, rank, targets, jax.random.key(seed + 1))}


def perturbed(params, scale=0.1):
    """Adapters with non-zero B (a trained-looking adapter)."""
    leaves, tree = jax.tree.flatten(params["lora"])
    keys = jax.random.split(jax.random.key(7), len(leaves))
    new = [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return {**params, "lora": jax.tree.unflatten(tree, new)}


def tokens(b=2, t=9, seed=3):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, CFG.vocab_size)


def test_step0_equals_base_and_merge_matches():
    p = lora_params()
    base = models.forward(CFG, lora.base_params(p), tokens())
    # B = 0 adds exact zeros, but the adapted forward is another program than the base one
    # (extra matmuls, other fusions), which may round the base's own terms differently on
    # another CPU type: float32 rounding over two tiny layers, not a bit-for-bit claim.
    np.testing.assert_allclose(models.forward(CFG, p, tokens()), base, rtol=1e-5, atol=1e-6)
    cfg = CFG.replace(lora_scale=2.0)
    q = perturbed(p)
    out = models.forward(cfg, q, tokens())
    assert np.abs(out - base).max() > 1e-2  # the adapters do something
    # The merged tree has no adapters, so the scale is unused: CFG runs the base's program.
    np.testing.assert_allclose(models.forward(CFG, lora.merge(cfg, q), tokens()), out,
                               atol=1e-5)


def test_targets_and_rank_errors():
    assert lora.resolve_targets(["q|v", "down"]) == ("q", "v", "down")
    assert lora.resolve_targets(".*") == lora.ALL_TARGETS
    with pytest.raises(ValueError, match="'qq' matches no projection"):
        lora.resolve_targets(["q", "qq"])
    with pytest.raises(ValueError, match="rank must be > 0"):
        lora.init_lora(CFG, 0, ("q",), jax.random.key(0))


def test_gradients_flow_only_to_adapters_and_base_is_unchanged():
    import optax
    p = lora_params(targets=("q", "v", "down"))
    state = create_train_state(p, optax.adam(1e-2), jax.random.key(0))
    n_lora = sum(x.size for x in jax.tree.leaves(p["lora"]))
    # Adam moments for the adapters only (mu, nu) plus the count: no optimizer state for the base.
    assert sum(x.size for x in jax.tree.leaves(state.opt_state)) == 2 * n_lora + 1
    t = tokens(4, 10)
    batch = {"tokens": t, "mask": jnp.ones_like(t, bool),
             "loss_mask": jnp.ones((4, 5), bool)}
    grads = jax.jit(lambda s, b: steps_lib.accumulate(
        lambda pp, s, b: steps_lib.sft_loss(CFG, pp, s, b), s, b)[0])(state, batch)
    assert set(grads) == {"lora"}
    assert float(jnp.abs(grads["lora"]["layers"]["q"]["b"]).max()) > 0
    step = steps_lib.build_sft_step(CFG, optax.adam(1e-2))
    base_before = jax.tree.map(np.asarray, lora.base_params(p))
    new, metrics = step(state, batch)
    jax.tree.map(np.testing.assert_array_equal, base_before,
                 jax.tree.map(np.asarray, lora.base_params(new.params)))
    assert not np.array_equal(np.asarray(new.params["lora"]["layers"]["q"]["b"]), 0)


def lora_cfg(**overrides):
    return tiny_cfg(**{"model.lora.rank": 4, "model.lora.alpha": 8.0,
                       "optimizer.learning_rate": 1e-2, "sft.learning_rate": 1e-2, **overrides})


def run_cfg():
    """The runs of this module: RL on the adapters from the start (no SFT warm-up; test_qlora's
    runs train adapters through SFT then RL)."""
    return lora_cfg(**{"sft.steps": 0})


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("lora_straight"))
    assert run.train(run_cfg(), workdir, devices=DEVICES) == 0
    return workdir


def saved_state(workdir):
    with checkpoint.CheckpointManager(checkpoint.checkpoint_dir(workdir)) as ckpt:
        return ckpt.restore().state


def test_lora_run_checkpoints_adapters_only_and_resumes_exactly(straight, tmp_path):
    records = read_metrics(straight)
    rl = [r for r in records if "reward/mean" in r]
    assert len(rl) == RL_STEPS and "kl_ref" in rl[0]
    assert rl[0]["rollout/logp_diff_max"] < 1e-4   # sampler and trainer read the same arrays
    saved = saved_state(straight)
    assert set(saved["params"]) == {"lora"}        # no base weights in the checkpoint
    assert saved.get("ref_params") is None          # the reference is the base: no copy
    workdir = str(tmp_path)
    assert run.train(run_cfg(), workdir, devices=DEVICES, stop=StopAfter(RL_STEPS // 2)) == 0
    assert len([r for r in read_metrics(workdir) if "reward/mean" in r]) == RL_STEPS // 2
    assert run.train(run_cfg(), workdir, devices=DEVICES) == 0
    assert comparable(read_metrics(workdir)) == comparable(records)
    jax.tree.map(np.testing.assert_array_equal,
                 jax.tree.map(np.asarray, saved_state(workdir)["params"]),
                 jax.tree.map(np.asarray, saved["params"]))


# ----------------------------------------------------------------------------- PEFT round trip

def test_peft_adapter_round_trip_matches_rljax_logits(tmp_path):
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    cfg = CFG.replace(lora_scale=8.0 / 4)
    p = perturbed(lora_params(cfg, rank=4, targets=lora.ALL_TARGETS), scale=0.2)
    base_dir, ad_dir = str(tmp_path / "base"), str(tmp_path / "adapter")
    models.save_hf(cfg, lora.base_params(p), base_dir)
    models.peft.save_adapter(cfg, p["lora"], ad_dir, base_model_name_or_path=base_dir)
    hf = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(hf, ad_dir).eval()
    t = tokens(2, 9)
    with torch.no_grad():
        ref = hf(torch.tensor(np.asarray(t))).logits.numpy()
    ours = np.asarray(models.forward(cfg, p, t))
    base = np.asarray(models.forward(cfg, lora.base_params(p), t))
    assert np.abs(ours - base).max() > 1e-2
    np.testing.assert_allclose(ours, ref, atol=2e-5, rtol=1e-4)
    # ... and back: model.adapter_path reads PEFT's files into the same adapters.
    adapters, rank, alpha = models.peft.load_adapter(ad_dir, cfg)
    assert (rank, alpha) == (4, 8.0)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 adapters, p["lora"])
    with pytest.raises(ValueError, match="do not match the base model"):
        models.peft.load_adapter(ad_dir, cfg.replace(hidden_size=64))
    with pytest.raises(ValueError, match="'qwen2' model|trained on a 'llama'"):
        models.peft.load_adapter(ad_dir, cfg.replace(model_type="qwen2"))


# ----------------------------------------------------------------------------- sharding, DPO

def test_lora_grpo_step_sharded_on_8_devices_equals_unsharded():
    from rljax import sharding as shd
    from rljax.train.core.state import eval_state_shape, state_shardings
    from test_train_steps import MODEL, algo_cfg, make_batch
    from rljax import config as config_lib
    from rljax.train.core import optim

    assert jax.device_count() == 8
    cfg = MODEL.replace(lora_scale=2.0)
    targets = lora.ALL_TARGETS
    opt_cfg = config_lib.default_config().optimizer
    opt_cfg.name = "sgd"
    opt = optim.make_optimizer(opt_cfg, 100, learning_rate=1.0)

    def fresh():
        p = perturbed(lora_params(cfg, rank=4, targets=targets), scale=0.05)
        return create_train_state(p, opt, jax.random.key(1))

    algo = algo_cfg(beta=0.05)
    batch = make_batch(2)
    state = fresh()
    assert state.ref_params is None
    want_state, want = grpo.build_update(cfg, algo, opt, num_micro=2)(state, batch)

    mesh = shd.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    state = fresh()
    pshard = shd.logical_to_sharding(
        {**models.param_logical_axes(cfg), "lora": lora.lora_logical_axes(cfg, 4, targets)},
        mesh, shapes=state.params)
    sshard = state_shardings(eval_state_shape(state.params, opt, state.rng), pshard)
    state = jax.device_put(state, sshard)
    assert state.params["lora"]["layers"]["q"]["b"].sharding.spec != jax.sharding.PartitionSpec()
    step = grpo.build_update(cfg, algo, opt, num_micro=2, state_shardings=sshard,
                                     mesh=mesh)
    new_state, m = step(state, batch)
    np.testing.assert_allclose(float(m["loss"]), float(want["loss"]), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(m["kl_ref"]), float(want["kl_ref"]), rtol=1e-4, atol=1e-7)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                         rtol=1e-5, atol=1e-6),
                 new_state.params, want_state.params)


def test_dpo_with_lora_holds_no_reference_copy(tmp_path):
    from rljax import config as config_lib
    from rljax.train import inference
    from rljax.train.core import setup
    from rljax.train.phases import make_phases

    cfg = config_lib.load_config("configs/dpo_arithmetic.py", [
        "steps=2", "sft.steps=0", "rollout.batch_size=8", "eval.num_examples=8",
        "eval.batch_size=8", "checkpoint.async_save=False", "logging.tensorboard=False",
        "mesh.data=1", "algo.ref_update_every=0", "model.lora.rank=4",
        "model.lora.targets=q|v"])
    ctx = setup.build_context(cfg, str(tmp_path / "ctx"), devices=DEVICES)
    shape = inference.abstract_state(ctx, make_phases(ctx), 0)
    assert shape.ref_params is None                       # the base is the reference
    n_lora = sum(x.size for x in jax.tree.leaves(shape.params["lora"]))
    n_opt = sum(x.size for x in jax.tree.leaves(shape.opt_state))
    assert n_opt <= 2 * n_lora + 8                        # Adam moments of the adapters only
    workdir = str(tmp_path / "run")
    assert run.train(cfg, workdir, devices=DEVICES) == 0
    saved = saved_state(workdir)
    assert set(saved["params"]) == {"lora"} and saved.get("ref_params") is None
    train = [r for r in read_metrics(workdir) if "rewards/margin" in r]
    assert len(train) == 2 and all(np.isfinite(r["loss"]) for r in train)


def test_export_merged_adapter_and_refusals(straight, tmp_path):
    from rljax import cli
    from rljax.train import inference

    cfg = run_cfg()
    out = str(tmp_path / "merged")
    assert run.export(cfg, straight, out, devices=DEVICES) == 0
    ctx, state, _ = inference.load_for_inference(cfg, straight, devices=DEVICES)
    t = tokens(2, 6) % ctx.model_cfg.vocab_size
    _, merged = models.load_hf(out)
    np.testing.assert_allclose(models.forward(ctx.model_cfg, merged, t),
                               models.forward(ctx.model_cfg, state.params, t), atol=1e-5)
    assert run.export(cfg, straight, str(tmp_path / "ad"), devices=DEVICES, adapter=True) == 0
    assert sorted(os.listdir(tmp_path / "ad")) == ["adapter_config.json",
                                                    "adapter_model.safetensors"]
    adapters, rank, alpha = models.peft.load_adapter(str(tmp_path / "ad"), ctx.model_cfg)
    assert (rank, alpha) == (4, 8.0)
    # A run without LoRA: one line, exit 2, before loading anything.
    from rljax import config as config_lib
    plain = str(tmp_path / "plain")
    os.makedirs(plain)
    with open(os.path.join(plain, "config.json"), "w") as f:
        f.write(config_lib.to_json(tiny_cfg()))
    assert cli.main(["export", "--workdir", plain, "--out", str(tmp_path / "x"),
                     "--adapter"]) == 2


# ----------------------------------------------------------------------------- PPO, RM

@pytest.mark.parametrize("algo,quantize", [("ppo", ""), ("rm", ""), ("ppo", "int4")])
def test_ppo_and_rm_critic_is_adapters_on_the_shared_base(algo, quantize, tmp_path):
    """... also when that base is kept quantized (QLoRA: the critic reads it too)."""
    from rljax import config as config_lib

    common = ["rollout.batch_size=8", "eval.num_examples=8", "eval.batch_size=8",
              "checkpoint.async_save=False", "logging.tensorboard=False", "mesh.data=1",
              "model.lora.rank=4", "model.lora.targets=q,v,down", f"model.quantize={quantize}"]
    extra = (["steps=2", "sft.steps=0", "algo.mini_batch_size=4", "algo.ref_update_every=0"]
             if algo == "ppo" else ["steps=2"])
    cfg = config_lib.load_config(f"configs/{algo}_arithmetic.py", common + extra)
    workdir = str(tmp_path)
    assert run.train(cfg, workdir, devices=DEVICES) == 0
    saved = saved_state(workdir)
    assert set(saved["params"]) == {"lora"} and saved.get("ref_params") is None
    assert set(saved["critic_params"]["trunk"]) == {"lora"}   # no copy of the base trunk
    key = "vf_loss" if algo == "ppo" else "score/margin"
    train = [r for r in read_metrics(workdir) if key in r]
    assert len(train) == 2 and all(np.isfinite(r["loss"]) for r in train)


def test_bad_lora_input_is_one_line_before_compiling(tmp_path):
    from rljax import config as config_lib
    from rljax.errors import ConfigError, UserError
    from rljax.train.core import setup

    with pytest.raises(ConfigError, match="model.lora.targets: LoRA target 'qq' matches no"):
        setup.check_inputs(tiny_cfg(**{"model.lora.rank": 4, "model.lora.targets": ("qq",)}),
                           1)
    with pytest.raises(ConfigError, match="model.lora.rank=-1 must be > 0"):
        config_lib.load_config(None, ["model.lora.rank=-1"])
    with pytest.raises(UserError, match="is not a PEFT adapter directory"):
        setup.check_inputs(tiny_cfg(**{"model.adapter_path": str(tmp_path)}), 1)


def test_adapter_path_starts_from_a_peft_adapter(tmp_path):
    from rljax.train.core import setup

    cfg = CFG.replace(lora_scale=8.0 / 4, vocab_size=128)  # >= the char tokenizer's
    p = perturbed(lora_params(cfg, rank=4, targets=("q", "down")), scale=0.2)
    base_dir, ad_dir = str(tmp_path / "base"), str(tmp_path / "adapter")
    models.save_hf(cfg, lora.base_params(p), base_dir)
    models.peft.save_adapter(cfg, p["lora"], ad_dir, base_model_name_or_path=base_dir)
    run_cfg = tiny_cfg(**{"model.path": base_dir, "model.adapter_path": ad_dir,
                          "tokenizer.kind": "char", "sft.steps": 0})
    run_cfg.model.overrides = {}  # the shapes come from the checkpoint
    setup.check_inputs(run_cfg, 1)
    ctx = setup.build_context(run_cfg, str(tmp_path / "run"), devices=DEVICES)
    assert ctx.model_cfg.lora_scale == 2.0 and set(ctx.params["lora"]["layers"]) == {"q", "down"}
    t = tokens()
    np.testing.assert_allclose(models.forward(ctx.model_cfg, ctx.params, t),
                               models.forward(cfg, p, t), atol=1e-6)


def test_sampler_reads_merged_adapters_on_a_float32_base_only():
    """``sampler.sampling_params``: adapters folded in once for sampling (float32 base, the
    default), the tree as it is otherwise; merged and unmerged sample the same tokens."""
    from types import SimpleNamespace

    import ml_collections

    from rljax import sampling
    from rljax.train.core import sampler

    params = perturbed(lora_params())
    ctx = lambda merge, dtype=jnp.float32: SimpleNamespace(  # noqa: E731
        cfg=ml_collections.ConfigDict({"model": {"lora": {"merge_for_sampling": merge}}}),
        model_cfg=CFG.replace(dtype=dtype))
    merged = sampler.sampling_params(ctx(True), params)
    assert "lora" not in merged and "lora" in params
    assert sampler.sampling_params(ctx(False), params) is params
    assert sampler.sampling_params(ctx(True, jnp.bfloat16), params) is params
    base = lora.base_params(params)
    assert sampler.sampling_params(ctx(True), base) is base
    toks = tokens()
    mask = jnp.ones(toks.shape, bool)
    kw = dict(rng=jax.random.PRNGKey(0), max_new_tokens=6, temperature=1.0, num_samples=2)
    a = sampling.generate(CFG, params, toks, mask, **kw)
    b = sampling.generate(CFG, merged, toks, mask, **kw)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_allclose(np.asarray(a.logps), np.asarray(b.logps), atol=1e-5)
