"""Board games: TicTacToe, Kuhn Poker and Negotiation rules against written-out cases, the
scripted players (minimax never loses, the Kuhn Nash strategy's value is -1/18 exactly, the
fair negotiator stays legal), the environments
against a scripted opponent (parsing, forfeits, counters), the data tasks, role-conditioned
advantages (RAE) against their formula, and the TicTacToe config training two iterations."""
import random
from fractions import Fraction

import jax
import numpy as np
import pytest

from rljax import data
from rljax.algorithms import role_advantages as rae
from rljax.envs import board_games as bg
from rljax.envs import env_metrics, game_trace, make_env, merge_counters

TTT = bg.TicTacToe()
KUHN = bg.KuhnPoker()


def play(game, moves, deal=None):
    state = game.initial(deal) if deal is not None else game.initial()
    for m in moves:
        state = game.apply(state, m)
    return state


# ----------------------------------------------------------------------------- TicTacToe

def test_tictactoe_moves_alternate_and_fill_the_chosen_cell():
    s = TTT.initial()
    assert s == "........." and TTT.to_move(s) == 0
    assert TTT.legal_moves(s) == tuple("123456789")
    for cell in range(1, 10):   # every first move: X in that cell, O to move, 8 left
        t = TTT.apply(s, str(cell))
        assert t == "." * (cell - 1) + "X" + "." * (9 - cell)
        assert TTT.to_move(t) == 1 and len(TTT.legal_moves(t)) == 8 and str(cell) not in TTT.legal_moves(t)
    t = play(TTT, "51")
    assert t == "O...X...." and TTT.to_move(t) == 0
    assert TTT.render(t, 0) == TTT.render(t, 1) == "O23\n4X6\n789\n"


@pytest.mark.parametrize("move", ["5", "0", "10", "", "x", "five"])
def test_tictactoe_refuses_occupied_and_unknown_cells(move):
    with pytest.raises(bg.IllegalMove):
        TTT.apply("....X....", move)


def test_tictactoe_win_detection_on_all_eight_lines():
    for line in bg.LINES:
        for mark, seat in (("X", 0), ("O", 1)):
            board = "".join(mark if i in line else "." for i in range(9))
            assert TTT.winner(board) == seat and TTT.is_terminal(board)
            assert TTT.returns(board) == ((1.0, -1.0) if seat == 0 else (-1.0, 1.0))
            assert TTT.legal_moves(board) == ()
            with pytest.raises(bg.IllegalMove):   # no move after a win
                TTT.apply(board, str(min(set(range(9)) - set(line)) + 1))
    # Two in a row is not a win; a full board without a line is a draw.
    assert TTT.winner("XX.OO....") is None and not TTT.is_terminal("XX.OO....")
    draw = "XOXXOOOXX"
    assert TTT.winner(draw) is None and TTT.is_terminal(draw) and TTT.returns(draw) == (0.0, 0.0)
    with pytest.raises(ValueError):
        TTT.returns("X........")


def test_tictactoe_a_played_win_ends_the_game():
    s = play(TTT, "14273")   # X: 1, 2, 3 (top row); O: 4, 7
    assert s == "XXXO..O.." and TTT.winner(s) == 0 and TTT.returns(s) == (1.0, -1.0)
    s = play(TTT, "15239")   # X: 1, 2, 9; O: 5, 3: no line yet
    assert s == "XXO.O...X" and not TTT.is_terminal(s) and TTT.to_move(s) == 1


@pytest.mark.parametrize("text,move", [("5", "5"), (" 7\n", "7"), ("I take 3, no: 9", "9"),
                                       ("15", None), ("0", None), ("", None), ("cell", None)])
def test_tictactoe_parses_the_last_lone_digit(text, move):
    assert TTT.parse_move(text) == move


def _game(game, players, rng, deal=None):
    s = game.initial(deal) if deal is not None else game.initial()
    while not game.is_terminal(s):
        s = game.apply(s, players[game.to_move(s)](game, s, rng))
    return game.returns(s)


