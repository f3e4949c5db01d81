"""Asynchronous GRPO on 8 fake devices split 4/4 (data x fsdp on each mesh): the schedule
(update k trains on samples of version k - s), the sampler's weights equal to the trainer's
bit for bit and placed on the rollout devices, exact resume, the one-line refusals."""
import re

import jax
import numpy as np
import pytest

from rljax import config
from rljax.train import run
from rljax.train.core import checkpoint, steps
from rljax.train.inference import initial_state, start_phase
from rljax.train.core.metrics import read_metrics
from rljax.train.phases import make_phases
from rljax.train.core.setup import build_context, check_inputs

from test_train_loop import StopAfter, comparable, final_params, resumes_exactly, tiny_cfg

SPLIT = {"mesh.rollout_devices": 4, "mesh.data": 2, "mesh.fsdp": 2, "mesh.rollout.data": 2,
         "mesh.rollout.fsdp": 2}


# One mesh: the sampler reads a copy of the policy beside the trainer (what the composition
# tests need, at half the compiles of a split).
NO_SPLIT = {"mesh.rollout_devices": 0, "mesh.data": -1, "mesh.fsdp": 1, "mesh.rollout.data": -1,
            "mesh.rollout.fsdp": 1}


def _cfg(**overrides):
    # entropy_coef: a gradient whatever the rewards (a tiny model scores 0), so versions differ.
    return tiny_cfg(**{"sft.steps": 0, "steps": 4, "algo.asynchronous": True,
                       "algo.entropy_coef": 0.01, "optimizer.learning_rate": 1e-2, **SPLIT,
                       **overrides})


def _devices(tree) -> set:
    return {d for x in jax.tree.leaves(tree) for d in x.sharding.device_set}


def _iterations(cfg, steps: int, after=None, devices=None):
    """Runs ``steps`` async iterations of ``cfg``'s GRPO phase by hand (on ``devices``, default
    all). Returns (ctx, the parameters each iteration started from, its metrics, the batches
    the updates trained on); ``after(phase, state, started_from)`` runs after each iteration."""
    ctx = build_context(cfg, "", jax.devices() if devices is None else devices)
    phase = make_phases(ctx)[-1]
    state = start_phase(ctx, phase, initial_state(ctx))
    trained, update = [], phase.update
    phase.update = lambda s, b: (trained.append(jax.tree.map(np.asarray, b)), update(s, b))[1]
    versions, records = [], []
    for k in range(steps):
        versions.append(jax.tree.map(np.asarray, state.params))
        state, metrics = phase.iteration(state, k)
        records.append(metrics)
        if after is not None:
            after(phase, state, versions[-1])
    return ctx, versions, records, trained


def test_schedule_and_the_weights_the_sampler_reads():
    """Lag 2 over 4 updates: batches 0-2 are drawn by version 0, batch 3 by version 1 (its
    sampler log-probs are version 1's, not version 0's or 3's); after each iteration the
    sampler holds a bit-exact copy of the version that update started from, on the rollout
    devices only."""
    devices = jax.devices()

    def check(phase, state, started_from):
        jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray,
                                                                 phase.sampler_params),
                     started_from)
        assert _devices(phase.sampler_params) == set(devices[4:])
        assert _devices(state.params) == set(devices[:4])

    ctx, versions, records, trained = _iterations(_cfg(**{"algo.async_lag": 2}), 4, check)
    assert [r["rollout/sample_version"] for r in records] == [0, 0, 0, 1]
    assert [r["rollout/staleness_max"] for r in records] == [0, 1, 2, 2]
    assert all(r["time/weight_transfer"] > 0 and 0 <= r["time/trainer_idle_frac"] <= 1
               for r in records)

    def gap(batch, params):   # sampler log-probs vs this version's, on completion tokens
        n = batch["loss_mask"].shape[1]
        logps = np.asarray(steps.completion_logps(ctx.model_cfg, params, batch)[0])
        return np.abs(logps - batch["sampler_logps"])[batch["mask"][:, -n:]].max()

    # Two programs (the sampler's and the scoring pass): float32 rounding apart.
    assert gap(trained[3], versions[1]) < 1e-4
    assert gap(trained[2], versions[0]) < 1e-4
    assert min(gap(trained[3], versions[0]), gap(trained[3], versions[3])) > 1e-3


