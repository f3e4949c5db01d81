"""Partial rollouts: the pool's carried samples, their policy versions and staleness bound, the
decoupled loss against its formula, exact resume, and the one-line refusals."""
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import algorithms, config, models, sampling
from rljax.data import selection
from rljax.sampling import engine, partial, tree_partial
from rljax.train import run
from rljax.train.core import checkpoint
from rljax.train.core.metrics import read_metrics
from rljax.train.core.partial import PartialRounds
from rljax.train.phases import grpo

from test_train_loop import StopAfter, comparable, final_params, resumes_exactly, tiny_cfg

PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [6], [2, 7, 1, 1, 4]]
G, N = 6, 10


@pytest.fixture(scope="module")
def small_vocab():
    """Vocabulary 8 with a sharpened head: stop tokens come often, at uneven lengths."""
    cfg = models.get_preset("tiny", init_std=0.1, vocab_size=8)
    params = models.init_params(cfg, jax.random.key(3))
    return cfg, dict(params, lm_head=params["lm_head"] * 3.0)


def _pool(cfg, temperature=1.0, slots=5, chunk_steps=2):
    pool = partial.Pool(cfg, num_samples=G, max_new_tokens=N, groups=len(PROMPTS), prompt_len=8,
                        slots=slots, chunk_steps=chunk_steps, temperature=temperature, eos_id=3,
                        pad_id=0)
    pool.admit(PROMPTS, list(range(len(PROMPTS))))
    return pool


def _by_group(taken, into):
    for i, meta in enumerate(taken.metas):
        into[meta] = {k: v[i * G:(i + 1) * G] for k, v in taken.rows.items()}


def test_greedy_pool_samples_what_the_static_sampler_samples(small_vocab):
    cfg, params = small_vocab
    taken = _pool(cfg, temperature=0.0, slots=24, chunk_steps=64).run(
        params, jax.random.key(5), version=0, want=4)
    prompt, pmask = sampling.pad_to_bucket(PROMPTS, pad_id=0, buckets=(8,))
    ref = sampling.generate(cfg, params, prompt, pmask, rng=jax.random.key(4), max_new_tokens=N,
                            temperature=0.0, num_samples=G, eos_id=3, pad_id=0)
    got = {}
    _by_group(taken, got)
    tokens = np.concatenate([got[i]["tokens"] for i in range(4)])
    np.testing.assert_array_equal(tokens, np.asarray(ref.tokens))


def test_carried_samples_record_their_versions_and_continue_exactly(small_vocab):
    """One group per run: the others stop mid-decode and continue in the next run from caches
    rebuilt from their tokens. Under unchanged weights that is the uninterrupted sample; each
    token records the run (version) that drew it."""
    cfg, params = small_vocab
    key = jax.random.key(5)
    straight = {}
    _by_group(_pool(cfg, slots=24, chunk_steps=64).run(params, key, version=0, want=4), straight)
    pool, got, version, drawn = _pool(cfg), {}, 0, 0
    compiled = None
    while len(got) < 4:
        taken = pool.run(params, key, version=version, want=1)
        assert taken.dropped_stale == 0
        _by_group(taken, got)
        version, drawn = version + 1, drawn + taken.drawn
        sizes = (partial._pool_prefill._cache_size(), engine.decode_chunk._cache_size())
        assert compiled in (None, sizes)   # one program each, whatever the pool holds
        compiled = sizes
    assert version == 4
    assert drawn == sum(int(got[i]["lengths"].sum()) for i in range(4))   # each token once
    carried = 0
    for i in range(4):
        np.testing.assert_array_equal(got[i]["tokens"], straight[i]["tokens"])
        np.testing.assert_allclose(got[i]["logps"], straight[i]["logps"], rtol=1e-5, atol=1e-5)
        v, m = got[i]["versions"], got[i]["mask"]
        assert np.all(v[~m] == -1) and np.all((v[m] >= 0) & (v[m] < version))
        assert np.all(np.diff(np.where(m, v, version), axis=1) >= 0)   # in decode order
        carried += int(v[m].max() > v[m].min())
    assert carried > 0   # some sample spans several versions


