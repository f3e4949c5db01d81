"""VinePPO (algo.adv_estimator='vineppo'): step advantages from the mean reward of forks
sampled at every step prefix, checked against written-out Monte-Carlo averages."""
import re

import jax
import numpy as np
import pytest

from rljax import algorithms
from rljax.train.methods.step_mc import step_ends
from rljax.train.methods.vine import cap_steps


def test_vineppo_advantages_written_out():
    # Completion 0: 3 steps (tokens 0-1 | 2 | 3-4), V = [0.5, 0.25, 1.0], R = 1
    #   A = [0.25 - 0.5, 1.0 - 0.25, 1 - 1.0] = [-0.25, 0.75, 0.0]
    # Completion 1: 1 step (tokens 0-2), V = [0.75], R = 0: A = -0.75 on each of its tokens.
    step_ids = np.array([[0, 0, 1, 2, 2, -1], [0, 0, 0, -1, -1, -1]])
    mask = step_ids >= 0
    values = np.array([[0.5, 0.25, 1.0, 0.0], [0.75, 9.0, 9.0, 9.0]], np.float32)
    adv = algorithms.get_advantage_estimator("vineppo")(
        np.array([1.0, 0.0]), 1, mask=mask, step_ids=step_ids, step_values=values,
        num_steps=np.array([3, 1]))
    np.testing.assert_allclose(np.asarray(adv), [[-0.25, -0.25, 0.75, 0.0, 0.0, 0.0],
                                                 [-0.75, -0.75, -0.75, 0, 0, 0]], atol=1e-7)


def test_step_splitters():
    text = "3+4=7\n7-2=5\n"
    ids = list(range(len(text)))
    decode = lambda xs: "".join(text[i] for i in xs)  # noqa: E731
    assert step_ends(ids, decode, "\n") == [6, 12]
    assert step_ends(ids, decode, "", pattern=re.compile(r"(?:=\d)\Z")) == [5, 11, 12]
    assert cap_steps([5, 11, 12], 2) == [5, 12] and cap_steps([5, 12], 4) == [5, 12]


# ----------------------------------------------------------------------------- in a run

# The knapsack tests' user reward file (1 for an even-length completion) and its rule here.
from test_knapsack import reward_file  # noqa: E402,F401  (a pytest fixture)


def even_length(completions):
    return [float(len(c) % 2 == 0) for c in completions]


def tiny_cfg(reward_file, **overrides):
    from rljax import config as config_lib
    cfg = config_lib.default_config()
    cfg.update_from_flattened_dict({
        "steps": 2, "eval_every": 0, "checkpoint_every": 0,
        "model.preset": "tiny", "tokenizer.kind": "char", "data.source": "arithmetic",
        "data.max_prompt_length": 8, "rollout.batch_size": 8, "rollout.max_new_tokens": 6,
        "algo.num_generations": 2, "algo.beta": 0.0, "optimizer.learning_rate": 1e-3,
        "sft.steps": 0, "eval.num_examples": 8, "eval.batch_size": 8,
        "logging.tensorboard": False, "checkpoint.async_save": False,
        "algo.adv_estimator": "vineppo", "algo.vine.forks": 3, "algo.vine.max_steps": 3,
        "algo.vine.splitter": "regex", "algo.vine.regex": r"[0-9]",
    })
    cfg.model.overrides = {"num_layers": 1, "hidden_size": 32, "intermediate_size": 64,
                           "num_heads": 2, "num_kv_heads": 1}
    cfg.data.kwargs = {"digits": 1, "eval_examples": 8, "num_examples": 8}
    cfg.reward.names = (f"{reward_file}:even_length",)
    cfg.update_from_flattened_dict(overrides)
    return config_lib.validate(cfg)


FAIL = {"algo.hint.threshold": 2.0}   # every group fails: all are guided
HINTS = {"algo.hint.mode": "fixed", "algo.hint.fraction": 0.5, **FAIL}
DEMOS = {"algo.mixed_policy": True, **FAIL}
ANNEALED = {"rollout.temperature_schedule.name": "linear",
            "rollout.temperature_schedule.start": 1.5, "rollout.temperature_schedule.end": 0.5}