def _recorded(monkeypatch, module, name: str) -> list:
    """The list every output of ``module.name`` is appended to from now on."""
    outputs, fn = [], getattr(module, name)
    monkeypatch.setattr(module, name,
                        lambda *a, **kw: (outputs.append(fn(*a, **kw)), outputs[-1])[1])
    return outputs


def _updates_ready_at_the_second_poll(monkeypatch) -> list:
    """In-flight updates made deterministic: an update is not ready at the sampler's first
    poll and is from the second. Returns the list every ``generate`` output is appended to."""
    from rljax.train.core import rollout as rollout_lib
    from rljax.train.phases import async_grpo

    def done(watch):
        watch.polls = getattr(watch, "polls", 0) + 1
        if watch.polls < 2:
            return False
        watch._thread.join()
        return True
    monkeypatch.setattr(async_grpo._Watch, "done", done)
    return _recorded(monkeypatch, rollout_lib, "generate")


# A tree of 4 leaves per prompt: a 1-token root segment, forks of 2 after tokens 1 and 2.
TREE = {"rollout.tree.enabled": True, "rollout.tree.segment_tokens": 1,
        "rollout.tree.branching": 2, "algo.adv_estimator": "rover"}


# Two prompt chunks of 8 rows, each decoded whole in one chunk of its engine call (which
# polls once, before its prefill): the second chunk's poll is the second.
CHUNKS = {"rollout.micro_batch_size": 8, "rollout.slots": 8, "rollout.chunk_steps": 4}


@pytest.mark.parametrize("case", ["flat", "tree", "chunks"])
def test_inflight_updates_reach_the_sampler_between_decode_chunks(monkeypatch, case):
    """``algo.inflight_updates``: update k - 1 (made ready at the sampler's second poll) is
    published between two decode chunks of batch k, so the batch mixes versions k - 1 and k.
    Tokens drawn before the swap carry version k - 1's log-probs; those after it were drawn
    by the new weights (their log-probs are not version k - 1's). A tree on the slot engine
    polls before each level too: its 1-token root segment is drawn at the first poll, so the
    swap comes between the root and the first fork, and every leaf shares the root's
    version-(k - 1) token. With ``rollout.micro_batch_size`` the swap lands between two
    prompt chunks (two engine calls), and counts as one all the same."""
    sampled = _updates_ready_at_the_second_poll(monkeypatch)
    tree = case == "tree"
    cfg = _cfg(**{"rollout.engine": "slots", "rollout.chunk_steps": 1, "rollout.slots": 4,
                  "algo.inflight_updates": True, "steps": 2 + (case == "flat"),
                  **{"flat": {}, "tree": TREE, "chunks": CHUNKS}[case]})
    n_steps = cfg.steps
    ctx, versions, records, trained = _iterations(cfg, n_steps)
    # sampled[0]: batch 0, before any update (no in-flight weights); sampled[k]: batch k, drawn
    # while update k - 1 ran, swapped to version k after its first decode chunk.
    assert [o.get("swaps") for o in sampled] == [None] + [1] * (n_steps - 1)
    assert [r["rollout/sample_version"] for r in records] == list(range(n_steps))
    assert [r["rollout/weight_swaps"] for r in records[1:]] == [1] * (n_steps - 1)
    for k in range(1, n_steps):
        out, batch, r = sampled[k], trained[k], records[k]
        mask = out["mask"]
        drawn = out["versions"][mask]
        assert set(np.unique(drawn)) == {k - 1, k}
        assert r["rollout/staleness_frac_0"] == pytest.approx(np.mean(drawn == k))
        assert r["rollout/staleness_frac_1"] == pytest.approx(np.mean(drawn == k - 1))
        assert r["rollout/staleness_max"] == 1 and 0 < r["rollout/staleness_mean"] < 1
        np.testing.assert_array_equal(batch["sampler_logps"], out["logps"])
        n = out["tokens"].shape[1]
        own = np.asarray(steps.completion_logps(ctx.model_cfg, versions[k - 1], batch)[0])
        before = mask & (out["versions"] == k - 1)
        after = mask & (out["versions"] == k)
        assert np.abs(own - out["logps"])[before].max() < 1e-4
        assert np.abs(own - out["logps"])[after].max() > 1e-3
        assert batch["mask"][:, -n:].sum() == mask.sum()
        if tree:   # the root segment before the swap, the forks' segments after it
            np.testing.assert_array_equal(out["versions"][mask], np.where(
                np.nonzero(mask)[1] == 0, k - 1, k))
            assert out["decoded"].sum() < mask.sum()   # shared segments decoded once
        if case == "chunks":   # the first chunk's rows before the swap, the second's after it
            np.testing.assert_array_equal(out["versions"][:8][mask[:8]], k - 1)
            np.testing.assert_array_equal(out["versions"][8:][mask[8:]], k)
    assert records[n_steps - 2]["time/weight_transfer"] > 0   # (with the in-flight publish)


