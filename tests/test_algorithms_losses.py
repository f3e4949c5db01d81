"""Policy losses, aggregation (incl. split invariance), KL, entropy and value loss against
NumPy written from the papers."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import algorithms as A

RTOL, ATOL = 1e-5, 1e-6
B, T = 8, 7


def _batch(seed=0, scale=0.3):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, T + 1, size=B)
    lengths[1] = 0          # one all-masked row
    lengths[0] = T
    mask = np.arange(T)[None] < lengths[:, None]
    old = (-rng.random((B, T)) * 3).astype(np.float32)
    logps = (old + rng.normal(scale=scale, size=(B, T))).astype(np.float32)
    adv = rng.normal(size=B).astype(np.float32)
    return logps, old, adv, mask


# ----------------------------------------------------------------------------- aggregation

def np_aggregate(l, m, mode, max_len=None):
    Bn, Tn = l.shape
    if mode == "token-mean":
        return sum(l[b, t] for b in range(Bn) for t in range(Tn) if m[b, t]), m.sum()
    s, w = 0.0, 0
    for b in range(Bn):
        toks = [l[b, t] for t in range(Tn) if m[b, t]]
        if not toks:
            continue
        w += 1
        if mode == "seq-mean-token-mean":
            s += sum(toks) / len(toks)
        elif mode == "seq-mean-token-sum":
            s += sum(toks)
        else:
            s += sum(toks) / (Tn if max_len is None else max_len)
    return s, w


@pytest.mark.parametrize("mode", A.AGGREGATION_MODES)
def test_aggregate_matches_numpy(mode):
    rng = np.random.default_rng(1)
    l = rng.normal(size=(B, T)).astype(np.float32)
    _, _, _, mask = _batch(1)
    l[~mask] = np.inf  # masked garbage must not leak
    for max_len in (None, 20):
        s, w = A.aggregate(jnp.asarray(l), jnp.asarray(mask), mode, max_len=max_len)
        ws, ww = np_aggregate(l, mask, mode, max_len)
        np.testing.assert_allclose(float(s), ws, rtol=RTOL, atol=ATOL)
        assert float(w) == ww
    with pytest.raises(ValueError, match="loss_agg_mode"):
        A.aggregate(jnp.asarray(l), jnp.asarray(mask), "mean")


def _toy_policy(seed=0, D=5, V=11):
    """A tiny shared-parameter 'model' so gradients from micro-batches must be summed."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(B, T, D)).astype(np.float32))
    tokens = jnp.asarray(rng.integers(0, V, size=(B, T)))
    W = jnp.asarray(rng.normal(scale=0.5, size=(D, V)).astype(np.float32))
    return x, tokens, W


@pytest.mark.parametrize("mode", A.AGGREGATION_MODES)
def test_split_invariance_of_gradients(mode):
    x, tokens, W = _toy_policy()
    _, old, adv, mask = _batch(2)
    mask = jnp.asarray(mask)
    ref = old - 0.1
    kl_fn = A.get_kl_estimator("k3")
    loss_fn = A.get_policy_loss("ppo")

    def _num_and_weight(W, x, tokens, old, adv, mask, ref):
        logits = x @ W
        logp_all = jax.nn.log_softmax(logits)
        logps = jnp.take_along_axis(logp_all, tokens[..., None], -1)[..., 0]
        pg, _ = loss_fn(logps, old, adv, mask, epsilon=0.2, epsilon_high=0.28, clip_ratio_c=3.0)
        tok = A.combine_token_losses(
            pg, mask, kl_tokens=kl_fn(logps, ref), kl_coef=0.05,
            entropy_tokens=A.entropy_from_logits(logits, chunk_size=3), entropy_coef=0.01)
        return A.aggregate(tok, mask, mode, max_len=10)

    # old log-probs 1 nat below: ratios ~e, so clipping and dual-clip branches are hit
    args = lambda sl: (x[sl], tokens[sl], old[sl] - 1.0, adv[sl], mask[sl], ref[sl])
    num_grad = jax.jit(jax.value_and_grad(_num_and_weight, has_aux=True))
    full_grad = jax.jit(jax.grad(lambda W, *a: A.finalize(*_num_and_weight(W, *a))))(
        W, *args(slice(0, B)))
    for k in (1, 2, 4):
        n = B // k
        gs, ws, ss = 0.0, 0.0, 0.0
        naive = 0.0
        for i in range(k):
            (s, w), g = num_grad(W, *args(slice(i * n, (i + 1) * n)))
            gs, ws, ss = gs + g, ws + w, ss + s
            naive += float(s / w) / k
        if k == 4:  # negative control: averaging micro-batch means is *not* exact here
            assert abs(naive - float(full_s / full_w)) > 1e-3
        assert np.isfinite(float(ss)) and float(ws) > 0
        if k == 1:
            full_s, full_w = ss, ws
        np.testing.assert_allclose(float(ss / ws), float(full_s / full_w), rtol=1e-5)
        np.testing.assert_allclose(np.asarray(gs / ws), np.asarray(full_grad), rtol=1e-4,
                                   atol=1e-6)


