"""Knapsack allocation of per-prompt samples (rollout.allocation='knapsack') and the group
estimators on groups of different sizes."""
import itertools

import numpy as np
import pytest

from rljax import algorithms, sampling
from rljax.data import allocation, selection


def _brute_force(p, budget, lo, hi, step=1):
    best, arg = -np.inf, None
    choices = [g for g in range(lo, hi + 1) if g % step == 0]
    for sizes in itertools.product(choices, repeat=len(p)):
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


def test_knapsack_in_multiples_of_a_step():
    """Tree sampling's groups are whole trees: sizes in multiples of the tree's leaves."""
    p = [0.97, 0.5, 0.03, 0.5]
    sizes = allocation.knapsack_allocate(p, 16, 1, 9, step=2)
    best, _ = _brute_force(p, 16, 1, 9, step=2)
    assert sizes.sum() == 16 and (sizes % 2 == 0).all() and sizes.max() <= 8
    assert allocation.task_value(sizes, p).sum() == pytest.approx(best, rel=1e-12)
    with pytest.raises(ValueError, match="in multiples of 4"):
        allocation.knapsack_allocate(p, 14, 1, 9, step=4)


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


# ----------------------------------------------------------------------------- in a run

REWARD = '''
def even_length(prompts, completions, **_):
    """Varied pass rates from an untrained model: 1 for an even-length completion."""
    return [float(len(c) % 2 == 0) for c in completions]
'''


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "reward.py"
    path.write_text(REWARD)
    return str(path)


def tiny_cfg(reward_file, **overrides):
    from rljax import config as config_lib
    cfg = config_lib.default_config()
    cfg.update_from_flattened_dict({
        "steps": 3, "eval_every": 0, "checkpoint_every": 0,
        "model.preset": "tiny", "tokenizer.kind": "char", "data.source": "arithmetic",
        "data.max_prompt_length": 8, "rollout.batch_size": 16, "rollout.max_new_tokens": 4,
        "algo.num_generations": 4, "algo.beta": 0.0, "optimizer.learning_rate": 1e-3,
        "sft.steps": 0, "eval.num_examples": 8, "eval.batch_size": 8,
        "logging.tensorboard": False, "checkpoint.async_save": False,
        "rollout.allocation": "knapsack", "rollout.knapsack.min_samples": 1,
        "rollout.knapsack.max_samples": 8,
    })
    cfg.model.overrides = {"num_layers": 1, "hidden_size": 32, "intermediate_size": 64,
                           "num_heads": 2, "num_kv_heads": 1}
    cfg.data.kwargs = {"digits": 3, "eval_examples": 8, "num_examples": 8}
    cfg.reward.names = (f"{reward_file}:even_length",)
    cfg.update_from_flattened_dict(overrides)
    return config_lib.validate(cfg)