@pytest.mark.parametrize("tree", [False, True])
def test_inflight_updates_reach_tool_episodes_between_decode_chunks(monkeypatch, tree):
    """``algo.inflight_updates`` with tool episodes on the episode engine: update 0 (made ready
    at the sampler's second poll) is published between two decode chunks of batch 1, so its
    episodes mix versions 0 and 1 (a slot keeps its cache and decodes on with the new
    weights). Tokens drawn before the swap carry version 0's log-probs; those after it do
    not. ``tree``: the first turns are a tree's leaves on the slot engine, which polls before
    each level: the 1-token root segment is drawn by version 0, the forks and every later turn
    by version 1, each first-turn token recording the tree's version."""
    from rljax.train.core import episodes
    from tests.test_agent_train import agent_cfg
    _updates_ready_at_the_second_poll(monkeypatch)
    played = _recorded(monkeypatch, episodes, "run_episodes")
    cfg = agent_cfg(**{"sft.steps": 0, "steps": 2, "algo.asynchronous": True,
                       "rollout.engine": "slots", "rollout.slots": 4, "rollout.chunk_steps": 1,
                       "algo.inflight_updates": True, "algo.entropy_coef": 0.01,
                       "optimizer.learning_rate": 1e-2,
                       **({**TREE, "algo.adv_estimator": "treepo"} if tree else {})})
    ctx, versions, records, trained = _iterations(cfg, 2, devices=jax.devices()[:1])
    # played[0]: batch 0, before any update; played[1]: batch 1, drawn while update 0 ran.
    assert [e.get("swaps") for e in played] == [None, 1]
    assert [r["rollout/sample_version"] for r in records] == [0, 1]
    eps, batch, r = played[1], trained[1], records[1]
    model = eps["model_mask"]
    assert set(np.unique(eps["versions"][model])) == {0, 1}
    assert (eps["versions"][~model] == -1).all()
    drawn = eps["versions"][batch["loss_mask"]]
    assert r["rollout/weight_swaps"] == 1
    assert r["rollout/staleness_frac_0"] == pytest.approx(np.mean(drawn == 1))
    assert r["rollout/staleness_frac_1"] == pytest.approx(np.mean(drawn == 0))
    np.testing.assert_array_equal(batch["sampler_logps"], eps["logps"])
    own = np.asarray(steps.completion_logps(ctx.model_cfg, versions[0], batch)[0])
    gap = np.abs(own - eps["logps"])
    assert gap[model & (eps["versions"] == 0)].max() < 1e-4
    assert gap[model & (eps["versions"] == 1)].max() > 1e-3
    if tree:   # the root segment before the swap, everything after it by version 1
        np.testing.assert_array_equal(eps["versions"][model], np.where(
            np.nonzero(model)[1] == 0, 0, 1))


