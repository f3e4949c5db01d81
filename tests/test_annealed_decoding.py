"""Exploratory annealed decoding: per-position temperature schedules in the sampler, and
training log-probs / importance ratios at the temperature each token was sampled at."""
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rljax import config as config_lib
from rljax import models, sampling
from rljax.errors import ConfigError
from rljax.train import run
from rljax.train.core.metrics import read_metrics
from rljax.train.core.state import create_train_state
from rljax.train.phases.grpo import build_update
from rljax.train.core.steps import build_logps_fn, completion_logps

N = 8


@pytest.fixture(scope="module")
def model():
    cfg = models.get_preset("tiny", num_layers=1, hidden_size=32, intermediate_size=64,
                            num_heads=2, num_kv_heads=1, vocab_size=48)
    return cfg, models.init_params(cfg, jax.random.PRNGKey(0))


def prompts():
    toks = np.array([[0, 0, 5, 6, 7], [9, 10, 11, 12, 13]], np.int32)
    return toks, toks != 0


def fresh_state(params, opt):
    """A train state over a copy of ``params`` (the step donates its state)."""
    return create_train_state(jax.tree.map(jnp.copy, params), opt, jax.random.PRNGKey(0))


# ----------------------------------------------------------------------------- schedules

def test_schedules_follow_their_written_out_formulas():
    start, end, span, n = 1.5, 0.5, 6, 10
    lin = sampling.temperature_schedule("linear", start, end, span, n)
    cos = sampling.temperature_schedule("cosine", start, end, span, n)
    exp = sampling.temperature_schedule("exp", start, end, span, n)
    const = sampling.temperature_schedule("constant", start, end, span, n)
    d = span / math.log(1 + start - end)
    for t in range(n):
        u = min(t / span, 1.0)
        assert lin[t] == pytest.approx(start + (end - start) * u, abs=1e-6)
        assert cos[t] == pytest.approx(end + (start - end) * (1 + math.cos(math.pi * u)) / 2,
                                       abs=1e-6)
        assert exp[t] == pytest.approx(max(1 + start - math.exp(min(t, span) / d), end),
                                       abs=1e-6)
        assert const[t] == start
    for s in (lin, cos, exp):   # start at `start`, reach `end` at `tokens`, stay there
        assert s[0] == pytest.approx(start) and np.all(s[span:] == np.float32(end))
        assert np.all(np.diff(s) <= 1e-7)   # annealing: never heats up
    # tokens=0 means the whole completion
    np.testing.assert_allclose(sampling.temperature_schedule("linear", 2.0, 1.0, 0, 5),
                               [2.0, 1.8, 1.6, 1.4, 1.2], atol=1e-6)


@pytest.mark.parametrize("start,end", [(0.0, 0.5), (1.0, -0.1)])
def test_schedule_rejects_non_positive_temperatures(start, end):
    with pytest.raises(ValueError, match="> 0"):
        sampling.temperature_schedule("linear", start, end, 0, 4)


# ----------------------------------------------------------------------------- sampler

@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 0.9)])
def test_constant_schedule_equals_the_scalar_temperature_sampler_exactly(model, top_k, top_p):
    cfg, params = model
    toks, mask = prompts()
    kw = dict(rng=jax.random.PRNGKey(3), max_new_tokens=N, top_k=top_k, top_p=top_p,
              eos_id=2, num_samples=3)
    scalar = sampling.generate(cfg, params, toks, mask, temperature=0.7, **kw)
    sched = sampling.generate(cfg, params, toks, mask, temperature=1.0,
                              temperatures=np.full(N, 0.7, np.float32), **kw)
    for name in ("tokens", "mask", "lengths", "truncated"):
        np.testing.assert_array_equal(np.asarray(getattr(scalar, name)),
                                      np.asarray(getattr(sched, name)), err_msg=name)
    # Two programs: XLA:CPU's default build gives equal log-probs, the test suite's -O0 build
    # (tests/conftest.py) rounds one of 48 differently by one float32 ulp.
    np.testing.assert_allclose(np.asarray(scalar.logps), np.asarray(sched.logps), rtol=1e-6,
                               atol=0)