def test_minimax_never_loses_to_random_and_draws_itself():
    rng = random.Random(0)
    outcomes = []
    for seat in (0, 1):
        players = [bg.random_player, bg.random_player]
        players[seat] = bg.tictactoe_minimax
        for _ in range(150):
            outcomes.append(_game(TTT, players, rng)[seat])
    assert min(outcomes) >= 0.0 and outcomes.count(1.0) > 200   # it wins most games
    assert _game(TTT, [bg.tictactoe_minimax] * 2, rng) == (0.0, 0.0)
    # It takes a win when there is one and blocks the opponent's.
    assert bg.tictactoe_minimax(TTT, "XX.OO....") == "3"
    assert bg.tictactoe_minimax(TTT, "XX.O.....") == "3"
    assert bg.tictactoe_minimax(TTT, "OO.X....X") == "3"   # X to move blocks O's row


# ----------------------------------------------------------------------------- Kuhn Poker

# Seat 0's payoff for every deal (seat 0's card, seat 1's card) and terminal history, in the
# order check-check, bet-call, bet-fold, check-bet-call, check-bet-fold.
HISTORIES = (("check", "check"), ("bet", "call"), ("bet", "fold"), ("check", "bet", "call"),
             ("check", "bet", "fold"))
PAYOFFS = {
    "JQ": (-1, -2, +1, -2, -1),
    "JK": (-1, -2, +1, -2, -1),
    "QJ": (+1, +2, +1, +2, -1),
    "QK": (-1, -2, +1, -2, -1),
    "KJ": (+1, +2, +1, +2, -1),
    "KQ": (+1, +2, +1, +2, -1),
}


def test_kuhn_payoffs_for_every_deal_and_history():
    assert len(KUHN.deals()) == 6
    for deal in KUHN.deals():
        row = PAYOFFS["".join("JQK"[c] for c in deal)]
        for history, payoff in zip(HISTORIES, row):
            s = play(KUHN, history, deal)
            assert KUHN.is_terminal(s) and KUHN.legal_moves(s) == ()
            assert KUHN.returns(s) == (payoff, -payoff), (deal, history)


def test_kuhn_legal_moves_and_illegal_ones():
    s = KUHN.initial((2, 0))
    assert KUHN.legal_moves(s) == ("check", "bet") and KUHN.to_move(s) == 0
    assert KUHN.legal_moves(KUHN.apply(s, "check")) == ("check", "bet")
    assert KUHN.legal_moves(KUHN.apply(s, "bet")) == ("call", "fold")
    assert KUHN.to_move(KUHN.apply(s, "bet")) == 1
    for history, move in (((), "call"), ((), "fold"), (("bet",), "bet"), (("bet",), "check"),
                          (("check",), "call"), (("check", "bet"), "check"),
                          (("bet", "call"), "check")):
        with pytest.raises(bg.IllegalMove):
            KUHN.apply(play(KUHN, history, (2, 0)), move)
    assert KUHN.render(play(KUHN, ("check", "bet"), (2, 0)), 0) == "card K, moves: check bet\n"
    assert KUHN.render(s, 1) == "card J, moves: -\n"   # the other card stays hidden
    with pytest.raises(ValueError):
        KUHN.initial((1, 1))
    assert KUHN.parse_move("I will Bet") == "bet" and KUHN.parse_move("better") is None


def _nash_value(alpha) -> Fraction:
    """Seat 0's expected payoff when both seats play the Nash strategy: every deal (1/6) and
    every history, weighted by the strategies' probabilities."""
    def value(s) -> Fraction:
        if KUHN.is_terminal(s):
            return Fraction(KUHN.returns(s)[0]).limit_denominator()
        policy = bg.kuhn_nash_policy(s, alpha)
        assert set(policy) == set(KUHN.legal_moves(s)) and sum(policy.values()) == 1
        return sum(p * value(KUHN.apply(s, m)) for m, p in policy.items() if p)
    return sum(value(KUHN.initial(d)) for d in KUHN.deals()) / 6


@pytest.mark.parametrize("alpha", [Fraction(0), Fraction(1, 6), Fraction(1, 3), Fraction(1, 10)])
def test_kuhn_nash_value_is_minus_one_eighteenth(alpha):
    assert _nash_value(alpha) == Fraction(-1, 18)