@pytest.mark.parametrize("tree", [False, True])
def test_knapsack_rollout_batch(reward_file, tmp_path, tree):
    """Groups of the knapsack's sizes, padded rows that weigh zero, advantages of each
    group over its own rows, and posteriors that learn (the second step's sizes differ).
    ``tree``: a group is whole trees (2 roots x 2 leaves configured: trees of 2 leaves, the
    sizes even), the two leaves of a tree sharing its first segment; the batch trains."""
    import jax
    from rljax.train import inference
    from rljax.train.core import setup
    from rljax.train.phases import make_phases

    step = 2 if tree else 1
    cfg = tiny_cfg(reward_file, **{"rollout.knapsack.budget": 14, **({
        "rollout.tree.enabled": True, "rollout.tree.roots": 2, "rollout.tree.branching": 2,
        "rollout.tree.segment_tokens": 1} if tree else {})})
    ctx = setup.build_context(cfg, str(tmp_path), devices=jax.devices()[:1])
    phase = make_phases(ctx)[-1]
    rounds = []
    original = phase.rollout.sample_round
    phase.rollout.sample_round = lambda *a: rounds.append(original(*a)) or rounds[-1]
    state = inference.start_phase(ctx, phase, inference.initial_state(ctx))
    for step_ in range(2):
        rounds.clear()
        batch, metrics = phase.rollout(state, step_)
        (rnd,) = rounds
        sizes = rnd["group_sizes"]
        assert sizes.sum() == 14 and sizes.min() >= 1 and sizes.max() <= 8
        assert (sizes % step == 0).all()
        if tree:   # each tree's leaves share the root's first segment
            first = rnd["tokens"][:, 0].reshape(-1, 2)
            assert (first[:, 0] == first[:, 1]).all() and len(np.unique(first)) > 1
        assert batch["tokens"].shape[0] == 16 and not batch["loss_mask"][14:].any()
        want = _per_group_sizes("grpo", rnd["rewards"], sizes)
        np.testing.assert_allclose(batch["advantages"][:14], want, rtol=1e-5, atol=1e-6)
        assert np.all(batch["advantages"][14:] == 0)
        assert metrics["rollout/group_size_max"] == sizes.max()
        assert metrics["rollout/effective_samples"] == int((want != 0).sum())
        if step_ == 0:   # flat priors: as even as the budget allows
            assert sizes.max() - sizes.min() <= step
            sizes_before = sizes
    assert not np.array_equal(sizes_before, sizes) or np.ptp(rnd["pass_rates"]) == 0
    if tree:
        _, metrics = phase.iteration(state, 2)
        assert np.isfinite(metrics["loss"]) and metrics["rollout/group_size_min"] % 2 == 0
    # A plain rollout with the knapsack as its round source; the phase saves the posteriors
    # under the key earlier checkpoints have.
    from rljax.train.core.rollout import Rollout
    from rljax.train.methods.allocation import KnapsackRounds
    assert type(phase.rollout) is Rollout and isinstance(phase.rollout.rounds, KnapsackRounds)
    saved = phase.state_dict()
    assert saved["allocation"] == {"pass_rates": phase.rollout.rounds.rates.state()}
    assert "partial" not in saved


def test_knapsack_in_micro_batches_samples_the_rows_of_one_call(reward_file, tmp_path,
                                                                monkeypatch):
    """rollout.micro_batch_size=4 with a budget of 14: the rows are sampled in 4 sampler
    calls of 4 rows (the last padded), and the batch equals the one-call batch row for row,
    each row drawing from its own key."""
    import jax
    from rljax.train import inference
    from rljax.train.core import setup
    from rljax.train.methods import allocation
    from rljax.train.phases import make_phases

    calls = []
    generate = allocation.generate
    monkeypatch.setattr(allocation, "generate", lambda *a, **k: calls.append(
        len(k["prompt_index"])) or generate(*a, **k))
    batches = []
    for micro in (0, 4):
        cfg = tiny_cfg(reward_file, **{"rollout.knapsack.budget": 14,
                                       "rollout.micro_batch_size": micro})
        ctx = setup.build_context(cfg, str(tmp_path / str(micro)), devices=jax.devices()[:1])
        phase = make_phases(ctx)[-1]
        state = inference.start_phase(ctx, phase, inference.initial_state(ctx))
        batches.append(phase.rollout(state, 0)[0])
    assert calls == [14, 4, 4, 4, 4]
    whole, chunked = batches
    assert len({tuple(r) for r in whole["tokens"][:14]}) > 7   # sampled, not all alike
    for key in ("tokens", "mask", "loss_mask", "advantages"):
        np.testing.assert_array_equal(chunked[key], whole[key], err_msg=key)
    np.testing.assert_allclose(chunked["sampler_logps"], whole["sampler_logps"], atol=1e-5)


def _per_group_sizes(name, rewards, sizes):
    fn = algorithms.get_advantage_estimator(name)
    out, start = [], 0
    for g in sizes:
        out.append(np.asarray(fn(rewards[start:start + g], int(g))))
        start += g
    return np.concatenate(out)


def test_the_slot_engine_samples_ragged_groups_as_the_static_sampler(reward_file, tmp_path):
    """Groups of any sizes (``prompt_index``) on the slot engine: greedy rows equal the static
    sampler's, row for row (each row continues its own prompt)."""
    import jax
    from rljax.train.core import sampler, setup

    owner = np.array([0, 0, 0, 1, 2, 2, 3, 3, 3, 3], np.int32)
    outs = []
    for engine in ("static", "slots"):
        cfg = tiny_cfg(reward_file, **{"rollout.engine": engine, "rollout.slots": 4})
        ctx = setup.build_context(cfg, str(tmp_path / engine), devices=jax.devices()[:1])
        tok, mask = sampling.pad_to_bucket([[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]],
                                           pad_id=0, buckets=(8,))
        outs.append(sampler.generate(ctx, ctx.params, tok, mask, jax.random.key(3),
                                     num_samples=1, max_new_tokens=4, temperature=0.0,
                                     prompt_index=owner))
    static, slots = outs
    assert static["tokens"].shape == slots["tokens"].shape == (len(owner), 4)
    assert len({tuple(r) for r in static["tokens"]}) > 1   # the prompts lead apart
    np.testing.assert_array_equal(slots["tokens"], static["tokens"])
    np.testing.assert_array_equal(slots["lengths"], static["lengths"])


