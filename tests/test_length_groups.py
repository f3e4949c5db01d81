"""Length-grouped micro-batches (``algo.group_by_length``): the plan keeps every real token,
and the grouped update equals the scanned one (float32 summation order), sharded too."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import distributed as dist
from rljax.train.core import length_groups, steps
from rljax.train.phases import grpo

from test_train_steps import (MODEL, V, algo_cfg, assert_same_sharded_update, fresh_state,
                              scanned_grpo_step,
                              sharded_fresh_state)

B, P, N = 8, 40, 20   # P, N > 16: trimming to the 16/32 buckets can happen on both sides


def rollout_batch(tokens, prompt_len, completion_len, rng, p):
    """A GRPO batch in the rollout layout from token ids int [R, P+N] and each row's real
    prompt length (left padding) and completion length (right padding)."""
    r, n = tokens.shape[0], tokens.shape[1] - p
    mask = np.zeros((r, p + n), bool)
    for i in range(r):
        mask[i, p - prompt_len[i]:p + completion_len[i]] = True
    loss_mask = mask[:, p:].copy()
    logps = (-rng.uniform(0.5, 4.0, (r, n)) * loss_mask).astype(np.float32)
    return {"tokens": np.where(mask, tokens, 0).astype(np.int32), "mask": mask,
            "loss_mask": loss_mask, "advantages": rng.normal(size=r).astype(np.float32),
            "old_logps": logps, "sampler_logps": logps, "ref_logps": logps}


def ragged_batch(seed=0):
    """Rows with their own prompt length (left padding) and completion length (right)."""
    rng = np.random.default_rng(seed)
    prompt_len = rng.integers(3, P + 1, B)
    prompt_len[0] = 5                          # a short row, so some micro-batch is trimmed
    completion_len = rng.integers(1, N + 1, B)
    completion_len[0] = 3
    return rollout_batch(rng.integers(4, V, (B, P + N)), prompt_len, completion_len, rng, P)


def test_plan_keeps_every_real_token_and_trims_padding():
    batch = ragged_batch()
    prompt_len, completion_len = length_groups.real_extents(batch["mask"], N)
    np.testing.assert_array_equal(prompt_len, batch["mask"][:, :P].sum(1))
    np.testing.assert_array_equal(completion_len, batch["mask"][:, P:].sum(1))
    plan = length_groups.plan(batch["mask"], N, 4)   # 4 micro-batches of 2 rows
    assert sorted(np.concatenate([mb.rows for mb in plan]).tolist()) == list(range(B))
    real = 0
    for mb in plan:
        part = length_groups.take(batch, mb, N)
        assert part["tokens"].shape == (2, mb.prompt_cols + mb.completion_cols)
        assert part["loss_mask"].shape == part["old_logps"].shape == (2, mb.completion_cols)
        assert part["advantages"].shape == (2,)
        assert mb.prompt_cols in (16, 32, P) and mb.completion_cols in (16, N)
        real += part["mask"].sum()
        np.testing.assert_array_equal(part["loss_mask"], batch["loss_mask"][mb.rows][:, :mb.completion_cols])
    assert real == batch["mask"].sum()          # no real token dropped
    parts = [length_groups.take(batch, mb, N) for mb in plan]
    assert length_groups.token_efficiency(parts) > batch["mask"].mean()
    assert plan[0].prompt_cols + plan[0].completion_cols < P + N   # the short rows were cut
    with pytest.raises(ValueError, match="not divisible"):
        length_groups.plan(batch["mask"], N, 3)   # 8 rows do not split in 3


def assert_planned_update_equals_scanned(algo, batch, prompts: int = 0) -> dict:
    """The host-planned update (``grpo.build_update``, 2 micro-batches) gives the
    same loss, metrics and parameters (SGD: linear in the gradient) as ``steps.update`` over
    the padded micro-batches. Returns its own ``update/*`` metrics."""
    state, opt = fresh_state(lr=1.0, name="sgd", with_ref=True)
    ref_state, ref_m = scanned_grpo_step(MODEL, algo, opt, num_micro=2)(state, batch)
    state, _ = fresh_state(lr=1.0, name="sgd", with_ref=True)
    new_state, m = grpo.build_update(MODEL, algo, opt, num_micro=2, prompts=prompts)(state,
                                                                                     batch)
    own = {k: m.pop(k) for k in list(m) if k.startswith("update/")}
    assert set(m) == set(ref_m)
    for key in ref_m:
        np.testing.assert_allclose(float(m[key]), float(ref_m[key]), rtol=2e-5, atol=1e-7,
                                   err_msg=key)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                         rtol=1e-5, atol=1e-6),
                 new_state.params, ref_state.params)
    assert int(new_state.step) == 1
    return own


def test_grouped_update_equals_scanned_update():
    """``seq-mean-token-sum-norm`` still divides by the full N after trimming."""
    algo = algo_cfg(beta=0.04, loss_agg_mode="seq-mean-token-sum-norm", epsilon_high=0.28)
    batch = ragged_batch(3)   # micro-batches of 16+16 and 40+16 columns (of 40+20)
    batch["old_logps"] = batch["old_logps"] * 0.5
    own = assert_planned_update_equals_scanned(algo, batch)
    assert 0 < own["update/token_efficiency"] <= 1
    assert own["update/shared_prompt"] == 0.0


def test_update_streams_equal_one_stream_and_are_deterministic():
    """``algo.update_streams``: each micro-batch cut into k parts whose gradients concurrent
    streams sum, then added in stream order: the one-stream update up to float32 order, the
    same bits on every run; fewer streams where a micro-batch does not split."""
    batch = ragged_batch(3)
    results = {}
    for k in (1, 2, 4, 4):
        algo = algo_cfg(beta=0.04, group_by_length=True, shared_prompt=False,
                        update_streams=k)
        state, opt = fresh_state(lr=1.0, name="sgd", with_ref=True)
        step = grpo.build_update(MODEL, algo, opt, num_micro=2)
        assert step.update_streams(B) == k   # micro-batches of 4 rows
        new_state, m = step(state, batch)
        if k in results:   # a second run of 4 streams: bit-identical
            jax.tree.map(np.testing.assert_array_equal, new_state.params, results[k][0].params)
        results[k] = (new_state, m)
    ref_state, ref_m = results[1]
    for k in (2, 4):
        new_state, m = results[k]
        assert set(m) == set(ref_m)
        for key in (k for k in ref_m if not k.startswith("update/")):   # finer parts trim more
            np.testing.assert_allclose(float(m[key]), float(ref_m[key]), rtol=2e-5, atol=1e-7,
                                       err_msg=key)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                             rtol=1e-5, atol=1e-6),
                     new_state.params, ref_state.params)
    update = length_groups.GroupedUpdate(opt, None, length_groups.Planner(2, False, 4),
                                         streams=2)
    assert update.update_streams(8) == 1   # one group of 4 per micro-batch: no split
    assert update.update_streams(16) == 2


def test_one_micro_batch_per_stream_is_its_own_total():
    """With one micro-batch per stream, a stream's gradients are its total: no zero total is
    made and no adds compiled. The same gradients as adding them to zeros, and the scanned
    update's result (to float32 rounding)."""
    algo = algo_cfg(beta=0.04, update_streams=2)
    batch = ragged_batch(3)
    state, opt = fresh_state(lr=1.0, name="sgd", with_ref=True)
    ref_state, ref_m = scanned_grpo_step(MODEL, algo, opt, num_micro=1)(state, batch)
    state, _ = fresh_state(lr=1.0, name="sgd", with_ref=True)
    step = grpo.build_update(MODEL, algo, opt, num_micro=1)
    k, parts = length_groups.stream_parts(step.planner, step.streams, batch, N)
    assert k == 2 and len(parts) == 2
    part, index = dist.device_batch(parts[1][1], None), jnp.asarray(1, jnp.int32)
    direct = step._grads(state, part, index, N)
    added = step._micro(state, step._zeros(state, parts[1][1], N), part, index, N)
    # Adding to zeros is exact, but _grads and _micro are two programs, which another CPU type
    # may round differently: float32 rounding of the same gradient sums.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 direct, added)

    new_state, m = step(state, batch)
    for key in (k for k in ref_m if not k.startswith("update/")):
        np.testing.assert_allclose(float(m[key]), float(ref_m[key]), rtol=2e-5, atol=1e-7,
                                   err_msg=key)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                         rtol=1e-5, atol=1e-6),
                 new_state.params, ref_state.params)


@pytest.mark.parametrize("num_micro", [1, 2])   # a stream's one micro-batch, or a total
def test_grouped_update_sharded_matches_unsharded(num_micro):
    assert jax.device_count() == 8, "conftest provides 8 fake CPU devices"
    algo = algo_cfg(beta=0.0)
    batch = ragged_batch(2)   # 16+20 and 40+20 columns
    state, opt = fresh_state(lr=1.0, name="sgd")
    ref_state, m_ref = scanned_grpo_step(MODEL, algo, opt, num_micro=num_micro)(state, batch)

    state, opt, sshard, mesh = sharded_fresh_state()
    step = grpo.build_update(MODEL, algo, opt, num_micro=num_micro,
                                         state_shardings=sshard, mesh=mesh)
    new_state, m = step(state, batch)
    assert_same_sharded_update(new_state, m, ref_state, m_ref, sshard)


def test_group_by_length_is_refused_outside_grpo():
    from rljax import config as config_lib
    from rljax.errors import ConfigError
    cfg = config_lib.default_config()
    cfg.algo.name, cfg.algo.adv_estimator, cfg.algo.group_by_length = "ppo", "gae", True
    with pytest.raises(ConfigError, match="algo.group_by_length"):
        config_lib.validate(cfg)


def test_grouped_training_run_resumes_exactly(tmp_path):
    """The trainer with ``algo.group_by_length``: a run stopped midway and resumed equals a
    straight run (the grouping is a function of the batch alone)."""
    from test_train_loop import DEVICES, StopAfter, comparable, final_params, tiny_cfg
    from rljax.train import run
    from rljax.train.core.metrics import read_metrics
    overrides = {"algo.group_by_length": True, "algo.micro_batch_size": 4, "sft.steps": 0,
                 "steps": 2}
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    assert run.train(tiny_cfg(**overrides), straight, devices=DEVICES) == 0
    assert run.train(tiny_cfg(**overrides), split, devices=DEVICES, stop=StopAfter(1)) == 0
    assert run.train(tiny_cfg(**overrides), split, devices=DEVICES) == 0
    records = read_metrics(straight)
    assert all(0 < r["update/token_efficiency"] <= 1 for r in records if "loss" in r)
    assert comparable(read_metrics(split)) == comparable(records)
    jax.tree.map(np.testing.assert_array_equal, final_params(split), final_params(straight))


def test_grouped_logps_equal_the_padded_pass():
    """Old/reference log-prob pass over trimmed micro-batches: the same [R, N] log-probs, 0
    outside the mask (host array, original row order)."""
    batch = ragged_batch(3)
    batch["temperatures"] = np.full((B, N), 0.7, np.float32)
    state, _ = fresh_state()
    want = np.asarray(steps.build_logps_fn(MODEL, num_micro=2)(state.params, batch))
    for k in (1, 2, 4):   # algo.update_streams: micro-batches in k concurrent parts
        algo = algo_cfg(group_by_length=True, shared_prompt=False, update_streams=k)
        fn = length_groups.build_logps_fn(MODEL, algo_cfg=algo, num_micro=2)
        assert length_groups.stream_count(fn.planner, fn.streams, B) == k
        got = fn(state.params, batch)
        assert isinstance(got, np.ndarray) and got.shape == (B, N)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(got[~batch["loss_mask"]], 0.0)
        assert np.abs(got[batch["loss_mask"]]).min() > 0
