"""SFT / GRPO update steps: learning on a fixed batch, exact micro-batch accumulation,
non-finite skipping, and sharded == unsharded on 8 fake devices."""
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from rljax import compilation_cache, config as config_lib
from rljax import algorithms, models
from rljax import sharding as shd
from rljax.train.core import optim, steps
from rljax.train.phases import grpo
from rljax.train.core.state import create_train_state, eval_state_shape, state_shardings

B, P, N, V = 8, 6, 5, 40
MODEL = models.get_preset("tiny", num_layers=1, hidden_size=32, intermediate_size=64,
                          num_heads=2, num_kv_heads=1, vocab_size=V)


def algo_cfg(**kw) -> ml_collections.ConfigDict:
    a = config_lib.default_config().algo
    a.update(kw)
    return a


def make_batch(seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(4, V, (B, P + N)).astype(np.int32)
    mask = np.ones((B, P + N), bool)
    mask[:, :2] = False                      # left padding of the prompt
    lengths = rng.integers(1, N + 1, B)
    loss_mask = np.arange(N)[None, :] < lengths[:, None]
    mask[:, P:] = loss_mask
    logps = -rng.uniform(0.5, 4.0, (B, N)).astype(np.float32) * loss_mask
    return {"tokens": tokens, "mask": mask, "loss_mask": loss_mask,
            "advantages": rng.normal(size=B).astype(np.float32),
            "old_logps": logps, "sampler_logps": logps, "ref_logps": logps}


def fresh_state(lr=1e-2, with_ref=False, name="adamw"):
    """A TrainState; ``name="sgd"`` makes params a linear function of the gradient (Adam's
    first step, g / |g|, would amplify rounding noise in near-zero gradients)."""
    params = models.init_params(MODEL, jax.random.PRNGKey(0))
    opt_cfg = config_lib.default_config().optimizer
    opt_cfg.name = name
    opt = optim.make_optimizer(opt_cfg, 100, learning_rate=lr)
    ref = jax.tree.map(jnp.copy, params) if with_ref else None
    return create_train_state(params, opt, jax.random.PRNGKey(1), ref_params=ref), opt


def on_policy(batch, state, algo):
    """Old log-probs from the model itself, as the trainer recomputes them."""
    fn = steps.build_logps_fn(MODEL)
    batch = dict(batch)
    batch["old_logps"] = np.asarray(fn(state.params, batch))
    return batch


def test_sft_step_learns_a_fixed_batch():
    state, opt = fresh_state()
    step = steps.build_sft_step(MODEL, opt)
    batch = make_batch()
    losses = []
    for _ in range(5):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    assert losses[-1] < losses[0] - 0.3
    assert int(state.step) == 5 and int(m["skipped"]) == 0
    assert set(m) >= {"loss", "nll", "grad_norm", "skipped"}


def test_grpo_step_learns_and_reports_metrics():
    algo = algo_cfg(beta=0.05, epsilon_high=0.28, clip_ratio_c=3.0, entropy_coef=0.01,
                    tis_cap=2.0)
    state, opt = fresh_state(lr=3e-3, with_ref=True)
    batch = on_policy(make_batch(), state, algo)
    step = grpo.build_update(MODEL, algo, opt)
    losses = []
    for _ in range(4):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    assert losses[-1] < losses[0]
    for key in ("pg_loss", "clipfrac_low", "clipfrac_high", "approx_kl", "kl_ref", "entropy",
                "tis_weight", "grad_norm"):
        assert np.isfinite(m[key]), key
    assert m["kl_ref"] > 0 and m["approx_kl"] > 0


@pytest.mark.parametrize("policy_loss,extra", [
    ("gspo", dict(importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4,
                  loss_agg_mode="seq-mean-token-mean")),
    ("cispo", dict(epsilon_high=0.28, loss_agg_mode="seq-mean-token-sum-norm")),
])
def test_policy_loss_variants_take_a_finite_step(policy_loss, extra):
    algo = algo_cfg(policy_loss=policy_loss, beta=0.0, **extra)
    state, opt = fresh_state()
    before = jax.tree.map(np.asarray, state.params)
    step = grpo.build_update(MODEL, algo, opt)
    state, m = step(state, make_batch())
    assert int(m["skipped"]) == 0 and np.isfinite(m["loss"])
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(np.asarray(a) - b).max(),
                                         state.params, before))
    assert max(moved) > 0