def test_max_staleness_restarts_groups_and_counts_their_samples(small_vocab):
    cfg, params = small_vocab
    key = jax.random.key(5)
    for bound, drops in ((0, True), (1, False)):
        pool = _pool(cfg)
        first = pool.run(params, key, version=0, want=1)
        started = int((pool.lengths > 0).sum())   # the other groups' samples with tokens
        assert started > 0 and first.dropped_stale == 0
        taken = pool.run(params, key, version=1, want=1, max_staleness=bound)
        assert taken.dropped_stale == (started if drops else 0)
        stale = 1 - taken.rows["versions"][taken.rows["mask"]]
        assert stale.max() <= bound
        if drops:   # every token of this run was drawn by version 1
            assert np.all(stale == 0)


@pytest.mark.parametrize("sizes", [None, [2, 6, 1, 3]])
def test_the_pool_state_round_trips(small_vocab, sizes):
    """``sizes``: groups of their own sizes (knapsack allocation), rows past a group's size
    never drawn; the sizes travel with the state."""
    cfg, params = small_vocab
    key = jax.random.key(5)
    a = _pool(cfg)
    if sizes is not None:
        a.reset()
        a.admit(PROMPTS, list(range(len(PROMPTS))), sizes)
    a.run(params, key, version=0, want=1)
    b = _pool(cfg)
    b.load_state_dict(a.state_dict())
    ta, tb = (p.run(params, key, version=1, want=2) for p in (a, b))
    for k in ta.rows:
        np.testing.assert_array_equal(ta.rows[k], tb.rows[k])
    assert ta.metas == tb.metas and ta.sizes == tb.sizes
    want = [G if sizes is None else sizes[m] for m in ta.metas]
    assert ta.sizes == want and len(ta.rows["tokens"]) == sum(want)
    with pytest.raises(ValueError, match="admit: 1 groups for 0 free places"):
        _pool(cfg).admit([[1]], [None])


TREE = dict(max_new_tokens=8, segment_tokens=2, branching=2, depth=2, roots=1)


def _tree_pool(cfg):
    pool = tree_partial.TreePool(cfg, **TREE, groups=len(PROMPTS), prompt_len=8, slots=5,
                                 chunk_steps=2, eos_id=5, pad_id=0)
    pool.admit(PROMPTS, list(range(len(PROMPTS))))
    return pool


def test_carried_trees_are_the_trees_an_uncarried_run_grows(small_vocab):
    """One tree per run: the others stop at a level boundary and grow their next level in the
    next run (re-prefilled). Under unchanged weights each equals the tree an uncarried run
    grows (all four in one run); trees come out in completion order (one whose paths all
    stopped early first); each token keeps its run's version; a pool restored from another's
    state continues exactly, and restarts its stale trees. (A tree reads the draws the slot
    engine's tree sampler makes for its prompt alone with ``fold_in(key, serial)``.)"""
    cfg, params = small_vocab
    key = jax.random.key(5)
    pool, got, order, version = _tree_pool(cfg), {}, [], 0
    while len(got) < 4:
        taken = pool.run(params, key, version=version, want=1)
        order += taken.metas
        for i, meta in enumerate(taken.metas):
            got[meta] = dict({k: v[i * 4:(i + 1) * 4] for k, v in taken.rows.items()},
                             decoded=taken.decoded[i])
        version += 1
        if version == 1:   # restored after the first run: continues as the original
            restored, strict = _tree_pool(cfg), _tree_pool(cfg)
            restored.load_state_dict(pool.state_dict())
            again = restored.run(params, key, version=1, want=2)
            strict.load_state_dict(pool.state_dict())   # with no stale token allowed
            fresh = strict.run(params, key, version=1, want=2, max_staleness=0)
    assert order == [0, 3, 1, 2]   # admission order is 0, 1, 2, 3
    straight = _tree_pool(cfg).run(params, key, version=0, want=4)   # all in one run
    assert straight.metas == [0, 3, 1, 2]
    for i, meta in enumerate(straight.metas):
        for k in ("tokens", "lengths", "truncated"):
            np.testing.assert_array_equal(got[meta][k], straight.rows[k][i * 4:(i + 1) * 4])
        np.testing.assert_allclose(got[meta]["logps"], straight.rows["logps"][i * 4:(i + 1) * 4],
                                   rtol=1e-5, atol=1e-5)
        assert got[meta]["decoded"] == straight.decoded[i]
    spans = [np.unique(got[i]["versions"][got[i]["mask"]]) for i in range(4)]
    assert [s.tolist() for s in spans] == [[0], [0, 2], [0, 2, 3], [0]]   # carried trees
    for i, meta in enumerate(again.metas):
        np.testing.assert_array_equal(again.rows["tokens"][i * 4:(i + 1) * 4],
                                      got[meta]["tokens"])
    assert again.metas == [3, 1]
    # Stale trees restart from their prompts (the 3 carried ones, their paths counted).
    assert fresh.dropped_stale > 0 and np.all(fresh.rows["versions"][fresh.rows["mask"]] == 1)


