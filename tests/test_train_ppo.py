"""Tests for rljax.train.phases.ppo: token rewards and GAE preparation, the PPO step lowers the policy
and value losses on a fixed batch, micro-batching and an 8-device sharded step are exact, a
non-finite gradient skips both models, and a 2-step end-to-end run of the config."""
import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from rljax import algorithms, config, models, sharding
from rljax.train.core import optim
from rljax.train.phases import ppo
from rljax.train.core.state import create_train_state, eval_state_shape, state_shardings

P, N, B, V = 4, 5, 8, 24


def _cfg():
    return models.get_preset("tiny", vocab_size=V, num_layers=1, hidden_size=32,
                             intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16)


def _algo(**kw):
    a = config.default_config().algo
    a.update(dict(name="ppo", adv_estimator="gae", beta=0.05, kl_in_reward=True,
                  kl_estimator="k1", epsilon=0.2, vf_coef=0.5, cliprange_value=0.2,
                  gamma=1.0, lam=0.95))
    a.update(kw)
    return a


def _opt(lr=3e-3):
    o = config.default_config().optimizer
    o.update(dict(name="adam", learning_rate=lr))
    return optim.make_optimizer(o, 100)


def _state(cfg, opt, critic_opt):
    params = models.init_params(cfg, jax.random.key(0))
    critic = models.init_value_params(cfg, jax.random.key(1), from_params=params)
    ref = models.init_params(cfg, jax.random.key(2))
    return create_train_state(params, opt, jax.random.key(3), critic_params=critic,
                              critic_optimizer=critic_opt, ref_params=ref)


