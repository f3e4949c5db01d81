"""Turn-based games with verifiable outcomes, in pure Python (no jax): a small ``Game``
protocol, TicTacToe, Kuhn Poker, a two-seat negotiation, and scripted players (random legal,
TicTacToe minimax, Kuhn Poker's Nash equilibrium, a fixed negotiator).

A game object holds the rules; states are immutable values, so a state can be shared, hashed
(minimax memoises on it) and replayed. The ``rljax.envs.game_env`` environments put one policy
seat against a scripted player.

    game = TicTacToe()
    s = game.initial()                 # deal=None: TicTacToe has no chance move
    s = game.apply(s, "5")             # X takes the centre
    game.to_move(s), game.legal_moves(s)   # 1 (O), ("1", "2", "3", "4", "6", ...)
    game.render(s, seat=1)             # "123\\n4X6\\n789\\n"

A player is ``player(game, state, rng: random.Random) -> move`` (a legal move of the seat to
move); ``make_player(game, "random" | "optimal", **options)`` builds the built-ins.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import random
import re
from fractions import Fraction
from typing import Any, Callable, Hashable, Mapping, Protocol, Sequence

__all__ = ["Game", "IllegalMove", "read_move", "TicTacToe", "KuhnPoker", "Negotiation", "GAMES", "get_game",
           "random_player", "tictactoe_minimax", "kuhn_nash_policy", "negotiation_fair",
           "make_player", "Player"]


def _digits(number: str) -> str:
    """A run of digits without its leading zeros ("007" -> "7"), as ``str(int(number))``
    but for any length (``int`` refuses more than 4300 digits)."""
    return number.lstrip("0") or "0"


def read_move(game: "Game", text: str) -> str | None:
    """``game.parse_move(text)``, or None when parsing the model's text fails in any way:
    model text that cannot be read is an illegal move, never the run's end."""
    try:
        return game.parse_move(text)
    except Exception:  # noqa: BLE001 - any failure to read a turn is the turn's forfeit
        return None


class IllegalMove(ValueError):
    """``Game.apply`` got a move that is not legal in the state (or the game is over)."""


class Game(Protocol):
    """The rules of a turn-based game of ``len(seats)`` players (TicTacToe and Kuhn Poker are
    zero-sum, Negotiation is not).

    seats: seat names, in seat order (index 0 moves first).
    deals(): the chance outcomes a game can start from (``(None,)`` without chance), each with
      equal probability; ``initial(deal)`` is the state after it.
    to_move(s): the seat index to move; legal_moves(s): its moves (strings, fixed order);
    apply(s, move) -> new state (``IllegalMove`` if not legal); is_terminal(s);
    returns(s): per-seat payoffs of a terminal state (tuple of floats);
    render(s, seat): the state as ``seat`` sees it (hidden information left out), a short text;
    parse_move(text): the move a text names (None if none), legal or not.
    """
    name: str
    seats: tuple[str, ...]
    move_help: str

    def deals(self) -> tuple[Any, ...]: ...
    def initial(self, deal: Any = None) -> Hashable: ...
    def to_move(self, state) -> int: ...
    def legal_moves(self, state) -> tuple[str, ...]: ...
    def apply(self, state, move: str): ...
    def is_terminal(self, state) -> bool: ...
    def returns(self, state) -> tuple[float, ...]: ...
    def render(self, state, seat: int) -> str: ...
    def parse_move(self, text: str) -> str | None: ...


# ----------------------------------------------------------------------------- TicTacToe

# The 8 winning lines over cells 0..8 (row-major): 3 rows, 3 columns, 2 diagonals.
LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))
_CELL = re.compile(r"(?<!\d)[1-9](?!\d)")