# ----------------------------------------------------------------------------- PPO family

def np_ppo(logps, old, adv, mask, eps_lo, eps_hi, c=None):
    """Per-token loss and d loss / d logp, written out per token."""
    loss = np.zeros_like(logps, dtype=np.float64)
    grad = np.zeros_like(loss)
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            a = float(adv[b])
            r = np.exp(np.float64(logps[b, t]) - old[b, t])
            surr1, surr2 = -a * r, -a * np.clip(r, 1 - eps_lo, 1 + eps_hi)
            l, g = (surr1, -a * r) if surr1 >= surr2 else (surr2, 0.0)
            if c is not None and a < 0 and l > -a * c:
                l, g = -a * c, 0.0
            loss[b, t], grad[b, t] = l, g
    return loss, grad


@pytest.mark.parametrize("eps_hi,c", [(None, None), (0.28, None), (0.28, 3.0)])
def test_ppo_clip_higher_dual_clip_matches_numpy(eps_hi, c):
    logps, old, adv, mask = _batch(3, scale=0.6)  # large enough to hit every clip branch
    adv[2] = -5.0
    logps[2, :3] = old[2, :3] + np.array([2.0, 0.5, -0.5])  # r = e^2 > c=3: dual clip
    fn = A.get_policy_loss("ppo")
    kw = dict(epsilon=0.2, epsilon_high=eps_hi, clip_ratio_c=c)
    loss, metrics = fn(logps, old, adv, mask, **kw)
    g = jax.grad(lambda lp: fn(lp, old, adv, mask, **kw)[0].sum())(jnp.asarray(logps))
    want_l, want_g = np_ppo(logps, old, adv, mask, 0.2, 0.2 if eps_hi is None else eps_hi, c)
    np.testing.assert_allclose(np.asarray(loss), want_l, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(g), want_g, rtol=RTOL, atol=ATOL)
    # Metrics
    hi = 0.2 if eps_hi is None else eps_hi
    r = np.exp(logps.astype(np.float64) - old)
    A2 = np.broadcast_to(adv[:, None], (B, T))
    n = mask.sum()
    m = A.finalize_metrics(metrics)
    np.testing.assert_allclose(float(m["clipfrac_low"]), ((r < 0.8) & (A2 < 0) & mask).sum() / n,
                               rtol=1e-6)
    np.testing.assert_allclose(float(m["clipfrac_high"]),
                               ((r > 1 + hi) & (A2 > 0) & mask).sum() / n, rtol=1e-6)
    dual = 0.0 if c is None else ((A2 < 0) & (r > c) & mask).sum() / n
    np.testing.assert_allclose(float(m["clipfrac_dual"]), dual, rtol=1e-6)
    if c is not None:
        assert dual > 0
    assert 0 < float(m["clipfrac_low"]) and 0 < float(m["clipfrac_high"])
    np.testing.assert_allclose(float(m["approx_kl"]),
                               ((r - 1 - np.log(r)) * mask).sum() / n, rtol=1e-5)


