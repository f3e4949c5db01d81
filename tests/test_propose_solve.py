"""The proposer/solver game: its rules against written-out cases, the learnability payoff, the
environment against scripted players, its SFT traces, role keys, and a self-play rollout whose
rows each carry their own seat's reward; the shipped config trains two iterations."""
import random
import re

import jax
import numpy as np
import pytest

from rljax import config as config_lib
from rljax import data
from rljax.config.reward import GAME_SEATS
from rljax.envs import board_games as bg
from rljax.envs import game_trace, make_env
from rljax.envs.game_env import GAME_ENVS, NUM_ROLES, role_key
from rljax.envs.propose_solve import ProposeSolve, learnability, value

GAME = ProposeSolve()


def play(moves, first=12):
    state = GAME.initial((first,))
    for m in moves:
        state = GAME.apply(state, m)
    return state


def test_deals_are_first_operands_and_legal_tasks_start_with_them():
    assert GAME.deals() == tuple((a,) for a in range(100))
    every = [t for (a,) in GAME.deals() for t in GAME.legal_moves(GAME.initial((a,)))]
    assert len(every) == len(set(every)) == 100 * 100 + 100 * 101 // 2   # a+b; a-b, a >= b
    for a in (0, 1, 12, 99):
        written_out = {f"{a}+{b}=" for b in range(100)} | {f"{a}-{b}=" for b in range(a + 1)}
        assert set(GAME.legal_moves(GAME.initial((a,)))) == written_out
    for bad in ("34+12=", "12-13=", "12+100=", "12*2=", "12+34=46", "12"):
        with pytest.raises(bg.IllegalMove):
            GAME.apply(GAME.initial((12,)), bad)
    with pytest.raises(ValueError):
        GAME.initial((100,))


@pytest.mark.parametrize("text,move", [
    ("12+34=", "12+34="), ("I propose 12 + 34.", "12+34="), ("07-3=04", "7-3="),
    ("1+1 then 5-2", "5-2="), ("46", "46"), ("it is 046", "46"), ("x 3 y 17", "17"),
    ("no number", None), ("", None)])
def test_parse_move_reads_the_last_task_else_the_last_number(text, move):
    assert GAME.parse_move(text) == move


def test_turns_views_and_solver_moves():
    s = play(["12+34="])
    assert GAME.to_move(GAME.initial((12,))) == 0 and GAME.to_move(s) == 1
    assert GAME.render(GAME.initial((12,)), 0) == "first 12, task:"
    assert [GAME.render(s, k) for k in range(1, 5)] == ["12+34=\n"] * 4   # no answer shown
    assert GAME.legal_moves(s) == tuple(str(i) for i in range(199))
    for bad in ("199", "-3", "12+34=", "046"):
        with pytest.raises(bg.IllegalMove):
            GAME.apply(s, bad)
    s = play(["12+34=", "46", "0", "46", "198"])
    assert GAME.is_terminal(s) and GAME.legal_moves(s) == ()
    with pytest.raises(bg.IllegalMove):
        GAME.apply(s, "46")


@pytest.mark.parametrize("answers,expected", [
    (["46", "46", "46", "46"], (0.0, 1, 1, 1, 1)),       # everybody: nothing to learn
    (["1", "2", "3", "4"], (0.0, 0, 0, 0, 0)),           # nobody: maybe unsolvable
    (["46", "1", "2", "3"], (0.75, 1, 0, 0, 0)),
    (["46", "46", "2", "3"], (0.5, 1, 1, 0, 0)),
    (["46", "46", "46", "3"], (0.25, 1, 1, 1, 0))])
def test_returns_pay_solvers_right_answers_and_the_proposer_learnability(answers, expected):
    assert GAME.returns(play(["12+34=", *answers])) == pytest.approx(expected)
    assert GAME.returns(play(["46-12=", *answers], first=46))[1:] == pytest.approx(
        [float(a == "34") for a in answers])


def test_learnability_written_out():
    for n in (1, 4, 8):
        for k in range(n + 1):
            assert learnability(k, n) == (0.0 if k in (0, n) else 1.0 - k / n)
    with pytest.raises(ValueError):
        learnability(5, 4)


def test_roles_keys_and_seat_counts():
    assert [role_key("propose_solve", s) for s in range(5)] == [6, 7, 7, 7, 7]
    assert role_key("kuhn_poker", 1) == 3 and NUM_ROLES == 8
    assert GAME_SEATS == {g: len(bg.get_game(g).seats) for g in GAME_ENVS}


def test_env_against_scripted_players_and_its_traces():
    solver = {"question": "propose_solve solver1\n", "seat": 1, "seed": 3, "deal": [57]}
    env = make_env("propose_solve", solver, opponent="random")
    prompt = env.reset()[0]["content"]
    question = prompt.splitlines()[1]          # a random task starting with 57
    assert question in GAME.legal_moves(GAME.initial((57,)))
    answer = str(eval(question.rstrip("=")))
    result = env.step(f"it is {answer}")
    assert result.done and result.reward == 1.0 and result.info["wins_solver1"] == 1
    env.reset()
    assert env.step("no idea").reward == -1.0   # no number: a forfeit
    proposer = {"question": "propose_solve proposer\n", "seat": 0, "seed": 3, "deal": [7]}
    env = make_env("propose_solve", proposer, opponent="optimal")   # solvers always right
    assert env.reset()[0]["content"] == "propose_solve proposer\nfirst 7, task:"
    assert env.step("I say 7 + 4").reward == 0.0
    env.reset()
    assert env.step("4+7=").reward == -1.0   # not the deal's operand: an illegal task
    for ex in (solver, proposer):
        trace = game_trace("propose_solve", ex)
        assert [m["role"] for m in trace] == ["user", "assistant"]
        move = trace[1]["content"]
        if ex["seat"]:
            assert move == answer   # the same random proposer's task, solved
        else:
            assert move in GAME.legal_moves(GAME.initial((7,)))


