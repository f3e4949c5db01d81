"""The slot engine samples what the static sampler samples, whatever the slots and chunks.

Tokens are compared exactly (the two programs' logits differ by float32 rounding only, and these
models' draws are far from ties, as in tests/test_sampling.py); log-probs with a tolerance."""
import jax
import numpy as np
import pytest

from rljax import models, sampling
from rljax.sampling import engine

PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [6], [2, 7, 1, 1, 4]]


@pytest.fixture(scope="module")
def small_vocab():
    """Vocabulary 8 with a sharpened head: stop tokens come often, at uneven lengths."""
    cfg = models.get_preset("tiny", init_std=0.1, vocab_size=8)
    params = models.init_params(cfg, jax.random.key(3))
    return cfg, dict(params, lm_head=params["lm_head"] * 3.0)


def _prompts():
    return sampling.pad_to_bucket(PROMPTS, pad_id=0, buckets=(8,))


def _assert_same(out, ref):
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ref.lengths))
    np.testing.assert_array_equal(np.asarray(out.mask), np.asarray(ref.mask))
    np.testing.assert_array_equal(np.asarray(out.truncated), np.asarray(ref.truncated))
    # two programs: the slot step's attention sums its prompt page and its own tokens apart
    np.testing.assert_allclose(np.asarray(out.logps), np.asarray(ref.logps), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_any_slots_and_chunks_give_the_static_samplers_completions(small_vocab, temperature):
    cfg, params = small_vocab
    prompt, pmask = _prompts()
    kw = dict(rng=jax.random.key(4), max_new_tokens=10, temperature=temperature, pad_id=0,
              num_samples=6, eos_id=3, stop_ids=(5,), min_new_tokens=2)
    ref = sampling.generate(cfg, params, prompt, pmask, **kw)
    assert 0 < int(np.asarray(ref.truncated).sum()) < 24   # uneven: some rows stop early
    utilisation = {}
    # one slot reused for every row, fewer slots than a prompt's samples, every row its slot
    for slots, chunk in ((1, 64), (5, 3), (7, 1), (24, 16)):
        out, stats = engine.generate(cfg, params, prompt, pmask, slots=slots, chunk_steps=chunk,
                                     **kw)
        _assert_same(out, ref)
        assert stats.rows == 24 and stats.slots == slots
        assert stats.useful_steps == int(np.asarray(ref.lengths).sum()) - 24
        utilisation[slots] = stats.slot_utilisation
    assert utilisation[1] == 1.0   # one slot is never idle
    assert utilisation[5] > engine.static_utilisation(np.asarray(ref.lengths))


def test_filters_and_a_temperature_schedule(small_vocab):
    cfg, params = small_vocab
    prompt, pmask = _prompts()
    schedule = sampling.temperature_schedule("linear", 1.5, 0.5, 0, 8)
    for extra in (dict(temperature=0.8, top_k=4, top_p=0.9), dict(temperatures=schedule)):
        kw = dict(rng=jax.random.key(9), max_new_tokens=8, pad_id=0, num_samples=3, eos_id=3,
                  **extra)
        ref = sampling.generate(cfg, params, prompt, pmask, **kw)
        out, _ = engine.generate(cfg, params, prompt, pmask, slots=4, chunk_steps=2, **kw)
        _assert_same(out, ref)


def test_logps_are_the_models(small_vocab):
    cfg, params = small_vocab
    prompt, pmask = _prompts()
    out, _ = engine.generate(cfg, params, prompt, pmask, rng=jax.random.key(1),
                             max_new_tokens=7, temperature=0.7, num_samples=2, eos_id=3,
                             slots=3, chunk_steps=2)
    seq = np.concatenate([np.repeat(prompt, 2, 0), np.asarray(out.tokens)], axis=1)
    mask = np.concatenate([np.repeat(pmask, 2, 0), np.asarray(out.mask)], axis=1)
    lp = models.token_logps(cfg, params, seq, attention_mask=mask, temperature=0.7)
    lp = lp[0] if isinstance(lp, tuple) else lp
    np.testing.assert_allclose(np.where(out.mask, lp[:, prompt.shape[1]:], 0.0), out.logps,
                               atol=1e-4)


def test_greedy_on_the_grouped_query_model_equals_the_static_sampler():
    cfg = models.get_preset("tiny", init_std=0.1)
    params = models.init_params(cfg, jax.random.key(0))
    assert cfg.num_heads > cfg.num_kv_heads   # grouped-query attention over pages
    prompt, pmask = sampling.pad_to_bucket([[5, 17, 3, 99, 42], [7, 8], [200, 1, 2]], pad_id=0,
                                           buckets=(8,))
    kw = dict(rng=jax.random.key(0), max_new_tokens=12, temperature=0.0, num_samples=2,
              eos_id=7)
    ref = sampling.generate(cfg, params, prompt, pmask, **kw)
    out, _ = engine.generate(cfg, params, prompt, pmask, slots=2, chunk_steps=5, **kw)
    _assert_same(out, ref)


def test_bad_arguments_are_one_line(small_vocab):
    cfg, params = small_vocab
    prompt, pmask = _prompts()
    with pytest.raises(ValueError, match="slots and chunk_steps must be >= 1"):
        engine.generate(cfg, params, prompt, pmask, rng=jax.random.key(0), max_new_tokens=4,
                        slots=0)


def test_static_utilisation():
    assert engine.static_utilisation(np.array([4, 4])) == 1.0
    assert engine.static_utilisation(np.array([1, 3])) == pytest.approx(4 / 6)


def test_params_sharded_over_eight_devices_give_the_same_completions():
    from rljax import sharding
    cfg = models.get_preset("tiny", init_std=0.1)
    params = models.init_params(cfg, jax.random.key(0))
    prompt, pmask = sampling.pad_to_bucket([[5, 17, 3, 99, 42], [7, 8], [200, 1, 2], [9]],
                                           pad_id=0, buckets=(8,))
    kw = dict(rng=jax.random.key(2), max_new_tokens=6, temperature=1.0, num_samples=2,
              eos_id=7, slots=3, chunk_steps=2)
    ref, _ = engine.generate(cfg, params, prompt, pmask, **kw)
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    shardings = sharding.logical_to_sharding(models.param_logical_axes(cfg), mesh, shapes=params)
    out, _ = engine.generate(cfg, sharding.shard_params(params, shardings), prompt, pmask, **kw)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    np.testing.assert_allclose(np.asarray(out.logps), np.asarray(ref.logps), atol=1e-5)


# ---- in the trainer: rollout.engine="slots" ------------------------------------------------

def _train(tmp_path, name, **rollout):
    import json

    from rljax import cli
    from tiny_config import tiny_config_source
    path = tmp_path / f"{name}.py"
    path.write_text(tiny_config_source(steps=3, rollout=dict(batch_size=8, max_new_tokens=6,
                                                             **rollout)))
    assert cli.main(["train", "--config", str(path), "--workdir", str(tmp_path / name)]) == 0
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if '"loss"' in x or '"reward/mean"' in x]