@pytest.mark.parametrize("tree", [False, True])
def test_inflight_updates_reach_partial_rollouts_between_decode_chunks(monkeypatch, tree):
    """``algo.inflight_updates`` with partial rollouts: update 0 (made ready at the sampler's
    second poll) reaches the pool between two decode chunks of batch 1, so its groups mix
    versions 0 and 1 (carried and first-chunk tokens version 0's, later ones version 1's),
    each token keeping the version that drew it and that version's log-prob. A pool of trees
    polls before each level's engine call and between its chunks alike (its trees grow in
    step: the second batch is the first run's other half, the third is grown under update 1;
    its first level's engine call polls again before its prefill, so version 2 draws it from
    its first token, where without in-flight updates version 1 would have)."""
    from rljax.sampling import partial as partial_lib, tree_partial
    _updates_ready_at_the_second_poll(monkeypatch)
    runs = _recorded(monkeypatch, tree_partial.TreePool if tree else partial_lib.Pool, "run")
    k = 2 if tree else 1   # the batch drawn across a swap, from version k - 1 to k
    cfg = _cfg(**{"rollout.engine": "slots", "rollout.partial": True, "rollout.slots": 4,
                  "rollout.chunk_steps": 1, "algo.inflight_updates": True, "steps": k + 1,
                  **(TREE if tree else {})})
    ctx, versions, records, trained = _iterations(cfg, k + 1)
    assert [t.swaps for t in runs] == [0] * k + [1] and records[k]["rollout/weight_swaps"] == 1
    taken, batch = runs[k], trained[k]
    n = batch["loss_mask"].shape[1]
    own = np.asarray(steps.completion_logps(ctx.model_cfg, versions[k - 1], batch)[0])
    gap = np.abs(own - batch["sampler_logps"])[batch["mask"][:, -n:]]
    if tree:
        assert set(np.unique(taken.rows["versions"][taken.rows["mask"]])) == {k}
        drawn = np.asarray(steps.completion_logps(ctx.model_cfg, versions[k], batch)[0])
        assert np.abs(drawn - batch["sampler_logps"])[batch["mask"][:, -n:]].max() < 1e-4
        assert gap.max() > 1e-3 and records[k]["rollout/staleness_max"] == 0
        return
    assert set(np.unique(taken.rows["versions"][taken.rows["mask"]])) == {k - 1, k}
    assert 0 < records[k]["rollout/staleness_frac_1"] < 1
    assert (gap < 1e-4).any() and (gap > 1e-3).any()   # drawn by version 0, and by 1


@pytest.mark.parametrize("tree", [False, True])
def test_inflight_updates_reach_partial_episodes_between_decode_chunks(monkeypatch, tree):
    """``algo.inflight_updates`` with partial rollouts of tool episodes: update 0 (made ready
    at the sampler's second poll) reaches the episode pool's engine between two decode chunks
    of batch 1, so its episodes mix versions 0 and 1, each turn's tokens keeping the versions
    that drew them and their log-probs. ``tree``: the places admitted in iteration 1 grow
    their first turns as trees first, which poll too (the swap comes between the first tree's
    root and its forks)."""
    from rljax.train.methods.episode_partial import EpisodePartialRounds
    from tests.test_agent_train import agent_cfg
    _updates_ready_at_the_second_poll(monkeypatch)
    cfg = agent_cfg(**{"sft.steps": 0, "steps": 2, "algo.asynchronous": True,
                       "rollout.engine": "slots", "rollout.partial": True, "rollout.slots": 4,
                       "rollout.chunk_steps": 1, "algo.inflight_updates": True,
                       "algo.entropy_coef": 0.01, "optimizer.learning_rate": 1e-2,
                       **({**TREE, "algo.adv_estimator": "treepo"} if tree else {})})
    turns = []   # the versions of every turn the pool recorded
    record = EpisodePartialRounds._record_turn
    monkeypatch.setattr(EpisodePartialRounds, "_record_turn", lambda self, *a, **k: (
        record(self, *a, **k), turns.append(self.turns[a[0]][a[1]][-1]))[0])
    ctx, versions, records, trained = _iterations(cfg, 2, devices=jax.devices()[:1])
    assert records[1]["rollout/weight_swaps"] == 1
    assert {v for t in turns for v in t.get("versions", [t["version"]])} == {0, 1}
    batch = trained[1]
    n = batch["loss_mask"].shape[1]
    own = np.asarray(steps.completion_logps(ctx.model_cfg, versions[0], batch)[0])
    gap = np.abs(own - batch["sampler_logps"])[batch["model_mask"]]
    assert batch["mask"][:, -n:].sum() > 0
    if tree:   # a tree's first turns across the swap: the root's token by 0, the forks' by 1
        assert any(t.get("versions", [])[:3] == [0, 1, 1] for t in turns)
        return   # (the groups that completed first, and trained, were carried: version 0's)
    assert (gap < 1e-4).any() and (gap > 1e-3).any()   # drawn by version 0, and by 1


