"""Board games with a policy in more than one seat: one shared game (``Match``) and one
environment per seat (``SeatEnv``), each seeing the game only from its own seat.

Self-play (one policy in every seat) and play against a frozen copy (an earlier checkpoint in
the other seats) are both a match whose seats are played by language models. Each seat is its
own multi-turn episode: its prompt, its own moves as model turns, and the state after the other
seats' moves as observations. So each seat keeps its own KV cache, sees only what its seat may
see (Kuhn Poker: its own card), and a token's reward is only its seat's return: there is no
trajectory that holds two seats' tokens. The rollout (``rljax.train.methods.matches``) steps the seat
envs of a match in the game's turn order:

    match = Match(game, deal=None)
    envs = [SeatEnv(match, example, seat) for seat in range(2)]
    [env.reset() for env in envs]        # X: prompt + board; O: prompt only (X moves first)
    envs[0].step("5")                    # X's move: not done, no observation yet
    envs[1].observe()                    # O's view: the board after X's move
    envs[1].step("1") ...                # and so on; a seat whose game ended on another
    envs[1].finish()                     # seat's move collects its reward with ``finish``

Rewards: a finished game pays each seat its return times ``reward_scale``; a seat that names
no move or an illegal one forfeits: it gets ``illegal_penalty`` and the game ends; the other
seats get ``forfeit_reward`` (default 0: a forfeit is not a won game). Counters as
``GameEnv``'s (``moves``, ``plies``, ``wins``, ``draws``, ``losses``, ``illegal_moves``,
``unparsable``, ``payoff``, ``games_<seat>``, ``wins_<seat>``) plus ``opponent_forfeits``.
"""
from __future__ import annotations

from typing import Any, Mapping

from rljax.envs import board_games as bg
from rljax.envs.base import Message, StepResult
from rljax.envs.game_env import role_key
from rljax.envs.tool_env import example_prompt

__all__ = ["Match", "SeatEnv", "seat_example"]


class Match:
    """One game shared by its seats' environments: the state, the plies played, and who
    forfeited (None: nobody). ``start`` is idempotent: the first seat env to reset starts it."""

    def __init__(self, game: bg.Game, deal: Any = None):
        self.game = game
        self.deal = tuple(deal) if deal is not None else game.deals()[0]
        self.state, self.plies, self.forfeit, self.abandoned = None, 0, None, False

    def start(self) -> None:
        if self.state is None:
            self.state = self.game.initial(self.deal)

    def over(self) -> bool:
        """The game ended: played out, a forfeit, or abandoned (a seat ran out of turns or
        tokens in the rollout)."""
        return (self.forfeit is not None or self.abandoned
                or self.game.is_terminal(self.state))

    def to_move(self) -> int:
        return self.game.to_move(self.state)


def seat_example(example: Mapping[str, Any], seat: int, game: bg.Game) -> dict:
    """``example`` for another seat of the same game: ``seat``, ``seat_name`` and a ``question``
    in the board-game task's form (``"tictactoe O\\n"``) when the example's was in that form;
    the rendered ``prompt`` is dropped (render it again for the new seat)."""
    ex = {k: v for k, v in example.items() if k != "prompt"}
    old = example.get("seat", 0)
    old = game.seats.index(old) if old in game.seats else int(old)
    if ex.get("question") == f"{game.name} {game.seats[old]}\n":
        ex["question"] = f"{game.name} {game.seats[seat]}\n"
    ex.update(seat=int(seat), seat_name=game.seats[seat])
    return ex