def test_the_pools_examples_round_trip_exactly_through_the_checkpoint_json():
    """An image's uint8 array and encoded bytes come back as they were (a resumed run decodes
    the pixels of the groups in flight again from their examples)."""
    from rljax.train.core import partial as rounds
    image = np.arange(12, dtype=np.uint8).reshape(2, 2, 3)
    metas = [{"prompt": "p", "images": image, "raw": [{"bytes": b"\x89PNG\x00", "path": None}],
              "n": np.int64(3)}, None]
    back = rounds.from_json_field(json.loads(json.dumps(metas, default=rounds.json_field)))
    assert back[0]["images"].dtype == np.uint8
    np.testing.assert_array_equal(back[0]["images"], image)
    assert back[0]["raw"] == [{"bytes": b"\x89PNG\x00", "path": None}]
    assert back[0]["n"] == 3 and back[0]["prompt"] == "p" and back[1] is None


@pytest.mark.parametrize("cap", [None, 2.0])
def test_the_decoupled_loss_equals_its_formula(cap):
    """l_t = min(pi_prox / pi_behav, C) * max(-A u, -A clip(u, 1 - eps, 1 + eps_high)),
    u = pi_theta / pi_prox: GRPO's options under rollout.partial, the loss by hand. Without
    ``algo.tis_cap`` the weight is uncapped (C = inf); with it, the cap binds."""
    cfg = config.default_config()
    cfg.algo.tis_cap = cap
    cfg = config.validate(cfg)
    opts = grpo.policy_loss_options(cfg.algo, partial=True)
    assert opts.get("clip_ratio_c") is None and opts.get("ratio_level") == "token"
    assert opts["tis_cap"] == (cap or np.inf)
    if cap is None:
        assert "tis_cap" not in grpo.policy_loss_options(cfg.algo)
    rng = np.random.default_rng(0)
    logps = rng.normal(-1.5, 0.5, (3, 5)).astype(np.float32)
    prox = logps + rng.normal(0, 0.3, (3, 5)).astype(np.float32)
    behav = prox + rng.normal(0, 1.0, (3, 5)).astype(np.float32)
    adv = np.asarray([1.0, -0.5, 2.0], np.float32)
    mask = rng.random((3, 5)) > 0.2
    eps, eps_high, c = opts["epsilon"], opts.get("epsilon_high", opts["epsilon"]), cap or np.inf
    loss, metrics = algorithms.get_policy_loss("ppo")(
        jnp.asarray(logps), jnp.asarray(prox), jnp.asarray(adv), jnp.asarray(mask),
        sampler_logps=jnp.asarray(behav), **opts)
    u = np.exp(logps - prox)
    a = adv[:, None]
    want = np.minimum(np.exp(prox - behav), c) * np.maximum(
        -a * u, -a * np.clip(u, 1 - eps, 1 + eps_high))
    np.testing.assert_allclose(np.asarray(loss), np.where(mask, want, 0.0), rtol=1e-5,
                               atol=1e-6)
    w = np.minimum(np.exp(prox - behav), c)[mask]
    np.testing.assert_allclose(float(metrics["tis_weight"][0]), w.sum(), rtol=1e-5)
    if cap is None:
        assert (w > 2.0).any()                    # no truncation at the old default of 2
    else:
        assert (w == cap).any() and (w < cap).any()   # the cap binds somewhere, not everywhere