# Each group is the 2 leaves of a tree forked after its first 2 tokens.
TREE = {"rollout.tree.enabled": True, "rollout.tree.segment_tokens": 2,
        "rollout.tree.branching": 2}


@pytest.mark.parametrize("guide", [{}, HINTS, DEMOS, ANNEALED, TREE],
                         ids=["sampled", "hints", "mixed_policy", "temperature_schedule",
                              "tree"])
def test_values_are_monte_carlo_averages_of_the_forks(reward_file, tmp_path, monkeypatch,
                                                       guide):
    """Each prefix's value is the mean reward of its K forks, each fork continues that exact
    prefix, and every token's advantage is V(next prefix) - V(its prefix) (R at the end). The
    rows valued are those that train: a hinted row's forks continue prompt ++ hint ++ its
    prefix and are judged with the hint (as its own reward is); a demonstration is valued
    from its own prefixes; a tree's leaves (sharing their first segment) are valued each from
    its own, and the advantages are VinePPO's, not a tree estimator's."""
    from rljax.train import inference
    from rljax.train.core import setup
    from rljax.train.methods import vine
    from rljax.train.phases import make_phases

    drawn = []   # the forks' temperatures: a scheduled fork's token t is the completion's start + t
    fork = vine.generate
    monkeypatch.setattr(vine, "generate", lambda *a, **kw: drawn.append(
        kw["temperatures"]) or fork(*a, **kw))
    cfg = tiny_cfg(reward_file, **guide)
    ctx = setup.build_context(cfg, str(tmp_path), devices=jax.devices()[:1])
    phase = make_phases(ctx)[-1]
    state = inference.start_phase(ctx, phase, inference.initial_state(ctx))
    batch, metrics = phase.rollout(state, 0)
    rnd = next(s for s in phase.rollout.stages if s.name == "vine")._last
    decode, k = ctx.tokenizer.decode, 3
    texts, rewards = rnd["fork_texts"], rnd["fork_rewards"]
    assert rewards.shape == (len(rnd["fork_rows"]), k)
    multi, hints = 0, rnd.get("hint_prefixes", {})
    assert len(hints) == (len(rnd["rewards"]) if guide == HINTS else 0)
    assert np.asarray(rnd.get("demo", False)).sum() == (4 if guide == DEMOS else 0)
    for j, (i, t, start) in enumerate(rnd["fork_rows"]):
        comp = rnd["tokens"][i][rnd["mask"][i]].tolist()
        prefix = decode(hints.get(i, []) + comp[:start])
        forks = texts[j * k:(j + 1) * k]
        assert all(f.startswith(prefix) for f in forks)
        assert rnd["step_values"][i, t] == pytest.approx(np.mean(even_length(forks)), abs=1e-7)
        multi += t > 0
        schedule = phase.rollout.temperatures
        if schedule is not None:
            at = np.minimum(start + np.arange(len(schedule)), len(schedule) - 1)
            np.testing.assert_array_equal(drawn[-1][j * k:(j + 1) * k],
                                          np.tile(schedule[at], (k, 1)))
    assert multi > 0, "no completion had a second step"
    assert (drawn[-1] is None) == (guide != ANNEALED)
    n = batch["loss_mask"].shape[1]
    for i in range(len(rnd["rewards"])):
        s, v, ids = rnd["num_steps"][i], rnd["step_values"][i], rnd["step_ids"][i]
        nxt = [v[t + 1] if t + 1 < s else rnd["rewards"][i] for t in range(s)]
        want = np.where(ids >= 0, np.asarray(nxt)[np.clip(ids, 0, None)] - v[np.clip(ids, 0, None)],
                        0.0)
        np.testing.assert_allclose(batch["advantages"][i, -n:], want * batch["loss_mask"][i],
                                   atol=1e-6)
    assert metrics["vine/fork_tokens"] > 0 and metrics["vine/prefixes"] == len(rnd["fork_rows"])
    if guide == TREE:   # the leaves were tree-sampled: siblings share their first 2 tokens
        t = rnd["tokens"]
        np.testing.assert_array_equal(t[0::2, :2], t[1::2, :2])
        assert metrics["rollout/decoded_tokens"] < metrics["vine/fork_tokens"] + \
            metrics["vine/fork_padding_tokens"] + int(rnd["lengths"].sum())
    assert metrics["rollout/decoded_tokens"] >= metrics["vine/fork_tokens"] + \
        int(rnd["lengths"].sum())