def test_ppo_token_advantages_and_on_policy_default():
    logps, _, _, mask = _batch(4)
    adv_t = np.random.default_rng(4).normal(size=(B, T)).astype(np.float32)
    loss, _ = A.ppo_loss(logps, None, adv_t, mask)
    np.testing.assert_allclose(np.asarray(loss), np.where(mask, -adv_t, 0), rtol=RTOL, atol=ATOL)
    g = jax.grad(lambda lp: A.ppo_loss(lp, None, adv_t, mask)[0].sum())(jnp.asarray(logps))
    np.testing.assert_allclose(np.asarray(g), np.where(mask, -adv_t, 0), rtol=RTOL, atol=ATOL)


def test_gspo_sequence_ratio_value_and_gradient():
    logps, old, adv, mask = _batch(5, scale=0.002)
    eps_lo, eps_hi = 3e-4, 4e-4
    fn = A.get_policy_loss("gspo")
    loss, _ = fn(logps, old, adv, mask)

    def np_obj(lp):  # GSPO objective with seq-mean-token-mean, exactly as in the paper
        tot = 0.0
        nseq = 0
        for b in range(B):
            n = mask[b].sum()
            if n == 0:
                continue
            nseq += 1
            s = np.exp(sum(lp[b, t] - old[b, t] for t in range(T) if mask[b, t]) / n)
            tot += -min(s * adv[b], np.clip(s, 1 - eps_lo, 1 + eps_hi) * adv[b])
        return tot / nseq

    agg = lambda lp: A.finalize(*A.aggregate(fn(lp, old, adv, mask)[0], jnp.asarray(mask),
                                             "seq-mean-token-mean"))
    lp64 = logps.astype(np.float64)
    np.testing.assert_allclose(float(agg(jnp.asarray(logps))), np_obj(lp64), rtol=1e-5)
    # every token of a sequence carries the same ratio value s_i
    for b in range(B):
        if mask[b].sum():
            toks = np.asarray(loss)[b][mask[b]]
            np.testing.assert_allclose(toks, toks[0], rtol=1e-6)
    # gradient vs central finite differences of the NumPy objective (float64)
    g = np.asarray(jax.grad(agg)(jnp.asarray(logps)))
    h = 1e-6
    for b, t in [(0, 0), (0, 3), (2, 0), (5, 0), (7, 0)]:
        if not mask[b, t]:
            continue
        e = np.zeros_like(lp64); e[b, t] = h
        fd = (np_obj(lp64 + e) - np_obj(lp64 - e)) / (2 * h)
        np.testing.assert_allclose(g[b, t], fd, rtol=1e-3, atol=1e-6)
    assert np.all(g[~mask] == 0)
    assert g[0, 0] == 0 and g[2, 0] != 0  # sequence 0 is clipped, sequence 2 is not


def test_cispo_matches_formula():
    logps, old, adv, mask = _batch(6, scale=0.5)
    fn = A.get_policy_loss("cispo")
    loss, metrics = fn(logps, old, adv, mask, epsilon_high=0.28)
    r = np.exp(logps.astype(np.float64) - old)
    w = np.minimum(r, 1.28)  # no lower bound by default
    A2 = np.broadcast_to(adv[:, None], (B, T))
    np.testing.assert_allclose(np.asarray(loss), np.where(mask, -w * A2 * logps, 0), rtol=RTOL,
                               atol=1e-5)
    g = jax.grad(lambda lp: fn(lp, old, adv, mask)[0].sum())(jnp.asarray(logps))
    np.testing.assert_allclose(np.asarray(g), np.where(mask, -w * A2, 0), rtol=RTOL, atol=ATOL)
    # with a lower bound
    loss2, _ = fn(logps, old, adv, mask, epsilon=0.2, epsilon_high=0.28)
    w2 = np.clip(r, 0.8, 1.28)
    np.testing.assert_allclose(np.asarray(loss2), np.where(mask, -w2 * A2 * logps, 0),
                               rtol=RTOL, atol=1e-5)
    assert float(A.finalize_metrics(metrics)["clipfrac_high"]) > 0


