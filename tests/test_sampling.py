"""Tests for rljax.sampling: cache vs recompute, logps, sampling statistics, fan-out, EOS,
bucketing/recompilation, and sharded decoding on 8 fake CPU devices."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import compilation_cache, models, sampling, sharding

PROMPTS = [[5, 17, 3, 99, 42], [7, 8], [9, 10, 11, 12, 13, 14, 15], [200, 1, 2]]
SMALL_PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [6], [2, 7, 1, 1, 4]]  # for the vocab-8 model


def _prompts(pad_id=0, rows=PROMPTS, bucket=8):
    return sampling.pad_to_bucket(rows, pad_id=pad_id, buckets=(bucket,))


def _cfg(**kw):
    # A larger init_std than the default makes logits peaked enough that greedy argmax has no
    # near-ties, so the cache/recompute comparison tests the cache and not float noise.
    return models.get_preset("tiny", init_std=0.1, **kw)


def _logps_by_forward(cfg, params, prompt, pmask, out, temperature):
    """log softmax(forward / T) of each completion token, recomputed on prompt + completion."""
    seq = jnp.concatenate([jnp.asarray(prompt), out.tokens], axis=1)
    mask = jnp.concatenate([jnp.asarray(pmask), out.mask], axis=1)
    logits = models.forward(cfg, params, seq, attention_mask=mask) / (temperature or 1.0)
    p = prompt.shape[1]
    lp = jax.nn.log_softmax(logits[:, p - 1:-1], axis=-1)
    return jnp.take_along_axis(lp, out.tokens[..., None], axis=-1)[..., 0]


def _expand(x, g):
    return np.repeat(np.asarray(x), g, axis=0)


# ----------------------------------------------------------------------------- bucketing

def test_bucket_length_and_pad():
    assert sampling.bucket_length(1) == 16
    assert sampling.bucket_length(16) == 16
    assert sampling.bucket_length(17, (8, 32, 64)) == 32
    with pytest.raises(ValueError, match="exceeds the largest bucket 64"):
        sampling.bucket_length(65, (8, 32, 64))
    toks, mask = sampling.pad_to_bucket([[1, 2, 3], [4]], pad_id=9, buckets=(4, 8))
    np.testing.assert_array_equal(toks, [[9, 1, 2, 3], [9, 9, 9, 4]])
    np.testing.assert_array_equal(mask, [[0, 1, 1, 1], [0, 0, 0, 1]])
    # An already left-padded array is re-bucketed from its real tokens.
    toks2, mask2 = sampling.pad_to_bucket(np.array([[0, 1, 2, 3], [0, 0, 0, 4]]), mask, pad_id=9,
                                          buckets=(2, 4, 16))
    np.testing.assert_array_equal(toks2, toks)
    np.testing.assert_array_equal(mask2, mask)


# ----------------------------------------------------------------------------- greedy parity

@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma"])
def test_greedy_cache_matches_full_recompute(family):
    cfg = _cfg(model_type=family)
    params = models.init_params(cfg, jax.random.key(0))
    prompt, pmask = _prompts()
    n = 5
    out = sampling.generate(cfg, params, prompt, pmask, rng=jax.random.key(1), max_new_tokens=n,
                            temperature=0.0, pad_id=0)
    # Reference: no cache. A fixed [B, P+N] buffer (future slots masked out; causality makes
    # them irrelevant) so the reference compiles once; re-run the full forward per token.
    b, p = prompt.shape
    seq = np.concatenate([prompt, np.zeros((b, n), np.int32)], axis=1)
    mask = np.concatenate([pmask, np.zeros((b, n), bool)], axis=1)
    fwd = jax.jit(lambda s, m: models.forward(cfg, params, s, attention_mask=m))
    for t in range(n):
        logits = fwd(seq, mask)[:, p + t - 1]
        seq[:, p + t] = np.argmax(np.asarray(logits), axis=-1)
        mask[:, p + t] = True
    np.testing.assert_array_equal(np.asarray(out.tokens), seq[:, p:])
    assert out.tokens.shape == (b, n) and out.tokens.dtype == jnp.int32
    assert bool(jnp.all(out.mask)) and bool(jnp.all(out.truncated))
    np.testing.assert_array_equal(out.lengths, [n] * b)


# ----------------------------------------------------------------------------- logps

@pytest.fixture(scope="module")
def small_vocab():
    """A vocab-8 model with a sharpened head: EOS is sampled often and frequencies are
    far from uniform."""
    cfg = _cfg(vocab_size=8)
    params = models.init_params(cfg, jax.random.key(3))
    params = dict(params, lm_head=params["lm_head"] * 3.0)
    return cfg, params


def test_logps_match_forward_with_eos_and_filters():
    cfg = _cfg()
    params = models.init_params(cfg, jax.random.key(0))
    prompt, pmask = _prompts()
    temp = 0.7
    out = sampling.generate(cfg, params, prompt, pmask, rng=jax.random.key(2), max_new_tokens=6,
                            temperature=temp, top_k=50, top_p=0.9, pad_id=0, num_samples=2)
    ref = _logps_by_forward(cfg, params, _expand(prompt, 2), _expand(pmask, 2), out, temp)
    np.testing.assert_allclose(np.where(out.mask, ref, 0.0), out.logps, atol=1e-4)
    if hasattr(models, "token_logps"):
        seq = jnp.concatenate([_expand(prompt, 2), out.tokens], axis=1)
        m = jnp.concatenate([_expand(pmask, 2), out.mask], axis=1)
        lp = models.token_logps(cfg, params, seq, attention_mask=m, temperature=temp)
        lp = lp[0] if isinstance(lp, tuple) else lp
        np.testing.assert_allclose(np.where(out.mask, lp[:, prompt.shape[1]:], 0.0), out.logps,
                                   atol=1e-4)


def test_eos_stop_ids_min_length_and_truncation(small_vocab):
    cfg, params = small_vocab
    prompt, pmask = _prompts(rows=SMALL_PROMPTS)
    n, g, stops = 10, 6, (3, 5)
    kw = dict(rng=jax.random.key(4), max_new_tokens=n, temperature=1.0, pad_id=0, num_samples=g)
    out = sampling.generate(cfg, params, prompt, pmask, eos_id=stops[0], stop_ids=stops[1:],
                            min_new_tokens=2, **kw)
    toks, mask, lengths = map(np.asarray, (out.tokens, out.mask, out.lengths))
    trunc = np.asarray(out.truncated)
    assert toks.shape == (len(SMALL_PROMPTS) * g, n)
    for row in range(toks.shape[0]):
        hits = np.flatnonzero(np.isin(toks[row], stops) & mask[row])
        assert hits.size == 0 or hits.min() >= 2, "min_new_tokens not respected"
        if hits.size:
            first = hits.min()
            assert lengths[row] == first + 1 and not trunc[row]
            assert np.all(toks[row, first + 1:] == 0)
        else:
            assert lengths[row] == n and trunc[row]
        np.testing.assert_array_equal(mask[row], np.arange(n) < lengths[row])
    # The seed gives both outcomes, and both stop ids occur.
    assert trunc.any() and (~trunc).any()
    last = toks[np.arange(len(toks)), lengths - 1]
    assert set(last[~trunc]) == set(stops)
    assert np.all(np.asarray(out.logps)[~mask] == 0.0)
    # logps are under the unfiltered model distribution, even where min length forbade stops.
    ref = _logps_by_forward(cfg, params, _expand(prompt, g), _expand(pmask, g), out, 1.0)
    np.testing.assert_allclose(np.where(mask, ref, 0.0), out.logps, atol=1e-4)
    # Without stop ids every row is truncated at N tokens.
    free = sampling.generate(cfg, params, prompt, pmask, eos_id=None, **kw)
    assert bool(jnp.all(free.truncated)) and bool(jnp.all(free.lengths == n))


# ----------------------------------------------------------------------------- sampling

def test_top_k_one_is_greedy_and_rng_determinism():
    cfg = _cfg()
    params = models.init_params(cfg, jax.random.key(0))
    prompt, pmask = _prompts()
    kw = dict(max_new_tokens=4, pad_id=0, eos_id=1)
    greedy = sampling.generate(cfg, params, prompt, pmask, rng=jax.random.key(0),
                               temperature=0.0, **kw)
    top1 = sampling.generate(cfg, params, prompt, pmask, rng=jax.random.key(7), temperature=1.0,
                             top_k=1, **kw)
    np.testing.assert_array_equal(greedy.tokens, top1.tokens)
    np.testing.assert_allclose(greedy.logps, top1.logps, atol=1e-6)  # both at temperature 1
    a = sampling.generate(cfg, params, prompt, pmask, rng=jax.random.key(5), temperature=1.0,
                          **kw)
    b = sampling.generate(cfg, params, prompt, pmask, rng=jax.random.key(5), temperature=1.0,
                          **kw)
    c = sampling.generate(cfg, params, prompt, pmask, rng=jax.random.key(6), temperature=1.0,
                          **kw)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logps, b.logps)
    assert not np.array_equal(a.tokens, c.tokens)


@pytest.mark.parametrize("draw", ["gumbel", "inverse_cdf"])
def test_sample_logits_frequencies(draw, monkeypatch):
    """Frequencies of 40k draws vs the target distribution. With n = 40k the standard error of a
    frequency is <= 0.0025, so a 0.012 tolerance is > 4.5 sigma (fixed seed anyway).
    ``inverse_cdf``: the large-vocabulary draw, in blocks of 4 tokens (two levels, padding)."""
    if draw == "inverse_cdf":
        monkeypatch.setattr(sampling.draw, "INVERSE_CDF_MIN_VOCAB", 1)
        monkeypatch.setattr(sampling.draw, "INVERSE_CDF_BLOCK", 4)
    logits = jnp.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n, tol = 40_000, 0.012
    rows = jnp.broadcast_to(logits, (n, 6))

    def freqs(**kw):
        tok, logp = sampling.sample_logits(jax.random.key(0), rows, **kw)
        t = kw.get("temperature", 1.0) or 1.0
        np.testing.assert_allclose(logp, jax.nn.log_softmax(logits / t)[tok], atol=1e-6)
        return np.bincount(np.asarray(tok), minlength=6) / n

    p = np.asarray(jax.nn.softmax(logits / 0.8))
    np.testing.assert_allclose(freqs(temperature=0.8), p, atol=tol)
    p_k = np.where(np.arange(6) < 3, p, 0) / p[:3].sum()
    np.testing.assert_allclose(freqs(temperature=0.8, top_k=3), p_k, atol=tol)
    # top_p = 0.7: p = [.58, .17, ...]; mass before token 1 is .58 < .7 so tokens {0, 1} kept.
    assert p[0] < 0.7 < p[0] + p[1]
    p_p = np.where(np.arange(6) < 2, p, 0) / p[:2].sum()
    np.testing.assert_allclose(freqs(temperature=0.8, top_p=0.7), p_p, atol=tol)
    np.testing.assert_array_equal(freqs(temperature=0.0), np.eye(6)[0])


def test_inverse_cdf_never_draws_tokens_without_mass(monkeypatch):
    """Masked (float32 min) logits and block padding are never drawn, also where float32
    rounding overshoots the last sum: with the uniform forced to 1.0 (beyond any real draw)
    the last token with mass is taken."""
    neg = jnp.finfo(jnp.float32).min
    logits = jnp.array([[0.0, neg, 1.0, 2.0, 0.5, neg, neg],       # last with mass: 4
                        [neg, neg, neg, neg, neg, 3.0, neg]])      # only 5
    got = sampling.categorical_inverse_cdf(jax.random.key(0), logits, block=3)
    assert got[1] == 5 and int(got[0]) in (0, 2, 3, 4)
    monkeypatch.setattr(jax.random, "uniform", lambda key, shape, dtype: jnp.ones(shape, dtype))
    np.testing.assert_array_equal(
        sampling.categorical_inverse_cdf(jax.random.key(0), logits, block=3), [4, 5])


def test_large_vocab_sampling_draws_by_inverse_cdf_with_top_k():
    """At V >= INVERSE_CDF_MIN_VOCAB sample_logits uses the inverse-CDF draw: top-k filtering
    still holds and the logps are the unfiltered log-softmax."""
    v = sampling.INVERSE_CDF_MIN_VOCAB
    logits = jax.random.normal(jax.random.key(1), (64, v)) * 4
    tok, logp = sampling.sample_logits(jax.random.key(2), logits, temperature=1.0, top_k=5)
    top5 = np.argsort(-np.asarray(logits), axis=-1)[:, :5]
    assert all(int(t) in row for t, row in zip(tok, top5))
    np.testing.assert_allclose(
        logp, np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), np.asarray(tok)[:, None],
                                 1)[:, 0], atol=1e-5)


def test_generate_frequencies_match_model_softmax(small_vocab):
    cfg, params = small_vocab
    prompt, pmask = _prompts(rows=[[1, 2, 3]])
    g, temp = 20_000, 1.5
    out = sampling.generate(cfg, params, prompt, pmask, rng=jax.random.key(8), max_new_tokens=1,
                            temperature=temp, pad_id=0, num_samples=g)
    logits = models.forward(cfg, params, jnp.asarray(prompt), attention_mask=jnp.asarray(pmask))
    p = np.asarray(jax.nn.softmax(logits[0, -1] / temp))
    assert p.max() > 0.3  # the sharpened head makes this a non-trivial distribution
    # Standard error <= 0.0036; tolerance 0.016 is > 4 sigma.
    np.testing.assert_allclose(np.bincount(np.asarray(out.tokens[:, 0]), minlength=8) / g, p,
                               atol=0.016)


# ----------------------------------------------------------------------------- fan-out

def _walk_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (list, tuple)) else [v]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _walk_eqns(inner)


def test_fan_out_equals_repeated_prompts_and_prefills_once():
    cfg = _cfg()
    params = models.init_params(cfg, jax.random.key(0))
    prompt, pmask = _prompts()
    g = 3
    kw = dict(rng=jax.random.key(9), max_new_tokens=5, temperature=1.0, pad_id=0, eos_id=1)
    fan = sampling.generate(cfg, params, prompt, pmask, num_samples=g, **kw)
    rep = sampling.generate(cfg, params, _expand(prompt, g), _expand(pmask, g), num_samples=1,
                            **kw)
    # Same key and the same [B*G, V] draws: not only the same distribution but the same samples.
    np.testing.assert_array_equal(fan.tokens, rep.tokens)
    np.testing.assert_allclose(fan.logps, rep.logps, atol=1e-5)
    np.testing.assert_array_equal(fan.lengths, rep.lengths)
    # The compiled program runs the prompt ([B, P] activations) through the layers once at batch
    # B: no matmul ever sees [B*G, P, ...] (projections run on [B*P, D] rows, attention on
    # [B, ...] batches).
    b, p = prompt.shape
    jaxpr = jax.make_jaxpr(lambda pr: sampling.generate(cfg, pr, prompt, pmask, num_samples=g,
                                                        **kw))(params)
    shapes = [v.aval.shape for e in _walk_eqns(jaxpr.jaxpr)
              if e.primitive.name == "dot_general" for v in e.outvars]
    rows = [s[0] for s in shapes if len(s) == 2]
    lead = [tuple(s[:2]) for s in shapes if len(s) > 2]
    assert b * p in rows
    assert b * g * p not in rows
    assert (b * g, p) not in lead


@pytest.mark.parametrize("streams", [1, 2])
def test_groups_of_any_sizes_equal_repeated_prompts(streams):
    """``prompt_index`` (knapsack allocation): rows of 1, 3, 0 and 2 samples of the four
    prompts, in any order, sample what the prompts repeated row by row sample with the same
    key, in one or two streams."""
    cfg = _cfg()
    params = models.init_params(cfg, jax.random.key(0))
    prompt, pmask = _prompts()
    index = np.asarray([3, 0, 1, 3, 1, 1], np.int32)
    kw = dict(rng=jax.random.key(9), max_new_tokens=5, temperature=1.0, pad_id=0, eos_id=1,
              num_samples=1, streams=streams)
    ragged = sampling.generate(cfg, params, prompt, pmask, prompt_index=index, **kw)
    rep = sampling.generate(cfg, params, np.asarray(prompt)[index], np.asarray(pmask)[index],
                            **kw)
    assert len(set(np.asarray(rep.tokens).ravel().tolist())) > 3   # really sampled
    for field in ("tokens", "mask", "lengths", "truncated"):
        np.testing.assert_array_equal(getattr(ragged, field), getattr(rep, field), err_msg=field)
    np.testing.assert_allclose(ragged.logps, rep.logps, atol=1e-5)
    with pytest.raises(ValueError, match="prompt_index must be int"):
        sampling.generate(cfg, params, prompt, pmask, prompt_index=np.asarray([4]), **kw)


@pytest.mark.parametrize("draw", ["gumbel", "inverse_cdf", "greedy"])
def test_streams_sample_what_one_stream_samples(draw, monkeypatch):
    """generate(streams=k): k concurrent chunks of prompts, each reading its rows of the whole
    batch's noise, give one stream's tokens (logps to float32 rounding), stop ids,
    min_new_tokens and top-p included; a count that does not divide the prompts runs fewer."""
    if draw == "inverse_cdf":
        monkeypatch.setattr(sampling.draw, "INVERSE_CDF_MIN_VOCAB", 8)
    cfg = _cfg(vocab_size=32)
    params = models.init_params(cfg, jax.random.key(0))
    prompt, pmask = _prompts(rows=[[1, 2, 3], [4, 5], [6, 7, 8, 9], [3], [9, 9], [2, 4, 6]])
    kw = dict(rng=jax.random.key(3), max_new_tokens=9, temperature=0.0 if draw == "greedy"
              else 1.0, top_p=0.9, eos_id=1, pad_id=0, num_samples=2, min_new_tokens=2)
    one = sampling.generate(cfg, params, prompt, pmask, streams=1, **kw)
    if draw != "greedy":
        assert len(set(np.asarray(one.tokens).ravel().tolist())) > 3   # really sampled
    for k, runs in ((2, 2), (4, 3)):   # 4 does not divide 6 prompts: 3 run
        assert sampling.stream_count(k, 6, 9, cfg.vocab_size, draw == "greedy", 2) == runs
        out = sampling.generate(cfg, params, prompt, pmask, streams=k, **kw)
        for field in ("tokens", "mask", "lengths", "truncated"):
            np.testing.assert_array_equal(getattr(out, field), getattr(one, field), err_msg=field)
        np.testing.assert_allclose(out.logps, one.logps, rtol=1e-5, atol=1e-5)
    # Too much noise to draw ahead: the per-step draws depend on the batch, so one stream.
    monkeypatch.setattr(sampling.draw, "NOISE_AHEAD_MAX_ELEMENTS", 0)
    assert sampling.stream_count(2, 6, 9, cfg.vocab_size, False, 2) == 1
    assert sampling.stream_count(2, 6, 9, cfg.vocab_size, True, 2) == 2   # greedy: no noise
    with pytest.raises(ValueError, match="streams must be >= 0"):
        sampling.generate(cfg, params, prompt, pmask, streams=-1, **kw)
    traced = jax.jit(lambda t, m: sampling.generate(cfg, params, t, m, streams=2, **kw).tokens)
    np.testing.assert_array_equal(traced(prompt, pmask), one.tokens)   # one program in a trace


def test_streams_are_one_under_a_multi_device_mesh():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    assert sampling.stream_count(2, 8, 4, 512, False, mesh=mesh) == 1
    assert sampling.stream_count(2, 8, 4, 512, False) == 2


def test_same_bucket_does_not_recompile():
    cfg = _cfg()
    params = models.init_params(cfg, jax.random.key(0))
    kw = dict(max_new_tokens=3, temperature=1.0, pad_id=0, eos_id=1, num_samples=2)
    a, am = _prompts(rows=[[1, 2, 3], [4, 5]], bucket=16)
    b, bm = _prompts(rows=[[6, 7, 8, 9, 10, 11], [12]], bucket=16)
    sampling.generate(cfg, params, a, am, rng=jax.random.key(0), **kw)
    before = sampling.core._generate._cache_size()
    out = sampling.generate(cfg, params, b, bm, rng=jax.random.key(1), **kw)
    assert sampling.core._generate._cache_size() == before
    assert out.tokens.shape == (4, 3)
    c, cm = _prompts(rows=[[1, 2, 3]], bucket=32)
    sampling.generate(cfg, params, c, cm, rng=jax.random.key(0), **kw)
    assert sampling.core._generate._cache_size() == before + 1  # a new bucket compiles once


def test_compile_for_startup_reaches_the_sampler(monkeypatch):
    """Under ``compile_for="startup"`` generate runs a twin of ``_generate`` built with the
    sampler's compiler options: a bad option fails its compile, and the real ones sample the
    same tokens (log-probs to float32 rounding) as XLA's defaults."""
    cfg = _cfg()
    params = models.init_params(cfg, jax.random.key(0))
    p, pm = _prompts()
    kw = dict(max_new_tokens=6, temperature=1.0, pad_id=0, eos_id=1, num_samples=2,
              rng=jax.random.key(3))
    monkeypatch.setenv("XLA_FLAGS", "")   # read per call: the suite's own flags would win
    monkeypatch.setattr(compilation_cache, "_compile_for", "throughput")
    assert sampling.core._generate_program() is sampling.core._generate
    ref = sampling.generate(cfg, params, p, pm, **kw)
    compilation_cache.set_compile_for("startup")
    assert sampling.core._generate_program() is not sampling.core._generate
    out = sampling.generate(cfg, params, p, pm, **kw)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_allclose(out.logps, ref.logps, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(compilation_cache, "sampler_compiler_options",
                        lambda: {"xla_backend_optimization_level": "not-a-level"})
    with pytest.raises(Exception, match="xla_backend_optimization_level"):
        sampling.generate(cfg, params, p, pm, **kw)


# ----------------------------------------------------------------------------- sharded

def test_sharded_greedy_equals_unsharded():
    cfg = _cfg()
    params = models.init_params(cfg, jax.random.key(0))
    prompt, pmask = _prompts()
    kw = dict(rng=jax.random.key(0), max_new_tokens=5, temperature=0.0, pad_id=0, num_samples=2)
    ref = sampling.generate(cfg, params, prompt, pmask, **kw)
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    shardings = sharding.logical_to_sharding(models.param_logical_axes(cfg), mesh, shapes=params)
    sparams = sharding.shard_params(params, shardings)
    sprompt = sharding.shard_batch({"t": prompt, "m": pmask}, mesh)
    out = sampling.generate(cfg, sparams, sprompt["t"], sprompt["m"], mesh=mesh, **kw)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_allclose(out.logps, ref.logps, atol=1e-5)
    # The completion batch stays split over the data-parallel axes.
    assert out.tokens.sharding.spec[0] == ("data", "fsdp")
    # The caller's params were used as given: still sharded, not copied/replaced.
    assert sparams["layers"]["q"].sharding.spec == shardings["layers"]["q"].spec


# ----------------------------------------------------------------------------- regressions

def _big_transposes(hlo_text, min_elements):
    """Shapes of `transpose` ops (fused or not) producing at least `min_elements` elements."""
    import re
    out = []
    for m in re.finditer(r"= [a-z0-9]+\[([0-9,]*)\]\{[0-9,]*\} transpose\(", hlo_text):
        dims = [int(d) for d in m.group(1).split(",") if d]
        if int(np.prod(dims)) >= min_elements:
            out.append(dims)
    return out


def test_decode_loop_does_not_transpose_the_kv_cache():
    # Regression: with a [L, B, S, K, Dh] cache the compiled decode loop transposed a copy of
    # every layer's K and V slice at every step (cost grew with the cache, not with the work).
    cfg = _cfg(num_layers=3)
    params = models.init_params(cfg, jax.random.key(0))
    prompt, pmask = _prompts()
    b, p, n, g = prompt.shape[0], prompt.shape[1], 29, 2  # S = 37 slots
    compiled = sampling.core._generate.lower(
        cfg, params, jnp.asarray(prompt), jnp.asarray(pmask), jax.random.key(0),
        max_new_tokens=n, temperature=1.0, top_k=0, top_p=1.0, stop_ids=(), pad_id=0,
        num_samples=g, min_new_tokens=0, mesh=None, rules=(), cache_dtype=None).compile()
    hlo = compiled.as_text()
    cache = models.init_cache(cfg, b * g, p + n)
    assert cache["k"].shape == (cfg.num_layers, b * g, cfg.num_kv_heads, p + n, cfg.head_dim)
    layer_slice = int(np.prod(cache["k"].shape[1:]))
    assert "while" in hlo
    assert _big_transposes(hlo, layer_slice) == []


def test_out_of_range_prompt_ids():
    cfg = _cfg()
    params = models.init_params(cfg, jax.random.key(0))
    prompt, pmask = _prompts()
    bad = prompt.copy()
    bad[0, -1] = cfg.vocab_size + 3
    with pytest.raises(ValueError, match=rf"{cfg.vocab_size + 3}.*vocab_size {cfg.vocab_size}"):
        sampling.generate(cfg, params, bad, pmask, rng=jax.random.key(0), max_new_tokens=2)
    # Ids under the padding mask are not checked (they are never attended to).
    padded = prompt.copy()
    padded[~pmask] = -1
    sampling.generate(cfg, params, padded, pmask, rng=jax.random.key(0), max_new_tokens=2)


# ----------------------------------------------------------------------------- decode loop cost

def _fresh_generate():
    """A separate jit of ``_generate``: module constants are read when it traces."""
    return jax.jit(sampling.core._generate.__wrapped__, static_argnames=sampling.core._STATIC)


@pytest.mark.parametrize("draw", ["gumbel", "inverse_cdf"])
def test_noise_drawn_ahead_gives_the_per_step_tokens(draw, monkeypatch):
    """generate draws every step's noise before the loop (NOISE_AHEAD_MAX_ELEMENTS): the same
    numbers as drawing fold_in(rng, t) inside each step, so the same tokens and logps."""
    if draw == "inverse_cdf":
        monkeypatch.setattr(sampling.draw, "INVERSE_CDF_MIN_VOCAB", 8)
    cfg = _cfg(vocab_size=32)
    params = models.init_params(cfg, jax.random.key(0))
    prompt, pmask = _prompts(rows=[[1, 2, 3], [4, 5], [6, 7, 8, 9]])
    kw = dict(max_new_tokens=9, temperature=1.0, top_k=0, top_p=0.9, stop_ids=(1,), pad_id=0,
              num_samples=2, min_new_tokens=2, mesh=None, rules=(), cache_dtype=None)
    args = (cfg, params, jnp.asarray(prompt), jnp.asarray(pmask), jax.random.key(3))
    ahead = _fresh_generate()(*args, **kw)
    monkeypatch.setattr(sampling.draw, "NOISE_AHEAD_MAX_ELEMENTS", 0)
    per_step = _fresh_generate()(*args, **kw)
    np.testing.assert_array_equal(ahead.tokens, per_step.tokens)
    # Two programs (noise as an input vs drawn in the loop): the same log-softmax, which another
    # CPU type may round differently in the last bit.
    np.testing.assert_allclose(ahead.logps, per_step.logps, rtol=1e-6, atol=1e-6)
    assert len(set(np.asarray(ahead.tokens).ravel().tolist())) > 3   # really sampled


def test_sample_logits_noise_is_the_categorical_draw():
    """The Gumbel path is jax.random.categorical's draw, noise passed in or drawn from rng."""
    logits = jax.random.normal(jax.random.key(1), (16, 50)) * 2.0
    for seed in range(3):
        key = jax.random.key(seed)
        want = jax.random.categorical(key, logits, axis=-1)
        got, _ = sampling.sample_logits(key, logits)
        ahead, _ = sampling.sample_logits(None, logits, noise=sampling.draw_noise(key, 16, 50))
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(ahead, want)


def _while_bodies(hlo_text):
    """{computation name: instruction lines} of every computation used as a while body."""
    import re
    comps, cur = {}, None
    for line in hlo_text.splitlines():
        if line and not line.startswith(" ") and "{" in line:
            cur = line.split(" ")[0].lstrip("%")
            comps[cur] = []
        elif cur is not None and line.startswith("  "):
            comps[cur].append(line)
    bodies = {m.group(1) for m in re.finditer(r"body=%?([\w.\-]+)", hlo_text)}
    return {name: comps[name] for name in bodies if name in comps}


def test_decode_loop_reads_layer_weights_and_cache_in_place():
    # Regression: with the layers scanned inside the decode loop, XLA:CPU copied every layer's
    # weight matrices and its [B, K, S, Dh] cache slices out of the stacks at every step (at
    # SmolLM2-135M: ~750 MB copied per token). Unstacked before the loop, no while body produces
    # an array of a layer weight's shape, and the cache slices only as in-place updates.
    cfg = _cfg(num_layers=3, hidden_size=48, intermediate_size=80, num_heads=4, num_kv_heads=2,
               head_dim=16)
    params = models.init_params(cfg, jax.random.key(0))
    prompt, pmask = _prompts()
    b, p, n, g = prompt.shape[0], prompt.shape[1], 13, 2
    hlo = sampling.core._generate.lower(
        cfg, params, jnp.asarray(prompt), jnp.asarray(pmask), jax.random.key(0),
        max_new_tokens=n, temperature=1.0, top_k=0, top_p=1.0, stop_ids=(), pad_id=0,
        num_samples=g, min_new_tokens=0, mesh=None, rules=(), cache_dtype=None
    ).compile().as_text()
    d, f, dh = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    weights = {(d, f), (f, d), (d, cfg.num_heads * dh), (cfg.num_heads * dh, d),
               (d, cfg.num_kv_heads * dh), (d, cfg.num_heads, dh), (cfg.num_heads, dh, d),
               (d, cfg.num_kv_heads, dh)}
    cache_slice = (b * g, cfg.num_kv_heads, p + n, dh)
    # The decode loop (and, before, its nested layer scan): the while bodies that run [B*G, D]
    # activations (the prefill's layer scan runs B*P rows).
    rows = (f"f32[{b * g},{d}]", f"f32[{b * g},1,{d}]")
    bodies = {name: lines for name, lines in _while_bodies(hlo).items()
              if any(r in line for line in lines for r in rows)}
    assert bodies
    import re
    for name, lines in bodies.items():
        for line in lines:
            m = re.match(r"\s+(?:ROOT )?%\S+ = f32\[([0-9,]*)\]\S* (\S+?)\(", line)
            if not m or m.group(2) in ("parameter", "get-tuple-element", "bitcast"):
                continue
            shape = tuple(int(x) for x in m.group(1).split(",") if x)
            assert shape not in weights, (name, line.strip()[:160])
            if shape == cache_slice:
                assert "dynamic-update-slice" in line, (name, line.strip()[:160])


def test_top_k_threshold_equals_lax_top_k_with_ties_and_extremes():
    """The bisection threshold is lax.top_k's k-th largest value (with multiplicity): ties
    at the k-th entry, negative values, float32 min (filtered) entries, k = 1 and V - 1."""
    rng = np.random.default_rng(0)
    rows = [rng.normal(size=64) * 10,
            np.repeat(rng.normal(size=8), 8),                       # every value 8 times
            np.concatenate([np.full(60, np.finfo(np.float32).min), rng.normal(size=4)]),
            -np.abs(rng.normal(size=64)) - 1e30,
            np.zeros(64)]
    x = jnp.asarray(np.stack(rows), jnp.float32)
    for k in (1, 2, 5, 7, 8, 9, 33, 63):
        want = jax.lax.top_k(x, k)[0][:, -1:]
        got = sampling.draw._top_k_threshold(x, k)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"k={k}")


def test_first_argmax_and_last_positive_equal_numpy():
    """The max/min reductions that replace argmax in the sampler pick the same indices,
    ties (first maximum) and rows of -inf included."""
    rng = np.random.default_rng(0)
    for b, v in [(64, 259), (4, 49152), (3, 7)]:
        x = rng.normal(size=(b, v)).astype(np.float32)
        x[0, [2, 5]] = x[0].max() + 1.0     # a tie: the first index wins
        x[1] = -np.inf
        np.testing.assert_array_equal(sampling.first_argmax(jnp.asarray(x)), np.argmax(x, -1))
        m = (rng.random((b, v)) < 0.3).astype(np.float32)
        m[1] = 0.0                          # no positive entry: the last index
        want = v - 1 - np.argmax((m > 0)[:, ::-1], -1)
        np.testing.assert_array_equal(sampling.draw._last_positive(jnp.asarray(m)), want)
