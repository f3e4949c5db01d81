"""Built-in synthetic tasks with exact verifiers: ``arithmetic``, ``countdown``, ``guess_number``,
and the board games ``tictactoe`` and ``kuhn_poker`` (``BoardGameTask``).

Examples are a pure function of ``(seed, split, index)``, so a task is a random-access dataset of
any size: no download, no files, the same example on every host and after every restart.
Each task also produces a verified solution text (``task.solution(example)``) for SFT warm-up.
The matching reward functions are ``rewards.get("arithmetic")`` and ``rewards.get("countdown")``.
"""
from __future__ import annotations

import itertools
import re
from fractions import Fraction
from typing import Sequence

import numpy as np

from rljax.data.shapes import ShapesTask
# The train/eval streams and hold-out buckets every synthetic task shares (re-exported).
from rljax.data.splits import HOLDOUT_FRACTION, _SPLIT_STREAM, _belongs_to, _rng  # noqa: F401

__all__ = ["ArithmeticTask", "CountdownTask", "GuessNumberTask", "BoardGameTask", "solve_countdown",
           "TASKS"]

class ArithmeticTask:
    """Short prompts like ``"12+7="``; the answer is the integer result ("19").

    Difficulty: ``digits`` (operands have 1..digits digits), ``operands`` (how many numbers),
    ``ops`` (a subset of "+-*"; usual precedence), ``allow_negative`` (else results are >= 0).
    ``steps``: the solution works left to right, one line per operation ("3+4=7\n7-2=5"), so
    it has ``operands - 1`` steps (step-level methods; needs ops without "*").
    """

    name = "arithmetic"

    def __init__(self, digits: int = 2, operands: int = 2, ops: str = "+",
                 allow_negative: bool = False, steps: bool = False, seed: int = 0):
        if digits < 1 or operands < 2:
            raise ValueError(f"arithmetic: need digits >= 1 and operands >= 2, got {digits}, {operands}")
        if not ops or set(ops) - set("+-*"):
            raise ValueError(f"arithmetic: ops must be a non-empty subset of '+-*', got {ops!r}")
        if steps and "*" in ops:
            raise ValueError("arithmetic: steps=True works left to right, which needs ops "
                             f"without '*' (precedence), got {ops!r}")
        self.digits, self.operands, self.ops = int(digits), int(operands), ops
        self.allow_negative, self.steps, self.seed = bool(allow_negative), bool(steps), int(seed)

    def example(self, index: int, split: str = "train") -> dict:
        rng = _rng(self.seed, split, index)
        while True:  # rejection sampling keeps results non-negative when asked to
            nums = [int(rng.integers(0, 10 ** int(rng.integers(1, self.digits + 1))))
                    for _ in range(self.operands)]
            ops = [self.ops[int(rng.integers(len(self.ops)))] for _ in range(self.operands - 1)]
            expr = "".join(str(n) + op for n, op in zip(nums, ops)) + str(nums[-1])
            value = _eval_int(expr)
            if (self.allow_negative or value >= 0) and _belongs_to(split, expr + "=", self.seed):
                return {"question": expr + "=", "answer": str(value)}

    def solution(self, example: dict) -> str:
        """The completion to train on: the result itself, or with ``steps`` the left-to-right
        partial results, one line each, the last line ending in the result."""
        if not self.steps:
            return str(example["answer"])
        terms = re.findall(r"[+-]?\d+", example["question"].rstrip("="))
        value, lines = int(terms[0]), []
        for term in terms[1:]:
            new = value + int(term)
            lines.append(f"{value}{term[0]}{term[1:]}={new}")
            value = new
        return "\n".join(lines)


def _eval_int(expr: str) -> int:
    """Evaluates a generated ``a+b*c-d`` string (digits and + - * only) with usual precedence."""
    total, term, sign, num = 0, 1, 1, ""
    pending = "*"  # how ``num`` joins ``term``
    for ch in expr + "+":
        if ch.isdigit():
            num += ch
            continue
        term = term * int(num) if pending == "*" else int(num)
        num = ""
        if ch == "*":
            pending = "*"
        else:
            total += sign * term
            sign, term, pending = (1 if ch == "+" else -1), 1, "*"
    return total