@pytest.mark.parametrize("selection_name, engine", [("uniform", "static"),
                                                    ("predicted", "static"),
                                                    ("curriculum", "slots")])
def test_knapsack_train_run(reward_file, tmp_path, selection_name, engine):
    """A short run, with the round source's own pass rates, with MoPPS's posterior, and with a
    curriculum on the slot engine; the update computes each prompt once (the ragged
    shared-prompt layout)."""
    import jax
    from rljax.train import run
    from rljax.train.core.metrics import read_metrics

    cfg = tiny_cfg(reward_file, **{"data.selection.name": selection_name, "steps": 2,
                                   "rollout.engine": engine, "rollout.slots": 4,
                                   # a curriculum on the digits, raised by every round
                                   "data.selection.knob": "digits", "data.selection.window": 1,
                                   "data.selection.threshold": 0.0, "data.selection.high": 0.5})
    assert run.train(cfg, str(tmp_path), devices=jax.devices()[:1]) == 0
    rl = [r for r in read_metrics(str(tmp_path)) if "reward/mean" in r]
    assert len(rl) == 2 and all(np.isfinite(r["loss"]) for r in rl)
    assert all(1 <= r["rollout/group_size_min"] <= r["rollout/group_size_max"] <= 8
               and r["rollout/group_size_mean"] == 4.0 for r in rl)
    assert all(0 <= r["rollout/effective_samples"] <= 16 for r in rl)
    # Groups of any sizes still compute each prompt once in the update.
    assert all(r["update/shared_prompt"] == 1.0 for r in rl)
    if engine == "slots":
        assert all(0 < r["rollout/slot_utilisation"] <= 1 for r in rl)
    if selection_name == "curriculum":
        assert [r["selection/level"] for r in rl] == [2, 3]


def test_knapsack_with_batches_sampled_ahead_resumes_exactly(reward_file, tmp_path):
    """algo.asynchronous: the sampler sizes the groups of the batch it draws ahead from the
    pass rates observed so far, and MoPPS (``data.selection.name='predicted'``) picks its
    prompts from its posteriors; both travel with the batches in flight: a run stopped after
    update 2 and resumed (batch 4 picked and sized after the restore) equals the straight
    run."""
    from rljax.train.core.metrics import read_metrics
    from test_train_loop import resumes_exactly

    cfg = lambda: tiny_cfg(reward_file, **{  # noqa: E731
        "steps": 4, "algo.asynchronous": True, "rollout.knapsack.budget": 14,
        "data.selection.name": "predicted", "data.selection.pool_factor": 2})
    straight, _ = resumes_exactly(cfg, tmp_path, stop_after=2)
    rl = [r for r in read_metrics(straight) if "reward/mean" in r]
    assert [r["rollout/sample_version"] for r in rl] == [0, 0, 1, 2]
    assert any(r["rollout/group_size_max"] > r["rollout/group_size_min"] for r in rl)
    assert rl[-1]["selection/tracked"] > 4