def test_kuhn_nash_policy_facts_and_its_sampled_player():
    third = Fraction(1, 3)
    assert bg.kuhn_nash_policy(KUHN.initial((0, 1)), third)["bet"] == third        # J bluffs
    assert bg.kuhn_nash_policy(KUHN.initial((2, 1)), Fraction(1, 9))["bet"] == third  # K: 3a
    assert bg.kuhn_nash_policy(play(KUHN, ("bet",), (2, 1)))["call"] == third     # P2 Q calls 1/3
    with pytest.raises(ValueError):
        bg.make_player(KUHN, "optimal", alpha=0.5)
    player = bg.make_player(KUHN, "optimal", alpha=Fraction(1, 3))
    rng = random.Random(0)
    bets = sum(player(KUHN, KUHN.initial((0, 1)), rng) == "bet" for _ in range(3000))
    assert 900 < bets < 1100   # a Jack bets 1/3 of the time


# ----------------------------------------------------------------------------- environments

def test_tictactoe_env_plays_against_the_scripted_opponent():
    ex = {"question": "tictactoe X\n", "seat": 0, "seed": 3}
    env = make_env("tictactoe", ex, opponent="optimal")
    assert env.reset() == [{"role": "user", "content": "tictactoe X\n123\n456\n789\n"}]
    r = env.step("I take 5")
    assert not r.done and r.reward == 0.0 and r.info == {"moves": 1}
    assert r.observation == [{"role": "user", "content": "O23\n4X6\n789\n"}]  # minimax: cell 1
    # Seat O: the opponent's first move is in the first message; the same every reset.
    env = make_env("tictactoe", {"question": "q\n", "seat": "O", "seed": 3})
    first = env.reset()
    assert first == env.reset() and first[0]["content"].count("X") == 1


def test_env_counts_a_win_with_its_length_and_seat():
    # X against minimax cannot win; a scripted game against random: X wins with the top row.
    ex = {"question": "", "seat": 0, "seed": 0}
    env = make_env("tictactoe", ex)
    env.reset()
    infos, result = [], None
    while result is None or not result.done:   # X plays the lowest legal cells
        result = env.step(TTT.legal_moves(env.state)[0])
        infos.append(result.info)
    counters = merge_counters(*infos)
    ret = TTT.returns(env.state)[0]
    assert result.reward == ret and counters["payoff"] == ret
    assert counters["wins"] + counters["draws"] + counters["losses"] == 1
    assert counters["wins"] == int(ret > 0) == counters["wins_X"] and counters["games_X"] == 1
    assert counters["moves"] == len(infos) and counters["plies"] == 9 - env.state.count(".")
    assert "illegal_moves" not in counters


@pytest.mark.parametrize("turn,unparsable", [("5", 0), ("pass", 1)])
def test_illegal_or_unparsable_move_forfeits_with_the_penalty(turn, unparsable):
    env = make_env("tictactoe", {"question": "", "seat": 0, "seed": 1}, illegal_penalty=-2.5)
    env.reset()
    env.step("5")
    r = env.step(turn)  # "5" is taken now
    assert r.done and r.reward == -2.5 and r.observation == ()
    assert r.info["illegal_moves"] == 1 and r.info["unparsable"] == unparsable
    assert r.info["games_X"] == 1 and "wins" not in r.info and r.info["plies"] == 2
    m = env_metrics([{"illegal_moves": 1, "moves": 2}, {"wins": 1, "moves": 3}])
    assert m["env/illegal_moves_mean"] == 0.5 and m["env/wins_mean"] == 0.5


def test_kuhn_env_pays_chips_scaled_and_honours_the_example_opponent():
    # P1 with a King bets; the Nash P2 with a Jack always folds: +1 chip.
    ex = {"question": "kuhn_poker P1\n", "seat": 0, "deal": [2, 0], "seed": 0,
          "opponent": "optimal"}
    env = make_env("kuhn_poker", ex, opponent="random", reward_scale=0.5)
    assert env.reset()[0]["content"] == "kuhn_poker P1\ncard K, moves: -\n"
    r = env.step("bet")
    assert r.done and r.reward == 0.5 and r.info["payoff"] == 1.0 and r.info["wins_P1"] == 1
    # P2 with a Queen after P1's check: bet; the Nash P1 with a Jack folds to it.
    env = make_env("kuhn_poker", {"question": "", "seat": 1, "deal": [0, 1], "seed": 0},
                   opponent="optimal", opponent_options={"alpha": 0})
    assert env.reset()[0]["content"] == "card Q, moves: check\n"
    r = env.step("bet")
    assert r.done and r.reward == 1.0 and r.info["plies"] == 3
    r = make_env("kuhn_poker", {"question": "", "seat": 1, "deal": [0, 1]},
                 opponent_options={"alpha": 0}, opponent="optimal")
    r.reset()
    assert r.step("call").info["illegal_moves"] == 1   # nothing to call after a check