class CountdownTask:
    """Reach ``target`` from ``numbers`` with + - * / and parentheses, each number at most once
    (exactly once when ``use_all``). Every generated instance is solvable by construction.

    Difficulty: ``num_numbers``, ``max_number`` (numbers are 1..max_number), ``max_target``.
    """

    name = "countdown"

    def __init__(self, num_numbers: int = 3, max_number: int = 10, max_target: int = 100,
                 use_all: bool = False, seed: int = 0):
        if not 2 <= num_numbers <= 6:
            raise ValueError(f"countdown: num_numbers must be in [2, 6], got {num_numbers}")
        if max_number < 1 or max_target < 1:
            raise ValueError("countdown: max_number and max_target must be positive")
        self.num_numbers, self.max_number, self.max_target = int(num_numbers), int(max_number), int(max_target)
        self.use_all, self.seed = bool(use_all), int(seed)

    def example(self, index: int, split: str = "train") -> dict:
        rng = _rng(self.seed, split, index)
        while True:
            numbers = [int(x) for x in rng.integers(1, self.max_number + 1, size=self.num_numbers)]
            target = self._random_target(numbers, rng)
            nums = " ".join(str(n) for n in numbers)
            if target is not None and _belongs_to(split, f"Use {nums} to make {target}.", self.seed):
                return {"question": f"Use {nums} to make {target}.", "numbers": numbers,
                        "target": target, "use_all": self.use_all}

    def _random_target(self, numbers: list[int], rng: np.random.Generator) -> int | None:
        """Folds a random subset (all if use_all) with random operations; None if out of range."""
        k = self.num_numbers if self.use_all else int(rng.integers(2, self.num_numbers + 1))
        order = [numbers[i] for i in rng.permutation(self.num_numbers)[:k]]
        value = Fraction(order[0])
        for n in order[1:]:
            op = "+-*/"[int(rng.integers(4))]
            if op == "/" and value % n != 0:
                op = "+"  # keep intermediate results whole numbers, like the classic game
            value = {"+": value + n, "-": value - n, "*": value * n, "/": value / n}[op]
        if value.denominator != 1 or not 1 <= value <= self.max_target:
            return None
        return int(value)

    def solution(self, example: dict) -> str:
        """A verified expression reaching the target (found by search, fine up to ~5 numbers)."""
        expr = solve_countdown(example["numbers"], example["target"], use_all=example.get("use_all", False))
        if expr is None:
            raise ValueError(f"countdown instance has no solution: {example}")
        return expr


def solve_countdown(numbers: Sequence[int], target: int, use_all: bool = False) -> str | None:
    """Exhaustive search; returns an expression string equal to ``target`` or None."""
    items = [(Fraction(n), str(n)) for n in numbers]
    return _search(items, Fraction(target), use_all)


def _search(items: list[tuple[Fraction, str]], target: Fraction, use_all: bool) -> str | None:
    if not use_all or len(items) == 1:
        for value, expr in items:
            if value == target:
                return expr
    if len(items) == 1:
        return None
    for i, j in itertools.permutations(range(len(items)), 2):
        (a, ea), (b, eb) = items[i], items[j]
        rest = [items[k] for k in range(len(items)) if k not in (i, j)]
        candidates = [(a + b, f"({ea}+{eb})"), (a - b, f"({ea}-{eb})"), (a * b, f"{_wrap(ea)}*{_wrap(eb)}")]
        if b != 0:
            candidates.append((a / b, f"{_wrap(ea)}/({eb})"))
        for value, expr in candidates:
            found = _search(rest + [(value, expr)], target, use_all)
            if found is not None:
                return _strip_outer(found)
    return None


def _wrap(expr: str) -> str:
    return expr if expr.isdigit() or expr.startswith("(") else f"({expr})"


def _strip_outer(expr: str) -> str:
    """Drops one pair of parentheses around the whole expression, if they enclose all of it."""
    if not (expr.startswith("(") and expr.endswith(")")):
        return expr
    depth = 0
    for i, ch in enumerate(expr):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0 and i < len(expr) - 1:
            return expr
    return expr[1:-1]