@pytest.mark.parametrize("guide", ["mixed_policy", "hints"])
def test_knapsack_with_guidance_resumes_exactly(reward_file, tmp_path, monkeypatch, guide):
    """ReLIFT with mixed-policy demonstrations or hints on groups of the knapsack's sizes: a
    group is the rows its prompt was given. A demonstration replaces exactly the last row of
    each group whose own samples all failed (padding rows are never demonstrations); hints
    re-sample each failed group at its own size, its rows now continuing prompt + hint.
    ReLIFT's buffer sees every group and its SFT step follows each update. Stopped after
    update 1 and resumed, the run equals the straight one."""
    from rljax.train.core.metrics import read_metrics
    from rljax.train.methods.guidance import Guide
    from test_train_loop import resumes_exactly

    seen = []   # per round: group sizes, the policy's rewards and prompt ids, the round after
    after_round = Guide.after_round

    def spy(self, rollout, params, rnd, rng):
        before = (np.array(rnd["group_sizes"]), np.array(rnd["rewards"]),
                  list(rnd["prompt_ids"]))
        seen.append((*before, after_round(self, rollout, params, rnd, rng)))
        return seen[-1][-1]
    monkeypatch.setattr(Guide, "after_round", spy)
    cfg = lambda: tiny_cfg(reward_file, **{  # noqa: E731
        "steps": 2, "seed": 4,   # (draws with failed and passed groups in both steps)
        "rollout.knapsack.budget": 10, "rollout.max_new_tokens": 3,
        "algo.relift.every": 1, "algo.relift.batch_size": 4, "algo.relift.k_visits": 1,
        **({"algo.mixed_policy": True} if guide == "mixed_policy" else
           {"algo.hint.mode": "fixed", "algo.hint.fraction": 0.5})})
    straight, _ = resumes_exactly(cfg, tmp_path, stop_after=1)
    rl = [r for r in read_metrics(straight) if "reward/mean" in r]
    for (sizes, rewards, prompt_ids, rnd), r in zip(seen[:2], rl):
        ends = np.cumsum(sizes)
        failed = np.add.reduceat(rewards >= 1.0, ends - sizes) == 0
        assert 0 < failed.sum() < len(sizes) and sizes.max() > sizes.min()
        if guide == "mixed_policy":
            assert np.flatnonzero(rnd["demo"]).tolist() == (ends - 1)[failed].tolist()
            assert r["mixed/demos"] == failed.sum()
            continue
        longer = [len(a) > len(b) for a, b in zip(rnd["prompt_ids"], prompt_ids)]
        assert longer == np.repeat(failed, sizes).tolist()   # every row of a failed group
        assert r["hint/fraction_hinted"] == failed.mean()
    assert all("relift/sft_loss" in r for r in rl)


@pytest.mark.parametrize("group_filter", ["algo.dynamic_sampling", "data.selection.name"])
def test_knapsack_with_group_filters_resumes_exactly(reward_file, tmp_path, monkeypatch,
                                                     group_filter):
    """Dynamic sampling (groups whose rewards differ) and the online filter (groups whose
    pass rate is in the band) on groups of the knapsack's sizes: every round is sized by the
    knapsack over its own prompts, the batch is the kept groups, in order, that fit in the
    update's rows (padding rows weigh zero), and sampling stops once they hold a round's
    budget. Stopped after update 1 and resumed (dynamic sampling), the run equals the
    straight one."""
    import jax
    from rljax.train import run
    from rljax.train.core.rollout import Rollout
    from rljax.train.methods.allocation import KnapsackRounds
    from test_train_loop import resumes_exactly

    calls = []   # per rollout call: its rounds, the groups it picked, the rows that train
    assemble, call = KnapsackRounds.assemble, Rollout.__call__
    monkeypatch.setattr(KnapsackRounds, "assemble", lambda self, ro, rounds, groups: (
        calls.append([list(rounds), list(groups)]) or assemble(self, ro, rounds, groups)))
    monkeypatch.setattr(Rollout, "__call__", lambda self, state, step: (
        lambda out: calls[-1].append(out[0]["loss_mask"].any(1)) or out)(call(self, state, step)))
    filters = {"algo.dynamic_sampling": True} if group_filter == "algo.dynamic_sampling" else {
        "data.selection.name": "online_filter", "data.selection.low": 0.2,
        "data.selection.high": 0.6}
    cfg = lambda: tiny_cfg(reward_file, **{  # noqa: E731
        "steps": 2, "seed": 4,   # (draws with groups both kept and dropped)
        "rollout.knapsack.budget": 12, "rollout.max_new_tokens": 3,
        "algo.max_sampling_rounds": 2, **filters})
    if group_filter == "algo.dynamic_sampling":
        resumes_exactly(cfg, tmp_path, stop_after=1)
    else:   # (resuming the filter's own state is test_selection's)
        assert run.train(cfg(), str(tmp_path), devices=jax.devices()[:1]) == 0
    dropped = 0
    for rounds, groups, trains in calls[:2]:   # the straight run's two steps
        sizes = [int(n) for rnd in rounds for n in rnd["group_sizes"]]
        pairs = [(r, i) for r, rnd in enumerate(rounds) for i in range(len(rnd["group_sizes"]))]
        signal = np.concatenate([
            allocation.informative_groups(rnd["rewards"], rnd["group_sizes"])
            if group_filter == "algo.dynamic_sampling" else selection.in_band(
                selection.group_successes(rnd["rewards"], rnd["group_sizes"])
                / rnd["group_sizes"], 0.2, 0.6) for rnd in rounds])
        picked, rows = [], 0
        for g, n, ok in zip(pairs, sizes, signal):   # first fit in the update's 16 rows
            if ok and rows + n <= 16:
                picked, rows = picked + [g], rows + n
        assert groups == picked and picked
        assert trains.tolist() == [True] * rows + [False] * (16 - rows)
        # More rounds only while the kept groups hold less than a round's budget of 12.
        held = np.cumsum([np.dot(sizes, signal * (np.array(pairs)[:, 0] == r))
                          for r in range(len(rounds))])
        assert (held[:-1] < 12).all() and (held[-1] >= 12 or len(rounds) == 3)
        dropped += int((~signal).sum())
    assert dropped and max(len(c[0]) for c in calls[:2]) > 1   # it dropped, it sampled more