def test_gspo_clip_range_applies_from_default_keys():
    # algo.policy_loss='gspo' with algo.epsilon / epsilon_high unset: the paper's 3e-4 / 4e-4
    # reach the loss (they used to be overridden by PPO's 0.2). Per token, with the
    # length-normalised sequence ratio s_i = exp(mean_t(log pi - log pi_old)):
    #     l_t = max(-A_i s_i, -A_i clip(s_i, 1 - 3e-4, 1 + 4e-4))
    cfg = config_lib.load_config(None, ["algo.policy_loss=gspo"])
    assert (cfg.algo.epsilon, cfg.algo.epsilon_high) == (3e-4, 4e-4)
    opts = grpo.policy_loss_options(cfg.algo)
    assert opts["epsilon"] == 3e-4 and opts["epsilon_high"] == 4e-4
    # Unvalidated config (keys None): the loss's own defaults, the same numbers.
    assert "epsilon" not in grpo.policy_loss_options(algo_cfg(policy_loss="gspo"))
    rng = np.random.default_rng(0)
    mask = np.arange(N)[None, :] < rng.integers(1, N + 1, B)[:, None]
    old = -rng.uniform(0.5, 3.0, (B, N)).astype(np.float32)
    # sequence log-ratios inside (-3e-4, 4e-4), between 4e-4 and 0.2, and below -3e-4
    seq_lr = np.array([1e-4, -2e-4, 3e-3, 0.05, -1e-3, -0.02, 5e-4, 0.0], np.float32)
    logps = (old + seq_lr[:, None]) * mask
    old = old * mask
    adv = np.array([1.0, -1.0, 1.0, -1.0, -1.0, 1.0, 0.5, 2.0], np.float32)
    loss, metrics = algorithms.get_policy_loss("gspo")(jnp.asarray(logps), jnp.asarray(old),
                                                       jnp.asarray(adv), jnp.asarray(mask),
                                                       **opts)
    lr = np.where(mask, logps.astype(np.float64) - old, 0.0).sum(1) / mask.sum(1)
    s = np.exp(lr)
    per_seq = np.maximum(-adv * s, -adv * np.clip(s, 1 - 3e-4, 1 + 4e-4))
    np.testing.assert_allclose(np.asarray(loss), np.where(mask, per_seq[:, None], 0.0),
                               rtol=1e-5, atol=1e-6)
    clipped_high = (s > 1 + 4e-4) & (adv > 0)
    assert clipped_high.sum() == 2  # rows 2 and 6; with epsilon=0.2 none would clip
    np.testing.assert_allclose(float(metrics["clipfrac_high"][0]),
                               float((mask * clipped_high[:, None]).sum()))
    # Keys the user sets win over the loss's defaults.
    mine = config_lib.load_config(None, ["algo.policy_loss=gspo", "algo.epsilon=1e-3",
                                         "algo.epsilon_high=2e-3"])
    assert grpo.policy_loss_options(mine.algo)["epsilon_high"] == 2e-3


def test_micro_batch_split_does_not_change_the_update():
    # seq-mean-token-mean is the mode where naive per-micro-batch means would differ most.
    algo = algo_cfg(beta=0.0, loss_agg_mode="seq-mean-token-mean")
    batch = make_batch(1)
    results = []
    for num_micro in (1, 2, 4):
        state, opt = fresh_state(lr=1.0, name="sgd")
        state, m = grpo.build_update(MODEL, algo, opt, num_micro=num_micro)(state, batch)
        results.append((jax.tree.map(np.asarray, state.params), float(m["loss"]),
                        float(m["grad_norm"])))
    for params, loss, gnorm in results[1:]:
        np.testing.assert_allclose(loss, results[0][1], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(gnorm, results[0][2], rtol=1e-5)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                     params, results[0][0])


def test_grpo_step_without_old_logps_uses_its_own():
    """One update per rollout: no ``old_logps`` in the batch -> the step's own log-probs
    (stop_gradient) are the old ones; same update as with recomputed old log-probs, and the
    sampler-vs-trainer diff metrics come from the step (max combined across micro-batches)."""
    algo = algo_cfg(beta=0.0, epsilon_high=0.28)
    state0, opt = fresh_state(lr=1.0, name="sgd")
    batch = on_policy(make_batch(2), state0, algo)
    batch["sampler_logps"] = batch["old_logps"] + 0.01 * np.arange(N, dtype=np.float32)
    real = batch["mask"][:, -N:]
    diff = np.abs(batch["old_logps"] - batch["sampler_logps"])[real]
    ref_state, ref_m = grpo.build_update(MODEL, algo, opt)(state0, batch)
    ref_params = jax.tree.map(np.asarray, ref_state.params)
    no_old = {k: v for k, v in batch.items() if k != "old_logps"}
    for num_micro in (1, 2):
        state, _ = fresh_state(lr=1.0, name="sgd")
        state, m = grpo.build_update(MODEL, algo, opt, num_micro=num_micro)(state, no_old)
        np.testing.assert_allclose(float(m["loss"]), float(ref_m["loss"]), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(float(m["grad_norm"]), float(ref_m["grad_norm"]), rtol=1e-4)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                     jax.tree.map(np.asarray, state.params), ref_params)
        np.testing.assert_allclose(float(m["rollout/logp_diff_mean"]), diff.mean(), atol=1e-5)
        np.testing.assert_allclose(float(m["rollout/logp_diff_max"]), diff.max(), atol=1e-5)
    assert "rollout/logp_diff_mean" not in ref_m