def test_grpo_loss_applies_the_behaviour_weight_only_under_partial_rollouts():
    """grpo_loss(partial=True) on a tiny model: pg_loss is the token mean of the formula above
    with pi_theta the model's own log-probs, pi_prox = old_logps, pi_behav = sampler_logps."""
    from test_train_steps import MODEL, algo_cfg, fresh_state, make_batch
    from rljax.train.core import steps
    state, _ = fresh_state()
    batch = make_batch()
    m = batch["loss_mask"]
    logps = np.asarray(steps.completion_logps(MODEL, state.params, batch)[0])
    rng = np.random.default_rng(1)
    batch["old_logps"] = np.where(m, logps + rng.normal(0, 0.2, m.shape), 0).astype(np.float32)
    batch["sampler_logps"] = np.where(m, batch["old_logps"] + rng.normal(0, 1.0, m.shape),
                                      0).astype(np.float32)
    algo = algo_cfg(beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_agg_mode="token-mean",
                    entropy_coef=0.0)
    u = np.exp(logps - batch["old_logps"])
    a = batch["advantages"][:, None]
    w = np.minimum(np.exp(batch["old_logps"] - batch["sampler_logps"]),
                   grpo.PARTIAL_BEHAVIOUR_CAP)
    surrogate = np.maximum(-a * u, -a * np.clip(u, 0.8, 1.28))
    for partial_on, weight in ((True, w), (False, 1.0)):
        (num, den), metrics = grpo.grpo_loss(MODEL, algo, 1.0, state.params, state, batch,
                                             partial=partial_on)
        want = np.where(m, weight * surrogate, 0).sum() / m.sum()
        np.testing.assert_allclose(float(num) / float(den), want, rtol=1e-5, atol=1e-6)
        assert ("tis_weight" in metrics) == partial_on


def _partial_cfg(**overrides):
    return tiny_cfg(**{"sft.steps": 0, "steps": 4, "rollout.engine": "slots",
                       "rollout.partial": True, "rollout.slots": 8, "rollout.chunk_steps": 2,
                       "rollout.max_new_tokens": 8, **overrides})


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("partial_straight"))
    assert run.train(_partial_cfg(), workdir, devices=jax.devices()[:1]) == 0
    return workdir


def test_training_reports_staleness(straight):
    rl = [r for r in read_metrics(straight) if "reward/mean" in r]
    assert len(rl) == 4
    assert rl[0]["rollout/staleness_max"] == 0 and rl[0]["rollout/carried_groups"] == 4
    assert max(r["rollout/staleness_max"] for r in rl) >= 1   # carried samples trained
    assert all(r["rollout/staleness_max"] <= 2 and r["rollout/dropped_stale"] >= 0
               and 0 <= r["rollout/staleness_mean"] <= r["rollout/staleness_max"]
               and "tis_weight" in r for r in rl)


def test_training_with_max_staleness_0_trains_only_fresh_tokens(tmp_path):
    workdir = str(tmp_path)
    assert run.train(_partial_cfg(**{"steps": 2, "rollout.max_staleness": 0}), workdir,
                     devices=jax.devices()[:1]) == 0
    rl = [r for r in read_metrics(workdir) if "reward/mean" in r]
    assert all(r["rollout/staleness_max"] == 0 for r in rl)
    assert sum(r["rollout/dropped_stale"] for r in rl) > 0   # carried groups restarted