def phase_resumes_exactly(cfg, tmp_path, steps: int, saved_after: int) -> list[dict]:
    """Runs ``steps`` iterations of ``cfg``'s GRPO phase, and again from the phase's host
    state saved after ``saved_after`` of them (through JSON, as a checkpoint holds it) in a
    new phase; asserts the resumed iterations' metrics (wall-clock values aside) and final
    parameters equal the straight ones. Returns the straight metrics. (One process: the
    update program is compiled once and shared, the cheap way to a resumed run.)"""
    import json

    import jax
    from rljax.train import inference
    from rljax.train.core import setup
    from rljax.train.phases import make_phases
    from test_train_loop import comparable

    ctx = setup.build_context(cfg, str(tmp_path), devices=jax.devices()[:1])

    def fresh():
        phase = make_phases(ctx)[-1]
        return phase, inference.start_phase(ctx, phase, inference.initial_state(ctx))
    phase, state = fresh()
    records = []
    for step in range(steps):
        if step == saved_after:   # (the update donates the state: a copy resumes)
            saved = json.loads(json.dumps(phase.state_dict()))
            kept = jax.tree.map(lambda x: x.copy(), state)
        state, metrics = phase.iteration(state, step)
        records.append(metrics)
    resumed, _ = fresh()
    resumed.load_state_dict(saved)
    resumed._step_fn = phase._step_fn
    for step in range(saved_after, steps):
        kept, metrics = resumed.iteration(kept, step)
        assert comparable([metrics]) == comparable([records[step]]), step
    jax.tree.map(np.testing.assert_array_equal, kept.params, state.params)
    return records


