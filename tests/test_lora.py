"""LoRA: adapters on a frozen base (step 0 == base, gradients only to adapters, exact resume,
the reference policy for free, PEFT round trip, sharded == unsharded)."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import models
from rljax.models import lora
from rljax.train import checkpoint, run
from rljax.train.metrics import read_metrics
from rljax.train.state import create_train_state
from rljax.train import steps as steps_lib

from test_train_loop import DEVICES, RL_STEPS, SFT_STEPS, StopAfter, comparable, tiny_cfg

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


def test_step0_equals_base_exactly_and_merge_matches():
    p = lora_params()
    base = models.forward(CFG, lora.base_params(p), tokens())
    np.testing.assert_array_equal(models.forward(CFG, p, tokens()), base)
    cfg = CFG.replace(lora_scale=2.0)
    q = perturbed(p)
    out = models.forward(cfg, q, tokens())
    assert np.abs(out - base).max() > 1e-2  # the adapters do something
    np.testing.assert_allclose(models.forward(cfg, lora.merge(cfg, q), tokens()), out,
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
    state = create_train_state(p, optax.adam(1e-2), jax.random.key(0),)
    opt_leaves = jax.tree.leaves(state.opt_state)
    n_lora = sum(x.size for x in jax.tree.leaves(p["lora"]))
    # Adam moments for the adapters only (mu, nu) plus the count: no optimizer state for the base.
    state = create_train_state(p, optax.adam(1e-2), jax.random.key(0))
    state = state.replace(opt_state=optax.adam(1e-2).init(lora.trainable(p)))
    assert sum(x.size for x in jax.tree.leaves(state.opt_state)) == 2 * n_lora + 1
    del opt_leaves
    t = tokens(4, 10)
    batch = {"tokens": t, "mask": jnp.ones_like(t, bool),
             "loss_mask": jnp.ones((4, 5), bool)}
    grads, *_ = steps_lib.accumulate(lambda pp, s, b: steps_lib.sft_loss(CFG, pp, s, b),
                                     state, batch)
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


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("lora_straight"))
    assert run.train(lora_cfg(), workdir, devices=DEVICES) == 0
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
    stop_at = SFT_STEPS + RL_STEPS // 2
    assert run.train(lora_cfg(), workdir, devices=DEVICES, stop=StopAfter(stop_at)) == 0
    assert run.train(lora_cfg(), workdir, devices=DEVICES) == 0
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
