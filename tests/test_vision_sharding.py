"""A vision-language model on 8 fake devices (data=2, fsdp=2, tensor=2): the tower's matrices
are split by the rules table, and the forward, loss and gradients (tower included) equal the
unsharded ones."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from rljax import models, sharding
from rljax.models.config import VisionConfig
from rljax.models import vision
from rljax.train.core import steps

IMG, MM = 60, 4


def _model():
    vcfg = VisionConfig(hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                        image_size=16, patch_size=4, mm_tokens_per_image=MM,
                        text_hidden_size=32)
    cfg = models.get_preset("tiny", model_type="gemma3", vocab_size=64, hidden_size=32,
                            intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8,
                            num_layers=2, image_token_id=IMG, vision=vcfg, train_vision=True)
    params = models.init_params(cfg, jax.random.PRNGKey(0))
    params["vision"] = vision.init_vision_params(vcfg.replace(init_std=0.3),
                                                 jax.random.PRNGKey(1))
    return cfg, params


def _batch(rows=4):
    """``rows`` sequences: 2 text tokens, one image, 4 completion tokens; pixels
    [rows, 1, 3, 16, 16]."""
    rng = np.random.default_rng(0)
    toks = np.concatenate([rng.integers(3, 59, (rows, 2)), np.full((rows, MM), IMG),
                           rng.integers(3, 59, (rows, 4))], 1).astype(np.int32)
    return {"tokens": toks, "mask": np.ones(toks.shape, bool),
            "loss_mask": np.ones((rows, 4), np.float32),
            "pixels": rng.normal(size=(rows, 1, 3, 16, 16)).astype(np.float32)}


def _loss_and_grads(cfg, params, batch):
    def loss(p):
        logps = steps.completion_logps(cfg, p, batch)[0]
        return -(logps * batch["loss_mask"]).sum() / batch["loss_mask"].sum(), logps
    return jax.value_and_grad(loss, has_aux=True)(params)


def test_sharded_vlm_forward_loss_and_grads_equal_unsharded():
    cfg, params = _model()
    batch = _batch()
    fn = jax.jit(lambda p, b: _loss_and_grads(cfg, p, b))
    (want_loss, want_logps), want_grads = fn(params, jax.tree.map(jnp.asarray, batch))

    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    shardings = sharding.logical_to_sharding(models.param_logical_axes(cfg), mesh,
                                             shapes=params)
    placed = sharding.shard_params(params, shardings)
    tower = placed["vision"]
    assert tower["layers"]["q"].sharding.spec == P(None, "fsdp", "tensor", None)
    assert tower["layers"]["o"].sharding.spec == P(None, "tensor", None, "fsdp")
    assert tower["layers"]["fc1"].sharding.spec == P(None, "fsdp", "tensor")
    assert tower["layers"]["fc2"].sharding.spec == P(None, "tensor", "fsdp")
    assert tower["patch"].sharding.spec == P(None, "fsdp")
    assert tower["mm_proj"].sharding.spec == P("tensor", "fsdp")
    # Each device holds a quarter of a layer's q (fsdp x tensor), not the whole of it.
    q = tower["layers"]["q"]
    assert q.addressable_shards[0].data.size == q.size // 4

    sharded_fn = jax.jit(lambda p, b: _loss_and_grads(cfg, p, b),
                         in_shardings=(shardings, None), out_shardings=(None, shardings))
    (loss, logps), grads = sharded_fn(placed, sharding.shard_batch(batch, mesh))
    assert grads["vision"]["layers"]["fc1"].sharding.spec == P(None, "fsdp", "tensor")
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(logps), np.asarray(want_logps), rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(want_grads["vision"]["patch"])).max() > 0
    jax.tree.map(lambda g, w: np.testing.assert_allclose(
        np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6 * max(np.abs(np.asarray(w)).max(), 1)),
        grads, want_grads)


class _OneTokenizer:
    """Just enough tokenizer for ``setup.build_model``: the image token's text is one id."""
    vocab_size = 64

    def encode(self, text):
        return [IMG] if text == "<img>" else [1, 2]


def test_a_vlm_checkpoint_loads_into_its_shards(tmp_path):
    """``model.vision.load``: text model and tower read from an exported directory straight
    onto the fsdp x tensor mesh, equal to what was written."""
    from rljax import config as config_lib
    from rljax.models.hf_vision import save_hf_vlm
    from rljax.train.core import setup
    cfg, params = _model()
    save_hf_vlm(cfg, params, str(tmp_path))
    run_cfg = config_lib.default_config()
    run_cfg.update_from_flattened_dict({"model.path": str(tmp_path), "model.vision.load": True,
                                        "model.vision.image_token": "<img>"})
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    model_cfg, loaded, _ = setup.build_model(run_cfg, _OneTokenizer(), mesh, None)
    assert model_cfg.vision == cfg.vision and model_cfg.image_token_id == IMG
    assert loaded["vision"]["layers"]["fc1"].sharding.spec == P(None, "fsdp", "tensor")
    assert loaded["layers"]["q"].sharding.spec == P(None, "fsdp", "tensor", None)
    jax.tree.map(np.testing.assert_array_equal, loaded, params)


def test_the_plan_counts_the_tower_in_its_shards():
    """``rljax plan``'s resident state holds the tower (a tiny-vlm run), split over fsdp x
    tensor like the text model: per device, less than on one device."""
    from rljax import plan as plan_lib
    from rljax.train.core.programs import shard_bytes
    from test_vision_run import vlm_cfg
    one = plan_lib.plan(vlm_cfg(**{"mesh.data": 1}), jax.devices()[:1], compile_phases=False)
    cfg = vlm_cfg(**{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2})
    eight = plan_lib.plan(cfg, jax.devices(), compile_phases=False)
    text = vlm_cfg(**{"mesh.data": 1, "model.preset": "tiny", "model.overrides": {
        "num_layers": 1, "model_type": "gemma3", "hidden_size": 64, "intermediate_size": 128,
        "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 16.0}})
    tower = jax.eval_shape(lambda: vision.init_vision_params(
        models.get_preset("tiny-vlm").vision, jax.random.key(0)))
    text_only = plan_lib.plan(text, jax.devices()[:1], compile_phases=False)
    assert one.resident_parts["params"] == text_only.resident_parts["params"] + shard_bytes(tower)
    assert eight.resident_parts["params"] < one.resident_parts["params"] / 2
