"""Knapsack allocation of per-prompt samples (rollout.allocation='knapsack') and the group
estimators on groups of different sizes."""
import itertools

import numpy as np
import pytest

from rljax import algorithms
from rljax.data import allocation


def _brute_force(p, budget, lo, hi):
    best, arg = -np.inf, None
    for sizes in itertools.product(range(lo, hi + 1), repeat=len(p)):
        if sum(sizes) != budget:
            continue
        v = allocation.task_value(np.array(sizes), p).sum()
        if v > best:
            best, arg = v, sizes
    return best, arg


def test_task_value_formula():
    # (1 - p^G - (1-p)^G) * p (1-p)^2, written out for one case
    p, g = 0.3, 4
    want = (1 - 0.3 ** 4 - 0.7 ** 4) * 0.3 * 0.7 ** 2
    assert allocation.task_value(g, p) == pytest.approx(want, rel=1e-12)
    assert allocation.task_value(8, 0.0) == 0.0 and allocation.task_value(8, 1.0) == 0.0


@pytest.mark.parametrize("seed", range(6))
def test_knapsack_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 5))
    lo, hi = int(rng.integers(1, 3)), int(rng.integers(3, 7))
    budget = int(rng.integers(n * lo, n * hi + 1))
    p = rng.uniform(0.01, 0.99, n)
    if seed % 2:   # some very easy / very hard prompts
        p[0], p[-1] = 0.98, 0.02
    sizes = allocation.knapsack_allocate(p, budget, lo, hi)
    best, _ = _brute_force(p, budget, lo, hi)
    assert sizes.sum() == budget and sizes.min() >= lo and sizes.max() <= hi
    assert allocation.task_value(sizes, p).sum() == pytest.approx(best, rel=1e-12, abs=1e-15)


def test_knapsack_moves_samples_to_uncertain_prompts():
    sizes = allocation.knapsack_allocate([0.97, 0.5, 0.03, 0.5], 16, 2, 8)
    assert sizes.sum() == 16
    assert sizes[0] == 2 and sizes[1] > 2 and sizes[3] > 2


def test_knapsack_refuses_impossible_budget():
    with pytest.raises(ValueError, match="cannot share"):
        allocation.knapsack_allocate([0.5, 0.5], 20, 2, 8)


def test_expand_groups_pads_with_singletons():
    prompt, group, real = allocation.expand_groups([2, 3], 7)
    np.testing.assert_array_equal(prompt, [0, 0, 1, 1, 1, 1, 1])
    np.testing.assert_array_equal(group, [0, 0, 1, 1, 1, 2, 3])
    np.testing.assert_array_equal(real, [1, 1, 1, 1, 1, 0, 0])


def test_pass_rates_posterior():
    rates = allocation.PassRates()
    rates.observe([7], [3], [4])
    assert rates.means([7, 8]) == pytest.approx([4 / 6, 0.5])
    again = allocation.PassRates()
    again.restore(rates.state())
    assert again.means([7]) == pytest.approx([4 / 6])


# ----------------------------------------------------------------------------- ragged groups

SIZES = [3, 1, 5, 2, 4]


def _ragged_batch(seed=0):
    rng = np.random.default_rng(seed)
    rewards = rng.integers(0, 2, sum(SIZES)).astype(np.float32)
    rewards[3] = 0.5                      # the one-row group
    rewards[4:9] = 1.0                    # a constant group
    rewards += rng.normal(0, 0.1, rewards.shape).astype(np.float32) * (np.arange(15) >= 9)
    ids = np.repeat(np.arange(len(SIZES)), SIZES)
    return rewards, ids


def _per_group(name, rewards, **opts):
    fn = algorithms.get_advantage_estimator(name)
    out, start = [], 0
    for g in SIZES:
        out.append(np.asarray(fn(rewards[start:start + g], g, **opts)))
        start += g
    return np.concatenate(out)


@pytest.mark.parametrize("name,opts", [
    ("grpo", {}), ("grpo", {"scale_rewards": "none"}), ("grpo", {"std_ddof": 0}),
    ("dr_grpo", {}), ("rloo", {})])
def test_group_local_estimators_equal_per_group(name, opts):
    rewards, ids = _ragged_batch()
    got = algorithms.get_advantage_estimator(name)(rewards, 0, group_ids=ids, **opts)
    np.testing.assert_allclose(np.asarray(got), _per_group(name, rewards, **opts),
                               rtol=1e-6, atol=1e-7)
    assert np.all(np.asarray(got)[3:9] == 0.0)   # one-row and constant groups: exactly 0


def test_group_ids_order_free():
    rewards, ids = _ragged_batch(1)
    perm = np.random.default_rng(0).permutation(len(ids))
    fn = algorithms.get_advantage_estimator("grpo")
    a = np.asarray(fn(rewards, 0, group_ids=ids))
    b = np.asarray(fn(rewards[perm], 0, group_ids=ids[perm] * 7 + 3))
    np.testing.assert_allclose(b, a[perm], rtol=1e-6, atol=1e-7)


def _centred(rewards, ids):
    return np.concatenate([rewards[ids == k] - rewards[ids == k].mean()
                           if np.ptp(rewards[ids == k]) else np.zeros((ids == k).sum())
                           for k in range(len(SIZES))])


def test_batch_level_estimators_on_ragged_groups():
    rewards, ids = _ragged_batch(2)
    fn = algorithms.get_advantage_estimator
    c = _centred(rewards, ids)
    np.testing.assert_allclose(
        np.asarray(fn("reinforce_pp_baseline_seq")(rewards, 0, group_ids=ids)),
        c / (c.std() + 1e-6), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        np.asarray(fn("grpo")(rewards, 0, group_ids=ids, scale_rewards="batch")),
        c / (rewards.std(ddof=1) + 1e-6), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        np.asarray(fn("reinforce_pp_seq")(rewards, 0, group_ids=ids)),
        (rewards - rewards.mean()) / (rewards.std() + 1e-6), rtol=1e-5, atol=1e-6)
    mask = np.zeros((len(rewards), 4), bool)
    for i in range(len(rewards)):
        mask[i, :1 + i % 4] = True
    got = np.asarray(fn("reinforce_pp_baseline")(rewards, 0, group_ids=ids, mask=mask))
    want = np.asarray(fn("reinforce_pp")(c.astype(np.float32), 1, mask=mask))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