def test_training_programs_compile_at_o1_on_cpu_and_match_o3(monkeypatch):
    """On CPU the update compiles with LLVM -O1 (``training_compiler_options``): three GRPO
    updates over two micro-batches leave the params of the -O3 default, to float32 rounding
    (SGD, as in the tests above: Adam's first steps amplify rounding noise)."""
    monkeypatch.setenv("XLA_FLAGS", "")   # read per call: the suite's -O0 flag would win
    assert compilation_cache.training_compiler_options() == {"xla_backend_optimization_level": 1}
    algo = algo_cfg(beta=0.0)
    batch = make_batch(3)

    def three_updates():
        state, opt = fresh_state(lr=1.0, name="sgd")
        step = grpo.build_update(MODEL, algo, opt, num_micro=2)
        for _ in range(3):
            state, _ = step(state, batch)
        return jax.tree.map(np.asarray, state.params)

    at_o1 = three_updates()
    monkeypatch.setattr(compilation_cache, "training_compiler_options", lambda: None)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 three_updates(), at_o1)
    # The options do reach the compiler: a bad one fails the compile.
    monkeypatch.setattr(compilation_cache, "training_compiler_options",
                        lambda: {"xla_backend_optimization_level": "not-a-level"})
    with pytest.raises(Exception, match="xla_backend_optimization_level"):
        three_updates()


def test_non_finite_update_is_skipped():
    algo = algo_cfg(beta=0.0)
    state, opt = fresh_state()
    before = jax.tree.map(np.asarray, state.params)
    batch = make_batch()
    batch["advantages"] = np.full(B, np.nan, np.float32)
    state, m = grpo.build_update(MODEL, algo, opt)(state, batch)
    assert int(m["skipped"]) == 1
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.params), before)


def test_sharded_step_matches_unsharded():
    assert jax.device_count() == 8, "conftest provides 8 fake CPU devices"
    algo = algo_cfg(beta=0.05)
    batch = make_batch(2)
    state, opt = fresh_state(lr=1.0, with_ref=True, name="sgd")
    ref_state, m_ref = grpo.build_update(MODEL, algo, opt, num_micro=2)(state, batch)

    state, opt, sshard, mesh = sharded_fresh_state(with_ref=True)
    assert state.params["layers"]["q"].sharding.spec != jax.sharding.PartitionSpec()
    step = grpo.build_update(MODEL, algo, opt, num_micro=2, state_shardings=sshard, mesh=mesh)
    new_state, m = step(state, batch)
    assert_same_sharded_update(new_state, m, ref_state, m_ref, sshard)


def sharded_fresh_state(with_ref=False):
    """``fresh_state(lr=1.0, name="sgd")`` placed on a data x fsdp x tensor = 2x2x2 mesh:
    (state, optimizer, state shardings, mesh)."""
    mesh = shd.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    shapes = jax.eval_shape(lambda: models.init_params(MODEL, jax.random.PRNGKey(0)))
    pshard = shd.logical_to_sharding(models.param_logical_axes(MODEL), mesh, shapes=shapes)
    state, opt = fresh_state(lr=1.0, with_ref=with_ref, name="sgd")
    shape = eval_state_shape(state.params, opt, state.rng, ref_params=state.ref_params)
    sshard = state_shardings(shape, pshard)
    return jax.device_put(state, sshard), opt, sshard, mesh


def scanned_grpo_step(model_cfg, algo, opt, num_micro=1):
    """The GRPO loss as one jitted program scanning its micro-batches (``steps.update``): the
    reference the host-planned update (``grpo.build_update``) is compared with."""
    loss_fn = grpo.grpo_loss_fn(model_cfg, algo)
    return jax.jit(lambda state, batch: steps.update(opt, loss_fn, state, batch, num_micro))


def assert_same_sharded_update(new_state, m, ref_state, m_ref, sshard):
    """A sharded step's result kept its shardings and equals the unsharded one."""
    assert new_state.params["embed"].sharding == sshard.params["embed"]
    np.testing.assert_allclose(float(m["loss"]), float(m_ref["loss"]), rtol=1e-5, atol=1e-7)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                         rtol=1e-5, atol=1e-6),
                 new_state.params, ref_state.params)
