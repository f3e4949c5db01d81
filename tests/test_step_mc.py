"""Step-level DPO pairs from Monte-Carlo step values (data.pairs="step_mc")."""
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import config as config_lib
from rljax import models, rewards
from rljax.data.tasks import ArithmeticTask
from rljax.rewards.combine import RewardResult
from rljax.tokenizers import CharTokenizer
from rljax.train.methods import step_mc
from rljax.train.phases import dpo
from tests.test_selfplay import text_parity_cell, ttt_cfg  # noqa: F401 (a fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOK = CharTokenizer()
EOS = TOK.eos_id


def ids(text, eos=False):
    return TOK.encode(text) + ([EOS] if eos else [])


# ----------------------------------------------------------------------------- pure helpers

def test_step_ends_cut_after_each_delimiter_and_at_the_stop_token():
    seq = ids("3+4=7\n7-2=5", eos=True)
    assert step_mc.step_ends(seq, TOK.decode, "\n", (EOS,)) == [6, 12]
    assert step_mc.step_ends(ids("12;3;"), TOK.decode, ";") == [3, 5]
    assert step_mc.step_ends(ids("no delimiter"), TOK.decode, "\n") == [12]   # one step
    assert step_mc.step_ends([], TOK.decode, "\n") == []


def test_candidate_values_are_mean_rewards_of_the_continuations_starting_with_them():
    steps = [(1,), (2,), (1,), (3,)]
    vals = step_mc.candidate_values(steps, [1.0, 0.0, 0.5, 0.25], extra=((2,), [1.0, 1.0]))
    assert vals == {(1,): (0.75, 2), (2,): (2.0 / 3.0, 3), (3,): (0.25, 1)}
    assert step_mc.best_worst_steps(vals) == ((1,), (3,), 0.5)
    assert step_mc.best_worst_steps(vals, min_gap=0.5) is None    # gap must exceed it
    assert step_mc.best_worst_steps({(1,): (1.0, 4)}) is None       # one candidate: no pair


def test_arithmetic_steps_solution_is_left_to_right_and_ends_in_the_answer():
    task = ArithmeticTask(digits=1, operands=4, ops="+-", steps=True)
    for i in range(20):
        ex = task.example(i)
        lines = task.solution(ex).split("\n")
        assert len(lines) == 3 and lines[-1].endswith("=" + ex["answer"])
        assert rewards.get("arithmetic")([ex["question"]], [task.solution(ex)],
                                         answer=[ex["answer"]]) == [1.0]
    with pytest.raises(ValueError, match="steps"):
        ArithmeticTask(ops="+*", steps=True)


# ----------------------------------------------------------------------------- scripted source

PROMPT = "1+2+3="
CONTINUATIONS = {   # prompt text fed to the sampler -> its K=2 continuations
    PROMPT: ["1+2=3\n3+3=6", "1+2=4\n4+3=7"],
    PROMPT + "1+2=3\n": ["3+3=6", "3+3=7"],
}
TIED = "2+2+2="   # both samples right: equal rewards, a group dynamic sampling drops
CONTINUATIONS[TIED] = ["2+2=4\n4+2=6", "2+2=4\n4+2=6"]
REWARD = {"1+2=3\n3+3=6": 1.0, "1+2=4\n4+3=7": 0.0, "1+2=3\n3+3=7": 0.5, "2+2=4\n4+2=6": 1.0}


