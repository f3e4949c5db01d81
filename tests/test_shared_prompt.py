"""Shared-prompt forward (``algo.shared_prompt``, ``rljax.models.shared_prompt``): each group's
prompt computed once gives the same completion log-probs, gradients and updates as the plain
forward over ``[prompt ++ completion]`` rows (float32 summation order), sharded too."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import models
from rljax.models import shared_prompt
from rljax.train.core import length_groups, steps
from rljax.train.phases import grpo

from test_length_groups import assert_planned_update_equals_scanned, rollout_batch
from test_train_steps import (MODEL, V, algo_cfg, assert_same_sharded_update, fresh_state,
                              scanned_grpo_step,
                              sharded_fresh_state)

G, P, N = 2, 24, 20


def group_batch(num_prompts=4, seed=0):
    """``num_prompts`` prompts of their own length (left padding) x G completions of their own
    length (right padding), rows group-contiguous, in the rollout layout [R, P+N]."""
    rng = np.random.default_rng(seed)
    r = num_prompts * G
    prompt_len = np.repeat(rng.integers(3, P + 1, num_prompts), G)
    completion_len = rng.integers(1, N + 1, r)
    prompts = np.repeat(rng.integers(4, V, (num_prompts, P)), G, axis=0)
    tokens = np.concatenate([prompts, rng.integers(4, V, (r, N))], axis=1)
    return rollout_batch(tokens, prompt_len, completion_len, rng, P)


def test_logps_entropies_and_gradients_equal_the_plain_forward():
    cfg = models.get_preset("tiny")
    params = models.init_params(cfg, jax.random.key(0))
    batch = group_batch(3, seed=1)
    layout = length_groups.shared_layout(batch, N, G)
    temps = np.random.default_rng(2).uniform(0.5, 1.5, (3 * G, N)).astype(np.float32)
    weights = jnp.asarray(np.random.default_rng(3).normal(size=(3 * G, N)), jnp.float32)

    def plain(p):
        t = jnp.concatenate([jnp.ones((3 * G, P)), temps], axis=1)
        lp, ent = models.token_logps(cfg, p, batch["tokens"], batch["mask"], temperature=t,
                                     with_entropy=True, first_scored=P)
        return lp[:, P:], ent[:, P:]

    def shared(p):
        return shared_prompt.completion_logps(
            cfg, p, layout["prompt_tokens"], layout["prompt_mask"], layout["tokens"],
            layout["mask"], temperature=temps, with_entropy=True)

    (lp_a, ent_a), (lp_b, ent_b) = plain(params), shared(params)
    np.testing.assert_allclose(lp_b, lp_a, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(ent_b, ent_a, rtol=1e-5, atol=2e-6)
    assert np.all(np.asarray(lp_b)[~batch["loss_mask"]] == 0)
    assert np.abs(np.asarray(lp_b)[batch["loss_mask"]]).min() > 0
    grads = [jax.grad(lambda p, f=f: (f(p)[0] * weights).sum())(params) for f in (plain, shared)]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6), *grads)


def knapsack_batch(sizes=(1, 4, 2, 3), seed=0):
    """Groups of the given sizes (knapsack allocation), rows shuffled: the rollout layout."""
    rng = np.random.default_rng(seed)
    sizes = np.asarray(sizes)
    owner = rng.permutation(np.repeat(np.arange(sizes.size), sizes))
    prompt_len = rng.integers(3, P + 1, sizes.size)[owner]
    prompt_len[owner == 0] = P   # one prompt without padding
    prompts = rng.integers(4, V, (sizes.size, P))[owner]
    tokens = np.concatenate([prompts, rng.integers(4, V, (owner.size, N))], axis=1)
    return rollout_batch(tokens, prompt_len, rng.integers(1, N + 1, owner.size), rng, P), owner


@pytest.mark.parametrize("local", [False, True])
def test_ragged_groups_equal_the_plain_forward(local):
    """Groups of 1-4 rows in shuffled order, one padding prompt (5 prompt rows for 4), and
    sliding-window layers: log-probs, entropies and gradients of the plain forward."""
    cfg = models.get_preset("tiny")
    if local:
        cfg = cfg.replace(sliding_window=6, layer_types=("sliding_attention",) * cfg.num_layers)
    params = models.init_params(cfg, jax.random.key(0))
    batch, owner = knapsack_batch(seed=1)
    layout = length_groups.ragged_layout(batch, N, prompts=5)
    r = owner.size
    assert layout["prompt_tokens"].shape == (5, P) and layout["tokens"].shape == (r, N)
    np.testing.assert_array_equal(layout["prompt_tokens"][layout["prompt_index"]],
                                  batch["tokens"][:, :P])
    assert np.unique(layout["prompt_index"]).size == 4
    weights = jnp.asarray(np.random.default_rng(3).normal(size=(r, N)), jnp.float32)

    def plain(p):
        lp, ent = models.token_logps(cfg, p, batch["tokens"], batch["mask"],
                                     with_entropy=True, first_scored=P)
        return lp[:, P:], ent[:, P:]

    def ragged(p):
        return shared_prompt.completion_logps(
            cfg, p, layout["prompt_tokens"], layout["prompt_mask"], layout["tokens"],
            layout["mask"], with_entropy=True, prompt_index=layout["prompt_index"])

    (lp_a, ent_a), (lp_b, ent_b) = plain(params), ragged(params)
    np.testing.assert_allclose(lp_b, lp_a, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(ent_b, ent_a, rtol=1e-5, atol=2e-6)
    grads = [jax.grad(lambda p, f=f: (f(p)[0] * weights).sum())(params) for f in (plain, ragged)]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6), *grads)


def test_ragged_layout_refuses_more_prompts_than_it_has_rows_for():
    batch, _ = knapsack_batch()
    assert length_groups.ragged_layout(batch, N, prompts=3) is None   # 4 distinct prompts


def test_ragged_update_equals_scanned_update():
    """The knapsack's update (``prompts``: each micro-batch's prompts once) equals the
    scanned one over the plain rows."""
    algo = algo_cfg(beta=0.04, num_generations=G, shared_prompt=True)
    batch, _ = knapsack_batch(sizes=(3, 1, 2, 4, 2, 4), seed=5)   # 16 rows, 2 micro-batches
    own = assert_planned_update_equals_scanned(algo, batch, prompts=6)
    assert own["update/shared_prompt"] == 1.0


def test_shared_layout_needs_equal_prompts_in_each_group():
    batch = group_batch(2)
    layout = length_groups.shared_layout(batch, N, G)
    assert layout["prompt_tokens"].shape == (2, P) and layout["tokens"].shape == (2 * G, N)
    np.testing.assert_array_equal(layout["prompt_tokens"], batch["tokens"][::G, :P])
    differs = dict(batch, tokens=batch["tokens"].copy())
    differs["tokens"][1, P - 1] += 1            # row 1's prompt is not row 0's
    assert length_groups.shared_layout(differs, N, G) is None
    assert length_groups.shared_layout(batch, N, 3) is None    # 4 rows are not groups of 3


@pytest.mark.parametrize("by_length", [False, True])
def test_shared_prompt_update_equals_scanned_update(by_length):
    algo = algo_cfg(beta=0.04, loss_agg_mode="seq-mean-token-sum-norm", epsilon_high=0.28,
                    num_generations=G, shared_prompt=True, group_by_length=by_length)
    batch = group_batch(4, seed=3)
    batch["old_logps"] = batch["old_logps"] * 0.5
    own = assert_planned_update_equals_scanned(algo, batch)
    assert own["update/shared_prompt"] == 1.0
    assert 0 < own["update/token_efficiency"] <= 1


def test_shared_prompt_update_sharded_matches_unsharded():
    assert jax.device_count() == 8, "conftest provides 8 fake CPU devices"
    algo = algo_cfg(beta=0.0, num_generations=G, shared_prompt=True)
    batch = group_batch(8, seed=2)   # 2 micro-batches of 4 prompts: split over data x fsdp
    state, opt = fresh_state(lr=1.0, name="sgd")
    ref_state, m_ref = scanned_grpo_step(MODEL, algo, opt, num_micro=2)(state, batch)
    state, opt, sshard, mesh = sharded_fresh_state()
    step = grpo.build_update(MODEL, algo, opt, num_micro=2,
                                         state_shardings=sshard, mesh=mesh)
    new_state, m = step(state, batch)
    assert m["update/shared_prompt"] == 1.0
    assert_same_sharded_update(new_state, m, ref_state, m_ref, sshard)


def test_shared_prompt_logps_equal_the_padded_pass():
    batch = group_batch(4, seed=4)
    state, _ = fresh_state()
    want = np.asarray(steps.build_logps_fn(MODEL, num_micro=2)(state.params, batch))
    algo = algo_cfg(num_generations=G, shared_prompt=True)
    got = length_groups.build_logps_fn(MODEL, algo_cfg=algo, num_micro=2)(state.params, batch)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_shared_prompt_training_run_resumes_exactly(tmp_path):
    """The trainer with ``algo.shared_prompt``: every micro-batch computes its prompts once,
    and a run stopped midway and resumed equals a straight run."""
    from test_train_loop import DEVICES, StopAfter, comparable, final_params, tiny_cfg
    from rljax.train import run
    from rljax.train.core.metrics import read_metrics
    overrides = {"algo.shared_prompt": True, "algo.micro_batch_size": 8, "sft.steps": 0,
                 "steps": 2}
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    assert run.train(tiny_cfg(**overrides), straight, devices=DEVICES) == 0
    assert run.train(tiny_cfg(**overrides), split, devices=DEVICES, stop=StopAfter(1)) == 0
    assert run.train(tiny_cfg(**overrides), split, devices=DEVICES) == 0
    records = [r for r in read_metrics(straight) if "loss" in r]
    assert records and all(r["update/shared_prompt"] == 1.0 for r in records)
    assert comparable(read_metrics(split)) == comparable(read_metrics(straight))
    jax.tree.map(np.testing.assert_array_equal, final_params(split), final_params(straight))


def test_dpo_pair_logps_equal_the_plain_forward_over_both_rows():
    """DPO scores chosen and rejected after their shared prompt, computed once: the same
    summed log-probs as ``token_logps`` over the ``pair_sequences`` rows."""
    from rljax.train.phases import dpo
    cfg = models.get_preset("tiny")
    params = models.init_params(cfg, jax.random.key(1))
    batch = group_batch(3, seed=5)   # pairs: rows 2i (chosen) and 2i+1 (rejected)
    layout = length_groups.shared_layout(batch, N, 2)
    pairs = {"prompt_tokens": layout["prompt_tokens"], "prompt_mask": layout["prompt_mask"],
             "chosen_tokens": layout["tokens"][0::2], "chosen_mask": layout["mask"][0::2],
             "rejected_tokens": layout["tokens"][1::2], "rejected_mask": layout["mask"][1::2]}
    seq = dpo.pair_sequences(pairs)
    plain, _ = models.token_logps(cfg, params, seq["tokens"], seq["attention_mask"])
    want = np.where(seq["completion_mask"], plain, 0.0).sum(1)
    got, lengths = dpo.sequence_logps(cfg, params, pairs)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(lengths, np.asarray(seq["completion_mask"]).sum(1))
