"""Partial rollouts of multi-turn episodes (rollout.partial with env.name): groups of tool
episodes and self-play games carried across iterations at turn boundaries, their turns'
versions in the staleness metrics, and a stop/resume equal to the straight run (the
environments rebuilt by replaying the recorded turns)."""
import jax
import numpy as np
import pytest

from rljax import config as config_lib
from rljax.envs import register_env
from rljax.train import run
from rljax.train.core.metrics import read_metrics
from rljax.train.methods.episode_partial import EpisodePartialRounds
from tests.test_agent_train import DEVICES, EchoEnv, agent_cfg
from tests.test_selfplay import ttt_cfg
from tests.test_partial import mopps_posteriors, posteriors_of, spy_on_prompts
from tests.test_train_loop import StopAfter, comparable, final_params

PARTIAL = {"rollout.engine": "slots", "rollout.partial": True, "rollout.slots": 3,
           "rollout.chunk_steps": 4, "rollout.max_staleness": 1, "algo.entropy_coef": 0.01}


class LongEchoEnv(EchoEnv):
    """Two turns around an observation of 7 to 18 tokens (fed one a step), its length set by
    the first turn's text: episodes of different lengths, most of their steps between their
    turns."""

    def answer(self, text: str) -> str:
        return f"<r>{'=' * (sum(map(ord, text)) % 12)}</r>"


register_env("test_long_echo", LongEchoEnv)
# The tool demo's environment (an untrained model seldom calls the tool), and one whose every
# episode has two turns around a long observation (so episodes are carried between their
# turns, their environments replayed mid-way); the echo runs pick their prompts with MoPPS.
ENVS = {"tool": {}, "echo": {"env.name": "test_long_echo", "env.tools": (), "sft.steps": 0,
                             "sft.env_traces": False, "rollout.max_new_tokens": 8,
                             "data.selection.name": "predicted"}}


def partial_cfg(env: str):
    cfg = agent_cfg(**{**PARTIAL, **ENVS[env]})
    if env == "echo":
        cfg.env.kwargs = {}
    return cfg


def watch_carried(monkeypatch) -> list:
    """Per iteration, the rows of unfinished places that start it with turns played
    (episodes or matches carried mid-way): ``(row's turns, ...)`` per such place."""
    seen = []
    drop_stale = EpisodePartialRounds._drop_stale

    def spy(self):
        seen.append([[len(t) for t in self.turns[j]] for j in range(len(self.serial))
                     if self.serial[j] >= 0 and self.completed_at[j] < 0
                     and any(self.turns[j])])
        return drop_stale(self)
    monkeypatch.setattr(EpisodePartialRounds, "_drop_stale", spy)
    return seen


@pytest.fixture(scope="module", params=list(ENVS))
def straight(request, tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp(f"episode_partial_{request.param}"))
    with pytest.MonkeyPatch.context() as mp:
        carried = watch_carried(mp)
        drawn, taken = spy_on_prompts(mp, EpisodePartialRounds)
        scored = EpisodePartialRounds.scored_round   # (its rounds name no examples: add them)
        mp.setattr(EpisodePartialRounds, "scored_round",
                   lambda self, rollout, eps, examples, t: dict(
                       scored(self, rollout, eps, examples, t), examples=examples))
        assert run.train(partial_cfg(request.param), workdir, devices=DEVICES) == 0
    if request.param == "echo":   # MoPPS: each group's rewards update its own prompt's
        assert posteriors_of(workdir) == mopps_posteriors(partial_cfg("echo"), drawn, taken)
    return request.param, workdir, carried


def test_episodes_are_carried_and_report_their_staleness(straight):
    env, workdir, carried = straight
    rl = [r for r in read_metrics(workdir) if "reward/mean" in r]
    assert len(rl) == 3
    assert all(r["rollout/carried_groups"] > 0 for r in rl)
    # Turns drawn by an earlier version trained: episodes were carried across iterations.
    assert max(r["rollout/staleness_max"] for r in rl) > 0
    assert all(r["rollout/staleness_max"] <= 1 for r in rl)   # rollout.max_staleness
    assert all(r["rollout/decoded_tokens"] > 0 for r in rl)
    assert any(carried), carried   # unfinished groups carried with turns played
    if env == "echo":   # every episode plays its two turns; some were carried between them
        assert all(r["env/turns_mean"] == 2 for r in rl)
        assert 1 in {n for places in carried for rows in places for n in rows}, carried


def test_stop_and_resume_equals_straight_run(straight, tmp_path):
    env, reference, _ = straight
    workdir, cfg = str(tmp_path), partial_cfg(env)
    first = min(r["step"] for r in read_metrics(reference) if "reward/mean" in r)
    assert run.train(cfg, workdir, devices=DEVICES, stop=StopAfter(first)) == 0
    assert max(r["step"] for r in read_metrics(workdir)) == first
    assert run.train(cfg, workdir, devices=DEVICES) == 0
    assert comparable(read_metrics(workdir)) == comparable(read_metrics(reference))
    jax.tree.map(np.testing.assert_array_equal, final_params(workdir), final_params(reference))
    if env == "echo":   # MoPPS's posteriors resume exactly too
        assert posteriors_of(workdir) == posteriors_of(reference)