@pytest.mark.parametrize("guide", ["hints", "mixed_policy"])
def test_knapsack_with_episodes_resumes_exactly(reward_file, tmp_path, monkeypatch, guide):
    """Multi-turn episodes (a tool agent) with per-turn credit: example i's group is G_i
    episodes, the turn advantages are each group's over its own episodes (the padding row is
    a group of one: zero), and the two prompts come back every step, so the second step is
    sized by the posteriors, which resume exactly. Every group counts as failed (a threshold
    no reward reaches): hints play it again after a hint, or its last episode is the
    example's scripted one (a demonstration)."""
    from rljax.algorithms import turn_credit
    from rljax.train.methods.episode_credit import TurnCredit

    seen = []   # per call: rows' turn returns, turns, group ids; the advantages per turn
    spread = turn_credit.spread_over_turns
    monkeypatch.setattr(turn_credit, "spread_over_turns", lambda per_turn, ids: (
        seen[-1].append(per_turn) or spread(per_turn, ids)))
    advantages = TurnCredit.advantages

    def spy(self, rollout, state, rewards, mask, rows, batch):
        seen.append([turn_credit.turn_returns(rows["turn_rewards"], rows["turns"], 0.5),
                     rows["turns"], rows["estimator_inputs"]["group_ids"]])
        return advantages(self, rollout, state, rewards, mask, rows, batch)
    monkeypatch.setattr(TurnCredit, "advantages", spy)

    cfg = tiny_cfg(reward_file, **{
        "rollout.batch_size": 8, "rollout.knapsack.budget": 7,
        "rollout.knapsack.max_samples": 5, "env.name": "tool", "env.tools": ("calculator",),
        "env.tool_format": "plain", "env.max_turns": 2, "env.max_total_tokens": 28,
        "env.max_obs_tokens": 8, "env.max_turn_tokens": 8, "env.turn_discount": 0.5,
        "algo.hint.threshold": 9.0, "data.max_prompt_length": 16,
        **({"algo.mixed_policy": True} if guide == "mixed_policy" else
           {"algo.hint.mode": "fixed"})})
    cfg.env.kwargs = {"describe_tools": False}
    cfg.data.kwargs = {"digits": 1, "eval_examples": 2, "num_examples": 2}
    records = phase_resumes_exactly(cfg, tmp_path, steps=2, saved_after=1)
    assert all(r["rollout/group_size_mean"] == 3.5 and "env/turns_mean" in r for r in records)
    if guide == "hints":   # failed groups played again at their own sizes
        assert all(r["hint/fraction_hinted"] == 1.0 for r in records)
    else:                  # a demonstration per group (the padding row repeats none)
        assert all(r["mixed/demos"] == 2 for r in records)
    assert all(np.isfinite(r["loss"]) and r["update/shared_prompt"] == 1.0 for r in records)
    for returns, turns, group_ids, per_turn in seen:
        sizes = np.bincount(group_ids)
        assert len(sizes) == 3 and sizes[-1] == 1 and sizes.sum() == 8   # 7 + 1 padding row
        want = [turn_credit.turn_advantages(returns[group_ids == k], turns[group_ids == k],
                                            int(n)) for k, n in enumerate(sizes)]
        np.testing.assert_allclose(per_turn, np.concatenate(want), rtol=1e-5, atol=1e-6)
    assert np.ptp(np.bincount(seen[1][2])[:2]) > 0   # the posteriors sized the second step


def test_knapsack_with_tree_episodes_resumes_exactly(reward_file, tmp_path, monkeypatch):
    """Tree rollouts of tool episodes: a group is whole trees of first turns (2 roots x 2
    leaves configured: trees of 2 leaves, one root each), each leaf played on as an episode;
    the two prompts' budget of 6 is split 4 + 2 (2 padding rows), and the posteriors, which
    learn the episodes' rewards, resume exactly."""
    from rljax.train.core import episodes

    played, real = [], episodes.run_episodes
    monkeypatch.setattr(episodes, "run_episodes", lambda *a, **kw: played.append(
        real(*a, **kw)) or played[-1])
    cfg = tiny_cfg(reward_file, **{
        "rollout.batch_size": 8, "rollout.knapsack.budget": 6,
        "rollout.knapsack.max_samples": 4, "env.name": "tool", "env.tools": ("calculator",),
        "env.tool_format": "plain", "env.max_turns": 2, "env.max_total_tokens": 28,
        "env.max_obs_tokens": 8, "env.max_turn_tokens": 8, "data.max_prompt_length": 16,
        "rollout.tree.enabled": True, "rollout.tree.roots": 2, "rollout.tree.branching": 2,
        "rollout.tree.segment_tokens": 1})
    cfg.env.kwargs = {"describe_tools": False}
    cfg.data.kwargs = {"digits": 1, "eval_examples": 2, "num_examples": 2}
    records = phase_resumes_exactly(cfg, tmp_path, steps=2, saved_after=1)
    assert all(r["rollout/group_size_min"] == 2 and r["rollout/group_size_max"] == 4
               and "env/turns_mean" in r and np.isfinite(r["loss"]) for r in records)
    assert len(played) == 3   # two steps, the resumed one again
    for eps in played:   # 3 trees of 2 episodes: a tree's leaves share their first token
        first = np.where(eps["turn_ids"] == 0, eps["tokens"], -1)[:, 0].reshape(3, 2)
        assert (first[:, 0] == first[:, 1]).all() and (eps["turns"] >= 1).all()


