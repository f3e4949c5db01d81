"""rljax.algorithms advantages, GAE and shaping helpers against NumPy written from the papers."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import algorithms as A

RTOL, ATOL = 1e-5, 1e-6


def _rewards(rng, n, kind="normal"):
    if kind == "binary":
        return rng.integers(0, 2, size=n).astype(np.float32)
    return rng.normal(size=n).astype(np.float32)


def np_grpo(r, G, scale, eps=1e-6, ddof=1):
    r = r.astype(np.float64)
    out = np.zeros_like(r)
    batch_std = np.std(r, ddof=ddof) if r.size > ddof else 0.0
    for s in range(0, len(r), G):
        grp = r[s:s + G]
        if np.all(grp == grp[0]):
            continue
        mean = sum(grp) / G
        std = {"group": np.std(grp, ddof=ddof) if G > ddof else 0.0, "batch": batch_std,
               "none": None}[scale]
        for i in range(G):
            out[s + i] = (grp[i] - mean) if std is None else (grp[i] - mean) / (std + eps)
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("kind", ["normal", "binary"])
def test_grpo_matches_numpy(scale, kind):
    rng = np.random.default_rng(0)
    G = 4
    r = _rewards(rng, 6 * G, kind)
    r[:G] = 0.7  # one constant group
    got = A.get_advantage_estimator("grpo")(jnp.asarray(r), G, scale_rewards=scale)
    np.testing.assert_allclose(np.asarray(got), np_grpo(r, G, scale), rtol=RTOL, atol=ATOL)
    assert np.all(np.asarray(got)[:G] == 0.0)


def test_grpo_population_std_option():
    rng = np.random.default_rng(1)
    r = _rewards(rng, 15)
    got = A.grpo_advantages(jnp.asarray(r), 5, std_ddof=0)
    np.testing.assert_allclose(np.asarray(got), np_grpo(r, 5, "group", ddof=0), rtol=RTOL,
                               atol=ATOL)


def test_dr_grpo_rloo_match_numpy():
    rng = np.random.default_rng(2)
    G = 5
    r = _rewards(rng, 4 * G)
    dr = np.zeros(len(r))
    rl = np.zeros(len(r))
    for s in range(0, len(r), G):
        grp = r[s:s + G].astype(np.float64)
        for i in range(G):
            dr[s + i] = grp[i] - grp.mean()
            rl[s + i] = grp[i] - (grp.sum() - grp[i]) / (G - 1)
    np.testing.assert_allclose(np.asarray(A.get_advantage_estimator("dr_grpo")(r, G)), dr,
                               rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(A.get_advantage_estimator("rloo")(r, G)), rl,
                               rtol=RTOL, atol=ATOL)


def test_reinforce_pp_seq_variants_match_numpy():
    rng = np.random.default_rng(3)
    G = 4
    r = _rewards(rng, 5 * G).astype(np.float64)
    eps = 1e-6
    want = (r - r.mean()) / (r.std() + eps)
    got = A.get_advantage_estimator("reinforce_pp_seq")(jnp.asarray(r, jnp.float32), G)
    np.testing.assert_allclose(np.asarray(got), want, rtol=RTOL, atol=ATOL)
    c = np.concatenate([r[s:s + G] - r[s:s + G].mean() for s in range(0, len(r), G)])
    want_b = (c - c.mean()) / (c.std() + eps)
    got_b = A.get_advantage_estimator("reinforce_pp_baseline_seq")(jnp.asarray(r, jnp.float32),
                                                                  G)
    np.testing.assert_allclose(np.asarray(got_b), want_b, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp_seq",
                                  "reinforce_pp_baseline_seq"])
def test_constant_rewards_and_g1_give_zero(name):
    fn = A.get_advantage_estimator(name)
    assert not A.is_token_level(name)
    for r, G in [(np.full(12, 0.1, np.float32), 4), (np.full(12, 1.0, np.float32), 3),
                 (np.zeros(8, np.float32), 8)]:
        got = np.asarray(fn(jnp.asarray(r), G))
        assert np.all(got == 0.0), (name, got)
    # G = 1: every group is a single sample.
    r = np.random.default_rng(4).normal(size=6).astype(np.float32)
    got = np.asarray(fn(jnp.asarray(r), 1))
    assert np.all(np.isfinite(got))
    if name != "reinforce_pp_seq":  # its baseline is the batch, not the group
        assert np.all(got == 0.0)
    # Gradients (e.g. if rewards come from a differentiable RM) stay finite.
    g = jax.grad(lambda x: fn(x, 4).sum())(jnp.full(8, 0.3))
    assert np.all(np.isfinite(np.asarray(g)))


# -------------------------------------------------------------- REINFORCE++ (token level)

def np_reinforce_pp(scores, lengths, T, *, kl=None, beta=0.0, gamma=1.0, G=None, eps=1e-8):
    """REINFORCE++ / -baseline written out from the paper (Hu et al. 2025), loops in float64.

    Completion i has lengths[i] real tokens (right-padded to T). baseline (G given): the
    outcome score minus its group mean. Token reward: -beta * kl[i, t] on every real token,
    plus the score on the last one; return G[i, t] = sum_{s >= t} gamma^(s-t) r[i, s];
    advantage: (G - mean) / (std + eps), mean and population std over all real tokens.
    """
    scores = np.asarray(scores, np.float64)
    if G is not None:
        scores = np.concatenate([scores[s:s + G] - np.mean(scores[s:s + G])
                                 for s in range(0, len(scores), G)])
    n = len(scores)
    ret = np.zeros((n, T))
    for i in range(n):
        L = lengths[i]
        for t in range(L):
            total = 0.0
            for s in range(t, L):
                r_s = -beta * (kl[i, s] if kl is not None else 0.0)
                if s == L - 1:
                    r_s += scores[i]
                total += gamma ** (s - t) * r_s
            ret[i, t] = total
    real = [(i, t) for i in range(n) for t in range(lengths[i])]
    vals = np.array([ret[i, t] for i, t in real])
    mean = vals.sum() / len(vals)
    std = math.sqrt(((vals - mean) ** 2).sum() / len(vals))
    out = np.zeros((n, T))
    for i, t in real:
        out[i, t] = (ret[i, t] - mean) / (std + eps)
    return out


def _ragged(rng, n, T):
    lengths = rng.integers(1, T + 1, size=n)
    lengths[0], lengths[1] = 1, T  # the extremes
    return lengths, np.arange(T)[None] < lengths[:, None]


@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("with_kl", [False, True])
@pytest.mark.parametrize("name", ["reinforce_pp", "reinforce_pp_baseline"])
def test_reinforce_pp_token_level_matches_paper(name, with_kl, gamma):
    rng = np.random.default_rng(11)
    G, T = 4, 7
    n = 6 * G
    lengths, mask = _ragged(rng, n, T)
    scores = _rewards(rng, n, "binary")
    kl = rng.normal(scale=0.3, size=(n, T)).astype(np.float32) if with_kl else None
    beta = 0.1 if with_kl else 0.0
    assert A.is_token_level(name)
    got = A.get_advantage_estimator(name)(
        jnp.asarray(scores), G, mask=jnp.asarray(mask),
        token_kl=None if kl is None else jnp.asarray(kl), kl_coef=beta, gamma=gamma)
    want = np_reinforce_pp(scores, lengths, T, kl=kl, beta=beta, gamma=gamma,
                           G=G if name == "reinforce_pp_baseline" else None)
    assert got.shape == (n, T)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=2e-6)
    assert np.all(np.asarray(got)[~mask] == 0.0)


def test_reinforce_pp_weighs_completions_by_length():
    # No KL, gamma = 1: every token of completion i carries (r_i - mu) / sigma with the
    # length-weighted mean and std  mu = sum L_i r_i / sum L_i,  sigma^2 = sum L_i (r_i - mu)^2
    # / sum L_i -- not the per-completion (r_i - mean r) / std r.
    rng = np.random.default_rng(12)
    n, T = 10, 9
    lengths, mask = _ragged(rng, n, T)
    r = rng.normal(size=n).astype(np.float32)
    L = lengths.astype(np.float64)
    mu = (L * r).sum() / L.sum()
    sigma = math.sqrt((L * (r - mu) ** 2).sum() / L.sum())
    want = np.where(mask, ((r - mu) / (sigma + 1e-8))[:, None], 0.0)
    got = np.asarray(A.reinforce_pp_advantages(jnp.asarray(r), mask=jnp.asarray(mask)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    per_seq = np.asarray(A.reinforce_pp_seq_advantages(jnp.asarray(r)))
    assert np.abs(got[:, 0] - per_seq).max() > 1e-2  # the two really differ


def test_reinforce_pp_baseline_constant_group_is_not_zero():
    # Group 0 all-correct, short completions; group 1 mixed, long ones. The centred score of
    # group 0 is 0, but the token-weighted batch mean of the centred returns is not, so the
    # paper's whitening gives group 0 -mu / sigma (the per-sequence variant gives exactly 0).
    r = np.array([1, 1, 1, 1, 1, 0, 0, 0], np.float32)
    lengths = np.array([2, 2, 2, 2, 6, 6, 3, 3])
    T = 6
    mask = np.arange(T)[None] < lengths[:, None]
    c = np.array([0, 0, 0, 0, 0.75, -0.25, -0.25, -0.25])
    L = lengths.astype(np.float64)
    mu = (L * c).sum() / L.sum()
    sigma = math.sqrt((L * (c - mu) ** 2).sum() / L.sum())
    got = np.asarray(A.reinforce_pp_baseline_advantages(jnp.asarray(r), 4,
                                                        mask=jnp.asarray(mask)))
    np.testing.assert_allclose(got[:4, :2], -mu / (sigma + 1e-8), rtol=1e-6)
    assert abs(mu) > 0.05
    assert np.all(np.asarray(A.reinforce_pp_baseline_seq_advantages(jnp.asarray(r), 4))[:4]
                  == 0.0)


def test_reinforce_pp_per_token_kl_return():
    # Before whitening, the return at token t is the score minus beta times the KL summed
    # from t to the end of the completion (gamma = 1), i.e. a KL return-to-go, not the whole
    # completion's KL at every token.
    score, beta = 1.0, 0.5
    kl = np.array([[0.1, 0.2, 0.4, 0.8, 9.0]], np.float32)  # the last slot is padding
    mask = np.array([[1, 1, 1, 1, 0]], bool)
    r = A.outcome_token_rewards(jnp.asarray([score]), jnp.asarray(mask), jnp.asarray(kl), beta)
    np.testing.assert_allclose(np.asarray(r), [[-0.05, -0.1, -0.2, 1.0 - 0.4, 0.0]], rtol=1e-6)
    ret = np.asarray(A.discounted_returns(r, jnp.asarray(mask)))
    want = [score - beta * kl[0, t:4].sum() for t in range(4)] + [0.0]
    np.testing.assert_allclose(ret[0], want, rtol=1e-6)
    # ... and the estimator whitens exactly those returns.
    adv = np.asarray(A.reinforce_pp_advantages(jnp.asarray([score]), mask=jnp.asarray(mask),
                                               token_kl=jnp.asarray(kl), kl_coef=beta))
    w = np.asarray(want[:4], np.float64)
    np.testing.assert_allclose(adv[0, :4], (w - w.mean()) / (w.std() + 1e-8), rtol=1e-5)
    assert adv[0, 4] == 0.0


def test_reinforce_pp_token_level_edge_cases():
    fn = A.get_advantage_estimator("reinforce_pp_baseline")
    mask = jnp.asarray(np.arange(5)[None] < np.array([[5], [3], [0], [2]]))
    # Equal returns everywhere (constant rewards, no KL): exactly 0, never 0 / eps.
    assert np.all(np.asarray(A.reinforce_pp_advantages(jnp.full(4, 0.3), mask=mask)) == 0.0)
    assert np.all(np.asarray(fn(jnp.full(4, 0.3), 2, mask=mask)) == 0.0)
    # A row with no real token gets 0; jit and gradients are fine.
    r = jnp.asarray([1.0, 0.0, 5.0, 0.5])
    out = jax.jit(fn, static_argnums=1)(r, 2, mask=mask)
    assert np.all(np.asarray(out)[2] == 0.0) and np.all(np.isfinite(np.asarray(out)))
    g = jax.grad(lambda x: fn(x, 2, mask=mask).sum())(r)
    assert np.all(np.isfinite(np.asarray(g)))
    with pytest.raises(ValueError, match="mask"):
        A.reinforce_pp_advantages(jnp.zeros(3), mask=jnp.ones((4, 2), bool))


def test_estimator_errors():
    with pytest.raises(ValueError, match="unknown adv_estimator"):
        A.get_advantage_estimator("nope")
    with pytest.raises(ValueError, match="group_size"):
        A.grpo_advantages(jnp.zeros(10), 3)
    with pytest.raises(ValueError, match="scale_rewards"):
        A.grpo_advantages(jnp.zeros(9), 3, scale_rewards="x")


# ----------------------------------------------------------------------------- GAE

def np_gae(rewards, values, mask, gamma, lam):
    """Direct recursion over the real tokens of each row (loops)."""
    B, T = rewards.shape
    adv = np.zeros((B, T))
    for b in range(B):
        idx = [t for t in range(T) if mask[b, t]]
        next_v, next_a = 0.0, 0.0  # terminal after the last real token
        for t in reversed(idx):
            delta = rewards[b, t] + gamma * next_v - values[b, t]
            a = delta + gamma * lam * next_a
            adv[b, t] = a
            next_v, next_a = values[b, t], a
    ret = np.where(mask, adv + values, 0.0)
    return adv, ret


def _ragged_mask(rng, B, T, interior_holes=False):
    lengths = rng.integers(0, T + 1, size=B)
    lengths[0], lengths[1] = T, 0
    mask = np.arange(T)[None] < lengths[:, None]
    if interior_holes:
        holes = rng.random((B, T)) < 0.2
        mask = mask & ~holes
    return mask, lengths


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.9), (0.9, 1.0), (1.0, 0.0)])
@pytest.mark.parametrize("holes", [False, True])
def test_gae_matches_numpy_recursion(gamma, lam, holes):
    rng = np.random.default_rng(5)
    B, T = 6, 9
    mask, lengths = _ragged_mask(rng, B, T, holes)
    rewards = rng.normal(size=(B, T)).astype(np.float32)
    values = rng.normal(size=(B, T)).astype(np.float32)
    adv, ret = A.gae(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), gamma, lam)
    want_adv, want_ret = np_gae(rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(np.asarray(adv), want_adv, rtol=RTOL, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ret), want_ret, rtol=RTOL, atol=1e-5)
    assert np.all(np.asarray(adv)[~mask] == 0) and np.all(np.asarray(ret)[~mask] == 0)


def test_gae_terminal_at_last_real_token():
    # Outcome reward at the last real token; values after it are garbage and must be ignored.
    T = 6
    values = np.array([[0.5, 0.2, 0.1, 99.0, -99.0, 7.0]], np.float32)
    mask = np.array([[1, 1, 1, 0, 0, 0]], bool)
    rewards = np.zeros((1, T), np.float32)
    rewards[0, 2] = 1.0
    rewards[0, 4] = 123.0  # reward in padding: ignored
    adv, ret = A.gae(rewards, values, mask, gamma=1.0, lam=1.0)
    # lam = gamma = 1: advantage = outcome - V(t); return = outcome at every real token.
    np.testing.assert_allclose(np.asarray(adv)[0, :3], [0.5, 0.8, 0.9], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(ret)[0, :3], [1.0, 1.0, 1.0], rtol=1e-6)
    # Last real token: delta = r - V (no bootstrap from the next slot).
    adv2, _ = A.gae(rewards, values, mask, gamma=0.9, lam=0.5)
    assert np.isclose(float(adv2[0, 2]), 1.0 - 0.1)


def test_gae_jit_and_all_masked():
    z = jnp.zeros((3, 5))
    adv, ret = jax.jit(A.gae)(z + 1.0, z + 2.0, jnp.zeros((3, 5), bool))
    assert np.all(np.asarray(adv) == 0) and np.all(np.asarray(ret) == 0)


def test_discounted_returns_matches_numpy():
    rng = np.random.default_rng(6)
    B, T, gamma = 5, 8, 0.9
    mask, _ = _ragged_mask(rng, B, T, interior_holes=True)
    r = rng.normal(size=(B, T)).astype(np.float32)
    want = np.zeros((B, T))
    for b in range(B):
        g = 0.0
        for t in reversed(range(T)):
            if mask[b, t]:
                g = r[b, t] + gamma * g
                want[b, t] = g
    np.testing.assert_allclose(np.asarray(A.discounted_returns(r, mask, gamma)), want,
                               rtol=RTOL, atol=1e-5)


def test_masked_whiten():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(4, 6)).astype(np.float32)
    mask = rng.random((4, 6)) < 0.6
    vals = x[mask].astype(np.float64)
    want = np.where(mask, (x - vals.mean()) / (vals.std() + 1e-8), 0.0)
    np.testing.assert_allclose(np.asarray(A.masked_whiten(x, mask)), want, rtol=RTOL, atol=ATOL)
    const = A.masked_whiten(jnp.full((2, 3), 0.1), jnp.ones((2, 3), bool))
    assert np.all(np.asarray(const) == 0)
    assert np.all(np.asarray(A.masked_whiten(x, np.zeros_like(mask))) == 0)


# ----------------------------------------------------------------------------- shaping

def test_overlong_penalty_matches_dapo_formula():
    max_len, buf, factor = 20, 5, 0.5
    lengths = np.arange(0, 26)
    got = np.asarray(A.overlong_penalty(jnp.asarray(lengths), max_len, buf, factor))
    for L, g in zip(lengths, got):
        if L <= max_len - buf:
            want = 0.0
        elif L <= max_len:
            want = ((max_len - buf) - L) / buf
        else:
            want = -1.0
        assert math.isclose(g, factor * want, abs_tol=1e-6), (L, g)
    assert got[20] == pytest.approx(-0.5) and got[15] == 0.0


def test_truncation_masking():
    tokens = jnp.array([[5, 6, 2, 0], [5, 6, 7, 8], [2, 0, 0, 0]])
    mask = jnp.array([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], bool)
    trunc = A.is_truncated(tokens, mask, eos_id=2)
    np.testing.assert_array_equal(np.asarray(trunc), [False, True, False])
    new = np.asarray(A.mask_truncated(mask, trunc))
    np.testing.assert_array_equal(new[1], [False] * 4)
    np.testing.assert_array_equal(new[0], np.asarray(mask[0]))


def test_dynamic_sampling_filter():
    r = np.array([1, 1, 1, 0, 1, 0, 0.5, 0.5, 0.5, 0, 0, 0], np.float32)
    want = [False, True, False, False]
    np.testing.assert_array_equal(A.nonzero_variance_groups(r, 3), want)
    np.testing.assert_array_equal(np.asarray(A.nonzero_variance_groups(jnp.asarray(r), 3)), want)
    assert not A.nonzero_variance_groups(np.arange(4.0), 1).any()  # G=1: nothing to learn


def test_pass_at_k_unbiased_estimator():
    for n in range(1, 12):
        for c in range(0, n + 1):
            for k in range(1, n + 1):
                want = 1.0 - math.comb(n - c, k) / math.comb(n, k)
                assert math.isclose(A.pass_at_k(n, c, k), want, rel_tol=1e-9, abs_tol=1e-12)
    got = A.pass_at_k(np.array([10, 10, 200]), np.array([0, 10, 3]), 5)
    np.testing.assert_allclose(got, [0.0, 1.0, 1 - math.comb(197, 5) / math.comb(200, 5)])
    # large n: the product form stays finite where binomials would overflow float
    assert 0.0 < A.pass_at_k(2000, 1, 100) < 1.0
    with pytest.raises(ValueError):
        A.pass_at_k(3, 1, 5)


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp_baseline_seq"])
def test_estimators_jit_with_static_group_size(name):
    fn = A.get_advantage_estimator(name)
    r = jnp.asarray(np.random.default_rng(8).normal(size=12).astype(np.float32))
    np.testing.assert_allclose(np.asarray(jax.jit(fn, static_argnums=1)(r, 4)),
                               np.asarray(fn(r, 4)), rtol=1e-6, atol=1e-7)