def test_training_with_the_slot_engine_samples_what_the_static_sampler_samples(tmp_path):
    static = _train(tmp_path, "static")
    slots = _train(tmp_path, "slots", engine="slots", slots=3, chunk_steps=2)
    assert len(static) == len(slots) == 3
    for a, b in zip(static, slots):
        # the same completions: the same lengths and rewards
        for key in ("completion/length_mean", "reward/mean", "rollout/tokens"):
            assert a[key] == b[key], key
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
        assert 0 < b["rollout/slot_utilisation"] <= 1
        assert 0 < b["rollout/static_utilisation"] <= 1
        assert "rollout/slot_utilisation" not in a


def test_the_slot_engine_takes_trees_and_a_checkpoint_opponent():
    """Trees run on the engine (``sampling.tree_engine``), and so do matches against a
    checkpoint (each side on an episode engine of its own, ``matches._engine_matches``)."""
    from rljax import config
    cfg = config.default_config()
    cfg.rollout.engine = "slots"
    cfg.rollout.tree.enabled = True
    config.check(cfg)
    cfg.rollout.tree.enabled = False
    cfg.env.name, cfg.env.selfplay.mode = "tictactoe", "checkpoint"
    cfg.env.selfplay.workdir = "runs/opponent"
    config.check(cfg)


def test_routes_recorded_by_the_engine_equal_the_static_samplers():
    """Routing replay on the engine: every token's experts in every layer, in the static
    sampler's layout (prompt slots, then each completion token fed), whatever the slots."""
    cfg = models.get_preset("tiny-moe", num_layers=2, hidden_size=32, num_heads=2,
                            num_kv_heads=1, moe_intermediate_size=16, init_std=0.1)
    params = models.init_params(cfg, jax.random.key(5))
    prompt, pmask = _prompts()
    kw = dict(rng=jax.random.key(6), max_new_tokens=6, temperature=1.0, pad_id=0,
              num_samples=3, eos_id=3, record_routes=True)
    ref = sampling.generate(cfg, params, prompt, pmask, **kw)
    out, _ = engine.generate(cfg, params, prompt, pmask, slots=5, chunk_steps=2, **kw)
    _assert_same(out, ref)
    routes, want = np.asarray(out.routes), np.asarray(ref.routes)
    assert routes.shape == want.shape == (12, 8 + 6, 2, cfg.num_experts_per_tok)
    p = prompt.shape[1]
    np.testing.assert_array_equal(routes[:, :p][np.repeat(pmask, 3, 0)],
                                  want[:, :p][np.repeat(pmask, 3, 0)])
    fed = np.arange(6)[None, :] < np.asarray(ref.lengths)[:, None] - 1   # tokens fed back
    np.testing.assert_array_equal(routes[:, p:][fed], want[:, p:][fed])
    assert len(np.unique(want[:, p:][fed])) > 2   # tokens go to several experts