class GuessNumberTask:
    """Games for the multi-turn environment ``guess_number`` (``rljax.envs.games``): a secret
    integer in ``[low, high]`` found from "higher"/"lower" hints. Fields: ``question``,
    ``secret``, ``low``, ``high``, and ``answer`` (the secret as text, so answer-matching rewards
    such as ``arithmetic`` can also score the final guess). Splits hold disjoint secrets.
    """

    name = "guess_number"

    def __init__(self, low: int = 1, high: int = 100, seed: int = 0):
        if high - low < 1:
            raise ValueError(f"guess_number: need low < high, got {low}, {high}")
        self.low, self.high, self.seed = int(low), int(high), int(seed)

    def example(self, index: int, split: str = "train") -> dict:
        rng = _rng(self.seed, split, index)
        question = f"Guess my number from {self.low} to {self.high}."
        for _ in range(10_000):
            secret = int(rng.integers(self.low, self.high + 1))
            if _belongs_to(split, f"{question}#{secret}", self.seed):
                return {"question": question, "secret": secret, "low": self.low,
                        "high": self.high, "answer": str(secret)}
        raise ValueError(f"guess_number: no secret in [{self.low}, {self.high}] falls in the "
                         f"{split!r} split; widen the range")

    def solution(self, example: dict) -> str:
        """The first move of a bisection (the range's midpoint). A game is several turns: the
        whole solved game for SFT warm-up is ``rljax.envs.guess_trace(example)``."""
        return str((int(example["low"]) + int(example["high"])) // 2)


class BoardGameTask:
    """Games for the environments ``tictactoe`` and ``kuhn_poker`` (``rljax.envs.game_env``):
    the policy's seat, the opponent's random seed and (poker) the deal. Fields: ``question``
    (``"tictactoe X\\n"``: the game and the seat's name; the environment appends the state),
    ``game``, ``seat`` (index), ``seat_name``, ``move_help``, ``seed``, ``deal`` (poker: the two
    cards, 0 = J, 1 = Q, 2 = K) and ``answer`` ("": the environment pays, not an answer).
    A prompt template can use any field (``"You play {seat_name}; move: {move_help}.\\n"``).

    seat: "any" (drawn per example) or a seat name ("X"/"O", "P1"/"P2"). The splits hold
    disjoint (seat, deal, seed) games, so held-out episodes face opponent draws training
    never saw."""

    def __init__(self, game: str = "tictactoe", seat: str = "any", seed: int = 0):
        from rljax.envs import board_games   # pure Python; the game's seats and deals

        self.game = board_games.get_game(game)
        self.name = self.game.name
        if seat != "any" and seat not in self.game.seats:
            raise ValueError(f"{game}: seat must be 'any' or one of {self.game.seats}, got {seat!r}")
        self.seat, self.seed = seat, int(seed)

    def example(self, index: int, split: str = "train") -> dict:
        rng = _rng(self.seed, split, index)
        game, deals = self.game, self.game.deals()
        for _ in range(10_000):
            seat = (int(rng.integers(len(game.seats))) if self.seat == "any"
                    else game.seats.index(self.seat))
            deal = deals[int(rng.integers(len(deals)))]
            seed = int(rng.integers(2 ** 31))
            if _belongs_to(split, f"{game.name}#{seat}#{deal}#{seed}", self.seed):
                break
        ex = {"question": f"{game.name} {game.seats[seat]}\n", "game": game.name, "seat": seat,
              "seat_name": game.seats[seat], "move_help": game.move_help, "seed": seed,
              "answer": ""}
        if deal is not None:
            ex["deal"] = list(deal)
        return ex

    def solution(self, example: dict) -> str:
        """The scripted player's first move. A game is several turns: the whole game for SFT
        warm-up is ``rljax.envs.game_trace(name, example)``."""
        from rljax.envs.game_env import game_trace

        return game_trace(self.name, example)[1]["content"]


def _game_task(game: str):
    def make(seat: str = "any", seed: int = 0) -> BoardGameTask:
        return BoardGameTask(game, seat=seat, seed=seed)
    return make


TASKS = {"arithmetic": ArithmeticTask, "countdown": CountdownTask, "guess_number": GuessNumberTask,
         "tictactoe": _game_task("tictactoe"), "kuhn_poker": _game_task("kuhn_poker"),
         "negotiation": _game_task("negotiation"), "propose_solve": _game_task("propose_solve"),
         "shapes": ShapesTask}