@pytest.mark.parametrize("name", ["ppo", "cispo"])
def test_truncated_importance_sampling(name):
    logps, old, adv, mask = _batch(7, scale=0.2)
    sampler = (old + np.random.default_rng(7).normal(scale=1.0, size=(B, T))).astype(np.float32)
    fn = A.get_policy_loss(name)
    base, _ = fn(logps, old, adv, mask)
    tis, metrics = fn(logps, old, adv, mask, sampler_logps=sampler, tis_cap=2.0)
    w = np.minimum(np.exp(old.astype(np.float64) - sampler), 2.0)
    np.testing.assert_allclose(np.asarray(tis), np.asarray(base) * np.where(mask, w, 0),
                               rtol=RTOL, atol=1e-5)
    assert 1.0 < w.max() and np.isclose(w.max(), 2.0)
    np.testing.assert_allclose(float(A.finalize_metrics(metrics)["tis_weight"]),
                               (w * mask).sum() / mask.sum(), rtol=1e-5)
    # the weight is a constant: gradient = w * base gradient
    gb = jax.grad(lambda lp: fn(lp, old, adv, mask)[0].sum())(jnp.asarray(logps))
    gt = jax.grad(lambda lp: fn(lp, old, adv, mask, sampler_logps=sampler,
                                tis_cap=2.0)[0].sum())(jnp.asarray(logps))
    np.testing.assert_allclose(np.asarray(gt), np.asarray(gb) * np.where(mask, w, 0), rtol=RTOL,
                               atol=1e-5)


@pytest.mark.parametrize("name", ["ppo", "gspo", "cispo"])
def test_extreme_log_ratios_are_finite(name):
    logps, old, adv, mask = _batch(8)
    logps = old + np.where(np.arange(T)[None] % 2 == 0, 50.0, -50.0).astype(np.float32)
    logps[3] = old[3] + 50.0
    old_masked = old.copy()
    old_masked[~mask] = -np.inf  # padding garbage
    fn = A.get_policy_loss(name)
    for kw in ({}, {"clip_ratio_c": 3.0} if name != "cispo" else {},
               {"sampler_logps": old - 50.0, "tis_cap": 5.0}):
        loss, metrics = fn(logps, old_masked, adv, mask, **kw)
        g = jax.grad(lambda lp: A.finalize(*A.aggregate(
            fn(lp, old_masked, adv, mask, **kw)[0], jnp.asarray(mask), "token-mean")))(
            jnp.asarray(logps))
        assert np.all(np.isfinite(np.asarray(loss))) and np.all(np.isfinite(np.asarray(g)))
        assert all(np.isfinite(float(v)) for v in A.finalize_metrics(metrics).values())


def test_all_masked_batch_gives_zero_not_nan():
    logps, old, adv, _ = _batch(9)
    mask = np.zeros((B, T), bool)
    for mode in A.AGGREGATION_MODES:
        f = lambda lp: A.finalize(*A.aggregate(A.ppo_loss(lp, old, adv, mask)[0],
                                                jnp.asarray(mask), mode))
        assert float(f(jnp.asarray(logps))) == 0.0
        assert np.all(np.asarray(jax.grad(f)(jnp.asarray(logps))) == 0.0)


def test_policy_loss_registry():
    assert A.get_policy_loss("vanilla") is A.get_policy_loss("ppo")
    with pytest.raises(ValueError, match="unknown policy_loss"):
        A.get_policy_loss("nope")


# ----------------------------------------------------------------------------- KL

