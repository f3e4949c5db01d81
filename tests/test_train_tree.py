"""GRPO with tree sampling (rollout.tree): the leaves are the group, the tree advantages get
the tree, resume is exact; bad tree budgets fail before compiling, naming the key."""
import os
import re
import string
import subprocess
import sys

import jax
import numpy as np
import pytest

from rljax import algorithms
from rljax import config as config_lib
from rljax.sampling import tree as tree_sampling, tree_partial
from rljax.errors import ConfigError
from rljax.train import run
from rljax.train.core.metrics import read_metrics
from rljax.train.core.rollout import Rollout

from rljax.envs import StepResult, register_env
from test_train_loop import StopAfter, comparable
from tests.test_agent_train import EchoEnv

DEVICES = jax.devices()[:1]
TREE = {"rollout.tree.enabled": True, "rollout.tree.segment_tokens": 1,
        "rollout.tree.branching": 2, "rollout.tree.roots": 1, "algo.num_generations": 4}


def tiny_cfg(**overrides):
    cfg = config_lib.default_config()
    cfg.update_from_flattened_dict({
        "steps": 3, "eval_every": 0, "checkpoint_every": 0, "sft.steps": 0,
        "model.preset": "tiny", "tokenizer.kind": "char", "data.source": "arithmetic",
        "data.max_prompt_length": 8, "rollout.batch_size": 16, "rollout.max_new_tokens": 4,
        "algo.beta": 0.0, "optimizer.learning_rate": 1e-2, "algo.entropy_coef": 0.1,
        "eval.num_examples": 8, "eval.batch_size": 8, "logging.tensorboard": False,
        "checkpoint.async_save": False, **TREE,
    })
    cfg.model.overrides = {"num_layers": 1, "hidden_size": 32, "intermediate_size": 64,
                           "num_heads": 2, "num_kv_heads": 1}
    cfg.data.kwargs = {"digits": 1, "eval_examples": 8}
    cfg.update_from_flattened_dict(overrides)
    return config_lib.validate(cfg)


# Hints (their state carried: adaptive fractions, replayed successes) and a temperature
# schedule compose with trees: a failed group is re-sampled as a tree grown from the hinted
# prompt, and every segment draws at its own positions' temperatures.
SCHEDULE = {"rollout.temperature_schedule.name": "linear",
            "rollout.temperature_schedule.start": 1.5, "rollout.temperature_schedule.end": 0.5}
HINTS = {"algo.hint.mode": "adaptive", "algo.hint.source": "replay", "algo.hint.step": 0.5,
         "data.kwargs": {"digits": 1, "eval_examples": 8, "num_examples": 4}}   # revisited


