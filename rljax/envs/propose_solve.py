"""A proposer/solver game: one seat writes an arithmetic task, the other seats solve it. In
self-play the same policy sits in every seat, so it makes its own curriculum.

    game = ProposeSolve()
    s = game.initial((12,))                      # the deal: the task's first operand
    game.render(s, 0)                            # "first 12, task:"
    s = game.apply(s, "12+34=")                  # the proposer's task
    game.render(s, 1)                            # "12+34=\\n": what every solver sees
    for _ in range(4):
        s = game.apply(s, "46")                  # each solver answers
    game.returns(s)                              # (0.0, 1.0, 1.0, 1.0, 1.0): solved by all

A task is ``a+b=`` or ``a-b=`` with operands of at most ``DIGITS`` digits, a non-negative
result, and ``a`` the deal's operand; any other is an illegal move (the proposer forfeits).
The deal keeps the tasks spread over their range whatever the proposer prefers, and what the
proposer chooses is the difficulty (``12+0=`` or ``12+89=``). The game computes the answer,
as Absolute Zero's executor runs a proposed program: a small model is not asked to solve its
own task to pose it. (A deal fixing the answer instead, as Search Self-play gives its proposer
the ground truth, asks the proposer to decompose a number: after a short warm-up the demo's
tiny model wrote no legal task.) A solver's move is a number in ``[0, 2 * (10**DIGITS - 1)]``;
a wrong number is a legal, unrewarded answer.

Returns: each solver 1.0 if its answer is right, else 0.0. The proposer is paid for a task
that is solvable but not trivial, Absolute Zero's learnability reward (arXiv 2505.03335):
``1 - p`` where ``p`` is the fraction of solvers that got it right, and 0 when ``p`` is 0 or
1 (a task nobody or everybody solves teaches nothing).

Roles (``roles``): the proposer is role 0 and every solver role 1, so role-conditioned
advantages keep one baseline for proposing and one for solving. Scripted players: "random"
(a uniformly random task for the deal; a uniformly random number) and "optimal" (the same
proposer, there being no best task; the right answer), the latter for SFT traces.
"""
from __future__ import annotations

import dataclasses
import functools
import random
import re

from rljax.envs import board_games as bg

__all__ = ["ProposeSolve", "ProposeSolveState", "learnability", "value"]

_TASK = re.compile(r"(\d+)\s*([+-])\s*(\d+)")
_NUMBER = re.compile(r"\d+")


def learnability(solved: int, solvers: int) -> float:
    """The proposer's payoff when ``solved`` of ``solvers`` got its task right:
    ``1 - solved / solvers`` if some but not all did, else 0."""
    if not 0 <= solved <= solvers or solvers < 1:
        raise ValueError(f"learnability: need 0 <= solved <= solvers, solvers >= 1; got "
                         f"{solved}, {solvers}")
    return 0.0 if solved in (0, solvers) else 1.0 - solved / solvers


@dataclasses.dataclass(frozen=True)
class ProposeSolveState:
    """``first``: the deal, the task's first operand; ``task``: the proposer's move
    ("12+34=", "" before it); ``answers``: the solvers' moves so far, in seat order."""
    first: int
    task: str = ""
    answers: tuple[str, ...] = ()


def value(task: str) -> int:
    """The value of a task ("12+34=" -> 46)."""
    a, op, b = _TASK.fullmatch(task.rstrip("=")).groups()
    return int(a) + int(b) if op == "+" else int(a) - int(b)


@functools.lru_cache(maxsize=None)
def _tasks_by_first(digits: int, ops: str) -> dict[int, tuple[str, ...]]:
    """Every task for operands below 10**digits (non-negative results), by first operand;
    once per process, not per environment."""
    top = 10 ** digits
    return {a: tuple(f"{a}{op}{b}=" for op in ops for b in range(top) if op == "+" or b <= a)
            for a in range(top)}


def _optimal(game: "ProposeSolve", state: ProposeSolveState, rng: random.Random) -> str:
    if not state.task:
        return rng.choice(game.legal_moves(state))
    return str(value(state.task))


class ProposeSolve:
    """The game (module docstring): seat 0 proposes, seats 1..``SOLVERS`` solve."""

    name = "propose_solve"
    DIGITS = 2
    OPS = "+-"
    SOLVERS = 4
    seats = ("proposer",) + tuple(f"solver{i + 1}" for i in range(SOLVERS))
    roles = (0,) + (1,) * SOLVERS
    move_help = "a task such as 12+34= starting with the given number (proposer), its answer (solver)"
    scripted = "optimal"
    players = {"random": bg.random_player, "optimal": _optimal}

    @property
    def _tasks(self) -> dict[int, tuple[str, ...]]:
        return _tasks_by_first(self.DIGITS, self.OPS)

    def deals(self) -> tuple[tuple[int], ...]:
        """The first operands, each as a one-number deal: (0,) .. (99,)."""
        return tuple((a,) for a in self._tasks)

    def initial(self, deal=None) -> ProposeSolveState:
        first = int((deal or self.deals()[0])[0])
        if first not in self._tasks:
            raise ValueError(f"propose_solve: a deal is one operand in 0..{max(self._tasks)}, "
                             f"got {deal!r}")
        return ProposeSolveState(first)

    def to_move(self, state: ProposeSolveState) -> int:
        return 1 + len(state.answers) if state.task else 0

    def is_terminal(self, state: ProposeSolveState) -> bool:
        return bool(state.task) and len(state.answers) == self.SOLVERS

    def legal_moves(self, state: ProposeSolveState) -> tuple[str, ...]:
        if self.is_terminal(state):
            return ()
        if not state.task:
            return self._tasks[state.first]
        return tuple(str(v) for v in range(2 * max(self._tasks) + 1))

    def apply(self, state: ProposeSolveState, move: str) -> ProposeSolveState:
        if move not in self.legal_moves(state):
            raise bg.IllegalMove(f"propose_solve: {move!r} is not legal in {state!r}")
        if not state.task:
            return ProposeSolveState(state.first, move)
        return ProposeSolveState(state.first, state.task, state.answers + (move,))

    def returns(self, state: ProposeSolveState) -> tuple[float, ...]:
        if not self.is_terminal(state):
            raise ValueError(f"propose_solve: {state!r} is not over")
        right = [float(a == str(value(state.task))) for a in state.answers]
        return (learnability(int(sum(right)), self.SOLVERS), *right)

    def render(self, state: ProposeSolveState, seat: int) -> str:
        """The proposer sees the operand its task must start with, ``"first 12, task:"`` (its
        move follows on the same line); a solver sees the task, ``"12+34=\\n"``."""
        if seat == 0:
            return f"first {state.first}, task:"
        return state.task + "\n" if state.task else "wait\n"

    def parse_move(self, text: str) -> str | None:
        """The last task in ``text`` ("12 + 34" or "12+34=46" -> "12+34="), else its last
        number ("046" -> "46"), else None."""
        tasks = _TASK.findall(text)
        if tasks:
            a, op, b = tasks[-1]
            return f"{bg._digits(a)}{op}{bg._digits(b)}="
        numbers = _NUMBER.findall(text)
        return bg._digits(numbers[-1]) if numbers else None


bg.GAMES[ProposeSolve.name] = ProposeSolve
