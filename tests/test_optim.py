"""Optimizer from config, schedules, non-finite update skipping and its host-side policy."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rljax.config import default_config
from rljax.errors import TrainingDiverged
from rljax.train.core.optim import (NonFiniteGuard, apply_if_finite, decay_mask, make_optimizer,
                               make_schedule)


def opt_cfg(**kw):
    cfg = default_config().optimizer
    cfg.update(kw)
    return cfg


def values(schedule, counts):
    return [float(schedule(c)) for c in counts]


def test_constant_schedule_with_warmup():
    s = make_schedule(opt_cfg(learning_rate=1.0, warmup_steps=4), total_steps=10)
    np.testing.assert_allclose(values(s, range(7)), [0.25, 0.5, 0.75, 1, 1, 1, 1])


def test_linear_and_cosine_decay():
    lin = make_schedule(opt_cfg(learning_rate=1.0, schedule="linear", min_lr_ratio=0.1), 10)
    np.testing.assert_allclose(values(lin, [0, 5, 10, 20]), [1.0, 0.55, 0.1, 0.1], rtol=1e-6)
    cos = make_schedule(opt_cfg(learning_rate=2.0, schedule="cosine", warmup_steps=2), 12)
    np.testing.assert_allclose(values(cos, [0, 1, 2, 7, 12]), [1.0, 2.0, 2.0, 1.0, 0.0],
                               atol=1e-6)


def test_clipping_and_sgd_step():
    tx = make_optimizer(opt_cfg(name="sgd", learning_rate=1.0, max_grad_norm=1.0), 10)
    params = {"w": jnp.zeros(2)}
    updates, _ = tx.update({"w": jnp.array([30.0, 40.0])}, tx.init(params), params)
    np.testing.assert_allclose(updates["w"], [-0.6, -0.8], rtol=1e-6)


def test_weight_decay_skips_norms():
    params = {"layers": {"w": jnp.ones((2, 3)), "attn_norm": jnp.ones((2, 3))}}
    assert decay_mask(params) == {"layers": {"w": True, "attn_norm": False}}
    tx = make_optimizer(opt_cfg(learning_rate=0.1, weight_decay=0.5, max_grad_norm=0.0), 10)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    np.testing.assert_allclose(updates["layers"]["w"], -0.05, rtol=1e-6)
    np.testing.assert_allclose(updates["layers"]["attn_norm"], 0.0)


def test_nonfinite_update_is_skipped_inside_jit():
    tx = make_optimizer(opt_cfg(learning_rate=0.1), 10)
    params = {"w": jnp.ones(3)}
    opt_state = tx.init(params)
    step = jax.jit(lambda p, s, g, l: apply_if_finite(tx, p, s, g, l))

    bad = step(params, opt_state, {"w": jnp.array([1.0, jnp.nan, 0.0])}, jnp.float32(1.0))
    assert bool(bad.skipped)
    for new, old in zip(jax.tree.leaves((bad.params, bad.opt_state)),
                        jax.tree.leaves((params, opt_state))):
        np.testing.assert_array_equal(new, old)
    assert bool(step(params, opt_state, {"w": jnp.ones(3)}, jnp.float32(jnp.inf)).skipped)
    # The test is the global norm: an inf in one leaf of several, and finite gradients whose
    # norm overflows float32, are skipped too.
    two = {"a": jnp.ones(3), "b": jnp.ones(2)}
    inf_leaf = jax.jit(lambda p, s, g: apply_if_finite(tx, p, s, g, jnp.float32(1.0)))(
        two, tx.init(two), {"a": jnp.ones(3), "b": jnp.array([0.0, -jnp.inf])})
    assert bool(inf_leaf.skipped) and not np.isfinite(float(inf_leaf.grad_norm))
    huge = step(params, opt_state, {"w": jnp.full(3, 3e19)}, jnp.float32(1.0))
    assert bool(huge.skipped)
    np.testing.assert_array_equal(huge.params["w"], params["w"])

    good = step(params, opt_state, {"w": jnp.ones(3)}, jnp.float32(1.0))
    assert not bool(good.skipped)
    assert float(good.params["w"][0]) < 1.0
    counts = optax.tree_utils.tree_get_all_with_path(good.opt_state, "count")
    assert counts and all(int(c) == 1 for _, c in counts)


def test_bfloat16_params_with_float32_gradients_keep_their_dtypes():
    # model.dtype=bfloat16 with gradients accumulated in float32: Adam's moments would be
    # promoted to float32 inside the update branch, which lax.cond rejects.
    tx = make_optimizer(opt_cfg(learning_rate=0.1), 10)
    params = {"w": jnp.ones(3, jnp.bfloat16)}
    opt_state = tx.init(params)
    out = jax.jit(lambda p, s, g: apply_if_finite(tx, p, s, g, jnp.float32(1.0)))(
        params, opt_state, {"w": jnp.ones(3, jnp.float32)})
    assert not bool(out.skipped)
    assert float(out.params["w"][0]) < 1.0
    for new, old in zip(jax.tree.leaves((out.params, out.opt_state)),
                        jax.tree.leaves((params, opt_state))):
        assert new.dtype == old.dtype


def test_guard_counts_consecutive_skips():
    guard = NonFiniteGuard(max_consecutive=3)
    for skipped in (True, True, False, True, True):
        guard.update(jnp.array(skipped))
    assert guard.consecutive == 2 and guard.total == 4
    with pytest.raises(TrainingDiverged, match="non-finite for 3 consecutive steps.*step 9"):
        guard.update(True, step=9)
    restored = NonFiniteGuard(3)
    restored.load_state_dict(guard.state_dict())
    assert restored.consecutive == 3 and restored.total == 5


def test_clip_reuses_a_given_norm_and_matches_optax():
    """rljax's clip equals optax.clip_by_global_norm bit for bit, with its own norm or the one
    apply_if_finite passes, and keeps optax's (empty) state, so checkpoints still restore."""
    from rljax.train.core.optim import clip_by_global_norm
    g = {"a": jax.random.normal(jax.random.key(0), (5, 3)) * 3,
         "b": jax.random.normal(jax.random.key(1), (4,))}
    norm = optax.tree.norm(g)
    for max_norm in (1.0, 100.0):   # clipping on, off
        ref, _ = optax.clip_by_global_norm(max_norm).update(g, optax.EmptyState())
        ours = clip_by_global_norm(max_norm)
        assert jax.tree.structure(ours.init(g)) == jax.tree.structure(
            optax.clip_by_global_norm(max_norm).init(g))
        for kwargs in ({}, {"grad_norm": norm}):
            out, _ = ours.update(g, ours.init(g), **kwargs)
            for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
                np.testing.assert_array_equal(x, y)
    # A given norm is what it uses: a larger one scales more.
    out, _ = clip_by_global_norm(1.0).update(g, optax.EmptyState(), grad_norm=2 * norm)
    np.testing.assert_allclose(optax.tree.norm(out), 0.5, rtol=1e-6)