RELIFT = {"algo.relift.every": 1, "algo.relift.batch_size": 4, "algo.relift.k_visits": 1}


KNAPSACK = {"rollout.allocation": "knapsack", "rollout.knapsack.min_samples": 1,
            "rollout.knapsack.max_samples": 4}


@pytest.mark.parametrize("guide", [{}, {**RELIFT, **HINTS}, {**RELIFT, **DEMOS}, ANNEALED,
                                   {"rollout.micro_batch_size": 4},
                                   {"algo.dynamic_sampling": True},
                                   {"data.selection.name": "online_filter", **KNAPSACK},
                                   TREE],
                         ids=["sampled", "relift_hints", "relift_mixed_policy",
                              "temperature_schedule", "micro_batches", "dynamic_sampling",
                              "knapsack_online_filter", "tree"])
def test_vineppo_train_run(reward_file, tmp_path, monkeypatch, guide):
    """VinePPO trains on the rows guidance leaves (hinted groups, demonstrations), and
    ReLIFT's SFT step follows its updates; with a temperature schedule, with the round
    sampled in micro-batches (its rows in order all the same), after a group filter (on the
    knapsack's groups too), and on trees' leaves: exactly the rows that train are valued."""
    from rljax.train import run
    from rljax.train.core.metrics import read_metrics
    from rljax.train.core.rollout import Rollout
    from rljax.train.methods.vine import VineValues

    valued = []   # per call: rows valued, rows the batch trains
    finish, call = VineValues.finish_batch, Rollout.__call__
    monkeypatch.setattr(VineValues, "finish_batch", lambda self, batch, rows: (
        valued.append([len(self._last["tokens"])]) or finish(self, batch, rows)))
    monkeypatch.setattr(Rollout, "__call__", lambda self, state, step: (
        lambda out: valued[-1].append(int(out[0]["loss_mask"].any(1).sum())) or out)(
            call(self, state, step)))
    assert run.train(tiny_cfg(reward_file, **{"algo.vine.splitter": "newline", **guide}),
                     str(tmp_path), devices=jax.devices()[:1]) == 0
    rl = [r for r in read_metrics(str(tmp_path)) if "reward/mean" in r]
    assert len(rl) == 2 and all(np.isfinite(r["loss"]) and r["vine/fork_tokens"] > 0
                                for r in rl)
    assert all(v == t for v, t in valued)
    if "algo.dynamic_sampling" in guide or "data.selection.name" in guide:
        assert any(v < 8 or r["rollout/rounds"] > 1 for (v, _), r in zip(valued, rl))
    if RELIFT.items() <= guide.items():
        assert all("relift/sft_loss" in r and (r.get("hint/fraction_hinted") == 1.0 or
                                               r.get("mixed/demos") == 4) for r in rl)


def test_vineppo_with_partial_rollouts_asynchronously_resumes_exactly(reward_file, tmp_path):
    """VinePPO's values are a rollout stage, so they value whatever round the sampler gives:
    here groups carried across iterations by the partial-rollout pool on the slot engine,
    sampled a version ahead of the update (asynchronous RL), with the prompts' digits set by a
    curriculum. The forks run on the engine too. Stopped after update 2 and resumed, the run
    equals the straight one."""
    from rljax.train.core.metrics import read_metrics
    from test_train_loop import resumes_exactly

    cfg = lambda: tiny_cfg(reward_file, **{  # noqa: E731
        "steps": 4, "rollout.engine": "slots", "rollout.partial": True, "rollout.slots": 4,
        "algo.asynchronous": True, "data.selection.name": "curriculum",
        "data.selection.knob": "digits", "data.selection.window": 1,
        "data.selection.threshold": 0.0, "data.selection.high": 0.5,
        "data.kwargs": {"digits": 2, "eval_examples": 8, "num_examples": 8}})
    straight, _ = resumes_exactly(cfg, tmp_path, stop_after=2)
    rl = [r for r in read_metrics(straight) if "reward/mean" in r]
    assert all(r["vine/fork_tokens"] > 0 and r["rollout/carried_groups"] > 0 for r in rl)
    assert [r["rollout/sample_version"] for r in rl] == [0, 0, 1, 2]
    assert max(r["rollout/staleness_max"] for r in rl) >= 2   # carried and sampled ahead