def test_inflight_updates_wait_for_relifts_sft_step(monkeypatch):
    """``algo.inflight_updates`` with ReLIFT every second update: an update that an SFT step
    may follow is not published in flight (the version would lack the SFT step); the next
    iteration publishes it whole. The other updates still reach the sampler mid-batch."""
    sampled = _updates_ready_at_the_second_poll(monkeypatch)
    cfg = _cfg(**{"rollout.engine": "slots", "rollout.chunk_steps": 1, "rollout.slots": 4,
                  "algo.inflight_updates": True, "steps": 4, "algo.mini_batch_size": 0,
                  "algo.relift.every": 2, "algo.relift.batch_size": 4})
    _, versions, records, _ = _iterations(cfg, 4)
    # Batch k + 1 is drawn while update k runs; SFT steps follow updates 1 and 3.
    assert [o.get("swaps") for o in sampled] == [None, 1, None, 1]
    assert ["relift/sft_loss" in r for r in records] == [False, True, False, True]
    assert [r.get("rollout/weight_swaps") for r in records] == [None, 1, None, 1]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("async_straight"))
    assert run.train(_cfg(), workdir, devices=jax.devices()) == 0
    return workdir


def test_stop_and_resume_equals_straight_run(straight, tmp_path):
    """Stopped after update 2 (batch 3, drawn by version 2, in flight), then resumed."""
    workdir = str(tmp_path)
    assert run.train(_cfg(), workdir, devices=jax.devices(), stop=StopAfter(2)) == 0
    with checkpoint.CheckpointManager(checkpoint.checkpoint_dir(workdir)) as ckpt:
        assert ckpt.latest_step() == 2
    assert run.train(_cfg(), workdir, devices=jax.devices()) == 0
    records = read_metrics(workdir)
    assert [r["rollout/sample_version"] for r in records if "reward/mean" in r] == [0, 0, 1, 2]
    assert comparable(records) == comparable(read_metrics(straight))
    jax.tree.map(np.testing.assert_array_equal, final_params(workdir), final_params(straight))


@pytest.mark.parametrize("change, message", [
    ({"algo.name": "dpo"},   # (offline: no groups to sample ahead)
     "algo.asynchronous=true needs algo.name='grpo', 'distill', 'ppo' or online 'dpo'"),
    ({"rollout.engine": "slots", "rollout.partial": True, "rollout.max_staleness": 1,
      "algo.async_lag": 2}, "rollout.max_staleness=1 must be >= algo.async_lag=2"),
    ({"algo.async_lag": 0}, "algo.async_lag"),
    ({"algo.inflight_updates": True}, "algo.inflight_updates=true needs "
                                      "rollout.engine='slots' (new weights"),
    ({"algo.inflight_updates": True, "algo.asynchronous": False, "mesh.rollout_devices": 0},
     "algo.inflight_updates=true needs algo.asynchronous=true"),
    ({"algo.asynchronous": False}, "mesh.rollout_devices=4 gives the sampler devices of its "
                                   "own, which only asynchronous RL uses"),
    ({"mesh.rollout.fsdp": 3}, "mesh.rollout {'data': -1, 'fsdp': 3, 'expert': 1, 'tensor': 1} "
                               "does not fit mesh.rollout_devices=4"),
])
def test_refusals_are_one_line(change, message):
    cfg = config.default_config()
    cfg.update_from_flattened_dict({"algo.asynchronous": True, "mesh.rollout_devices": 4,
                                    **change})
    with pytest.raises(config.ConfigError, match=re.escape(message)) as err:
        config.validate(cfg)
    assert "\n" not in str(err.value)