def test_env_options_are_checked():
    for seat in ("Z", 2, -1):
        with pytest.raises(ValueError, match="is not one of"):
            make_env("tictactoe", {"question": "", "seat": seat})
    assert make_env("tictactoe", {"question": "", "seat": "1"}).seat == 1
    with pytest.raises(ValueError):
        make_env("tictactoe", {"question": "", "seat": 0}, opponent="genius")
    with pytest.raises(ValueError):
        make_env("tictactoe", {"question": ""}, state_format="board")


def test_traces_are_legal_games_and_optimal_ones_never_lose():
    task = data.BoardGameTask("tictactoe")
    for i in range(40):
        ex = task.example(i)
        msgs = game_trace("tictactoe", ex)
        env = make_env("tictactoe", ex)
        env.reset()
        for m in msgs[1:]:
            if m["role"] == "assistant":
                r = env.step(m["content"])
        assert r.done and "illegal_moves" not in r.info and r.info["payoff"] >= 0
        noisy = game_trace("tictactoe", ex, noise=1.0, rng=np.random.default_rng(i))
        assert noisy[-1]["role"] == "assistant"
    with pytest.raises(ValueError):
        game_trace("tictactoe", task.example(0), noise=0.5)
    assert task.solution(task.example(0)) == game_trace("tictactoe", task.example(0))[1]["content"]
    kuhn = data.BoardGameTask("kuhn_poker")
    msgs = game_trace("kuhn_poker", kuhn.example(0))
    assert msgs[1]["content"] in ("check", "bet", "call", "fold")


# ----------------------------------------------------------------------------- Negotiation

NEGO = bg.Negotiation()


def test_negotiation_values_deals_and_legal_moves():
    pool = NEGO.COUNTS
    valuations = {v for deal in NEGO.deals() for v in deal}
    assert len(valuations) == 14 and len(NEGO.deals()) == 14 * 13
    assert all(sum(x * c for x, c in zip(v, pool)) == 10 and min(v) >= 0 for v in valuations)
    s = NEGO.initial(((2, 1, 2), (0, 2, 2)))
    proposals = NEGO.legal_moves(s)
    assert len(proposals) == 2 * 3 * 4 and "accept" not in proposals   # nothing to accept
    assert proposals[0] == "propose 0 0 0" and proposals[-1] == "propose 1 2 3"
    for bad in ("accept", "propose 2 0 0", "propose 0 0 4", "fold"):
        with pytest.raises(bg.IllegalMove):
            NEGO.apply(s, bad)
    t = NEGO.apply(s, "propose 1 0 3")
    assert NEGO.to_move(t) == 1 and NEGO.legal_moves(t)[-1] == "accept"
    with pytest.raises(ValueError):
        NEGO.initial(((2, 1, 2), (1, 1, 1)))   # worth 6, not 10


def test_negotiation_payoffs_written_out():
    deal = ((2, 1, 2), (0, 2, 2))
    # P1 keeps the book and the balls (2 + 3*2 = 8), P2 takes the hats (2*2 = 4).
    s = play(NEGO, ["propose 1 0 3", "accept"], deal)
    assert NEGO.is_terminal(s) and NEGO.returns(s) == (0.8, 0.4)
    # P2 counters keeping the balls (6); P1 accepts the book and the hats (2 + 2 = 4).
    s = play(NEGO, ["propose 1 2 0", "propose 0 0 3", "accept"], deal)
    assert NEGO.returns(s) == (0.4, 0.6)
    # Six proposals and no acceptance: no deal, nothing for anyone; the game is over.
    s = play(NEGO, ["propose 1 2 3"] * NEGO.MAX_MOVES, deal)
    assert NEGO.is_terminal(s) and NEGO.returns(s) == (0.0, 0.0) and NEGO.legal_moves(s) == ()
    with pytest.raises(ValueError):
        NEGO.returns(play(NEGO, ["propose 1 2 3"], deal))


