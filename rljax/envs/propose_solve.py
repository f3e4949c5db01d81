"""A proposer/solver game: one seat writes an arithmetic task for a given answer, the other
seats solve it. In self-play the same policy sits in every seat, so it makes its own
curriculum.

    game = ProposeSolve()
    s = game.initial((46,))                      # the deal: the answer the task must have
    game.render(s, 0)                            # "answer 46, task:"
    s = game.apply(s, "12+34=")                  # the proposer's task
    game.render(s, 1)                            # "12+34=\\n": all a solver sees
    for _ in range(4):
        s = game.apply(s, "46")                  # each solver answers
    game.returns(s)                              # (0.0, 1.0, 1.0, 1.0, 1.0): solved by all

As in Search Self-play (arXiv 2510.18821), where the proposer is given the ground-truth answer
and writes a question that has it, the deal fixes the answer and the proposer chooses the
task: ``a+b=`` or ``a-b=`` with operands of at most ``DIGITS`` digits whose value is the
deal's. Any other task is an illegal move (the proposer forfeits). So the answers stay
spread over their whole range whatever the proposer prefers, the proposer needs no arithmetic
it could get wrong to stay legal (``46+0=`` always is), and what it controls is the
difficulty. A solver's move is a number in ``[0, 2 * (10**DIGITS - 1)]``; a wrong number is a
legal, unrewarded answer.

Returns: each solver 1.0 if its answer is right, else 0.0. The proposer is paid for a task
that is solvable but not trivial, Absolute Zero's learnability reward (arXiv 2505.03335):
``1 - p`` where ``p`` is the fraction of solvers that got it right, and 0 when ``p`` is 0 or
1 (a task nobody or everybody solves teaches nothing).

Roles (``roles``): the proposer is role 0 and every solver role 1, so role-conditioned
advantages keep one baseline for proposing and one for solving. Scripted players: "random"
(a uniformly random task for the answer; a uniformly random number) and "optimal" (the same
proposer, there being no best task; the right answer), the latter for SFT traces.
"""
from __future__ import annotations

import dataclasses
import functools
import random
import re

from rljax.envs import board_games as bg

__all__ = ["ProposeSolve", "ProposeSolveState", "learnability"]

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
    """``answer``: the deal, the value the task must have; ``task``: the proposer's move
    ("12+34=", "" before it); ``answers``: the solvers' moves so far, in seat order."""
    answer: int
    task: str = ""
    answers: tuple[str, ...] = ()


@functools.lru_cache(maxsize=None)
def _tasks_by_answer(digits: int, ops: str) -> dict[int, tuple[str, ...]]:
    """Every task for operands below 10**digits, by value (non-negative values only); once
    per process, not per environment."""
    top, out = 10 ** digits, {}
    for a in range(top):
        for b in range(top):
            for op in ops:
                value = a + b if op == "+" else a - b
                if value >= 0:
                    out.setdefault(value, []).append(f"{a}{op}{b}=")
    return {v: tuple(t) for v, t in sorted(out.items())}


def _optimal(game: "ProposeSolve", state: ProposeSolveState, rng: random.Random) -> str:
    if not state.task:
        return rng.choice(game.legal_moves(state))
    return str(state.answer)


class ProposeSolve:
    """The game (module docstring): seat 0 proposes, seats 1..``SOLVERS`` solve."""

    name = "propose_solve"
    DIGITS = 2
    OPS = "+-"
    SOLVERS = 4
    seats = ("proposer",) + tuple(f"solver{i + 1}" for i in range(SOLVERS))
    roles = (0,) + (1,) * SOLVERS
    move_help = "a task such as 12+34= with the answer given (proposer), its answer (solver)"
    scripted = "optimal"
    players = {"random": bg.random_player, "optimal": _optimal}

    @property
    def _tasks(self) -> dict[int, tuple[str, ...]]:
        return _tasks_by_answer(self.DIGITS, self.OPS)

    def deals(self) -> tuple[tuple[int], ...]:
        """The answers a task can have, each as a one-number deal: (0,) .. (198,)."""
        return tuple((v,) for v in self._tasks)

    def initial(self, deal=None) -> ProposeSolveState:
        answer = int((deal or self.deals()[0])[0])
        if answer not in self._tasks:
            raise ValueError(f"propose_solve: a deal is one answer in 0..{max(self._tasks)}, "
                             f"got {deal!r}")
        return ProposeSolveState(answer)

    def to_move(self, state: ProposeSolveState) -> int:
        return 1 + len(state.answers) if state.task else 0

    def is_terminal(self, state: ProposeSolveState) -> bool:
        return bool(state.task) and len(state.answers) == self.SOLVERS

    def legal_moves(self, state: ProposeSolveState) -> tuple[str, ...]:
        if self.is_terminal(state):
            return ()
        if not state.task:
            return self._tasks[state.answer]
        return tuple(str(v) for v in range(max(self._tasks) + 1))

    def apply(self, state: ProposeSolveState, move: str) -> ProposeSolveState:
        if move not in self.legal_moves(state):
            raise bg.IllegalMove(f"propose_solve: {move!r} is not legal in {state!r}")
        if not state.task:
            return ProposeSolveState(state.answer, move)
        return ProposeSolveState(state.answer, state.task, state.answers + (move,))

    def returns(self, state: ProposeSolveState) -> tuple[float, ...]:
        if not self.is_terminal(state):
            raise ValueError(f"propose_solve: {state!r} is not over")
        right = [float(a == str(state.answer)) for a in state.answers]
        return (learnability(int(sum(right)), self.SOLVERS), *right)

    def render(self, state: ProposeSolveState, seat: int) -> str:
        """The proposer sees the answer its task must have, ``"answer 46, task:"`` (its move
        follows on the same line); a solver sees the task alone, ``"12+34=\\n"``."""
        if seat == 0:
            return f"answer {state.answer}, task:"
        return state.task + "\n" if state.task else "wait\n"

    def parse_move(self, text: str) -> str | None:
        """The last task in ``text`` ("12 + 34" or "12+34=46" -> "12+34="), else its last
        number ("046" -> "46"), else None."""
        tasks = _TASK.findall(text)
        if tasks:
            a, op, b = tasks[-1]
            return f"{int(a)}{op}{int(b)}="
        numbers = _NUMBER.findall(text)
        return str(int(numbers[-1])) if numbers else None


bg.GAMES[ProposeSolve.name] = ProposeSolve