def test_more_rollout_devices_than_there_are_is_refused_before_building():
    cfg = _cfg(**{"mesh.rollout_devices": 8, "mesh.data": -1, "mesh.fsdp": 1,
                  "mesh.rollout.data": -1, "mesh.rollout.fsdp": 1})
    with pytest.raises(config.ConfigError, match=re.escape(
            "mesh.rollout_devices=8 leaves no device to train: there are 8 devices")):
        check_inputs(cfg, 8)
    with pytest.raises(config.ConfigError, match="does not match the 4 available devices"):
        check_inputs(_cfg(**{"mesh.data": 4}), 8)   # 4 x 2 training devices: only 4 are left


def test_the_plan_plans_the_sampler_on_the_rollout_mesh():
    """Rollout mesh data=4 (the policy's copy replicated there), training data=2 x fsdp=2
    (sharded): the sample program's resident argument is the whole policy."""
    from rljax import plan as plan_lib
    planned = plan_lib.plan(_cfg(**{"mesh.rollout.data": 4, "mesh.rollout.fsdp": 1}),
                            jax.devices())
    rows = {p.name: p for p in planned.phases}
    shard = planned.resident_parts["params"]   # per training device
    assert rows["sample"].resident_arguments > shard   # replicated: more than a shard
    assert rows["eval"].resident_arguments == shard   # eval reads the trainer's shards
    assert any(n.startswith("mesh.rollout_devices=4: the sample programs are planned on the "
                            "rollout mesh (data=4 fsdp=1 tensor=1)") for n in planned.notes)


def test_the_plan_counts_the_samplers_copies_for_the_kl_in_the_reward():
    """GRPO's KL in the reward, batches sampled ahead. On one mesh the sampler's copies of the
    policy and of the reference sit beside the train state: the plan's resident parts count
    both, equal to what the sampler holds after an iteration. On a rollout mesh of its own the
    plan has the sampler's scoring pass there, reading the policy's copy."""
    from rljax import plan as plan_lib
    from rljax.train.core.programs import shard_bytes

    kl = {"algo.beta": 0.5, "algo.kl_in_reward": True, "steps": 1}
    parts = plan_lib.plan(_cfg(**NO_SPLIT, **kl), jax.devices(), compile_phases=False
                          ).resident_parts
    held = {}
    _iterations(_cfg(**NO_SPLIT, **kl), 1, lambda phase, state, _: held.update(
        sampler_params=shard_bytes(phase.sampler_params),
        sampler_reference=shard_bytes(phase.sampler_ref)))
    assert {k: parts[k] for k in held} == held
    assert held["sampler_params"] == parts["params"] == parts["reference"] > 0
    split = plan_lib.plan(_cfg(**kl), jax.devices(), programs=lambda n: n.startswith("sample"))
    rows = {p.name: p for p in split.phases}
    assert rows["sample/logps"].resident_arguments == rows["sample"].resident_arguments
    assert "sampler_params" not in split.resident_parts