def test_stop_and_resume_equals_straight_run(straight, tmp_path):
    workdir = str(tmp_path)
    devices = jax.devices()[:1]
    assert run.train(_partial_cfg(), workdir, devices=devices, stop=StopAfter(2)) == 0
    with checkpoint.CheckpointManager(checkpoint.checkpoint_dir(workdir)) as ckpt:
        assert ckpt.latest_step() == 2
    assert run.train(_partial_cfg(), workdir, devices=devices) == 0
    assert comparable(read_metrics(workdir)) == comparable(read_metrics(straight))
    jax.tree.map(np.testing.assert_array_equal, final_params(workdir), final_params(straight))


def test_dynamic_sampling_and_relift_take_groups_as_they_complete_and_resume_exactly(
        tmp_path):
    """algo.dynamic_sampling with partial rollouts: a group whose rewards are all equal is
    dropped and the pool decodes on until enough informative groups complete (extra rounds,
    each taking the next groups to complete); the staleness metrics cover every round's
    tokens. Hints re-sample a completed group that failed, by the current policy; ReLIFT's
    buffer sees each group when it completes and its SFT step follows every second update.
    Stopped after update 2 and resumed, the run equals the straight one."""
    def cfg():
        c = _partial_cfg(**{
            "steps": 4, "algo.dynamic_sampling": True, "reward.names": ("arithmetic", "length"),
            "reward.kwargs": {"length": {"max_length": 8, "buffer": 6}},
            "algo.relift.every": 2, "algo.relift.batch_size": 4, "algo.relift.k_visits": 1,
            "algo.hint.mode": "adaptive", "algo.hint.source": "replay"})
        c.data.kwargs = {"digits": 1, "eval_examples": 8, "num_examples": 8}  # prompts revisit
        return config.validate(c)

    straight, _ = resumes_exactly(cfg, tmp_path, stop_after=2)
    rl = [r for r in read_metrics(straight) if "reward/mean" in r]
    assert any(r["rollout/rounds"] > 1 for r in rl), [r["rollout/rounds"] for r in rl]
    assert max(r["rollout/staleness_max"] for r in rl) >= 1
    assert ["relift/sft_loss" in r for r in rl] == [False, True, False, True]
    assert any(r["hint/fraction_hinted"] > 0 for r in rl)


def test_mixed_policy_and_mopps_take_groups_as_they_complete_and_resume_exactly(
        tmp_path, monkeypatch):
    """algo.mixed_policy with partial rollouts: each completed group that failed gets the
    reference solution in place of its last sample (behaviour and old log-probs 0, mu = 1, so
    the behaviour weight is 1; the staleness metrics count the tokens the pool drew, the
    replaced sample's included). MoPPS selection (data.selection.name='predicted') picks the
    prompts admitted; each completed group's rewards (the policy's, before the demonstration)
    update the posterior of the prompt it was drawn for, iterations earlier if it was carried:
    after 4 updates the posteriors are exactly those groups' updates. Stopped after update 2
    and resumed, the run (posteriors included) equals the straight one."""
    drawn, taken = spy_on_prompts(monkeypatch, PartialRounds)

    def cfg():
        c = _partial_cfg(**{"algo.mixed_policy": True, "data.selection.name": "predicted"})
        c.data.kwargs = {"digits": 1, "eval_examples": 8, "num_examples": 8}  # prompts revisit
        return config.validate(c)

    straight, split = resumes_exactly(cfg, tmp_path, stop_after=2)
    rl = [r for r in read_metrics(straight) if "reward/mean" in r]
    assert all(r["mixed/demos"] > 0 for r in rl)
    assert max(r["rollout/staleness_max"] for r in rl) >= 1   # carried groups among them
    # The straight run's 4 rounds, each group's prompt by the dataset index it was drawn at;
    # some were drawn in an earlier round (carried).
    assert any(not set(map(id, ex)) <= now for ex, _, now in taken[1:4])
    posteriors = [posteriors_of(w) for w in (straight, split)]
    assert posteriors[0] == posteriors[1] == mopps_posteriors(cfg(), drawn, taken[:4])