def test_a_number_too_long_for_int_is_an_illegal_move():
    huge = "1" * 5000   # int() refuses more than 4300 digits
    assert GAME.parse_move(f"it is {huge}") == huge
    assert GAME.parse_move(f"{huge}+0") == f"{huge}+0="
    assert GAME.parse_move("the answer is 046") == "46"
    solver = {"question": "propose_solve solver1\n", "seat": 1, "seed": 3, "deal": [57]}
    env = make_env("propose_solve", solver, opponent="random")
    env.reset()
    r = env.step(f"it is {huge}")
    assert r.done and r.reward == -1.0 and r.info["illegal_moves"] == 1
    proposer = {"question": "propose_solve proposer\n", "seat": 0, "seed": 3, "deal": [7]}
    env = make_env("propose_solve", proposer, opponent="optimal")
    env.reset()
    r = env.step(f"7+{huge}")
    assert r.done and r.reward == -1.0 and r.info["illegal_moves"] == 1


def test_task_examples_cycle_seats_and_splits_are_disjoint():
    train = data.make_source({"source": "propose_solve"}, "train")
    held = data.make_source({"source": "propose_solve", "eval_examples": 200}, "eval")
    assert {train[i]["seat"] for i in range(100)} == set(range(5))
    key = lambda ex: (ex["seat"], ex["seed"])
    assert not {key(train[i]) for i in range(200)} & {key(held[i]) for i in range(200)}


def _cfg(*overrides):
    return config_lib.load_config("configs/grpo_propose_solve_selfplay.py", [
        "steps=2", "sft.steps=2", "sft.batch_size=8", "rollout.batch_size=20",
        "algo.num_generations=2", "eval.num_examples=10", "eval.batch_size=10",
        "eval_every=0", "checkpoint_every=0", "checkpoint.async_save=False",
        "logging.tensorboard=False", "mesh.data=1", "model.overrides.num_layers=1",
        "model.overrides.hidden_size=32", "model.overrides.intermediate_size=64", *overrides])


def test_selfplay_rows_carry_their_own_seats_reward(tmp_path, monkeypatch):
    """Whatever they wrote, every proposer turn plays the first task for its deal, solvers 1
    and 2 answer right, 3 and 4 wrong: the proposer's rows get 0.5, the solvers' 1, 1, 0, 0;
    a proposer's row saw its operand, a solver's the task."""
    from rljax.envs.selfplay import SeatEnv
    from rljax.train.core import setup
    from rljax.train.phases import grpo
    from tests.test_agent_train import episode_rollout
    from rljax.train.core.state import create_train_state
    step = SeatEnv.step
    def scripted(self, text):
        state = self.match.state
        if self.seat == 0:
            return step(self, self.game.legal_moves(state)[0])
        right = value(state.task)
        return step(self, str(right if self.seat <= 2 else (right + 1) % 199))
    monkeypatch.setattr(SeatEnv, "step", scripted)
    g = 2
    cfg = config_lib.validate(_cfg("sft.steps=0"))
    setup.check_inputs(cfg, num_devices=1)
    ctx = setup.build_context(cfg, str(tmp_path), devices=jax.devices()[:1])
    phase = grpo.GRPOPhase(ctx, int(cfg.steps))
    state = phase.init_state(create_train_state(ctx.params, phase.optimizer, jax.random.key(0)))
    rollout = episode_rollout(ctx, setup.rl_iterator(ctx, 2))
    eps = rollout.sample_round(state.params, jax.random.key(1))["episodes"]
    seat = np.repeat(np.tile(np.arange(5), 2), g)   # groups ordered (example, seat)
    np.testing.assert_array_equal(eps["roles"], np.where(seat == 0, 6, 7))
    np.testing.assert_allclose(eps["env_rewards"],
                               np.select([seat == 0, seat <= 2], [0.5, 1.0], 0.0))
    assert not eps["truncated"].any()
    tok = ctx.tokenizer
    for i in range(len(seat)):
        obs = tok.decode(eps["tokens"][i][eps["mask"][i] & ~eps["model_mask"][i]].tolist())
        prompt = eps["prompts"][i]
        assert prompt.startswith(f"propose_solve {GAME.seats[seat[i]]}\n")
        if seat[i] == 0:
            first = int(prompt.split("first ")[1].split(",")[0])
            assert obs == "" and prompt.endswith(f"first {first}, task:")
            tasks = [GAME.legal_moves(GAME.initial((first,)))[0]]
        else:   # the task of the same match (row j of each seat's group)
            assert obs == tasks[0] + "\n"
    batch, metrics = rollout(state, 0)
    assert metrics["rollout/logp_diff_max"] < 1e-4


@pytest.mark.parametrize("override,needle", [
    ("rollout.batch_size=24", "algo.num_generations * seats = 10")])
def test_batch_must_hold_whole_games(override, needle):
    with pytest.raises(config_lib.ConfigError, match=re.escape(needle)):
        config_lib.validate(_cfg(override))


@pytest.mark.slow
def test_config_trains_two_iterations(tmp_path):
    from rljax.train import run
    from rljax.train.core import metrics
    assert run.train(_cfg(), str(tmp_path), devices=jax.devices()[:1]) == 0
    records = metrics.read_metrics(str(tmp_path / "metrics.jsonl"))
    rl = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in rl] == [3, 4]
    for r in rl:
        assert np.isfinite(r["loss"]) and -1.0 <= r["reward/mean"] <= 1.0
    evals = [r for r in records if "eval/accuracy" in r]
    assert evals and any(k.startswith("eval/win_rate_solver") for k in evals[-1])