def test_kl_estimators_match_schulman():
    rng = np.random.default_rng(10)
    lp = rng.normal(size=(4, 6)).astype(np.float32) - 2
    ref = (lp + rng.normal(scale=0.7, size=(4, 6))).astype(np.float32)
    d = lp.astype(np.float64) - ref
    r = np.exp(-d)  # pi_ref / pi
    want = {"k1": d, "k2": 0.5 * d ** 2, "k3": r - 1 - np.log(r), "k3+": r - 1 - np.log(r),
            "abs": np.abs(d), "low_var_kl": r - 1 - np.log(r), "mse": 0.5 * d ** 2, "kl": d}
    for name, w in want.items():
        np.testing.assert_allclose(np.asarray(A.get_kl_estimator(name)(lp, ref)), w, rtol=1e-5,
                                   atol=1e-6, err_msg=name)
    # k3+: value of k3, gradient of k2 (= log ratio)
    g = jax.grad(lambda x: A.get_kl_estimator("k3+")(x, ref).sum())(jnp.asarray(lp))
    np.testing.assert_allclose(np.asarray(g), d, rtol=1e-5, atol=1e-6)
    g3 = jax.grad(lambda x: A.kl_k3(x, ref).sum())(jnp.asarray(lp))
    np.testing.assert_allclose(np.asarray(g3), 1 - r, rtol=1e-5, atol=1e-6)
    # MC sanity: E_pi[k1] = E_pi[k3] = KL(pi||ref) for two categoricals
    p = np.array([0.5, 0.3, 0.2]); q = np.array([0.2, 0.5, 0.3])
    s = rng.choice(3, p=p, size=200_000)
    true = (p * np.log(p / q)).sum()
    k3 = np.asarray(A.kl_k3(jnp.log(p)[s], jnp.log(q)[s]))
    assert abs(k3.mean() - true) < 0.01


def test_kl_extreme_and_penalized_rewards():
    lp = jnp.array([[-1.0, -60.0, -1.0]])
    ref = jnp.array([[-60.0, -1.0, -1.0]])
    for name in ("k1", "k2", "k3", "k3+", "abs"):
        fn = A.get_kl_estimator(name)
        v = np.asarray(fn(lp, ref))
        g = np.asarray(jax.grad(lambda x: fn(x, ref).sum())(lp))
        assert np.all(np.isfinite(v)) and np.all(np.isfinite(g)), name
    assert float(A.kl_k3(lp, ref).max()) == 10.0  # value clamp
    mask = jnp.array([[True, True, False]])
    rew = jnp.array([[0.0, 0.0, 1.0]])
    out = A.kl_penalized_rewards(rew, lp, ref, mask, kl_coef=0.1, estimator="k1")
    np.testing.assert_allclose(np.asarray(out), [[-0.1 * 59.0, 0.1 * 59.0, 0.0]], rtol=1e-6)


@pytest.mark.parametrize("d", [30.0, -30.0])
def test_kl_without_exp_is_not_clamped(d):
    # log ratio d = log pi - log pi_ref far beyond 20: k1, k2, abs and the k2 gradient of k3+
    # keep their exact values and gradients (d/d log pi of k1 = 1, of k2 = d, of abs = sign d),
    # as verl's; only k3 (an exp) clamps, to the value cap.
    ref = jnp.array([[-40.0]])
    lp = ref + d
    want = {"k1": (d, 1.0), "k2": (0.5 * d * d, d), "abs": (abs(d), float(np.sign(d))),
            "k3+": (10.0, d)}
    for name, (value, grad) in want.items():
        fn = A.get_kl_estimator(name)
        v, g = jax.value_and_grad(lambda x: fn(x, ref).sum())(lp)
        assert float(v) == pytest.approx(value, rel=1e-6), name
        assert float(g[0, 0]) == pytest.approx(grad, rel=1e-6), name
    # k3 = (r - 1) - log r has an exp: its log ratio is clamped to +-20, its value to 10.
    v3, g3 = jax.value_and_grad(lambda x: A.kl_k3(x, ref).sum())(lp)
    assert float(v3) == 10.0 and float(g3[0, 0]) == 0.0
    assert np.isfinite(float(A.kl_k3(lp, ref, max_value=None).sum()))
    # A clamp is still available on request.
    assert float(A.kl_k1(lp, ref, log_ratio_clamp=20.0).sum()) == pytest.approx(np.sign(d) * 20)