def scripted_source(monkeypatch, max_steps=2, prompts=(PROMPT,), **options):
    cfg = config_lib.default_config()
    cfg.update_from_flattened_dict({
        "algo.name": "dpo", "algo.online": True, "algo.num_generations": 2,
        "rollout.batch_size": 2, "rollout.max_new_tokens": 12, "data.max_prompt_length": 8,
        "data.pairs": "step_mc", "algo.step_mc.max_steps": max_steps, **options})
    config_lib.validate(cfg)
    calls = []

    def fake_generate(ctx, params, p_tok, p_mask, rng, *, num_samples, max_new_tokens, **kw):
        prompts = TOK.batch_decode(p_tok, p_mask)
        calls.append((prompts, num_samples, p_tok.shape))
        rows = [ids(c, eos=True) for p in prompts for c in CONTINUATIONS[p]]
        tokens = np.zeros((len(rows), max_new_tokens), np.int32)
        mask = np.zeros(tokens.shape, bool)
        for i, r in enumerate(rows):
            tokens[i, :len(r)], mask[i, :len(r)] = r, True
        return {"tokens": tokens, "mask": mask, "lengths": mask.sum(1),
                "logps": np.zeros(tokens.shape, np.float32), "truncated": ~mask.any(1)}

    def reward_fn(prompts, texts, **_):
        total = [REWARD[t] for t in texts]
        return RewardResult(total=total, per_function={"scripted": total},
                            errors={"scripted": 0})

    monkeypatch.setattr(step_mc, "generate", fake_generate)
    ctx = types.SimpleNamespace(cfg=cfg, tokenizer=TOK, reward_fn=lambda: reward_fn, mesh=None)
    source = step_mc.StepMCPairs(ctx, iter([[{"prompt": p, "answer": "6"}] for p in prompts]))
    state = types.SimpleNamespace(rng=jax.random.PRNGKey(0), params=None)
    return source, state, calls


def test_step_pairs_share_the_prefix_and_differ_in_the_step(monkeypatch):
    source, state, calls = scripted_source(monkeypatch)
    batch, metrics = source(state, 0)
    # Level 0 from the prompt, then K continuations of the trajectory's one proper prefix,
    # each prefix prefilled once and fanned out to K rows (num_samples=K).
    assert [c[0] for c in calls] == [[PROMPT], [PROMPT + "1+2=3\n"]]
    assert [c[1] for c in calls] == [2, 2]
    assert batch["pair_mask"].tolist() == [True, True]
    context = TOK.batch_decode(batch["prompt_tokens"], batch["prompt_mask"])
    chosen = [TOK.decode(t[m], skip_special=False)
              for t, m in zip(batch["chosen_tokens"], batch["chosen_mask"])]
    rejected = [TOK.decode(t[m], skip_special=False)
                for t, m in zip(batch["rejected_tokens"], batch["rejected_mask"])]
    # Root: "1+2=3\n" is valued by its own sample (1.0) and the K continuations of the next
    # prefix (1.0, 0.5): 2.5 / 3; "1+2=4\n" by its one sample (0.0).
    assert context[0] == PROMPT and chosen[0] == "1+2=3\n" and rejected[0] == "1+2=4\n"
    # Depth 1: the shared prefix is context; the two steps differ.
    assert context[1] == PROMPT + "1+2=3\n"
    assert chosen[1] == "3+3=6<eos>" and rejected[1] == "3+3=7<eos>"
    assert metrics["step_mc/pairs"] == 2 and metrics["step_mc/prefixes"] == 1
    assert metrics["step_mc/value_gap_mean"] == pytest.approx((2.5 / 3 + 0.5) / 2)
    # V(prefix) = mean reward of its K continuations: root (1 + 0) / 2, depth 1 (1 + .5) / 2.
    assert metrics["step_mc/prefix_value_mean"] == pytest.approx((0.5 + 0.75) / 2)
    assert metrics["reward/mean"] == pytest.approx(0.5)
    # Static shapes: context padded to max_prompt_length + max_new_tokens.
    assert batch["prompt_tokens"].shape == (2, 20) and batch["chosen_tokens"].shape == (2, 12)