def test_selfplay_with_partial_rollouts_resumes_exactly(tmp_path, monkeypatch):
    """Self-play matches carried across iterations (a place is a game's G matches, a group
    per seat): stopped after the first iteration and resumed (the matches rebuilt by
    replaying their recorded moves in order), equal to the straight run. The games are
    picked by MoPPS, whose posteriors (each game's learned from its seats' groups, the
    places' dataset indices carried) resume exactly too."""
    cfg = ttt_cfg(**{"env.selfplay.mode": "self", "steps": 3, "data.selection.name": "predicted",
                     "algo.num_generations": 2, "rollout.max_new_tokens": 8,
                     "algo.entropy_coef": 0.01, "rollout.engine": "slots",
                     "rollout.partial": True, "rollout.chunk_steps": 3,
                     "rollout.max_staleness": 1})
    straight_dir, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    carried = watch_carried(monkeypatch)
    assert run.train(cfg, straight_dir, devices=DEVICES) == 0
    monkeypatch.undo()
    assert any(carried), carried   # games carried with moves played
    rl = [r for r in read_metrics(straight_dir) if "reward/mean" in r]
    assert len(rl) == 3 and max(r["rollout/staleness_max"] for r in rl) > 0
    assert all(r["rollout/carried_groups"] > 0 for r in rl)
    assert run.train(cfg, resumed, devices=DEVICES, stop=StopAfter(rl[0]["step"])) == 0
    assert run.train(cfg, resumed, devices=DEVICES) == 0
    assert comparable(read_metrics(resumed)) == comparable(read_metrics(straight_dir))
    jax.tree.map(np.testing.assert_array_equal, final_params(resumed),
                 final_params(straight_dir))
    assert posteriors_of(resumed) == posteriors_of(straight_dir) != []


SCHEDULE = {"rollout.temperature_schedule.name": "linear",
            "rollout.temperature_schedule.start": 2.0, "rollout.temperature_schedule.end": 0.5,
            "rollout.temperature_schedule.tokens": 12, "steps": 1}


@pytest.mark.parametrize("case", ["partial_episodes", "selfplay", "selfplay_slots",
                                  "selfplay_partial"])
def test_a_temperature_schedule_reaches_carried_episodes_and_matches(tmp_path, case):
    """``rollout.temperature_schedule`` on the episode loops of their own: partial rollouts
    of tool episodes and self-play matches (static plies, the engine, carried matches). A
    row's k-th model token is drawn at schedule[k] whatever its turn, so the trainer's
    log-probs at those temperatures equal the sampler's (the first iteration: every token
    drawn by the version that trains; a wrong temperature is off by far more)."""
    if case == "partial_episodes":
        cfg = partial_cfg("echo")
        cfg.update_from_flattened_dict({**SCHEDULE, "data.selection.name": "uniform"})
    else:
        engine = {"selfplay": {}, "selfplay_slots": {"rollout.engine": "slots"},
                  "selfplay_partial": {"rollout.engine": "slots", "rollout.partial": True,
                                       "rollout.chunk_steps": 3}}[case]
        cfg = ttt_cfg(**{"env.selfplay.mode": "self", "algo.num_generations": 2,
                         "rollout.max_new_tokens": 8, **SCHEDULE, **engine})
    assert run.train(config_lib.validate(cfg), str(tmp_path), devices=DEVICES) == 0
    (r,) = [r for r in read_metrics(str(tmp_path)) if "reward/mean" in r]
    assert r["rollout/logp_diff_max"] < 1e-4, r["rollout/logp_diff_max"]


def test_trees_of_episodes_are_carried_whole_and_resume_exactly(tmp_path, monkeypatch):
    """Tree rollouts of carried episodes: a place's first turns are one tree's 4 leaves (a
    shared root token, then pairs), grown whole when the place is admitted or restarted, and
    recorded as its rows' first turns; the episodes are then carried at turn boundaries as
    any, and the groups that train hold the trees' leaves. The pool (trees' turns included)
    saved mid-run and resumed equals the straight run."""
    from tests.test_knapsack import phase_resumes_exactly

    trained, scored = [], EpisodePartialRounds.scored_round

    def spy(self, rollout, eps, examples, *args, **kw):   # each group's first two tokens
        first = np.where(eps["turn_ids"] == 0, eps["tokens"], -1)[:, :2]
        trained.extend(first.reshape(-1, 4, 2))
        return scored(self, rollout, eps, examples, *args, **kw)
    monkeypatch.setattr(EpisodePartialRounds, "scored_round", spy)
    carried = watch_carried(monkeypatch)
    cfg = partial_cfg("echo")
    cfg.update_from_flattened_dict({"rollout.tree.enabled": True,
                                    "rollout.tree.segment_tokens": 1,
                                    "rollout.tree.branching": 2})
    records = phase_resumes_exactly(config_lib.validate(cfg), tmp_path, steps=3, saved_after=2)
    assert all(r["rollout/carried_groups"] > 0 and np.isfinite(r["loss"]) for r in records)
    assert max(r["rollout/staleness_max"] for r in records) > 0   # carried across versions
    assert 1 in {n for places in carried for rows in places for n in rows}   # after the tree
    assert len(trained) == 8   # 2 groups a step, the resumed step's again
    for first in trained:   # one root token, forked in pairs after it
        assert (first[:, 0] == first[0, 0]).all() and (first[::2, 1] == first[1::2, 1]).all()