@pytest.mark.parametrize("engine,streams", [(False, 1), (False, 2), (True, 1)],
                         ids=["static", "static_streams", "slots"])
def test_a_schedule_per_row_samples_each_row_as_its_own_schedule_does(model, engine, streams):
    """temperatures [R, N] (VinePPO's forks continue a scheduled completion at different
    positions): row r is the row the batch gives under row r's schedule [N] alone (with
    decode streams, each stream's rows keep their own)."""
    cfg, params = model
    toks, mask = prompts()
    own = np.stack([sampling.temperature_schedule("linear", 2.0, 0.4, N - 2, N),
                    np.full(N, 0.5, np.float32), np.full(N, 1.5, np.float32),
                    sampling.temperature_schedule("cosine", 1.5, 0.3, 0, N)])

    def sample(temps):
        kw = dict(rng=jax.random.PRNGKey(5), max_new_tokens=N, eos_id=2, num_samples=2,
                  temperatures=temps)
        if engine:
            return sampling.engine.generate(cfg, params, toks, mask, slots=3, chunk_steps=3,
                                            **kw)[0]
        return sampling.generate(cfg, params, toks, mask, streams=streams, **kw)
    rows = sample(own)
    for r in range(4):
        alone = sample(own[r])
        np.testing.assert_array_equal(np.asarray(rows.tokens[r]), np.asarray(alone.tokens[r]))
        np.testing.assert_allclose(np.asarray(rows.logps[r]), np.asarray(alone.logps[r]),
                                   rtol=1e-5, atol=1e-6)


def reference_logps(cfg, params, toks, mask, out, temps, g):
    """Written-out reference: one full forward over prompt ++ completion, then
    log_softmax(logits[t-1] / temps[t]) at each sampled token."""
    seq = np.concatenate([np.repeat(toks, g, 0), np.asarray(out.tokens)], 1)
    seq_mask = np.concatenate([np.repeat(mask, g, 0), np.asarray(out.mask)], 1)
    logits = np.asarray(models.forward(cfg, params, jnp.asarray(seq),
                                       attention_mask=jnp.asarray(seq_mask)), np.float64)
    p = toks.shape[1]
    ref = np.zeros(out.tokens.shape)
    for t in range(out.tokens.shape[1]):
        z = logits[:, p + t - 1] / float(temps[t])
        z = z - z.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        ref[:, t] = np.take_along_axis(logp, seq[:, p + t][:, None], -1)[:, 0]
    return np.where(np.asarray(out.mask), ref, 0.0), seq, seq_mask


def test_sampler_logps_are_full_forward_logps_at_each_tokens_temperature(model):
    cfg, params = model
    toks, mask = prompts()
    temps = sampling.temperature_schedule("linear", 2.0, 0.4, N - 2, N)
    out = sampling.generate(cfg, params, toks, mask, rng=jax.random.PRNGKey(1),
                            max_new_tokens=N, eos_id=2, num_samples=2, temperatures=temps)
    ref, seq, seq_mask = reference_logps(cfg, params, toks, mask, out, temps, 2)
    np.testing.assert_allclose(np.asarray(out.logps), ref, atol=2e-5)
    # The trainer's completion log-probs with the per-token temperatures carried in the batch.
    batch = {"tokens": jnp.asarray(seq), "mask": jnp.asarray(seq_mask),
             "loss_mask": jnp.asarray(out.mask),
             "temperatures": jnp.broadcast_to(jnp.asarray(temps), out.tokens.shape)}
    got, _ = completion_logps(cfg, params, batch)
    np.testing.assert_allclose(np.where(out.mask, np.asarray(got), 0.0), ref, atol=2e-5)
    # ... and not at a single temperature (the check can fail).
    flat, _ = completion_logps(cfg, params,
                               {k: v for k, v in batch.items() if k != "temperatures"})
    assert np.abs(np.where(out.mask, np.asarray(flat), 0.0) - ref).max() > 1e-2