@pytest.mark.parametrize("extra_rounds", [1, 0])
def test_dynamic_sampling_builds_pairs_for_the_prompts_whose_samples_differ(monkeypatch,
                                                                            extra_rounds):
    """A prompt whose K samples tie is dropped before its prefixes are sampled and the next
    round's prompt takes its place; without a round left it only fills the batch: no pairs."""
    source, state, calls = scripted_source(monkeypatch, prompts=(TIED, PROMPT), **{
        "algo.dynamic_sampling": True, "algo.max_sampling_rounds": extra_rounds})
    batch, metrics = source(state, 0)
    assert metrics["rollout/rounds"] == 1 + extra_rounds
    if extra_rounds:
        assert [c[0] for c in calls] == [[TIED], [PROMPT], [PROMPT + "1+2=3\n"]]
        assert batch["pair_mask"].tolist() == [True, True]
        assert metrics["rollout/filler_groups"] == 0 and metrics["step_mc/pairs"] == 2
    else:
        assert [c[0] for c in calls] == [[TIED]]   # no prefix of a filler prompt is sampled
        assert batch["pair_mask"].tolist() == [False, False]
        assert metrics["rollout/filler_groups"] == 1 and metrics["step_mc/pairs"] == 0
    # reward/mean: every sampled completion of the step, of dropped rounds too
    assert metrics["reward/mean"] == pytest.approx(0.75 if extra_rounds else 1.0)


def test_pairs_stop_at_max_steps_and_pad_statically(monkeypatch):
    source, state, calls = scripted_source(monkeypatch, max_steps=1)
    batch, metrics = source(state, 0)
    assert len(calls) == 1   # no prefix continuations
    assert batch["pair_mask"].tolist() == [True] and metrics["step_mc/prefixes"] == 0