def _batch(seed=0):
    """A rollout batch in the steps layout: left-padded prompts, right-padded completions."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, V, size=(B, P + N)).astype(np.int32)
    mask = np.ones((B, P + N), bool)
    plen = rng.integers(1, P + 1, size=B)
    clen = rng.integers(1, N + 1, size=B)
    for i in range(B):
        mask[i, :P - plen[i]] = False
        mask[i, P + clen[i]:] = False
    tokens = np.where(mask, tokens, 0)
    return {"tokens": tokens, "mask": mask, "loss_mask": mask[:, P:].copy(),
            "rewards": rng.integers(0, 2, size=B).astype(np.float32)}


@functools.cache
def _prepare():
    return ppo.build_prepare(_cfg(), _algo())


@functools.cache
def _step(num_micro=1):
    return ppo.build_ppo_step(_cfg(), _algo(), _opt(), _opt(1e-2), num_micro=num_micro)


def _prepared():
    state = _state(_cfg(), _opt(), _opt(1e-2))
    batch, metrics = _prepare()(state, _batch())
    return state, batch, metrics


def test_token_rewards_place_score_on_last_token():
    mask = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], bool)
    kl = jnp.full((3, 4), 0.5)
    r = ppo.token_rewards(jnp.array([1.0, 2.0, 3.0]), mask, kl, beta=0.1)
    np.testing.assert_allclose(r, [[-0.05, -0.05, 0.95, 0.0], [1.95, 0, 0, 0], [0, 0, 0, 0]],
                               atol=1e-6)


def test_prepare_matches_independent_gae():
    cfg = _cfg()
    state, batch, metrics = _prepared()
    raw = _batch()
    m = raw["loss_mask"]
    # Independent path: log_softmax of models.forward, values read one position earlier.
    @jax.jit
    def independent(params, ref_params, critic_params, tokens, mask):
        def logps(p):
            logits = models.forward(cfg, p, tokens, attention_mask=mask)
            lp = jax.nn.log_softmax(logits[:, P - 1:-1], -1)
            return jnp.take_along_axis(lp, tokens[:, P:, None], -1)[..., 0]
        values = models.value_forward(cfg, critic_params, tokens, attention_mask=mask)
        return logps(params), logps(ref_params), values[:, P - 1:-1]

    old, ref, values = independent(state.params, state.ref_params, state.critic_params,
                                   raw["tokens"], raw["mask"])
    np.testing.assert_allclose(np.where(m, batch["old_logps"], 0), np.where(m, old, 0),
                               atol=1e-5)
    np.testing.assert_allclose(np.where(m, batch["old_values"], 0), np.where(m, values, 0),
                               atol=1e-5)
    r = ppo.token_rewards(raw["rewards"], m, old - ref, beta=0.05)
    adv, ret = algorithms.gae(r, values, m, gamma=1.0, lam=0.95)
    np.testing.assert_allclose(batch["returns"], ret, atol=1e-5)
    np.testing.assert_allclose(batch["advantages"], algorithms.masked_whiten(adv, m), atol=1e-4)
    whitened = np.asarray(batch["advantages"])[m]
    assert abs(whitened.mean()) < 1e-5 and abs(whitened.std() - 1) < 1e-3
    assert np.isfinite(float(metrics["kl_ref"]))


def test_ppo_step_lowers_policy_and_value_loss():
    state, batch, _ = _prepared()
    step = _step()
    history = []
    for _ in range(8):
        state, m = step(state, batch)
        history.append(m)
    assert int(history[-1]["skipped"]) == 0 and int(state.step) == 8
    # First update: ratio 1 everywhere, so the clipped surrogate is -mean(A) = 0 (whitened).
    assert abs(float(history[0]["pg_loss"])) < 1e-5
    assert float(history[0]["approx_kl"]) < 1e-8
    assert float(history[-1]["pg_loss"]) < -0.05          # the policy moved along A
    # Value clipping (0.2 around the rollout's values) bounds how far one batch moves V.
    assert float(history[-1]["vf_loss"]) < 0.8 * float(history[0]["vf_loss"])
    assert float(history[-1]["approx_kl"]) > 0


def test_micro_batches_are_exact():
    state, batch, _ = _prepared()
    one = _step()(state, batch)
    state2, batch2, _ = _prepared()
    two = _step(num_micro=2)(state2, batch2)
    for key in ("loss", "pg_loss", "vf_loss", "grad_norm", "critic_grad_norm"):
        np.testing.assert_allclose(float(one[1][key]), float(two[1][key]), rtol=1e-5, atol=1e-7)
    # Adam normalises the step: compare with an absolute tolerance far below one step (3e-3).
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=3e-5),
                 (one[0].params, one[0].critic_params), (two[0].params, two[0].critic_params))


def test_non_finite_skips_both_models():
    state, batch, _ = _prepared()
    bad = dict(batch, returns=batch["returns"].at[0, 0].set(jnp.nan))
    new, m = _step()(state, bad)
    assert int(m["skipped"]) == 1
    ref_state, _, _ = _prepared()
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y),
                 (new.params, new.critic_params), (ref_state.params, ref_state.critic_params))


def test_sharded_step_matches_unsharded():
    cfg = _cfg()
    state, batch, _ = _prepared()
    base_state, base_m = _step()(state, batch)

    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    state, batch, _ = _prepared()
    pshard = sharding.logical_to_sharding(models.param_logical_axes(cfg), mesh,
                                          shapes=state.params)
    cshard = sharding.logical_to_sharding(models.value_param_logical_axes(cfg), mesh,
                                          shapes=state.critic_params)
    shape = eval_state_shape(state.params, _opt(), state.rng, critic_params=state.critic_params,
                             critic_optimizer=_opt(1e-2), ref_params=state.ref_params)
    sshard = state_shardings(shape, pshard, cshard)
    state = jax.device_put(state, sshard)
    step = ppo.build_ppo_step(cfg, _algo(), _opt(), _opt(1e-2), state_shardings=sshard,
                              mesh=mesh)
    new_state, m = step(state, sharding.shard_batch(batch, mesh))
    assert new_state.critic_params["trunk"]["embed"].sharding.spec == \
        sshard.critic_params["trunk"]["embed"].spec
    for key in ("loss", "pg_loss", "vf_loss", "grad_norm", "critic_grad_norm"):
        np.testing.assert_allclose(float(m[key]), float(base_m[key]), rtol=1e-5, atol=1e-6)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y),
                                                         atol=3e-5),
                 (new_state.params, new_state.critic_params),
                 (base_state.params, base_state.critic_params))


@pytest.mark.slow
def test_config_runs_two_steps(tmp_path):
    from rljax.train import run
    from rljax.train.core import metrics

    cfg = config.load_config("configs/ppo_arithmetic.py", [
        "steps=2", "sft.steps=1", "sft.batch_size=8", "rollout.batch_size=8",
        "algo.mini_batch_size=4", "eval.num_examples=8", "eval.batch_size=8",
        "checkpoint.async_save=False", "logging.tensorboard=False", "mesh.data=1"])
    assert run.train(cfg, str(tmp_path), devices=jax.devices()[:1]) == 0
    records = metrics.read_metrics(str(tmp_path / "metrics.jsonl"))
    train = [r for r in records if "vf_loss" in r]
    assert [r["step"] for r in train] == [2, 3]
    for r in train:
        assert np.isfinite(r["vf_loss"]) and np.isfinite(r["pg_loss"]) and "reward/mean" in r
        assert 0.0 <= r["time/host_frac"] <= 1.0
    assert any("eval/accuracy" in r for r in records)


def _stopped_and_resumed(tmp_path, *overrides) -> list[dict]:
    """A 3-iteration PPO run of the shipped config with ``overrides``, straight and stopped
    after the first update then resumed: asserts the two give the same metrics and final
    parameters, returns the straight run's training records."""
    from rljax.train import run
    from rljax.train.core import metrics
    from tests.test_train_loop import StopAfter, comparable, final_params

    cfg = lambda: config.load_config("configs/ppo_arithmetic.py", [  # noqa: E731
        "steps=3", "sft.steps=0", "rollout.batch_size=8", "algo.mini_batch_size=4",
        "eval.num_examples=8", "eval.batch_size=8", "checkpoint.async_save=False",
        "logging.tensorboard=False", "mesh.data=1", *overrides])
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    devices = jax.devices()[:1]
    assert run.train(cfg(), straight, devices=devices) == 0
    assert run.train(cfg(), split, devices=devices, stop=StopAfter(1)) == 0
    assert run.train(cfg(), split, devices=devices) == 0
    records = metrics.read_metrics(straight)
    assert comparable(metrics.read_metrics(split)) == comparable(records)
    jax.tree.map(np.testing.assert_array_equal, final_params(split), final_params(straight))
    return [r for r in records if "vf_loss" in r]