def test_negotiation_views_hide_the_other_values_and_show_the_offer_to_the_mover():
    s = NEGO.apply(NEGO.initial(((2, 1, 2), (0, 2, 2))), "propose 1 0 3")
    assert NEGO.render(s, 1) == "pool 1 2 3, values 0 2 2, offer 0 2 0, left 5\n"
    assert NEGO.render(s, 0) == "pool 1 2 3, values 2 1 2, offer -, left 5\n"


@pytest.mark.parametrize("text, move", [
    ("I propose 1 2 0.", "propose 1 2 0"), ("Accept", "accept"), ("PROPOSE  0 0  3", "propose 0 0 3"),
    ("propose 1 0 0, no wait: accept", "accept"), ("propose 1 2", None), ("deal", None),
    ("propose 10 0 0", "propose 10 0 0"),   # read, then refused as illegal
])
def test_negotiation_parses_the_last_move_named(text, move):
    assert NEGO.parse_move(text) == move


def test_negotiation_fair_player_is_legal_and_accepts_half():
    s = NEGO.initial(((2, 1, 2), (0, 2, 2)))
    assert bg.negotiation_fair(NEGO, s) == "propose 0 0 3"   # the fewest items worth >= 6
    offered = NEGO.apply(s, "propose 1 0 1")                  # P2 is offered 2 hats, 2 balls
    assert bg.negotiation_fair(NEGO, offered) == "accept"     # worth 8 >= 5
    stingy = NEGO.apply(s, "propose 1 2 2")                   # 1 ball: worth 2
    assert bg.negotiation_fair(NEGO, stingy) != "accept"
    last = play(NEGO, ["propose 1 2 2"] * (NEGO.MAX_MOVES - 1), s.values)
    assert bg.negotiation_fair(NEGO, last) == "accept"        # something beats nothing
    rng, fair = random.Random(0), bg.make_player(NEGO, "fair")
    for i in range(200):   # against random legal moves, from either seat: always legal
        deal = NEGO.deals()[i % len(NEGO.deals())]
        state, seat = NEGO.initial(deal), i % 2
        while not NEGO.is_terminal(state):
            player = fair if NEGO.to_move(state) == seat else bg.random_player
            state = NEGO.apply(state, player(NEGO, state, rng))
        assert all(0.0 <= r <= 1.0 for r in NEGO.returns(state))
    with pytest.raises(ValueError, match="known: random, fair"):
        bg.make_player(NEGO, "optimal")


def test_negotiation_env_pays_the_share_and_traces_are_legal():
    task = data.BoardGameTask("negotiation")
    ex = {**task.example(0), "seat": 0, "deal": [(2, 1, 2), (0, 2, 2)]}
    env = make_env("negotiation", ex, opponent="fair")
    assert env.reset()[-1]["content"].endswith("values 2 1 2, offer -, left 6\n")
    r = env.step("propose 1 0 1")   # fair P2 is offered 2 hats and 2 balls (8): accepts
    assert r.done and r.reward == pytest.approx(0.4) and r.info["wins_P1"] == 1
    for i in range(20):
        ex = task.example(i)
        msgs = game_trace("negotiation", ex, noise=1.0, rng=np.random.default_rng(i))
        env = make_env("negotiation", ex)
        env.reset()
        for m in msgs[1:]:
            if m["role"] == "assistant":
                r = env.step(m["content"])
        assert r.done and "illegal_moves" not in r.info


def test_model_text_that_cannot_be_read_is_an_illegal_move_not_the_runs_end():
    huge = "9" * 5000   # int() refuses more than 4300 digits
    assert NEGO.parse_move(f"propose {huge} 0 0") == f"propose {huge} 0 0"
    assert NEGO.parse_move("propose 007 0 0") == "propose 7 0 0"
    ex = {**data.BoardGameTask("negotiation").example(0), "seat": 0,
          "deal": [(2, 1, 2), (0, 2, 2)]}
    env = make_env("negotiation", ex, opponent="fair")
    env.reset()
    r = env.step(f"propose {huge} 0 0")
    assert r.done and r.reward == -1.0 and r.info["illegal_moves"] == 1

    class Broken(bg.TicTacToe):   # a parser that fails on some text: the turn forfeits
        def parse_move(self, text):
            raise ValueError("cannot read")
    assert bg.read_move(Broken(), "5") is None and bg.read_move(TTT, "5") == "5"


# ----------------------------------------------------------------------------- data tasks