def test_prefix_tokens_are_context_not_scored_by_the_dpo_logps():
    """sequence_logps of a step pair == the sum of full-forward log-probs over the step's
    tokens only (the shared prefix conditions them but is not part of the sum)."""
    cfg = models.get_preset("tiny", num_layers=1, hidden_size=32, intermediate_size=64,
                            num_heads=2, num_kv_heads=1, vocab_size=TOK.vocab_size)
    params = models.init_params(cfg, jax.random.PRNGKey(0))
    context, chosen, rejected = ids("1+2+3=1+2=3\n"), ids("3+3=6", True), ids("3+3=7", True)
    p, n = 20, 8
    pt = np.zeros((1, p), np.int32)
    pt[0, p - len(context):] = context

    def right(s):
        t = np.zeros((1, n), np.int32)
        t[0, :len(s)] = s
        return t, t != 0
    ct, cm = right(chosen)
    rt, rm = right(rejected)
    batch = {"prompt_tokens": pt, "prompt_mask": pt != 0, "chosen_tokens": ct,
             "chosen_mask": cm, "rejected_tokens": rt, "rejected_mask": rm}
    got, lengths = dpo.sequence_logps(cfg, params, batch)
    for row, step in enumerate((chosen, rejected)):
        seq = np.asarray([context + step])
        logits = np.asarray(models.forward(cfg, params, jnp.asarray(seq)), np.float64)
        top = logits.max(-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        tok_logp = [logp[0, t - 1, seq[0, t]] for t in range(1, seq.shape[1])]
        step_only = sum(tok_logp[len(context) - 1:])
        with_prefix = sum(tok_logp)
        assert float(got[row]) == pytest.approx(step_only, abs=1e-4)
        assert abs(with_prefix - step_only) > 1.0   # the prefix would have counted
        assert float(lengths[row]) == len(step)


# ----------------------------------------------------------------------------- bad input

def test_config_rejects_step_mc_outside_online_dpo():
    with pytest.raises(config_lib.ConfigError, match="data.pairs='step_mc'"):
        config_lib.load_config(None, ["--config.data.pairs=step_mc"])


def test_delimiter_that_never_occurs_is_one_line_exit_2(tmp_path):
    args = ["--config", os.path.join(ROOT, "configs", "dpo_arithmetic_step_mc.py"),
            "--workdir", str(tmp_path / "w"), "--config.data.step_delimiter=;"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
               XLA_FLAGS=os.environ.get("RLJAX_TEST_COMPILER_FLAGS", ""))
    proc = subprocess.run([sys.executable, "-m", "rljax.cli", "train", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "data.step_delimiter=';'" in lines[0], proc.stderr
    assert not os.path.isdir(tmp_path / "w" / "checkpoints")


# ----------------------------------------------------------------------------- end to end

def tiny_step_mc_cfg(steps, **options):
    cfg = config_lib.default_config()
    cfg.update_from_flattened_dict({
        "steps": steps, "eval_every": 0, "checkpoint_every": 0, "tokenizer.kind": "char",
        "data.max_prompt_length": 8, "data.pairs": "step_mc", "algo.name": "dpo",
        "algo.online": True, "algo.num_generations": 2, "algo.step_mc.max_steps": 2,
        "rollout.batch_size": 4, "rollout.max_new_tokens": 8, "optimizer.learning_rate": 1e-3,
        "sft.steps": 2, "sft.batch_size": 4, "sft.max_length": 26, "eval.num_examples": 4,
        "eval.batch_size": 4, "logging.tensorboard": False, "checkpoint.async_save": False,
        **options})
    cfg.model.overrides = {"num_layers": 1, "hidden_size": 32, "intermediate_size": 64,
                           "num_heads": 2, "num_kv_heads": 1}
    cfg.data.kwargs = {"digits": 1, "operands": 3, "steps": True, "eval_examples": 4}
    return config_lib.validate(cfg)


def digit_share(prompts, completions, **_):
    """A reward in [0, 1] that tells the untrained policy's samples apart (its arithmetic
    is all wrong): the share of digits in the completion."""
    return [sum(c.isdigit() for c in t) / max(len(t), 1) for t in completions]


@pytest.mark.parametrize("options, acted", [
    # MoPPS learns each prompt's posterior from its level-0 samples; the online filter keeps
    # the prompts whose pass rate (digit share >= 0.2) is in its band, sampling more rounds.
    ({"data.selection.name": "predicted", "data.selection.pool_factor": 2},
     lambda rs: rs[-1]["selection/tracked"] > 0),
    ({"data.selection.name": "online_filter", "data.selection.threshold": 0.2,
      "data.selection.low": 0.5, "data.selection.high": 0.5, "algo.max_sampling_rounds": 3},
     lambda rs: max(r["rollout/rounds"] for r in rs) > 1
     and 0 < rs[-1]["selection/in_band_frac"] < 1),
    # the curriculum starts its knob at min_level (the configured 3 operands is the top)
    ({"data.selection.name": "curriculum", "data.selection.knob": "operands",
      "data.selection.min_level": 2, "data.selection.window": 1},
     lambda rs: all(r["selection/level"] == 2 for r in rs)),
])
def test_step_mc_pairs_of_the_prompts_selection_picks_train(tmp_path, monkeypatch, options,
                                                             acted):
    """Prompt selection draws the prompts whose step pairs are built and learns from their
    first samples: two DPO rounds train on pairs with finite losses, and the selector acted."""
    from rljax.rewards import registry
    from rljax.train import run
    from rljax.train.core.metrics import read_metrics

    monkeypatch.setitem(registry._REGISTRY, "digit_share", lambda: digit_share)
    cfg = tiny_step_mc_cfg(2, **{"sft.steps": 0, "reward.names": ("digit_share",), **options})
    assert run.train(cfg, str(tmp_path), devices=jax.devices()[:1]) == 0
    rounds = [r for r in read_metrics(str(tmp_path)) if "step_mc/pairs" in r]
    assert len(rounds) == 2 and all(np.isfinite(r["loss"]) for r in rounds)
    assert acted(rounds) and sum(r["dpo/pairs"] for r in rounds) > 0, rounds


# Asynchronous DPO: the sampler builds the pair batches ahead on a device of its own.
ASYNC = {"algo.asynchronous": True, "mesh.rollout_devices": 1, "mesh.data": 1, "mesh.fsdp": 1,
         "mesh.rollout.data": 1, "mesh.rollout.fsdp": 1}


@pytest.mark.parametrize("options, devices", [({}, 1), (ASYNC, 2)], ids=["sync", "async"])
def test_step_mc_run_resumes_exactly(tmp_path, monkeypatch, options, devices):
    """Same seed: a run stopped after its first DPO round and resumed logs the same metrics
    and ends with the same parameters as a straight run (the sampling keys come from the train
    state, the data position from the phase's state_dict; asynchronous: the pair batch in
    flight, sampled by version 1 before the stop, is saved with the checkpoint)."""
    from rljax.train import run
    from rljax.train.core import checkpoint
    from rljax.train.core.metrics import read_metrics

    from rljax.rewards import registry
    from test_train_loop import StopAfter

    monkeypatch.setitem(registry._REGISTRY, "digit_share", lambda: digit_share)
    options = {"reward.names": ("digit_share",), **options}   # pairs to train on
    devices = jax.devices()[:devices]
    steps = 3 if len(options) > 1 else 2
    straight, parts = str(tmp_path / "a"), str(tmp_path / "b")
    assert run.train(tiny_step_mc_cfg(steps, **options), straight, devices=devices) == 0
    assert run.train(tiny_step_mc_cfg(steps, **options), parts, devices=devices,
                     stop=StopAfter(3)) == 0
    assert run.train(tiny_step_mc_cfg(steps, **options), parts, devices=devices) == 0

    def comparable(workdir):
        return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "tokens_per_s"}
                for r in read_metrics(workdir)]
    rounds = [r for r in comparable(straight) if "step_mc/pairs" in r]
    assert len(rounds) == steps and all("rollout/tokens" in r for r in rounds)
    assert all(np.isfinite(r["loss"]) and r["dpo/pairs_frac"] > 0 for r in rounds)
    if steps == 3:   # batch k trains on pairs sampled by version k - 1 (the first by version 0)
        assert [r["rollout/sample_version"] for r in rounds] == [0, 0, 1]
    assert comparable(parts) == comparable(straight)

    def params(workdir):
        with checkpoint.CheckpointManager(checkpoint.checkpoint_dir(workdir)) as ckpt:
            return jax.tree.map(np.asarray, ckpt.restore().state["params"])
    jax.tree.map(np.testing.assert_array_equal, params(parts), params(straight))


def test_step_mc_pairs_over_an_environments_turns_pair_sibling_turns(tmp_path):
    """data.pairs='step_mc' with env.name: the steps are the episode's model turns; the
    best episode's prefix after turn 0 (its observation included) is continued as episodes
    that replay turn 0, and chosen and rejected are sibling turns at a prefix, laid out as
    MCTS pairs over turns are; a DPO round trains on them."""
    from rljax.envs.base import register_env
    from rljax.train.core import setup
    from rljax.train.core.state import create_train_state
    from rljax.train.methods import step_mc_episodes
    from test_mcts_rollout import EPISODE_SEARCH, TwoTurnEnv

    register_env("test_two_turns", TwoTurnEnv)
    env = {k: v for k, v in EPISODE_SEARCH.items() if k.startswith(("env.", "reward."))}
    cfg = tiny_step_mc_cfg(1, **env, **{"sft.steps": 0, "rollout.batch_size": 6,
                                         "rollout.max_new_tokens": 12})
    ctx = setup.build_context(cfg, str(tmp_path), devices=jax.devices()[:1])
    phase = dpo.DPOPhase(ctx, 1)
    assert isinstance(phase.source, step_mc_episodes.EpisodeStepMCPairs)
    state = phase.init_state(create_train_state(ctx.params, phase.optimizer, jax.random.key(0)))
    batch, m = phase.source(state, 0)
    real = np.flatnonzero(batch["pair_mask"])
    assert real.size and m["step_mc/pairs"] == real.size and m["step_mc/prefixes"] > 0
    assert m["step_mc/steps_mean"] == 2   # TwoTurnEnv's episodes have two model turns
    contexts = [TOK.decode(batch["prompt_tokens"][i][batch["prompt_mask"][i]]) for i in real]
    assert any("<o>" in c for c in contexts)   # a pair after turn 0: the observation is context
    # The context holds up to the whole episode before the turn, and the plan knows its width.
    from rljax.train.core import programs
    width = cfg.data.max_prompt_length + cfg.env.max_total_tokens
    assert batch["prompt_tokens"].shape[1] == width > cfg.data.max_prompt_length + 12
    assert programs.pair_batch(ctx, phase.num_pairs)["prompt_tokens"].shape[1] == width
    for i in real:   # the steps are model turns (env.max_turn_tokens = 4), not observations
        sides = [batch[f"{s}_tokens"][i][batch[f"{s}_mask"][i]] for s in ("chosen", "rejected")]
        assert all(0 < len(t) <= 4 and "<o>" not in TOK.decode(t) for t in sides)
        assert sides[0].tolist() != sides[1].tolist()
    _, train = phase.iteration(state, 0)   # a round (the iterator's next prompts), trained
    assert train["dpo/pairs"] == train["step_mc/pairs"] > 0 and np.isfinite(train["loss"])


def test_step_mc_candidates_in_a_match_are_played_from_the_trajectorys_state():
    """A learner turn d is a candidate at prefix d only where its match up to it is the
    trajectory's: at the root of a seat that does not move first, the level-0 matches that
    share the trajectory's opening; a match without turn d is none."""
    from rljax.train.methods.step_mc_matches import MatchPlay, MatchStepMCPairs

    def match(opening, *turns):   # the other seat opens, then the turns alternate with (9,)
        history = (opening,) + tuple(x for t in turns for x in (t, (9,)))
        return MatchPlay([(t, ()) for t in turns], history, tuple(range(1, 2 * len(turns), 2)),
                         ())
    traj = match((5,), (1,), (2,))
    played = [traj, match((5,), (3,)), match((6,), (4,)), match((5,))]
    at_root = MatchStepMCPairs.candidates(None, 0, played, [1.0, 0.0, -1.0, 0.5], traj)
    assert at_root == [((1,), 1.0), ((3,), 0.0)]
    forks = [match((5,), (1,), (7,)), match((5,), (3,), (8,))]   # the second did not replay
    assert MatchStepMCPairs.candidates(None, 1, forks, [1.0, 0.0], traj) == [((7,), 1.0)]


@pytest.mark.parametrize("mode", ["self", "checkpoint"])
def test_step_mc_pairs_in_selfplay_replay_the_match_and_value_the_learner_seat(
        tmp_path, monkeypatch, text_parity_cell, mode):
    """data.pairs='step_mc' with env.selfplay: the trajectory is the best of an example's K
    matches seen from its seat; a prefix's continuations replay its match, every seat's plies
    up to the learner's turn d (the learner's view of them included), then play it out (the
    other seat by the policy, or the greedy checkpoint), and a continuation's value is the
    learner seat's reward in its match; pairs are the learner's sibling turns after its
    match so far. Two DPO rounds train on them, and a run stopped after its first and resumed
    equals the straight one. (A move is the cell ``text_parity_cell`` reads in the text.)"""
    from rljax.envs import board_games
    from rljax.train import run
    from rljax.train.core import checkpoint, setup
    from rljax.train.core.metrics import read_metrics
    from rljax.train.methods import step_mc_matches
    from rljax.train.methods.selfplay import seat_of
    from test_train_loop import StopAfter
    from tests.test_mcts_rollout import replayed_match, write_opponent_run

    def cfg(**extra):
        return ttt_cfg(**{"algo.name": "dpo", "algo.online": True, "data.pairs": "step_mc",
                          "data.step_delimiter": "\n", "rollout.batch_size": 4,
                          "algo.num_generations": 2, "algo.step_mc.max_steps": 3,
                          "data.max_prompt_length": 64, "optimizer.warmup_steps": 0,
                          "optimizer.learning_rate": 1e-3, "env.selfplay.mode": "self",
                          **extra})
    extra = {}
    if mode == "checkpoint":
        ctx = setup.build_context(cfg(), str(tmp_path / "ctx"), devices=jax.devices()[:1])
        extra = {"env.selfplay.mode": "checkpoint", "env.selfplay.workdir": write_opponent_run(
            str(tmp_path / "opponent"), cfg(), ctx.params)}
    plays, play = [], step_mc_matches.MatchStepMCPairs._play
    monkeypatch.setattr(step_mc_matches.MatchStepMCPairs, "_play", lambda self, *a: (
        plays.append((a[1], a[3], a[4], out := play(self, *a))), out)[1])
    batches, call = [], step_mc_matches.MatchStepMCPairs.__call__
    monkeypatch.setattr(step_mc_matches.MatchStepMCPairs, "__call__", lambda self, *a: (
        batches.append(out := call(self, *a)), out)[1])
    straight, parts = str(tmp_path / "straight"), str(tmp_path / "parts")
    devices = jax.devices()[:1]
    assert run.train(cfg(**extra), straight, devices=devices) == 0
    rounds = [r for r in read_metrics(straight) if "step_mc/pairs" in r]
    assert len(rounds) == 2 and all(np.isfinite(r["loss"]) for r in rounds)
    assert sum(r["dpo/pairs"] for r in rounds) > 0

    tok, game, k = setup.make_tokenizer(cfg(), None), board_games.get_game("tictactoe"), 2
    replies, first = 0, None
    for examples, trajectories, depths, (rewards, played, _, _) in plays:
        if trajectories[0] is None:   # level 0: fresh matches; the prefixes' trajectories
            first = {id(p): (ex, p, max(rewards[i // k * k:(i // k + 1) * k]))   # are best
                     for i, (ex, p) in enumerate(zip(np.repeat(examples, k), played))}
            continue
        for r, (ex, traj, d) in enumerate(zip(examples, trajectories, depths)):
            owner, best, value = first[id(traj)]
            assert owner is ex and best is traj
            assert value == max(x for e, p, x in first.values() if e is ex)
            ply = traj.plies[d]   # the match before the learner's turn d, every seat's plies
            replies += ply - d
            for j in range(r * k, (r + 1) * k):
                cont = played[j]
                assert cont.history[:ply] == traj.history[:ply]
                assert cont.turns[:d] == traj.turns[:d] and len(cont.turns) > d
                seats, reward = replayed_match(ex, cont.history, tok)
                own = seat_of(game, ex)
                assert [ids for s, ids in zip(seats, cont.history) if s == own] == [
                    t for t, _ in cont.turns]
                assert rewards[j] == reward   # the learner seat's
    assert first is not None and replies > 0   # the other seat's moves were replayed
    for batch, m in batches:   # the learner's sibling turns after its match so far
        real = np.flatnonzero(batch["pair_mask"])
        assert m["step_mc/pairs"] == real.size
        for i in real:
            context = tok.decode(batch["prompt_tokens"][i][batch["prompt_mask"][i]])
            assert context.startswith(("tictactoe X\n", "tictactoe O\n"))
            sides = [batch[f"{s}_tokens"][i][batch[f"{s}_mask"][i]].tolist()
                     for s in ("chosen", "rejected")]
            assert all(0 < len(t) <= 2 for t in sides) and sides[0] != sides[1]

    assert run.train(cfg(**extra), parts, devices=devices, stop=StopAfter(1)) == 0
    assert max(r["step"] for r in read_metrics(parts)) == 1
    assert run.train(cfg(**extra), parts, devices=devices) == 0

    def comparable(workdir):
        return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "tokens_per_s"}
                for r in read_metrics(workdir)]
    assert comparable(parts) == comparable(straight)

    def params(workdir):
        with checkpoint.CheckpointManager(checkpoint.checkpoint_dir(workdir)) as ckpt:
            return jax.tree.map(np.asarray, ckpt.restore().state["params"])
    jax.tree.map(np.testing.assert_array_equal, params(parts), params(straight))