def test_asynchronous_ppo_resumes_exactly(tmp_path):
    """algo.asynchronous with PPO: batches sampled a version ahead, values/GAE and proximal
    log-probs at update time, the behaviour ratio in the loss; stopped after the first update
    and resumed (the batch in flight saved with the checkpoint), equal to the straight run."""
    train = _stopped_and_resumed(tmp_path, "algo.asynchronous=True")
    assert [r["rollout/sample_version"] for r in train] == [0, 0, 1]
    assert all(np.isfinite(r["vf_loss"]) and np.isfinite(r["pg_loss"]) for r in train)


def test_ppo_with_partial_rollouts_trains_carried_samples_and_resumes_exactly(tmp_path):
    """rollout.partial with PPO: groups carried across iterations on the slot engine (the
    pool is the reward rollout's round source), values/GAE and proximal log-probs at update
    time, the behaviour weight in the loss; stopped after one update and resumed (the groups
    in flight saved with the checkpoint), equal to the straight run."""
    train = _stopped_and_resumed(tmp_path, "rollout.engine=slots", "rollout.partial=True",
                                 "rollout.slots=8", "rollout.chunk_steps=2")
    assert len(train) == 3 and train[0]["rollout/carried_groups"] > 0
    assert max(r["rollout/staleness_max"] for r in train) >= 1   # carried samples trained
    assert all("tis_weight" in r and np.isfinite(r["pg_loss"]) for r in train)