def mopps_posteriors(cfg, drawn, taken) -> list:
    """The MoPPS posteriors (``[index, a, b]`` in recency order) after the rounds ``taken``
    (``spy_on_prompts``'): each group's successes update its own prompt's, in order."""
    sel, g = cfg.data.selection, cfg.algo.num_generations
    want: dict = {}
    for examples, rewards, _ in taken:
        wins = selection.group_successes(rewards, g, sel.threshold, sel.fractional)
        for ex, s in zip(examples, wins):
            a, b = want.pop(drawn[id(ex)], (sel.prior_a, sel.prior_b))
            want[drawn[id(ex)]] = selection.beta_update(a, b, float(s), g, decay=sel.decay,
                                                        prior_a=sel.prior_a, prior_b=sel.prior_b)
    return [[i, a, b] for i, (a, b) in want.items()]


def spy_on_prompts(monkeypatch, rounds_cls):
    """(drawn, taken): ``drawn[id(example)]`` is the dataset index each example was drawn at
    (the data iterator's own record), ``taken`` per round of ``rounds_cls`` (a round source):
    its groups' examples, their rewards (before any stage) and the ids of the examples drawn
    during that round."""
    from rljax.data.iterator import DataIterator
    drawn, keep, taken = {}, [], []   # keep: every batch (ids stay unique while they live)
    next_batch, sample_round = DataIterator.__next__, rounds_cls.sample_round

    def draw(self):
        batch = next_batch(self)
        keep.append(batch)
        drawn.update({id(ex): int(i) for ex, i in zip(batch, self.last_indices)})
        return batch

    def round_(self, rollout, params, rng=None):
        start = len(keep)
        rnd = sample_round(self, rollout, params, rng)
        now = {id(ex) for batch in keep[start:] for ex in batch}
        taken.append((list(rnd["examples"]), np.array(rnd["rewards"]), now))
        return rnd

    monkeypatch.setattr(DataIterator, "__next__", draw)
    monkeypatch.setattr(rounds_cls, "sample_round", round_)
    return drawn, taken


def posteriors_of(workdir) -> list:
    """The MoPPS posteriors the run's last checkpoint holds."""
    with checkpoint.CheckpointManager(checkpoint.checkpoint_dir(workdir)) as ckpt:
        return ckpt.restore_meta()["phase_state"]["data"]["selection"]["posteriors"]


@pytest.mark.parametrize("change, message", [
    ({"rollout.engine": "static"},
     "rollout.partial=true needs rollout.engine='slots' (got 'static')"),
    ({"algo.name": "dpo"},   # (offline: no rounds to carry)
     "rollout.partial=true needs algo.name='grpo', 'distill', 'ppo' or online 'dpo'"),
    ({"rollout.micro_batch_size": 8},
     "rollout.partial=true has no meaning with rollout.micro_batch_size"),
    ({"rollout.max_staleness": -1}, "rollout.max_staleness"),
])
def test_refusals_are_one_line(change, message):
    cfg = config.default_config()
    cfg.update_from_flattened_dict({"rollout.engine": "slots", "rollout.partial": True,
                                    **change})
    with pytest.raises(config.ConfigError, match=re.escape(message)) as err:
        config.validate(cfg)
    assert "\n" not in str(err.value)


def test_the_plan_plans_the_pools_programs():
    from rljax import plan as plan_lib
    planned = plan_lib.plan(_partial_cfg(), jax.devices()[:1])
    names = {p.name for p in planned.phases}
    assert {"sample/prefill", "sample/decode"} <= names and "sample" not in names