def test_first_update_ratio_is_one_with_annealing(model):
    """old log-probs (the rollout's forward) and the update's own, both at per-token
    temperatures: ratio 1 to float error, nothing clipped; the sampler agrees to float error."""
    cfg, params = model
    toks, mask = prompts()
    g = 4
    temps = sampling.temperature_schedule("exp", 1.5, 0.5, N - 3, N)
    out = sampling.generate(cfg, params, toks, mask, rng=jax.random.PRNGKey(7),
                            max_new_tokens=N, eos_id=2, num_samples=g, temperatures=temps)
    seq = np.concatenate([np.repeat(toks, g, 0), np.asarray(out.tokens)], 1)
    seq_mask = np.concatenate([np.repeat(mask, g, 0), np.asarray(out.mask)], 1)
    batch = {"tokens": seq, "mask": seq_mask, "loss_mask": np.asarray(out.mask),
             "temperatures": np.broadcast_to(temps, out.tokens.shape).copy(),
             "sampler_logps": np.asarray(out.logps),
             "advantages": np.linspace(-1, 1, 2 * g).astype(np.float32)}
    batch["old_logps"] = build_logps_fn(cfg, num_micro=2)(params, batch)
    np.testing.assert_allclose(np.asarray(batch["old_logps"]), np.asarray(out.logps),
                               atol=2e-5)
    algo = config_lib.default_config().algo
    algo.beta, algo.epsilon, algo.epsilon_high = 0.0, 0.2, 0.2
    opt = optax.sgd(1e-2)
    state = fresh_state(params, opt)
    step = build_update(cfg, algo, opt, temperature=1.0, num_micro=2)
    _, m = step(state, batch)
    # Two programs (the old-log-prob pass and the update's forward): on some CPU types they round
    # a log-prob differently by a few float32 ulps (|log p| < 20, so < 1e-5 apart); approx_kl is
    # then ~(1e-5)^2 / 2, far below 1e-9 and far below the off-policy control's 1e-3.
    assert float(m["approx_kl"]) < 1e-9
    assert float(m["clipfrac_low"]) == 0.0 and float(m["clipfrac_high"]) == 0.0
    # Control: the same rollout scored at temperature 1 is off-policy (ratio != 1).
    state = fresh_state(params, opt)
    plain = {k: v for k, v in batch.items() if k != "temperatures"}
    _, m = step(state, plain)
    assert float(m["approx_kl"]) > 1e-3


# ----------------------------------------------------------------------------- config / loop

@pytest.mark.parametrize("key,value", [("start", 0.0), ("end", -0.5)])
def test_non_positive_schedule_temperature_is_a_config_error_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=f"rollout.temperature_schedule.{key}"):
        config_lib.load_config(None, [f"--config.rollout.temperature_schedule.name=linear",
                                      f"--config.rollout.temperature_schedule.{key}={value}"])


def test_grpo_run_with_annealing_scores_tokens_at_their_temperature(tmp_path):
    """End to end through the controller: the rollout carries the schedule into the batch, so
    the trainer's log-probs match the sampler's (logp_diff at float error) and the first
    update's ratio is 1 (num_iterations=2: old log-probs from a separate forward)."""
    cfg = config_lib.default_config()
    cfg.update_from_flattened_dict({
        "steps": 2, "eval_every": 0, "checkpoint_every": 0, "tokenizer.kind": "char",
        "data.max_prompt_length": 8, "rollout.batch_size": 8, "rollout.max_new_tokens": 4,
        "algo.num_generations": 4, "algo.beta": 0.0, "algo.num_iterations": 2,
        "optimizer.learning_rate": 1e-3, "eval.num_examples": 4, "eval.batch_size": 4,
        "logging.tensorboard": False, "checkpoint.async_save": False,
        "rollout.temperature_schedule.name": "linear",
        "rollout.temperature_schedule.start": 2.0, "rollout.temperature_schedule.end": 0.5,
    })
    cfg.model.overrides = {"num_layers": 1, "hidden_size": 32, "intermediate_size": 64,
                           "num_heads": 2, "num_kv_heads": 1}
    cfg.data.kwargs = {"digits": 1, "eval_examples": 4}
    config_lib.validate(cfg)
    assert run.train(cfg, str(tmp_path), devices=jax.devices()[:1]) == 0
    rl = [r for r in read_metrics(str(tmp_path)) if "reward/mean" in r]
    assert len(rl) == 2
    for r in rl:
        assert r["rollout/logp_diff_max"] < 1e-4, r