class SeatEnv:
    """The episode of ``seat`` in ``match``: the environment protocol (``reset``, ``step``)
    plus what a multi-seat rollout needs (``to_move``, ``observe``, ``finish``, ``done``).

    example: the seat's example (prompt text; the deal is the match's); illegal_penalty,
    reward_scale, system_prompt, state_format: as ``GameEnv``; forfeit_reward: what the other
    seats get when one forfeits."""

    def __init__(self, match: Match, example: Mapping[str, Any], seat: int, *,
                 illegal_penalty: float = -1.0, reward_scale: float = 1.0,
                 forfeit_reward: float = 0.0, system_prompt: str | None = None,
                 state_format: str = "{state}"):
        game = match.game
        if not 0 <= int(seat) < len(game.seats):
            raise ValueError(f"{game.name}: seat {seat!r} is not an index below "
                             f"{len(game.seats)}")
        if "{state}" not in state_format:
            raise ValueError(f"{game.name}: state_format must contain {{state}}, got "
                             f"{state_format!r}")
        self.match, self.game, self.seat = match, game, int(seat)
        self.example = dict(example)
        self.illegal_penalty, self.reward_scale = float(illegal_penalty), float(reward_scale)
        self.forfeit_reward = float(forfeit_reward)
        self.system_prompt, self.state_format = system_prompt, state_format
        self.done = False

    @property
    def role_key(self) -> int:
        return role_key(self.game.name, self.seat)

    def _view(self) -> str:
        return self.state_format.format(state=self.game.render(self.match.state, self.seat))

    def reset(self) -> list[Message]:
        """The seat's first messages: the prompt, followed by the state when this seat moves
        first (otherwise the state arrives as its first observation, ``observe``)."""
        self.match.start()
        self.done = False
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        text = example_prompt(self.example)
        if self.to_move() and self.match.plies == 0:
            text += self._view()
        return system + [{"role": "user", "content": text}]

    def to_move(self) -> bool:
        """This seat moves next in a game that is still on."""
        return not self.match.over() and self.match.to_move() == self.seat

    def observe(self) -> list[Message]:
        """The state as this seat sees it now (after the other seats' moves)."""
        return [{"role": "user", "content": self._view()}]

    def step(self, model_turn: str) -> StepResult:
        """This seat's move. Done when it ended the game (a win, a draw, a forfeit); otherwise
        reward 0, no observation: the next one comes from ``observe`` when the seat is to
        move again."""
        match, game, name = self.match, self.game, self.game.seats[self.seat]
        if not self.to_move():
            raise ValueError(f"{game.name}: seat {name} is not to move")
        move = bg.read_move(game, model_turn)
        info = {"moves": 1}
        if move is None or move not in game.legal_moves(match.state):
            match.forfeit = self.seat
            self.done = True
            info.update(illegal_moves=1, unparsable=int(move is None), plies=match.plies,
                        **{f"games_{name}": 1})
            return StepResult((), self.illegal_penalty, True, info)
        match.state = game.apply(match.state, move)
        match.plies += 1
        if not game.is_terminal(match.state):
            return StepResult((), 0.0, False, info)
        reward, outcome = self._outcome()
        self.done = True
        return StepResult((), reward, True, {**info, **outcome})

    def _outcome(self) -> tuple[float, dict]:
        ret = self.game.returns(self.match.state)[self.seat]
        name = self.game.seats[self.seat]
        return ret * self.reward_scale, {
            "plies": self.match.plies, "payoff": ret, "wins": int(ret > 0),
            "draws": int(ret == 0), "losses": int(ret < 0), f"games_{name}": 1,
            f"wins_{name}": int(ret > 0)}

    def finish(self) -> StepResult:
        """The seat's result once its game ended on another seat's move (done), or, for an
        abandoned game, nothing (reward 0, not done: the episode was cut short)."""
        match, name = self.match, self.game.seats[self.seat]
        if not match.over() or self.done:
            raise ValueError(f"{self.game.name}: finish() for seat {name} before its game "
                             "ended, or twice")
        if match.forfeit is not None:
            self.done = True
            return StepResult((), self.forfeit_reward, True,
                              {"opponent_forfeits": 1, "plies": match.plies,
                               f"games_{name}": 1})
        if match.abandoned:
            return StepResult((), 0.0, False, {})
        reward, outcome = self._outcome()
        self.done = True
        return StepResult((), reward, True, outcome)