def test_knapsack_with_partial_tree_episodes_resumes_exactly(reward_file, tmp_path):
    """Partial rollouts of tree episodes with knapsack sizes: a place of G_i episodes grows
    G_i / 2 trees of 2 leaves (one root each) as its first turns, carried at turn boundaries
    with the pool; the budget of 6 is split 2 + 4, and the run resumes exactly."""
    from rljax.train.methods.episode_partial import EpisodePartialRounds

    grown, grow = [], EpisodePartialRounds._grow_trees

    def spy(self, *args, **kw):   # the rows each grown place's trees gave first turns
        decoded, swaps, first = grow(self, *args, **kw)
        grown.extend(sum(map(bool, first[n:n + self.rows]))
                     for n in range(0, len(first), self.rows) if first[n])
        return decoded, swaps, first
    cfg = tiny_cfg(reward_file, **{
        "rollout.batch_size": 8, "rollout.knapsack.budget": 6,
        "rollout.knapsack.max_samples": 4, "env.name": "tool", "env.tools": ("calculator",),
        "env.tool_format": "plain", "env.max_turns": 2, "env.max_total_tokens": 28,
        "env.max_obs_tokens": 8, "env.max_turn_tokens": 8, "data.max_prompt_length": 16,
        "rollout.engine": "slots", "rollout.slots": 4, "rollout.partial": True,
        "rollout.tree.enabled": True, "rollout.tree.roots": 2, "rollout.tree.branching": 2,
        "rollout.tree.segment_tokens": 1})
    cfg.env.kwargs = {"describe_tools": False}
    cfg.data.kwargs = {"digits": 1, "eval_examples": 2, "num_examples": 2}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EpisodePartialRounds, "_grow_trees", spy)
        records = phase_resumes_exactly(cfg, tmp_path, steps=2, saved_after=1)
    assert all(r["rollout/group_size_min"] == 2 and r["rollout/group_size_max"] == 4
               and np.isfinite(r["loss"]) for r in records)
    assert sorted(set(grown)) == [2, 4]   # a place's rows: its size's trees' leaves


@pytest.mark.parametrize("asynchronous", [False, True])
def test_knapsack_with_partial_episodes_resumes_exactly(reward_file, tmp_path, asynchronous):
    """Partial rollouts of tool episodes: a place holds room for max_samples = G episodes and
    plays the first G_i the knapsack gave its example at admission; an iteration trains on
    the first P groups to complete (carried at turn boundaries), whatever their sizes, and
    resumes exactly with groups in flight. ``asynchronous``: the batch of step k is drawn by
    version k - 1, which its tokens record (the pool takes the sampler's version)."""
    from rljax.train.methods.episode_partial import EpisodePartialRounds

    played = []   # per round: its group sizes and its episodes' turns
    subset = EpisodePartialRounds.sample_round

    def spy(self, rollout, params, rng=None):
        rnd = subset(self, rollout, params, rng)
        played.append((rnd["group_sizes"], rnd["turns"]))
        assert not any(self.turns[j][k] for j in np.flatnonzero(self.serial >= 0)
                       for k in range(self.sizes[j], self.rows))   # rows past a size: unplayed
        return rnd
    cfg = tiny_cfg(reward_file, **{
        "rollout.batch_size": 8, "rollout.knapsack.budget": 7,
        "rollout.knapsack.max_samples": 4, "env.name": "tool", "env.tools": ("calculator",),
        "env.tool_format": "plain", "env.max_turns": 2, "env.max_total_tokens": 28,
        "env.max_obs_tokens": 8, "env.max_turn_tokens": 8, "data.max_prompt_length": 16,
        "rollout.engine": "slots", "rollout.slots": 4, "rollout.partial": True,
        "rollout.max_staleness": 2, "algo.asynchronous": asynchronous})
    cfg.env.kwargs = {"describe_tools": False}
    cfg.data.kwargs = {"digits": 1, "eval_examples": 2, "num_examples": 2}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EpisodePartialRounds, "sample_round", spy)
        records = phase_resumes_exactly(cfg, tmp_path, steps=3, saved_after=2)
    assert all(r["rollout/group_size_mean"] == 3.5 and r["rollout/carried_groups"] == 2
               and "env/turns_mean" in r and np.isfinite(r["loss"]) for r in records)
    for sizes, turns in played:   # every episode of a group of G_i played a turn
        assert sorted(sizes.tolist()) == [3, 4] and len(turns) == 7 and (turns >= 1).all()
    if not asynchronous:   # carried episodes' turns a version old
        assert records[1]["rollout/staleness_max"] >= 1
    else:   # step 1's tokens all drawn by version 0; step 2's carried ones too
        assert records[1]["rollout/sample_version"] == 0
        assert records[1]["rollout/staleness_mean"] == 1.0
        assert records[2]["rollout/staleness_max"] == 2


