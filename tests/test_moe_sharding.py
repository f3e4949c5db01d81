"""Expert parallelism: a mixture of experts on 8 fake CPU devices (see conftest.py), its
experts split over the mesh's ``expert`` axis, computes what the unsharded model does."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from rljax import models, sharding


def _model():
    cfg = models.get_preset("tiny-moe", hidden_size=32, num_heads=4, num_kv_heads=2,
                            moe_intermediate_size=16)
    params = models.init_params(cfg, jax.random.PRNGKey(0))
    # A router sharp enough that every expert gets tokens and ties never happen.
    params["layers"]["router"] = params["layers"]["router"] * 40
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, size=(8, 16)).astype(np.int32)
    mask = np.ones((8, 16), bool)
    mask[1, :5] = False
    return cfg, params, tokens, mask


def _loss(cfg, params, tokens, mask):
    logps, _ = models.token_logps(cfg, params, tokens, mask)
    return jnp.sum(logps)


@pytest.mark.parametrize("axes", [{"data": 2, "expert": 4},
                                  {"fsdp": 2, "expert": 2, "tensor": 2}])
def test_expert_parallel_forward_and_grad_equal_unsharded(axes):
    cfg, params, tokens, mask = _model()
    fn = jax.jit(jax.value_and_grad(_loss, argnums=1), static_argnums=0)
    ref_loss, ref_grad = fn(cfg, params, tokens, mask)
    ref_logits = models.forward(cfg, params, tokens, mask)

    mesh = sharding.make_mesh(axes)
    shardings = sharding.logical_to_sharding(models.param_logical_axes(cfg), mesh,
                                             shapes=params)
    sharded = sharding.shard_params(params, shardings)
    gate = sharded["layers"]["expert_gate"]
    assert gate.sharding.spec[1] == "expert"
    assert gate.addressable_shards[0].data.shape[1] == cfg.num_experts // axes["expert"]
    if "fsdp" in axes:
        assert gate.sharding.spec == P(None, "expert", "fsdp", "tensor")
    batch = sharding.shard_batch({"tokens": tokens, "mask": mask}, mesh)
    loss, grad = fn(cfg, sharded, batch["tokens"], batch["mask"])
    logits = jax.jit(models.forward, static_argnums=0)(cfg, sharded, batch["tokens"],
                                                       batch["mask"])
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for name in ("router", "expert_gate", "expert_up", "expert_down", "q"):
        np.testing.assert_allclose(np.asarray(grad["layers"][name]),
                                   np.asarray(ref_grad["layers"][name]), rtol=1e-4,
                                   atol=1e-6)


def test_plan_sizes_a_moe_split_over_the_expert_axis():
    """``rljax plan`` (resident state, no compile): the experts' bytes per device shrink with
    mesh.expert, and the model's parameter count includes every expert."""
    import os
    from rljax import config, plan
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base = ["--config.sft.steps=0", "--config.rollout.batch_size=16",
            "--config.algo.num_generations=2", "--config.rollout.max_new_tokens=4",
            "--config.model.preset=tiny-moe", "--config.mesh.data=2"]

    def params_bytes(expert):
        cfg = config.load_config(os.path.join(root, "configs", "grpo_arithmetic.py"),
                                 [*base, f"--config.mesh.expert={expert}",
                                  "--config.model.overrides={}"])
        return plan.plan(cfg, jax.devices()[:2 * expert], compile_phases=False)

    one, four = params_bytes(1), params_bytes(4)
    cfg = models.get_preset("tiny-moe")
    experts = 3 * cfg.num_layers * cfg.num_experts * cfg.hidden_size * cfg.moe_intermediate_size
    saved = one.resident_parts["params"] - four.resident_parts["params"]
    assert saved == 4 * experts * 3 // 4   # float32: 3/4 of the experts' bytes leave each device
