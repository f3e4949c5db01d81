"""Tests for rljax.sharding on 8 fake CPU devices (see conftest.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from rljax import sharding


def test_eight_fake_devices():
    assert len(jax.devices()) == 8


@pytest.mark.parametrize("axes,shape", [
    ({"data": 2, "fsdp": 2, "tensor": 2}, (2, 2, 1, 2)),
    ({"data": -1}, (8, 1, 1, 1)),
    ({"data": 2, "fsdp": -1, "tensor": 2}, (2, 2, 1, 2)),
    ({"fsdp": 4, "tensor": -1}, (1, 4, 1, 2)),
    ({"data": 2, "expert": 4}, (2, 1, 4, 1)),
    (None, (8, 1, 1, 1)),
])
def test_make_mesh_sizes(axes, shape):
    mesh = sharding.make_mesh(axes)
    assert mesh.axis_names == ("data", "fsdp", "expert", "tensor")
    assert tuple(mesh.shape[a] for a in mesh.axis_names) == shape
    assert mesh.devices.size == 8


def test_make_mesh_subset_of_devices():
    mesh = sharding.make_mesh({"data": 2, "tensor": 2}, devices=jax.devices()[:4])
    assert mesh.devices.size == 4


@pytest.mark.parametrize("axes,match", [
    ({"data": 3, "fsdp": 1, "tensor": 1},
     r"data=3, fsdp=1, expert=1, tensor=1.*multiply to 3.*8 devices"),
    ({"data": 3, "fsdp": -1}, r"not divisible.*data=3.*'fsdp'"),
    ({"data": -1, "fsdp": -1}, r"at most one -1"),
    ({"data": 0}, r"data=0"),
    ({"model": 8}, r"unknown axis name.*model"),
])
def test_make_mesh_bad_sizes(axes, match):
    with pytest.raises(ValueError, match=match):
        sharding.make_mesh(axes)


def test_logical_to_spec_rules_and_fallbacks():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    spec = sharding.logical_to_spec
    assert spec(("layers", "embed", "mlp"), mesh, shape=(2, 64, 128)) == P(None, "fsdp", "tensor")
    assert spec(("vocab", "embed"), mesh, shape=(256, 64)) == P("tensor", "fsdp")
    # Not divisible: vocab 255 over tensor=2 -> replicated along that dim only.
    assert spec(("vocab", "embed"), mesh, shape=(255, 64)) == P(None, "fsdp")
    # Batch keeps the longest dividing prefix of (data, fsdp, expert).
    assert spec(("batch", "length"), mesh, shape=(8, 5)) == P(("data", "fsdp", "expert"), None)
    assert spec(("batch", "length"), mesh, shape=(2, 5)) == P("data", None)
    assert spec(("batch", "length"), mesh, shape=(3, 5)) == P(None, None)
    # Without shapes the rule applies as written; unknown names and None replicate.
    assert spec(("norm", None, "whatever"), mesh) == P(None, None, None)
    # One mesh axis at most once per array.
    assert spec(("heads", "mlp"), mesh, shape=(4, 4)) == P("tensor", None)
    with pytest.raises(ValueError, match="do not match shape"):
        spec(("embed",), mesh, shape=(4, 4))


def test_logical_to_sharding_tree_and_shard_params():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    params = {"embed": jnp.ones((256, 64)), "layers": {"w": jnp.ones((2, 64, 128)),
                                                       "norm": jnp.ones((2, 64))},
              "scalar": jnp.float32(1.0)}
    axes = {"embed": ("vocab", "embed"), "layers": {"w": ("layers", "embed", "mlp"),
                                                    "norm": ("layers", "norm")},
            "scalar": ()}
    shardings = sharding.logical_to_sharding(axes, mesh, shapes=params)
    assert jax.tree.structure(shardings) == jax.tree.structure(params)
    placed = sharding.shard_params(params, shardings)
    assert placed["embed"].sharding.spec == P("tensor", "fsdp")
    assert placed["layers"]["w"].sharding.spec == P(None, "fsdp", "tensor")
    # 64/2 rows x 128/2 cols per device.
    assert placed["layers"]["w"].addressable_shards[0].data.shape == (2, 32, 64)
    assert placed["scalar"].sharding.spec == P()
    np.testing.assert_array_equal(np.asarray(placed["embed"]), np.ones((256, 64)))


def test_shard_batch():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    batch = {"tokens": np.zeros((8, 16), np.int32), "mask": np.ones((6, 3), bool)}
    out = sharding.shard_batch(batch, mesh)
    assert out["tokens"].sharding.spec == P(("data", "fsdp", "expert"), None)
    assert out["tokens"].addressable_shards[0].data.shape == (2, 16)
    assert out["mask"].sharding.spec == P("data", None)  # 6 is not divisible by 4


def test_opt_state_sharded_like_params():
    optax = pytest.importorskip("optax")
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    params = {"a": jnp.ones((64, 128)), "b": jnp.ones((64,))}
    axes = {"a": ("embed", "mlp"), "b": ("norm",)}
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    state = opt.init(params)
    shardings = sharding.opt_state_shardings(state, axes, mesh)
    placed = sharding.shard_opt_state(state, axes, mesh)
    adam = placed[1][0]
    assert adam.mu["a"].sharding.spec == P("fsdp", "tensor")
    assert adam.nu["a"].sharding.spec == P("fsdp", "tensor")
    assert adam.count.sharding.spec == P()
    assert jax.tree.structure(shardings) == jax.tree.structure(state)
    # Works on abstract states too (what jit out_shardings needs).
    abstract = jax.eval_shape(opt.init, params)
    assert sharding.opt_state_shardings(abstract, axes, mesh)[1][0].mu["a"].spec == P("fsdp", "tensor")


def test_constrain_inside_jit():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    f = jax.jit(lambda x: sharding.constrain(x * 2, ("batch", None), mesh))
    y = f(jnp.ones((8, 4)))
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P(("data", "fsdp", "expert"), None)), 2)
    assert sharding.constrain(jnp.ones(3), ("batch",), None).shape == (3,)


# ----------------------------------------------------------------------------- with models

def _tiny():
    from rljax import models
    cfg = models.get_preset("tiny")
    return models, cfg, models.init_params(cfg, jax.random.key(0))


def test_load_hf_places_each_param_on_its_rule(tmp_path):
    models, cfg, params = _tiny()
    models.save_hf(cfg, params, str(tmp_path))
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    abstract = jax.eval_shape(lambda k: models.init_params(cfg, k), jax.random.key(0))
    shardings = sharding.logical_to_sharding(models.param_logical_axes(cfg), mesh,
                                             shapes=abstract)
    cfg2, loaded = models.load_hf(str(tmp_path), dtype=jnp.float32, shardings=shardings)
    assert cfg2.num_layers == cfg.num_layers
    flat_loaded = jax.tree_util.tree_flatten_with_path(loaded)[0]
    flat_want = jax.tree.leaves(shardings)
    assert len(flat_loaded) == len(flat_want)
    for (path, x), want in zip(flat_loaded, flat_want):
        assert x.sharding.is_equivalent_to(want, x.ndim), jax.tree_util.keystr(path)
    # Spot checks of the rules themselves: q [L, D, H, Dh] -> (None, fsdp, tensor, None).
    assert loaded["layers"]["q"].sharding.spec == P(None, "fsdp", "tensor", None)
    assert loaded["embed"].sharding.spec == P("tensor", "fsdp")
    np.testing.assert_array_equal(np.asarray(loaded["layers"]["down"]),
                                  np.asarray(params["layers"]["down"]))


def test_sharded_forward_equals_unsharded():
    models, cfg, params = _tiny()
    tokens = jax.random.randint(jax.random.key(1), (8, 12), 0, cfg.vocab_size, jnp.int32)
    mask = jnp.arange(12)[None, :] >= jnp.array([0, 3, 5, 0, 1, 7, 2, 0])[:, None]  # left pad
    ref = models.forward(cfg, params, tokens, attention_mask=mask)
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    shardings = sharding.logical_to_sharding(models.param_logical_axes(cfg), mesh, shapes=params)
    sparams = sharding.shard_params(params, shardings)
    batch = sharding.shard_batch({"tokens": tokens, "mask": mask}, mesh)
    fwd = jax.jit(lambda p, t, m: models.forward(cfg, p, t, attention_mask=m))
    out = fwd(sparams, batch["tokens"], batch["mask"])
    # Really ran distributed: the inputs were split 4-way over the batch, 2-way over heads.
    assert batch["tokens"].addressable_shards[0].data.shape == (2, 12)
    assert sparams["layers"]["q"].addressable_shards[0].data.shape[2] == cfg.num_heads // 2
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)


def test_split_devices_takes_the_last_of_each_process():
    from types import SimpleNamespace
    devices = [SimpleNamespace(id=i, process_index=i // 4) for i in range(8)]
    train, rollout = sharding.split_devices(devices, 4)
    assert [d.id for d in train] == [0, 1, 4, 5] and [d.id for d in rollout] == [2, 3, 6, 7]
    assert sharding.split_devices(devices, 0) == (devices, [])
    with pytest.raises(ValueError, match="does not split evenly over the 2 processes"):
        sharding.split_devices(devices, 3)
    with pytest.raises(ValueError, match=r"leaves a process with 1 device\(s\) none to train"):
        sharding.split_devices([*devices[:4], *devices[4:5]], 4)
    one = jax.devices()   # one process: the last ones, as listed
    assert sharding.split_devices(one, 3) == (one[:-3], one[-3:])