@pytest.mark.parametrize("tree", [False, True])
def test_knapsack_with_partial_rollouts_resumes_exactly(reward_file, tmp_path, tree):
    """Partial rollouts: the pool's groups are sized by the knapsack when their prompts are
    admitted (at most max_samples = G rows each, so any P groups fit the update), an
    iteration trains on the first P to complete, whatever their sizes, and the posteriors
    learn each group when it completes. The dataset's 8 prompts come back in the third
    iteration, sized by what the posteriors learned; saved with groups in flight after the
    second, the run resumes exactly. ``tree``: a group is whole trees of 2 leaves (its pool
    place grows 1 or 2 roots), carried at level boundaries."""
    cfg = tiny_cfg(reward_file, **{
        "rollout.engine": "slots", "rollout.slots": 4, "rollout.partial": True,
        "rollout.knapsack.budget": 12, "rollout.knapsack.max_samples": 4, **({
            "rollout.tree.enabled": True, "rollout.tree.roots": 2,
            "rollout.tree.branching": 2, "rollout.tree.segment_tokens": 1} if tree else {})})
    records = phase_resumes_exactly(cfg, tmp_path, steps=3, saved_after=2)
    assert all(r["rollout/carried_groups"] == 4 and r["rollout/group_size_mean"] == 3.0
               for r in records[:2])   # the first two batches: 3 each on average
    last = records[-1]
    assert last["rollout/group_size_max"] > last["rollout/group_size_min"]
    assert np.isfinite(last["loss"])
    if not tree:
        assert last["rollout/staleness_max"] >= 1
    else:   # whole trees: sizes 2 or 4 (the flat prior already splits them)
        assert all(r["rollout/group_size_min"] == 2 and r["rollout/group_size_max"] == 4
                   for r in records)
        # The first run completes all 8 trees, 24 leaves: 12 roots grown (1 + 2 x 3 tokens
        # each at most), not 16; the second trains the 4 carried ones.
        assert records[0]["rollout/decoded_tokens"] <= 12 * 7
        assert records[1]["rollout/staleness_max"] >= 1


@pytest.mark.parametrize("overrides, key", [
    (["rollout.allocation=knapsack", "rollout.knapsack.max_samples=3"], "rollout.knapsack"),
    (["rollout.allocation=knapsack", "rollout.knapsack.budget=32"], "rollout.knapsack.budget"),
    (["rollout.allocation=knapsack", "algo.name=dpo"], "algo.name"),
    (["rollout.allocation=knapsack", "rollout.tree.enabled=true", "rollout.knapsack.budget=14"],
     "whole trees of 4 leaves"),
    (["rollout.allocation=knapsack", "rollout.partial=true", "rollout.engine=slots"],
     "rollout.knapsack.max_samples=16: with rollout.partial"),
    # (no meaning: the seats of a match share its rows, and their outcomes are one another's)
    (["rollout.allocation=knapsack", "env.name=tictactoe", "env.selfplay.mode=self"],
     "env.selfplay.mode='self'"),
])
def test_bad_knapsack_config_names_the_key(overrides, key):
    from rljax import config as config_lib
    from rljax.errors import ConfigError
    base = ["rollout.batch_size=16", "algo.num_generations=4"]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_lib.load_config(None, base + overrides)


def test_knapsack_with_ppo_resumes_exactly(reward_file, tmp_path):
    """PPO takes GRPO's round source: groups of the knapsack's sizes (the critic and GAE per
    row, padded rows masked out), the pass-rate posteriors saved with the phase, so the
    iteration after a resume equals the straight one."""
    cfg = tiny_cfg(reward_file, **{"algo.name": "ppo", "algo.adv_estimator": "gae",
                                   "steps": 2, "data.kwargs.num_examples": 4})  # (revisited)
    records = phase_resumes_exactly(cfg, tmp_path, steps=2, saved_after=1)
    assert all(np.isfinite(r["vf_loss"]) and np.isfinite(r["pg_loss"]) for r in records)
    assert records[1]["rollout/group_size_max"] > records[1]["rollout/group_size_min"]