# ----------------------------------------------------------------------------- entropy

def test_entropy_matches_numpy_and_chunking():
    rng = np.random.default_rng(11)
    logits = (rng.normal(size=(3, 10, 17)) * 3).astype(np.float32)
    logits[0, 0, :5] = -np.inf  # masked vocabulary entries
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(-1, keepdims=True)); p /= p.sum(-1, keepdims=True)
    want = -np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0).sum(-1)
    ent = jax.jit(A.entropy_from_logits, static_argnames=("chunk_size", "temperature"))
    for chunk in (None, 3, 4):
        got = ent(jnp.asarray(logits), chunk_size=chunk)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(A.entropy_from_logps(jax.nn.log_softmax(logits))),
                               want, rtol=1e-5, atol=1e-5)
    # temperature
    zt = z / 0.7
    pt = np.exp(zt - zt.max(-1, keepdims=True)); pt /= pt.sum(-1, keepdims=True)
    wt = -np.where(pt > 0, pt * np.log(np.where(pt > 0, pt, 1)), 0).sum(-1)
    np.testing.assert_allclose(np.asarray(ent(logits, temperature=0.7)), wt,
                               rtol=1e-5, atol=1e-6)
    # gradient: chunked == unchunked == -p (log p + H)
    f = lambda c: jax.jit(jax.grad(lambda x: A.entropy_from_logits(x, chunk_size=c).sum()))(
        jnp.asarray(logits))
    g1, g2 = np.asarray(f(None)), np.asarray(f(3))
    np.testing.assert_allclose(g1, g2, rtol=1e-5, atol=1e-6)
    logp = np.log(np.where(p > 0, p, 1))
    want_g = np.where(p > 0, -p * (logp + want[..., None]), 0)
    np.testing.assert_allclose(g1, want_g, rtol=1e-4, atol=1e-6)
    big = jnp.full((1, 2, 5), 1e4).at[0, 0, 0].set(-1e4)
    assert np.all(np.isfinite(np.asarray(jax.grad(lambda x: A.entropy_from_logits(x).sum())(big))))


# ----------------------------------------------------------------------------- value loss

@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_loss_matches_numpy(clip):
    rng = np.random.default_rng(12)
    _, _, _, mask = _batch(12)
    v = rng.normal(size=(B, T)).astype(np.float32)
    vold = (v + rng.normal(scale=0.5, size=(B, T))).astype(np.float32)
    ret = rng.normal(size=(B, T)).astype(np.float32)
    s, w = A.value_loss(v, vold, ret, mask, clip_range=clip)
    tot, grad = 0.0, np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            l1 = (v[b, t] - ret[b, t]) ** 2
            if clip is None:
                tot += 0.5 * l1; grad[b, t] = v[b, t] - ret[b, t]
                continue
            vc = np.clip(v[b, t], vold[b, t] - clip, vold[b, t] + clip)
            l2 = (vc - ret[b, t]) ** 2
            tot += 0.5 * max(l1, l2)
            inside = vold[b, t] - clip < v[b, t] < vold[b, t] + clip
            grad[b, t] = (v[b, t] - ret[b, t]) if l1 >= l2 else ((vc - ret[b, t]) if inside else 0)
    np.testing.assert_allclose(float(s), tot, rtol=1e-5)
    assert float(w) == mask.sum()
    g = jax.grad(lambda x: A.value_loss(x, vold, ret, mask, clip_range=clip)[0])(jnp.asarray(v))
    np.testing.assert_allclose(np.asarray(g), grad, rtol=1e-5, atol=1e-6)
