"""Tests for rljax.sampling.tree: parity with sampling.generate, log-probs against a full
forward, the same trees on the slot engine (sampling.tree_engine), shared prefixes,
decoded-token counts, static shapes, determinism, layout helpers."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import models, sampling
from rljax.sampling import tree as ts

PROMPTS = [[5, 17, 3, 99, 42], [7, 8], [9, 10, 11, 12, 13, 14, 15], [200, 1, 2]]
SMALL_PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [6], [2, 7, 1, 1, 4]]  # for the vocab-8 model


def _prompts(rows=PROMPTS, bucket=8):
    return sampling.pad_to_bucket(rows, pad_id=0, buckets=(bucket,))


@pytest.fixture(scope="module")
def tiny():
    cfg = models.get_preset("tiny", init_std=0.1)
    return cfg, models.init_params(cfg, jax.random.key(0))


@pytest.fixture(scope="module")
def small_vocab():
    """Vocab 8, sharpened head: the stop token (1) is sampled often, so paths end early."""
    cfg = models.get_preset("tiny", init_std=0.1, vocab_size=8)
    params = models.init_params(cfg, jax.random.key(3))
    return cfg, dict(params, lm_head=params["lm_head"] * 3.0)


def _full_forward_logps(cfg, params, prompt, pmask, out, temperature):
    """models.token_logps over prompt ++ completion: f32 [rows, N], 0 outside the mask."""
    seq = jnp.concatenate([jnp.asarray(prompt), out.tokens], axis=1)
    mask = jnp.concatenate([jnp.asarray(pmask), out.mask], axis=1)
    lp, _ = models.token_logps(cfg, params, seq, attention_mask=mask, temperature=temperature)
    return np.where(out.mask, np.asarray(lp)[:, prompt.shape[1]:], 0.0)


# A temperature schedule: every position its own temperature (a tree's segments included).
SCHEDULE = sampling.temperature_schedule("linear", 1.3, 0.4, 7, 7)


@pytest.mark.parametrize("temperature, temperatures", [(0.0, None), (1.0, None),
                                                       (1.0, SCHEDULE)])
def test_branching_one_equals_generate(tiny, temperature, temperatures):
    cfg, params = tiny
    prompt, pmask = _prompts()
    kw = dict(rng=jax.random.key(3), max_new_tokens=7, temperature=temperature, eos_id=1,
              pad_id=0, temperatures=temperatures)
    ref = sampling.generate(cfg, params, prompt, pmask, num_samples=3, **kw)
    out = ts.generate(cfg, params, prompt, pmask, segment_tokens=3, branching=1, depth=2,
                      roots=3, **kw)
    # Same key, same [rows, V] draws per position: the same samples, not only the same law.
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.logps, ref.logps)
    np.testing.assert_array_equal(out.mask, ref.mask)
    np.testing.assert_array_equal(out.lengths, ref.lengths)
    np.testing.assert_array_equal(out.truncated, ref.truncated)


def test_leaf_logps_equal_full_forward(small_vocab):
    temperature = 0.7   # the sampler's log-probs are under softmax(logits / T)
    cfg, params = small_vocab
    prompt, pmask = _prompts(SMALL_PROMPTS)
    out = ts.generate(cfg, params, prompt, pmask, rng=jax.random.key(5), max_new_tokens=9,
                      segment_tokens=2, branching=2, depth=3, roots=2, temperature=temperature,
                      eos_id=1, pad_id=0)
    m = 2 * 2 ** 3
    assert out.tokens.shape == (4 * m, 9) and out.node_ids.shape == (4 * m, 4)
    # Some paths stopped before the last level (their children are copies): the test covers it.
    assert int(out.lengths.min()) < 6 and bool(out.truncated.any())
    ref = _full_forward_logps(cfg, params, np.repeat(prompt, m, 0), np.repeat(pmask, m, 0), out,
                              temperature)
    np.testing.assert_allclose(out.logps, ref, atol=2e-5, rtol=0)
    np.testing.assert_array_equal(out.tokens[~out.mask], 0)   # pad after the stop token


def test_the_slot_engine_grows_the_static_samplers_trees(small_vocab):
    """Forks served as slot-engine requests (prompt + path re-prefilled, 3 slots refilled
    across paths): each token reads the static tree sampler's draw for its (prompt, path,
    position), so the sampled trees are the same, paths stopped early included."""
    from rljax.sampling import tree_engine

    cfg, params = small_vocab
    prompt, pmask = _prompts(SMALL_PROMPTS)
    kw = dict(rng=jax.random.key(5), max_new_tokens=9, segment_tokens=2, branching=2, depth=3,
              roots=2, temperature=0.7, eos_id=1, pad_id=0)
    ref = ts.generate(cfg, params, prompt, pmask, **kw)
    out, stats = tree_engine.generate(cfg, params, prompt, pmask, slots=3, chunk_steps=2, **kw)
    assert int(ref.lengths.min()) < 6 and bool(ref.truncated.any())   # some paths stopped
    for key in ("tokens", "mask", "lengths", "truncated", "node_ids", "decoded"):
        np.testing.assert_array_equal(getattr(out, key), np.asarray(getattr(ref, key)), key)
    np.testing.assert_allclose(out.logps, ref.logps, atol=2e-5, rtol=0)
    assert len(stats) == 4 and sum(st.useful_steps for st in stats) > 0


def test_tree_structure_shared_prefixes_and_decoded_count(small_vocab):
    cfg, params = small_vocab
    prompt, pmask = _prompts(SMALL_PROMPTS)
    n, seg, k, d, r = 9, 2, 2, 3, 2
    # The same static arguments as test_leaf_logps_equal_full_forward: no second compile.
    out = ts.generate(cfg, params, prompt, pmask, rng=jax.random.key(7), max_new_tokens=n,
                      segment_tokens=seg, branching=k, depth=d, roots=r, temperature=0.7,
                      eos_id=1, pad_id=0)
    tokens, mask = np.asarray(out.tokens), np.asarray(out.mask)
    node_ids = np.asarray(out.node_ids)
    m = r * k ** d
    level = ts.segment_of_position(n, seg, d)
    expected_decoded, distinct = [], []
    for i in range(len(SMALL_PROMPTS)):
        rows = slice(i * m, (i + 1) * m)
        tok, msk, nid = tokens[rows], mask[rows], node_ids[rows]
        count = 0
        for j in range(d + 1):
            upto = level <= j
            for node in np.unique(nid[:, j]):
                members = np.flatnonzero(nid[:, j] == node)
                # Leaves of one node share every token up to the end of its segment.
                assert (tok[members][:, upto] == tok[members[0]][upto]).all()
                assert (msk[members][:, upto] == msk[members[0]][upto]).all()
                count += int(msk[members[0]][level == j].sum())  # the node's segment, once
        expected_decoded.append(count)
        distinct.append(len({tuple(t) for t in tok}))
    # Siblings are separate draws: some differ (more distinct leaves than roots).
    assert max(distinct) > r
    np.testing.assert_array_equal(out.decoded, expected_decoded)
    assert int(out.decoded.sum()) < int(out.lengths.sum())   # shared prefixes decoded once


def test_static_shapes_one_compile_and_determinism(tiny):
    cfg, params = tiny
    kw = dict(max_new_tokens=5, segment_tokens=1, branching=2, depth=2, roots=1,
              temperature=1.0, eos_id=1, pad_id=0)
    a, am = _prompts([[1, 2, 3], [4, 5]], bucket=16)
    b, bm = _prompts([[6, 7, 8, 9, 10, 11], [12]], bucket=16)
    first = ts.generate(cfg, params, a, am, rng=jax.random.key(0), **kw)
    before = ts._tree_generate._cache_size()
    out = ts.generate(cfg, params, b, bm, rng=jax.random.key(1), **kw)
    assert ts._tree_generate._cache_size() == before   # a second input: no new program
    assert out.tokens.shape == first.tokens.shape == (8, 5)
    again = ts.generate(cfg, params, a, am, rng=jax.random.key(0), **kw)
    for x, y in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
        np.testing.assert_array_equal(x, y)
    other = ts.generate(cfg, params, a, am, rng=jax.random.key(2), **kw)
    assert not np.array_equal(other.tokens, first.tokens)


def _walk_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (list, tuple)) else [v]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _walk_eqns(inner)


def test_prompt_prefilled_once_and_levels_run_at_their_width(tiny):
    cfg, params = tiny
    prompt, pmask = _prompts()
    b, p = prompt.shape
    kw = dict(rng=jax.random.key(0), max_new_tokens=6, segment_tokens=2, branching=2, depth=2,
              roots=1, temperature=1.0, pad_id=0)
    jaxpr = jax.make_jaxpr(lambda pr: ts.generate(cfg, pr, prompt, pmask, **kw))(params)
    shapes = [v.aval.shape for e in _walk_eqns(jaxpr.jaxpr)
              if e.primitive.name == "dot_general" for v in e.outvars]
    rows = {s[0] for s in shapes if len(s) == 2}
    assert b * p in rows                       # the prefill, at batch B
    assert not {b * 2 * p, b * 4 * p} & rows   # never at the fanned-out widths
    # The vocabulary projection runs at each level's width: B, 2B, 4B rows (1, 2, 4 paths).
    vocab_rows = {s[0] for s in shapes if len(s) == 2 and s[1] == cfg.vocab_size}
    assert {b, 2 * b, 4 * b} <= vocab_rows


def test_layout_and_depth_helpers():
    node_ids, parents = ts.tree_layout(roots=2, branching=2, depth=2)
    np.testing.assert_array_equal(node_ids, [[0, 2, 6], [0, 2, 7], [0, 3, 8], [0, 3, 9],
                                             [1, 4, 10], [1, 4, 11], [1, 5, 12], [1, 5, 13]])
    np.testing.assert_array_equal(parents, [-1, -1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5])
    # Every leaf's path follows the parents table.
    for row in node_ids:
        for j in range(1, 3):
            assert parents[row[j]] == row[j - 1]
    assert ts.tree_depth(2, 2, 8) == 2 and ts.tree_depth(1, 3, 9) == 2
    assert ts.tree_depth(4, 1, 4) == 0 and ts.tree_depth(1, 2, 6) is None
    assert ts.tree_depth(3, 2, 8) is None and ts.tree_depth(1, 1, 2) is None
    np.testing.assert_array_equal(ts.segment_of_position(7, 2, 2), [0, 0, 1, 1, 2, 2, 2])
    with pytest.raises(ValueError, match="must be < max_new_tokens"):
        ts.check_tree(6, 3, 2, 2, 1)
    with pytest.raises(ValueError, match="branching >= 1"):
        ts.check_tree(6, 1, 0, 2, 1)


def test_sharded_equals_unsharded(tiny):
    from rljax import sharding
    cfg, params = tiny
    prompt, pmask = _prompts()
    kw = dict(rng=jax.random.key(0), max_new_tokens=5, segment_tokens=1, branching=2, depth=2,
              roots=1, temperature=0.0, pad_id=0, eos_id=1)
    ref = ts.generate(cfg, params, prompt, pmask, **kw)
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    shardings = sharding.logical_to_sharding(models.param_logical_axes(cfg), mesh, shapes=params)
    sparams = sharding.shard_params(params, shardings)
    sprompt = sharding.shard_batch({"t": prompt, "m": pmask}, mesh)
    out = ts.generate(cfg, sparams, sprompt["t"], sprompt["m"], mesh=mesh, **kw)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_allclose(out.logps, ref.logps, atol=1e-5)
    np.testing.assert_array_equal(out.decoded, ref.decoded)
    assert out.tokens.sharding.spec[0] == ("data", "fsdp")   # leaves stay split over data