@pytest.mark.parametrize("engine", ["static", "slots", "partial"])
def test_rover_run_trains_on_tree_advantages_and_resumes_exactly(tmp_path, monkeypatch, engine):
    """Static tree sampler, or the slot engine serving the forks (3 slots for 16 leaves), or
    partial rollouts: a pool of trees carried across iterations (``sampling.tree_partial``),
    the iteration training on the trees that completed first. All with a temperature
    schedule, the static and slot-engine runs with hints too."""
    original, seen = Rollout.advantages, []

    def advantages(self, rewards, **kw):
        adv = original(self, rewards, **kw)
        seen.append((np.asarray(rewards), kw["mask"], adv))
        return adv

    monkeypatch.setattr(Rollout, "advantages", advantages)
    run_pool, spans = tree_partial.TreePool.run, []

    def pool_run(self, *args, **kw):   # the versions that drew each trained tree
        taken = run_pool(self, *args, **kw)
        v, m = (taken.rows[k].reshape(len(taken.places), -1) for k in ("versions", "mask"))
        spans.extend(len(np.unique(tv[tm])) for tv, tm in zip(v, m))
        return taken

    monkeypatch.setattr(tree_partial.TreePool, "run", pool_run)
    # Partial: most characters stop a path, so trees finish at different levels (and DAPO's
    # overlong penalty rewards the short leaves).
    partial = {"rollout.partial": True, "rollout.engine": "slots", "algo.overlong_buffer": 2,
               "steps": 2,
               "rollout.stop_strings": tuple(string.ascii_letters + "13579")}
    cfg = tiny_cfg(**{"algo.adv_estimator": "rover", "rollout.slots": 3,
                      **SCHEDULE, **({"rollout.engine": engine, **HINTS}
                                     if engine != "partial" else partial)})
    straight = str(tmp_path / "straight")
    assert run.train(cfg, straight, devices=DEVICES) == 0
    # The estimator saw the tree of the run's layout: 1 root, 2 forks of 2 -> 4 leaves.
    node_ids, _ = tree_sampling.tree_layout(1, 2, 2)
    segments = tree_sampling.segment_of_position(4, 1, 2)
    for rewards, mask, adv in seen:
        want = algorithms.rover_advantages(rewards, 4, mask=mask, segments=segments,
                                           node_ids=np.tile(node_ids, (len(rewards) // 4, 1)))
        np.testing.assert_allclose(adv, want, atol=1e-6)
        assert adv.shape == mask.shape == (16, 4)
    rl = [r for r in read_metrics(straight) if "reward/mean" in r]
    assert len(rl) == cfg.steps and all(np.isfinite(r["loss"]) for r in rl)
    assert all(("rollout/slot_utilisation" in r) == (engine != "static") for r in rl)
    # The trainer's log-probs of the leaves agree with the tree sampler's (same params), at
    # the schedule's temperatures; hinted trees replaced failed groups.
    assert rl[0]["rollout/logp_diff_max"] < 1e-4
    assert all((r.get("hint/fraction_hinted", 0) > 0) == (engine != "partial") for r in rl)
    if engine == "partial":   # a second batch of trees in flight; some grown by two versions
        assert [r["rollout/carried_groups"] for r in rl] == [4, 4]
        assert len(spans) == 8 and max(spans) == 2
    else:   # shared segments are decoded once: fewer decoded tokens than completion tokens
        assert all(r["rollout/decoded_tokens"] < r["rollout/tokens"] for r in rl)
    assert any(np.abs(a).max() > 0 for _, _, a in seen)   # some signal reached the update
    # Stopped after step 1 and resumed: identical to the straight run.
    resumed = str(tmp_path / "resumed")
    assert run.train(cfg, resumed, devices=DEVICES, stop=StopAfter(1)) == 0
    assert run.train(cfg, resumed, devices=DEVICES) == 0
    assert comparable(read_metrics(resumed)) == comparable(read_metrics(straight))


def test_tree_rollouts_sampled_ahead_train_and_resume_exactly(tmp_path):
    """algo.asynchronous with tree rollouts: the sampler grows the trees of the batch it draws
    ahead with its own policy version (the leaves' log-probs are the behaviour the decoupled
    loss reads); stopped after update 2 and resumed, the run equals the straight run."""
    from test_train_loop import resumes_exactly

    cfg = lambda: tiny_cfg(**{"algo.adv_estimator": "rover", "algo.asynchronous": True,  # noqa
                              "steps": 4})
    straight, _ = resumes_exactly(cfg, tmp_path, stop_after=2)
    rl = [r for r in read_metrics(straight) if "reward/mean" in r]
    assert [r["rollout/sample_version"] for r in rl] == [0, 0, 1, 2]
    assert all(r["rollout/decoded_tokens"] < r["rollout/tokens"] for r in rl)   # trees


# Episodes: the tree forks within the first model turn, each leaf is played on on the engine.
EPISODES = {"env.name": "tool", "env.tools": ("calculator",), "env.tool_format": "plain",
            "env.max_turns": 2, "env.max_total_tokens": 28, "env.max_obs_tokens": 8,
            "env.max_turn_tokens": 8, "data.max_prompt_length": 16}


class OddLengthEndsEnv(EchoEnv):
    """Ends after a first turn of odd length (its episode never reaches the episode engine);
    else answers it and ends after the second."""

    def step(self, text):
        return StepResult(done=True) if self.turns == 0 and len(text) % 2 else super().step(text)


register_env("odd_length_ends", OddLengthEndsEnv)
# Routing replay: a mixture of experts whose sampler records every token's experts.
MOE = {"model.preset": "tiny-moe", "algo.routing_replay": True, "env.tools": (),
       "env.name": "odd_length_ends",
       "model.overrides": {"num_layers": 1, "hidden_size": 32, "num_heads": 2,
                           "num_kv_heads": 1, "moe_intermediate_size": 16}}


@pytest.mark.parametrize("engine", ["static", "slots", "routes"])
def test_tree_of_episodes_trains_on_the_leaves_rewards(tmp_path, monkeypatch, engine):
    """rollout.tree with env.name: each group's first turns are one tree's leaves (they share
    the tree's first segment, pairs its second; grown by the static tree sampler or on the
    slot engine), later turns are played on per episode on the episode engine, and treepo
    trains on the leaves' episode rewards, scoring every turn as the sampler did; the
    decoded tokens count a shared segment once. ``routes``:
    routing replay on a mixture of experts (the tree on the slot engine): a row's routes are the
    tree's for its first turn (an episode that ended there never reached the engine) and the
    engine's after it, and the update replays them."""
    from rljax.train.core import episodes

    played, real = [], episodes.run_episodes

    def recording(*args, **kw):
        played.append(out := real(*args, **kw))
        return out

    monkeypatch.setattr(episodes, "run_episodes", recording)
    cfg = tiny_cfg(**{**EPISODES, "steps": 1 if engine == "routes" else 2,
                      "algo.adv_estimator": "treepo",
                      "rollout.engine": "slots" if engine == "routes" else engine,
                      "rollout.slots": 3, **(MOE if engine == "routes" else {})})
    cfg.env.kwargs = {} if engine == "routes" else {"describe_tools": False}
    assert run.train(cfg, str(tmp_path), devices=DEVICES) == 0
    rl = [r for r in read_metrics(str(tmp_path)) if "reward/mean" in r]
    assert len(rl) == cfg.steps and all(np.isfinite(r["loss"]) for r in rl)
    assert all(r["rollout/logp_diff_max"] < 1e-4 for r in rl)   # every turn as sampled
    # (the tree's shared segments are decoded once, not once per leaf)
    assert all(r["rollout/decoded_tokens"] < r["rollout/train_tokens"] for r in rl)
    eps = [e for e in played if len(e["tokens"]) == 16]
    assert len(eps) == cfg.steps
    for e in eps:
        first = np.where(e["turn_ids"] == 0, e["tokens"], -1)[:, :2].reshape(4, 4, 2)
        assert (first[:, :, 0] == first[:, :1, 0]).all()          # one root segment per tree
        assert (first[:, ::2, 1] == first[:, 1::2, 1]).all()      # forked in pairs after it
        assert (e["turns"] >= 1).all() and e["model_tokens"].min() >= 1
        if engine == "routes":   # every first turn's fed tokens have their experts
            p, n = e["routes"].shape[1] - 28, (e["turn_ids"] == 0).sum(1)
            assert all(e["routes"][i, p:p + n[i] - 1].any(-1).all() for i in range(16))
            assert (e["turns"] == 1).any() and (e["turns"] == 2).any()


CHECKPOINT = {"env.name": "tictactoe", "env.selfplay.mode": "checkpoint",
              "env.selfplay.workdir": "runs/x"}


@pytest.mark.parametrize("overrides, message", [
    ({"env.name": "tictactoe", "env.selfplay.mode": "self"},
     "rollout.tree.enabled=true with env.name has no meaning with env.selfplay.mode='self'"),
])
def test_tree_of_episodes_refuses_what_it_cannot_do(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        tiny_cfg(**{**EPISODES, **overrides})


def test_tree_against_a_checkpoint_opponent_takes_partial_rollouts():
    """Carried matches keep their tree (``partial_matches._grow_trees``): the config holds."""
    cfg = tiny_cfg(**{**EPISODES, **CHECKPOINT, "rollout.partial": True,
                      "rollout.engine": "slots"})
    assert cfg.rollout.partial and cfg.rollout.tree.enabled


@pytest.mark.parametrize("overrides, message", [
    ({"rollout.tree.max_leaves": 8}, "rollout.tree.max_leaves=8 must equal "
                                     "algo.num_generations=4"),
    ({"algo.num_generations": 6, "rollout.batch_size": 12},
     "rollout.tree.max_leaves=6 is not reachable"),
    ({"rollout.tree.roots": 3}, "rollout.tree.max_leaves=4 is not reachable"),
    ({"rollout.tree.branching": 0}, "rollout.tree.branching=0 must be >= 1"),
    ({"rollout.tree.segment_tokens": 2}, "rollout.tree.segment_tokens=2: 2 forks"),
    ({**EPISODES, "rollout.tree.segment_tokens": 4, "rollout.max_new_tokens": 16},
     "4 tokens must be < env.max_turn_tokens=8"),   # episodes: a tree of first turns
    ({"rollout.tree.enabled": False, "algo.adv_estimator": "treepo"},
     "set rollout.tree.enabled=true"),
    ({"algo.adv_estimator": "rover", "algo.kl_in_reward": True, "algo.beta": 0.1},
     "algo.kl_in_reward=true is not supported"),
    ({"algo.name": "dpo"}, "needs algo.name='grpo', 'distill' or 'ppo' (got 'dpo')"),
    ({"algo.asynchronous": True, "algo.inflight_updates": True},
     "algo.inflight_updates=true needs rollout.engine='slots'"),
])
def test_bad_tree_budgets_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tiny_cfg(**overrides)


def test_cli_bad_tree_exits_2_with_one_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", "rljax.cli", "train", "--config", "configs/grpo_arithmetic.py",
         "--workdir", str(tmp_path), "--config.rollout.tree.enabled=true",
         "--config.rollout.tree.segment_tokens=2"],
        capture_output=True, text=True, env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "rljax: error: rollout.tree.segment_tokens=2: 3 forks * 2 tokens must be < "
        "rollout.max_new_tokens=6 (the leaves need a segment)"]


def test_tree_demo_config_validates():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = config_lib.load_config(os.path.join(root, "configs", "grpo_arithmetic_tree.py"))
    assert cfg.algo.adv_estimator == "treepo" and cfg.rollout.tree.enabled
    opts = tree_sampling.options_from_config(cfg.rollout.tree, cfg.algo.num_generations)
    assert opts == dict(segment_tokens=1, branching=2, roots=2, depth=2)


def test_steps_tree_config_differs_from_its_baseline_only_in_the_rollout_tree():
    """The multi-step comparison (docs/search.md) is fair only if the two configs are the same
    run apart from the sampler and the estimator."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    plain = config_lib.load_config(os.path.join(root, "configs", "grpo_arithmetic_steps.py"))
    tree = config_lib.load_config(os.path.join(root, "configs", "grpo_arithmetic_steps_tree.py"))
    config_lib.validate(plain)
    config_lib.validate(tree)
    opts = tree_sampling.options_from_config(tree.rollout.tree, tree.algo.num_generations)
    assert opts == dict(segment_tokens=4, branching=2, roots=2, depth=2)
    assert not plain.rollout.tree.enabled and plain.algo.adv_estimator == "grpo"
    tree.rollout.tree = plain.rollout.tree
    tree.algo.adv_estimator = plain.algo.adv_estimator
    assert tree.to_dict() == plain.to_dict()