def test_curriculum_hints_and_relift_with_batches_sampled_ahead_resume_exactly(tmp_path):
    """data.selection, algo.hint and algo.relift with algo.asynchronous: the curriculum
    observes each batch as the sampler draws it (a version ahead of the update) and moves the
    level of the prompts drawn next; the sampler hints the failed groups of that batch (the
    hinted samples drawn by its own version, whose log-probs the decoupled loss reads);
    ReLIFT's SFT step follows every second update, so the next version published includes
    it. The level, the replay store, the adaptive fractions and the ReLIFT buffer are saved
    with the batches in flight: a run stopped after update 2 and resumed (batch 4 drawn after
    the restore) equals the straight run. (MoPPS's posteriors: tests/test_knapsack.py.)"""
    def cfg():
        c = _cfg(**{**NO_SPLIT, "algo.hint.mode": "adaptive", "algo.hint.step": 0.5,
                    "algo.hint.source": "replay",
                    "algo.mini_batch_size": 0, "algo.relift.every": 2,
                    "algo.relift.batch_size": 4,
                    # every sample counts as a success for the level: 1, 2, then 3 digits
                    "data.selection.name": "curriculum", "data.selection.knob": "digits",
                    "data.selection.min_level": 1, "data.selection.window": 1,
                    "data.selection.threshold": 0.0, "data.selection.low": 0.1,
                    "data.selection.high": 0.5})
        c.data.kwargs = {"digits": 3, "eval_examples": 8, "num_examples": 8}  # prompts revisit
        return config.validate(c)

    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    devices = jax.devices()[:1]
    assert run.train(cfg(), straight, devices=devices) == 0
    assert run.train(cfg(), split, devices=devices, stop=StopAfter(2)) == 0
    with checkpoint.CheckpointManager(checkpoint.checkpoint_dir(split)) as ckpt:
        state = ckpt.restore_meta()["phase_state"]
    assert state["guidance"]["hints"]["fractions"] and state["guidance"]["relift"]["entries"]
    assert run.train(cfg(), split, devices=devices) == 0
    records = [r for r in read_metrics(straight) if "reward/mean" in r]
    assert [r["rollout/sample_version"] for r in records] == [0, 0, 1, 2]
    assert [r["selection/level"] for r in records] == [2, 3, 3, 3]
    assert all(r["hint/fraction_hinted"] > 0 for r in records)
    assert ["relift/sft_loss" in r for r in records] == [False, True, False, True]
    with checkpoint.CheckpointManager(checkpoint.checkpoint_dir(straight)) as ckpt:
        assert int(ckpt.restore().state["step"]) == 4 + 2   # 4 RL and 2 SFT updates
    assert comparable(read_metrics(split)) == comparable(read_metrics(straight))
    jax.tree.map(np.testing.assert_array_equal, final_params(split), final_params(straight))


@pytest.mark.parametrize("mesh", ["split", "one"])
def test_kl_in_the_reward_is_the_sampling_policys_and_resumes_exactly(tmp_path, mesh):
    """GRPO's KL in the reward with batches sampled ahead: the sampler scores its batch under
    the policy that drew it and the reference (a copy of the reference on its mesh), before
    the advantages. The first two batches are drawn by version 0, the reference itself, so
    their KL is exactly 0; later ones are not (a KL taken under the update's policy would be
    non-zero from the second batch on). Stopped after update 2 and resumed, the run equals
    the straight one."""
    layout = SPLIT if mesh == "split" else NO_SPLIT
    cfg = lambda: _cfg(**{**layout, "algo.beta": 0.5, "algo.kl_in_reward": True})  # noqa: E731
    straight, _ = resumes_exactly(cfg, tmp_path, stop_after=2, devices=jax.devices())
    rl = [r for r in read_metrics(straight) if "reward/mean" in r]
    assert [r["rollout/sample_version"] for r in rl] == [0, 0, 1, 2]
    assert [r["kl_ref_seq"] == 0 for r in rl] == [True, True, False, False], rl
    assert "kl_ref" not in rl[0]   # no KL term in the loss


def test_mixed_policy_demonstrations_with_batches_sampled_ahead(tmp_path):
    """``algo.mixed_policy`` with ``algo.asynchronous``: the sampler puts the reference
    solution into each failed group of the batch it draws ahead (behaviour log-probs 0); the
    update's proximal pass gives those rows old log-probs 0 too (mu = 1), so they train with
    ratio pi_theta / 1 while sampled rows keep version k's log-probs. A run stopped after
    update 2 and resumed (the demonstration rows saved with the batches in flight) equals the
    straight run."""
    cfg = lambda: _cfg(**{**NO_SPLIT, "algo.mixed_policy": True,   # noqa: E731
                          "algo.mini_batch_size": 0})
    _, _, records, trained = _iterations(cfg(), 3)
    assert all(r["mixed/demos"] > 0 for r in records)
    for batch in trained:
        demo, old = batch["demo"], batch["old_logps"]
        assert demo.any() and np.all(old[demo] == 0) and np.all(batch["sampler_logps"][demo] == 0)
        sampled = batch["loss_mask"] & ~demo[:, None]
        assert np.all(old[sampled] < 0)   # version k's log-probs, not zeroed
    resumes_exactly(cfg, tmp_path, stop_after=2, devices=jax.devices())