def test_ppo_with_hints_and_relift_resumes_exactly(tmp_path):
    """Hints and ReLIFT with PPO: failed groups are re-sampled with a hint prefix (the critic
    values the hinted rows as any other) and ReLIFT's SFT step runs on the policy; stopped
    after one update and resumed (hint fractions and the ReLIFT buffer saved with the phase),
    equal to the straight run."""
    train = _stopped_and_resumed(tmp_path, "algo.hint.mode=fixed", "algo.hint.fraction=0.5",
                                 "algo.relift.every=1", "algo.relift.batch_size=4",
                                 "algo.relift.k_visits=1")
    assert all(r["hint/fraction_hinted"] > 0 and np.isfinite(r["vf_loss"]) for r in train)
    assert any(np.isfinite(r.get("relift/sft_loss", np.nan)) for r in train)


def test_ppo_demonstrations_anchor_the_ratio_at_mu_one(tmp_path):
    """Mixed-policy demonstrations with PPO: the last row of a failed group is the reference
    solution, and ``prepare`` gives it old log-probs 0 (mu = 1) while sampled rows keep the
    policy's."""
    from rljax.train.core import setup

    cfg = config.load_config("configs/ppo_arithmetic.py", [
        "steps=1", "sft.steps=0", "rollout.batch_size=8", "algo.mini_batch_size=4",
        "algo.mixed_policy=True", "checkpoint.async_save=False", "logging.tensorboard=False",
        "mesh.data=1"])
    ctx = setup.build_context(cfg, str(tmp_path), devices=jax.devices()[:1])
    phase = ppo.PPOPhase(ctx, 1)
    state = phase.init_state(create_train_state(ctx.params, phase.optimizer, jax.random.key(0)))
    batch, metrics = phase.rollout(state, 0)
    demo = np.asarray(batch["demo"], bool)
    assert metrics["mixed/demos"] == demo.sum() > 0
    prepared, _ = phase.prepare(state, {k: jnp.asarray(v) for k, v in batch.items()})
    old, m = np.asarray(prepared["old_logps"]), np.asarray(batch["loss_mask"], bool)
    assert np.all(old[demo] == 0) and np.all(old[~demo][m[~demo]] < 0)
    state, _ = phase.iteration(state, 0)   # and it trains


@pytest.mark.parametrize("engine", ["static", "slots"])
def test_ppo_on_tree_rollouts_values_each_leaf(tmp_path, engine):
    """``rollout.tree`` with PPO: a prompt's group is its tree's leaves (shared segments
    decoded once, on the static tree sampler or the slot engine), each leaf a row that the
    critic values and GAE credits; two iterations train."""
    from rljax.train import run
    from rljax.train.core import metrics

    cfg = config.load_config("configs/ppo_arithmetic.py", [
        "steps=2", "sft.steps=0", "rollout.batch_size=8", "algo.mini_batch_size=4",
        "rollout.tree.enabled=True", "rollout.tree.segment_tokens=1",
        "rollout.tree.branching=2", "algo.num_generations=4", f"rollout.engine={engine}",
        "rollout.slots=8", "eval.num_examples=8", "eval.batch_size=8",
        "eval_every=0", "checkpoint.async_save=False", "logging.tensorboard=False",
        "mesh.data=1"])
    assert run.train(cfg, str(tmp_path), devices=jax.devices()[:1]) == 0
    train = [r for r in metrics.read_metrics(str(tmp_path)) if "vf_loss" in r]
    assert len(train) == 2 and all(np.isfinite(r["vf_loss"]) and np.isfinite(r["pg_loss"])
                                   for r in train)
    assert all(r["rollout/decoded_tokens"] < r["rollout/tokens"] for r in train)  # shared