class TicTacToe:
    """3x3 TicTacToe. State: the board, a 9-character string of "X", "O" and "." (row-major);
    X (seat 0) moves first. A move is a cell number "1".."9" (row-major, 1 = top left).
    Returns: +1 to the seat with three in a row, -1 to the other, 0 each for a full board."""

    name = "tictactoe"
    seats = ("X", "O")
    move_help = "a free cell number 1-9"
    EMPTY = "." * 9

    def deals(self) -> tuple[Any, ...]:
        return (None,)

    def initial(self, deal: Any = None) -> str:
        return self.EMPTY

    def to_move(self, state: str) -> int:
        return int(state.count("X") > state.count("O"))

    def winner(self, state: str) -> int | None:
        """The seat with three in a row, or None."""
        for a, b, c in LINES:
            if state[a] != "." and state[a] == state[b] == state[c]:
                return self.seats.index(state[a])
        return None

    def is_terminal(self, state: str) -> bool:
        return self.winner(state) is not None or "." not in state

    def legal_moves(self, state: str) -> tuple[str, ...]:
        if self.is_terminal(state):
            return ()
        return tuple(str(i + 1) for i, c in enumerate(state) if c == ".")

    def apply(self, state: str, move: str) -> str:
        if move not in self.legal_moves(state):
            raise IllegalMove(f"tictactoe: {move!r} is not legal on {state!r}")
        i = int(move) - 1
        return state[:i] + self.seats[self.to_move(state)] + state[i + 1:]

    def returns(self, state: str) -> tuple[float, float]:
        if not self.is_terminal(state):
            raise ValueError(f"tictactoe: {state!r} is not over")
        w = self.winner(state)
        return (0.0, 0.0) if w is None else ((1.0, -1.0) if w == 0 else (-1.0, 1.0))

    def render(self, state: str, seat: int) -> str:
        """Three lines; a free cell shows its own number, so the legal moves are the digits in
        sight (``"12O\\n4X6\\n789\\n"``). Nothing is hidden: the same for both seats."""
        cells = [c if c != "." else str(i + 1) for i, c in enumerate(state)]
        return "".join("".join(cells[r:r + 3]) + "\n" for r in (0, 3, 6))

    def parse_move(self, text: str) -> str | None:
        """The last lone digit 1-9 of ``text`` ("I take 5" -> "5"; "15" has none)."""
        found = _CELL.findall(text)
        return found[-1] if found else None


@functools.lru_cache(maxsize=None)
def _negamax(state: str) -> int:
    """Value of ``state`` for the seat to move under perfect play: a win scores
    1 + the empty cells left when it happens (a quicker win is better), a draw 0."""
    game = _TTT
    if game.winner(state) is not None:   # the previous mover just won
        return -(1 + state.count("."))
    if "." not in state:
        return 0
    return max(-_negamax(game.apply(state, m)) for m in game.legal_moves(state))


def tictactoe_minimax(game: "TicTacToe", state: str, rng: random.Random | None = None) -> str:
    """The optimal move: the highest negamax value, ties to the lowest cell number (so the
    player is deterministic; ``rng`` is unused). Never loses."""
    moves = game.legal_moves(state)
    if not moves:
        raise IllegalMove(f"tictactoe: no move in {state!r}")
    return max(moves, key=lambda m: (-_negamax(game.apply(state, m)), -int(m)))


_TTT = TicTacToe()


# ----------------------------------------------------------------------------- Kuhn Poker

@dataclasses.dataclass(frozen=True)
class KuhnState:
    """cards: (seat 0's card, seat 1's card), 0 = J, 1 = Q, 2 = K; history: the moves so far."""
    cards: tuple[int, int]
    history: tuple[str, ...] = ()