@pytest.mark.parametrize("overrides,needle", [
    (["algo.name=rm"], "not 'rm'"),
    (["algo.name=dpo", "algo.online=True", "data.pairs=step_mc"],
     "rollout.temperature_schedule.name='constant'"),
    (["rollout.temperature_schedule.start=0.5", "rollout.temperature_schedule.end=1.0"],
     "start >= end"),
])
def test_schedule_combinations_it_cannot_serve_are_config_errors(overrides, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        config_lib.load_config(None, ["--config.rollout.temperature_schedule.name=exp"]
                               + [f"--config.{o}" for o in overrides])


def test_schedule_under_a_sharded_mesh_reports_logps_at_each_tokens_temperature(model):
    """8 fake devices (data 2 x fsdp 2 x tensor 2): the schedule array is replicated into the
    sharded decode loop and the logps still match the written-out reference."""
    from rljax import sharding
    cfg, params = model
    toks, mask = np.tile(prompts()[0], (2, 1)), np.tile(prompts()[1], (2, 1))
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    shardings = sharding.logical_to_sharding(models.param_logical_axes(cfg), mesh, shapes=params)
    sparams = sharding.shard_params(jax.tree.map(jnp.copy, params), shardings)
    temps = sampling.temperature_schedule("cosine", 1.8, 0.5, 5, N)
    out = sampling.generate(cfg, sparams, toks, mask, rng=jax.random.PRNGKey(2),
                            max_new_tokens=N, eos_id=2, num_samples=2, temperatures=temps,
                            mesh=mesh)
    ref, _, _ = reference_logps(cfg, params, toks, mask, out, temps, 2)
    np.testing.assert_allclose(np.asarray(out.logps), ref, atol=2e-5)


def test_ppo_and_distillation_score_tokens_at_their_schedule_temperature(tmp_path):
    """A schedule with PPO (its ``prepare`` scores the batch at each token's temperature, so
    the old log-probs are the sampler's) and with distillation (GRPO's update: the run's
    logp_diff at float error)."""
    import jax.numpy as jnp

    from rljax.train.core import setup
    from rljax.train.core.state import create_train_state
    from rljax.train.phases import ppo
    from test_distill import distill_cfg, write_teacher_workdir
    schedule = ["rollout.temperature_schedule.name=linear",
                "rollout.temperature_schedule.start=2.0", "rollout.temperature_schedule.end=0.5"]
    cfg = config_lib.load_config("configs/ppo_arithmetic.py", [
        "sft.steps=0", "rollout.batch_size=8", "algo.mini_batch_size=4",
        "logging.tensorboard=False", "mesh.data=1", *schedule])
    ctx = setup.build_context(cfg, str(tmp_path / "ppo"), devices=jax.devices()[:1])
    phase = ppo.PPOPhase(ctx, 1)
    state = phase.init_state(create_train_state(ctx.params, phase.optimizer, jax.random.key(0)))
    batch, _ = phase.rollout(state, 0)
    prepared, _ = phase.prepare(state, {k: jnp.asarray(v) for k, v in batch.items()})
    m = np.asarray(batch["loss_mask"], bool)
    assert np.abs(np.asarray(prepared["old_logps"]) - batch["sampler_logps"])[m].max() < 1e-4
    write_teacher_workdir(tmp_path / "teacher", seed=7)
    cfg = distill_cfg(str(tmp_path / "teacher"), **{
        "steps": 1, "sft.steps": 0, "rollout.temperature_schedule.name": "linear",
        "rollout.temperature_schedule.start": 2.0, "rollout.temperature_schedule.end": 0.5})
    assert run.train(config_lib.validate(cfg), str(tmp_path / "distill"),
                     devices=jax.devices()[:1]) == 0
    (r,) = [r for r in read_metrics(str(tmp_path / "distill")) if "reward/mean" in r]
    assert r["rollout/logp_diff_max"] < 1e-4 and np.isfinite(r["distill/reverse_kl"])