@pytest.mark.parametrize("game", ["tictactoe", "kuhn_poker", "negotiation"])
def test_task_is_deterministic_and_its_splits_disjoint(game):
    train = data.make_source({"source": game}, "train")
    again = data.make_source({"source": game}, "train")
    held = data.make_source({"source": game, "eval_examples": 300}, "eval")
    assert [train[i] for i in range(50)] == [again[i] for i in range(50)]
    key = lambda ex: (ex["seat"], str(ex.get("deal", ())), ex["seed"])
    train_keys = {key(train[i]) for i in range(300)}
    assert not train_keys & {key(held[i]) for i in range(300)}
    assert {train[i]["seat"] for i in range(50)} == {0, 1}
    if game == "kuhn_poker":
        assert {tuple(train[i]["deal"]) for i in range(100)} == set(bg.KuhnPoker().deals())
    one_seat = data.make_source({"source": game, "seat": bg.get_game(game).seats[1]}, "train")
    assert {one_seat[i]["seat"] for i in range(20)} == {1}
    with pytest.raises(ValueError):
        data.make_source({"source": game, "seat": "nobody"}, "train")


# ----------------------------------------------------------------------------- RAE

def test_rae_matches_the_written_out_update_and_advantage():
    alpha = 0.9
    baseline = np.array([0.5, -0.2, 0.0, 1.0], np.float32)
    returns = np.array([1.0, -1.0, 0.0, 1.0, 1.0, -1.0], np.float32)
    roles = np.array([0, 0, 1, 1, 1, 3])   # role 2 is not in the batch
    expected = baseline.copy()
    for k in range(4):
        if (roles == k).any():
            expected[k] = alpha * baseline[k] + (1 - alpha) * returns[roles == k].mean()
    adv, new = rae.rae_step(baseline, returns, roles, alpha=alpha)
    np.testing.assert_allclose(new, expected, rtol=1e-6)
    np.testing.assert_allclose(adv, returns - expected[roles], rtol=1e-6)
    assert new[2] == baseline[2]
    batch = rae.role_mean_advantages(returns, roles, 4)
    role_means = {0: 0.0, 1: 2 / 3, 3: -1.0}   # (1 - 1) / 2, (0 + 1 + 1) / 3, -1 / 1
    np.testing.assert_allclose(batch, returns - np.array([role_means[k] for k in roles]),
                               atol=1e-6)
    np.testing.assert_array_equal(rae.role_keys([0, 1, 1], [1, 0, 1], 2), [1, 2, 3])
    jitted = jax.jit(lambda b, r, k: rae.rae_step(b, r, k, alpha=alpha))(baseline, returns, roles)
    np.testing.assert_allclose(jitted[1], expected, rtol=1e-6)
    with pytest.raises(ValueError):
        rae.rae_update(baseline, returns, roles, alpha=1.5)


# ----------------------------------------------------------------------------- config

def tiny_overrides():
    return ["steps=2", "sft.steps=2", "sft.batch_size=8", "rollout.batch_size=8",
            "algo.num_generations=4", "eval.num_examples=8", "eval.batch_size=8",
            "eval_every=0", "checkpoint_every=0", "checkpoint.async_save=False",
            "logging.tensorboard=False", "mesh.data=1", "model.overrides.num_layers=1",
            "model.overrides.hidden_size=32", "model.overrides.intermediate_size=64"]


@pytest.mark.slow
def test_tictactoe_config_trains_two_iterations(tmp_path):
    from rljax import config
    from rljax.train import run
    from rljax.train.core import metrics

    cfg = config.load_config("configs/grpo_tictactoe.py", tiny_overrides())
    assert run.train(cfg, str(tmp_path), devices=jax.devices()[:1]) == 0
    records = metrics.read_metrics(str(tmp_path / "metrics.jsonl"))
    rl = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in rl] == [3, 4]
    for r in rl:
        assert np.isfinite(r["loss"]) and -1.0 <= r["reward/mean"] <= 1.0
        assert "env/plies_mean" in r and "env/moves_mean" in r
        outcomes = sum(r.get(f"env/{k}_mean", 0.0) for k in ("wins", "draws", "losses",
                                                             "illegal_moves"))
        assert outcomes + r["env/truncated_frac"] == pytest.approx(1.0)
    assert any("eval/accuracy" in r for r in records)
    assert [r["step"] for r in records if "sft/loss" in r] == [1, 2]