class KuhnPoker:
    """Kuhn Poker (Kuhn 1950): a 3-card deck J < Q < K, one card each, an ante of 1 chip each.
    Seat 0 ("P1") acts first: "check" or "bet" (1 chip). After a check seat 1 checks (showdown
    for the pot of 2: +-1) or bets; facing a bet a seat "call"s (showdown for 4: +-2) or
    "fold"s (losing its ante: -1). The higher card wins a showdown.

    Terminal histories and seat 0's payoff: check check +-1, bet call +-2, bet fold +1,
    check bet call +-2, check bet fold -1."""

    name = "kuhn_poker"
    seats = ("P1", "P2")
    move_help = "check, bet, call or fold"
    CARDS = "JQK"
    _WORD = re.compile(r"\b(check|bet|call|fold)\b", re.IGNORECASE)
    _TERMINAL = {("check", "check"), ("bet", "call"), ("bet", "fold"),
                 ("check", "bet", "call"), ("check", "bet", "fold")}

    def deals(self) -> tuple[tuple[int, int], ...]:
        return tuple(itertools.permutations(range(3), 2))   # 6 deals, each 1/6

    def initial(self, deal: Sequence[int] = (0, 1)) -> KuhnState:
        cards = tuple(int(c) for c in deal)
        if len(cards) != 2 or cards[0] == cards[1] or not set(cards) <= {0, 1, 2}:
            raise ValueError(f"kuhn_poker: a deal is two different cards of 0, 1, 2; got {deal!r}")
        return KuhnState(cards)

    def to_move(self, state: KuhnState) -> int:
        return len(state.history) % 2

    def is_terminal(self, state: KuhnState) -> bool:
        return state.history in self._TERMINAL

    def legal_moves(self, state: KuhnState) -> tuple[str, ...]:
        if self.is_terminal(state):
            return ()
        return ("call", "fold") if state.history[-1:] == ("bet",) else ("check", "bet")

    def apply(self, state: KuhnState, move: str) -> KuhnState:
        if move not in self.legal_moves(state):
            raise IllegalMove(f"kuhn_poker: {move!r} is not legal after {state.history!r}")
        return KuhnState(state.cards, state.history + (move,))

    def returns(self, state: KuhnState) -> tuple[float, float]:
        if not self.is_terminal(state):
            raise ValueError(f"kuhn_poker: {state.history!r} is not over")
        h = state.history
        if h[-1] == "fold":        # the folder loses its ante (and nothing more)
            folder = (len(h) - 1) % 2
            win = 1.0 if folder == 1 else -1.0
        else:                      # showdown for 1 (check check) or 2 (a called bet)
            stake = 2.0 if "bet" in h else 1.0
            win = stake if state.cards[0] > state.cards[1] else -stake
        return (win, -win)

    def render(self, state: KuhnState, seat: int) -> str:
        """``seat``'s card and the moves so far; the other card stays hidden
        (``"card K, moves: check bet\\n"``, ``"card K, moves: -\\n"`` before the first)."""
        moves = " ".join(state.history) or "-"
        return f"card {self.CARDS[state.cards[seat]]}, moves: {moves}\n"

    def parse_move(self, text: str) -> str | None:
        """The last of the words check/bet/call/fold in ``text`` (any case), else None."""
        found = self._WORD.findall(text)
        return found[-1].lower() if found else None


def kuhn_nash_policy(state: KuhnState, alpha: float | Fraction = Fraction(1, 6)
                     ) -> dict[str, Fraction]:
    """Kuhn Poker's equilibrium strategies (Kuhn 1950; the family with one parameter alpha in
    [0, 1/3], which sets player 1's strategy; player 2's is unique). For the seat to move in
    ``state``, the probability of each legal move:

    * P1 first: a Jack bets with probability alpha (a bluff), a Queen always checks, a King bets
      with probability 3 * alpha.
    * P1 after check, bet: a Jack folds, a Queen calls with probability alpha + 1/3, a King
      calls.
    * P2 facing a bet: a Jack folds, a Queen calls with probability 1/3, a King calls.
    * P2 after a check: a Jack bets with probability 1/3 (a bluff), a Queen checks, a King bets.

    The game's value for P1 is -1/18 for every alpha (``tests/test_board_games.py`` sums it
    exactly over the deals and both strategies)."""
    alpha = Fraction(alpha).limit_denominator(10 ** 6) if isinstance(alpha, float) else Fraction(alpha)
    if not 0 <= alpha <= Fraction(1, 3):
        raise ValueError(f"kuhn_poker: the Nash parameter alpha must be in [0, 1/3], got {alpha}")
    h, seat = state.history, len(state.history) % 2
    card = state.cards[seat]
    third = Fraction(1, 3)
    if h == ():
        p = (alpha, Fraction(0), 3 * alpha)[card]
        return {"check": 1 - p, "bet": p}
    if h == ("check", "bet"):
        p = (Fraction(0), alpha + third, Fraction(1))[card]
        return {"call": p, "fold": 1 - p}
    if h == ("bet",):
        p = (Fraction(0), third, Fraction(1))[card]
        return {"call": p, "fold": 1 - p}
    if h == ("check",):
        p = (third, Fraction(0), Fraction(1))[card]
        return {"check": 1 - p, "bet": p}
    raise IllegalMove(f"kuhn_poker: no move after {h!r}")


# ----------------------------------------------------------------------------- Negotiation