def check_episode_values(rnd: dict, batch: dict, decode, k: int) -> int:
    """Asserts what the forks of a round of episode rows did (see the test below); returns
    how many forks started in a second model turn."""
    eps, later_turn = rnd["fork_episodes"], 0
    turn_text = lambda f, n: decode(eps["tokens"][f][eps["turn_ids"][f] == n].tolist())  # noqa
    for j, (i, t, start) in enumerate(rnd["fork_rows"]):
        later_turn += rnd["turn_ids"][i, start] > 0
        for f in range(j * k, (j + 1) * k):   # the fork continues the row's trajectory
            np.testing.assert_array_equal(eps["tokens"][f, :start], rnd["tokens"][i, :start])
            np.testing.assert_array_equal(eps["turn_ids"][f, :start], rnd["turn_ids"][i, :start])
            assert eps["turns"][f] == 2 and not eps["truncated"][f]   # played to its end
            want = (len(turn_text(f, 0)) % 3) / 3 + (len(turn_text(f, 1)) % 4) / 4
            assert rnd["fork_rewards"][j, f - j * k] == pytest.approx(want, abs=1e-6)
        assert rnd["step_values"][i, t] == pytest.approx(rnd["fork_rewards"][j].mean(), abs=1e-6)
    n = batch["loss_mask"].shape[1]
    for i in range(len(rnd["rewards"])):
        s, v, ids = rnd["num_steps"][i], rnd["step_values"][i], rnd["step_ids"][i]
        np.testing.assert_array_equal(ids >= 0, batch["model_mask"][i, -n:])
        nxt = [v[t + 1] if t + 1 < s else rnd["rewards"][i] for t in range(s)]
        want = np.where(ids >= 0, np.asarray(nxt)[np.clip(ids, 0, None)] - v[np.clip(ids, 0, None)],
                        0.0)
        np.testing.assert_allclose(batch["advantages"][i, -n:], want, atol=1e-6)
    return later_turn


def test_vineppo_on_episodes_replays_the_environment_and_resumes_exactly(tmp_path, monkeypatch):
    """Multi-turn episodes (two turns around an observation), carried across iterations by
    the partial-rollout pool. Steps are cut within the model's turns; each fork replays the
    episode's earlier turns through env.step, finishes the turn it forks from and plays the
    episode out; a value is the mean of its forks' episode rewards (here the two turns'
    environment rewards, recomputed from the fork's own turns), and observation tokens get no
    advantage. A fork's draws depend on its (row, step, fork) only: the first rows valued alone
    get the same forks. Stopped after the first update and resumed, the run equals the
    straight one."""
    from test_agent_credit import episode_cfg   # registers the two-turn environment
    from rljax.train.core.metrics import read_metrics
    from rljax.train.core.rollout import Rollout
    from rljax.train.methods import vine_episodes
    from test_train_loop import resumes_exactly

    k, later_turn, subsets = 2, [], []
    values, call = vine_episodes.step_values, Rollout.__call__

    def alone(stage, params, view, key):   # the first two rows again, under the same key
        out = values(stage, params, view, key)
        first = values(stage, params, {**view, **{name: view[name][:2] for name in (
            "tokens", "mask", "turn_ids", "prompt_ids", "examples")}}, key)
        m = len(first["fork_rows"])
        assert out["fork_rows"][:m] == first["fork_rows"]
        np.testing.assert_array_equal(first["fork_rewards"], out["fork_rewards"][:m])
        np.testing.assert_array_equal(first["fork_episodes"]["tokens"],
                                      out["fork_episodes"]["tokens"][:m * k])
        subsets.append(m)
        return out

    def checked(self, state, step):
        batch, metrics = call(self, state, step)
        rnd = next(s for s in self.stages if s.name == "vine")._last
        later_turn.append(check_episode_values(rnd, batch, self.ctx.tokenizer.decode, k))
        assert metrics["vine/prefixes"] == len(rnd["fork_rows"])
        return batch, metrics

    monkeypatch.setattr(vine_episodes, "step_values", alone)
    monkeypatch.setattr(Rollout, "__call__", checked)
    cfg = lambda: episode_cfg(**{  # noqa: E731
        "steps": 2, "algo.adv_estimator": "vineppo", "algo.vine.forks": k,
        "algo.vine.max_steps": 3, "algo.vine.splitter": "regex", "algo.vine.regex": r"[0-9]",
        "rollout.batch_size": 4, "algo.num_generations": 2, "rollout.engine": "slots",
        "rollout.partial": True, "rollout.slots": 3, "rollout.chunk_steps": 4})
    straight, _ = resumes_exactly(cfg, tmp_path, stop_after=1)
    assert sum(later_turn) > 0, "no fork started in a second turn"
    assert len(later_turn) == 4 and all(m > 0 for m in subsets)
    rl = [r for r in read_metrics(straight) if "reward/mean" in r]
    assert len(rl) == 2 and all(r["vine/fork_tokens"] > 0 for r in rl)
    assert any(r["rollout/carried_groups"] > 0 for r in rl)


@pytest.mark.parametrize("overrides, key", [
    (["algo.kl_in_reward=true", "algo.beta=0.01"], "algo.kl_in_reward"),
    (["algo.gamma=0.9"], "algo.gamma"),
    (["algo.vine.splitter=regex", "algo.vine.regex=("], "algo.vine.regex"),
    (["algo.name=ppo"], "algo"),
])
def test_bad_vine_config_names_the_key(overrides, key):
    from rljax import config as config_lib
    from rljax.errors import ConfigError
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_lib.load_config(None, ["algo.adv_estimator=vineppo"] + overrides)


def test_vineppo_forks_of_episodes_follow_the_temperature_schedule(tmp_path, monkeypatch):
    """With ``rollout.temperature_schedule`` a fork's turn continues the episode's schedule:
    its first turn's temperatures start after the model tokens fed before the fork point
    (earlier turns and the turn so far), so a fork draws its k-th model token at
    schedule[k] as the episode did; the run trains."""
    from test_agent_credit import episode_cfg   # registers the two-turn environment
    from rljax.train import run
    from rljax.train.core import episodes as ep
    from rljax.train.core.metrics import read_metrics
    from rljax.train.core.sampler import rollout_temperatures

    asked, turn_temperatures = [], ep._Trajectories.turn_temperatures

    def spy(self, rows, ahead=0):
        out = turn_temperatures(self, rows, ahead)
        if out is not None:
            done = int(self.model_mask[rows[0]].sum()) + ahead
            asked.append((ahead, out[0, 0] == self.schedule[min(done, len(self.schedule) - 1)]))
        return out
    monkeypatch.setattr(ep._Trajectories, "turn_temperatures", spy)
    cfg = episode_cfg(**{
        "steps": 1, "algo.adv_estimator": "vineppo", "algo.vine.forks": 2,
        "algo.vine.max_steps": 3, "algo.vine.splitter": "regex", "algo.vine.regex": r"[0-9]",
        "rollout.batch_size": 4, "algo.num_generations": 2, "rollout.engine": "slots",
        "rollout.temperature_schedule.name": "linear",
        "rollout.temperature_schedule.start": 2.0, "rollout.temperature_schedule.end": 0.5,
        "rollout.temperature_schedule.tokens": 12})
    assert rollout_temperatures(cfg) is not None
    assert run.train(cfg, str(tmp_path), devices=jax.devices()[:1]) == 0
    (r,) = [r for r in read_metrics(str(tmp_path)) if "reward/mean" in r]
    assert r["vine/fork_tokens"] > 0 and np.isfinite(r["loss"])
    assert any(ahead > 0 for ahead, _ in asked) and all(ok for _, ok in asked)