@dataclasses.dataclass(frozen=True)
class NegotiationState:
    """values: each seat's private value of one item of each type; history: the moves so far
    ("propose a b c": what the mover keeps, or "accept")."""
    values: tuple[tuple[int, ...], tuple[int, ...]]
    history: tuple[str, ...] = ()


class Negotiation:
    """Split a pool of items between two seats with private values (after Lewis et al. 2017's
    Deal or No Deal, cut down): 1 book, 2 hats and 3 balls; each seat values one item of each
    type at an integer, so that the whole pool is worth 10 to it. The seats alternate, P1
    first: "propose a b c" keeps a books, b hats and c balls for the mover and offers the other
    seat the rest; "accept" takes the standing offer and ends the game. Each seat gets its
    share's value / 10 (in [0, 1]); no agreement after ``MAX_MOVES`` moves pays both 0.

    Not zero-sum: both gain from a deal that gives each seat the items it values more.
    ``wins`` in the game counters is a deal worth something to the seat."""

    name = "negotiation"
    seats = ("P1", "P2")
    move_help = "propose <books> <hats> <balls> to keep, or accept"
    COUNTS = (1, 2, 3)
    MAX_MOVES = 6
    scripted = "fair"   # the scripted player of SFT traces (no optimal player here)
    _MOVE = re.compile(r"\b(accept|propose\s+(\d+)\s+(\d+)\s+(\d+))\b", re.IGNORECASE)

    @functools.cached_property
    def _valuations(self) -> tuple[tuple[int, ...], ...]:
        """Every value vector worth 10 for the whole pool."""
        return tuple(v for v in itertools.product(*(range(10 // c + 1) for c in self.COUNTS))
                     if sum(x * c for x, c in zip(v, self.COUNTS)) == 10)

    @functools.cached_property
    def _proposals(self) -> tuple[str, ...]:
        return tuple("propose " + " ".join(map(str, k))
                     for k in itertools.product(*(range(c + 1) for c in self.COUNTS)))

    def deals(self) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
        """(P1's values, P2's values): every ordered pair of different valuations (182)."""
        return tuple((a, b) for a in self._valuations for b in self._valuations if a != b)

    def initial(self, deal=None) -> NegotiationState:
        deal = self.deals()[0] if deal is None else deal
        values = tuple(tuple(int(x) for x in v) for v in deal)
        if len(values) != 2 or any(v not in self._valuations for v in values):
            raise ValueError(f"negotiation: a deal is two value vectors worth 10 for the pool "
                             f"{self.COUNTS}; got {deal!r}")
        return NegotiationState(values)

    def to_move(self, state: NegotiationState) -> int:
        return len(state.history) % 2

    def is_terminal(self, state: NegotiationState) -> bool:
        return state.history[-1:] == ("accept",) or len(state.history) >= self.MAX_MOVES

    def legal_moves(self, state: NegotiationState) -> tuple[str, ...]:
        if self.is_terminal(state):
            return ()
        return self._proposals + (("accept",) if state.history else ())

    def apply(self, state: NegotiationState, move: str) -> NegotiationState:
        if move not in self.legal_moves(state):
            raise IllegalMove(f"negotiation: {move!r} is not legal after {state.history!r}")
        return NegotiationState(state.values, state.history + (move,))

    def offer(self, state: NegotiationState) -> tuple[int, ...] | None:
        """What the standing proposal gives the seat to move (None before the first)."""
        if not state.history or state.history[-1] == "accept":
            return None
        kept = tuple(int(x) for x in state.history[-1].split()[1:])
        return tuple(c - k for c, k in zip(self.COUNTS, kept))

    def value(self, state: NegotiationState, seat: int, items: Sequence[int]) -> int:
        """``seat``'s value of ``items`` (a count per type), out of 10."""
        return sum(v * n for v, n in zip(state.values[seat], items))

    def returns(self, state: NegotiationState) -> tuple[float, float]:
        if not self.is_terminal(state):
            raise ValueError(f"negotiation: {state.history!r} is not over")
        if state.history[-1] != "accept":
            return (0.0, 0.0)
        accepter = (len(state.history) - 1) % 2
        got = self.offer(NegotiationState(state.values, state.history[:-1]))
        kept = tuple(c - g for c, g in zip(self.COUNTS, got))
        shares = {accepter: got, 1 - accepter: kept}
        return tuple(self.value(state, s, shares[s]) / 10 for s in (0, 1))

    def render(self, state: NegotiationState, seat: int) -> str:
        """The pool, ``seat``'s own values (the other's stay hidden), the standing offer to the
        seat to move and the moves left: ``"pool 1 2 3, values 4 0 2, offer 0 1 3, left 5\n"``
        (``offer -`` before the first proposal)."""
        offer = self.offer(state) if self.to_move(state) == seat else None
        return (f"pool {' '.join(map(str, self.COUNTS))}, values "
                f"{' '.join(map(str, state.values[seat]))}, offer "
                f"{' '.join(map(str, offer)) if offer else '-'}, "
                f"left {self.MAX_MOVES - len(state.history)}\n")

    def parse_move(self, text: str) -> str | None:
        """The last "accept" or "propose a b c" in ``text`` (any case, any spacing)."""
        found = self._MOVE.findall(text)
        if not found:
            return None
        word, *counts = found[-1]
        return "accept" if word.lower() == "accept" else "propose " + " ".join(
            _digits(c) for c in counts)


def negotiation_fair(game: Negotiation, state: NegotiationState,
                     rng: random.Random | None = None) -> str:
    """A fixed, reasonable negotiator (not optimal: the game has none without the other's
    values): accepts an offer worth at least 5 of its 10, or any offer on the last move;
    otherwise proposes to keep the fewest items worth at least 6 to it (ties to the first in
    order). Deterministic (``rng`` is unused)."""
    seat = game.to_move(state)
    offer = game.offer(state)
    last = len(state.history) == game.MAX_MOVES - 1
    if offer is not None and (game.value(state, seat, offer) >= 5 or last):
        return "accept"
    best = None
    for move in game._proposals:
        kept = [int(x) for x in move.split()[1:]]
        v = game.value(state, seat, kept)
        key = (v < 6, sum(kept), -v)
        if best is None or key < best[0]:
            best = (key, move)
    return best[1]


# ----------------------------------------------------------------------------- players

Player = Callable[[Any, Any, random.Random], str]


def random_player(game: Game, state, rng: random.Random) -> str:
    """A uniformly random legal move."""
    return rng.choice(game.legal_moves(state))


def _sample(policy: Mapping[str, Fraction], rng: random.Random) -> str:
    u, total = Fraction(rng.random()), Fraction(0)
    for move, p in policy.items():
        total += p
        if u < total:
            return move
    return next(m for m, p in reversed(policy.items()) if p > 0)   # u rounds to the top


def make_player(game: Game, kind: str, **options) -> Player:
    """The scripted player ``kind``: "random" (uniform legal moves) or "optimal" (TicTacToe:
    minimax; Kuhn Poker: the Nash strategy, option ``alpha`` (default 1/6)); Negotiation has
    "fair" (``negotiation_fair``) instead of an optimal player. A game may bring its own
    players as a ``players`` mapping of kind -> player."""
    own = getattr(game, "players", None)
    if own is not None:
        if kind not in own:
            raise ValueError(f"{game.name}: unknown player {kind!r}; known: {', '.join(own)}")
        return own[kind]
    if kind == "random":
        return random_player
    if kind == "optimal" and game.name == "tictactoe":
        return tictactoe_minimax
    if kind == "fair" and game.name == "negotiation":
        return negotiation_fair
    if kind == "optimal" and game.name == "kuhn_poker":
        alpha = options.get("alpha", Fraction(1, 6))
        kuhn_nash_policy(KuhnState((0, 1)), alpha)   # checks alpha now, not mid-episode
        return lambda g, s, rng: _sample(kuhn_nash_policy(s, alpha), rng)
    known = "random, fair" if game.name == "negotiation" else "random, optimal"
    raise ValueError(f"{game.name}: unknown player {kind!r}; known: {known}")


GAMES: dict[str, Callable[[], Game]] = {"tictactoe": TicTacToe, "kuhn_poker": KuhnPoker,
                                        "negotiation": Negotiation}


def get_game(name: str) -> Game:
    """A built-in game by name ("tictactoe", "kuhn_poker", "negotiation", "propose_solve":
    ``rljax.envs``, imported before this module, registers the last)."""
    if name not in GAMES:
        raise KeyError(f"unknown game {name!r}; known: {', '.join(sorted(GAMES))}")
    return GAMES[name]()
