"""Environments ``tictactoe``, ``kuhn_poker`` and ``negotiation``: the policy plays one seat of a game
(``rljax.envs.board_games``), a scripted opponent plays the other inside ``step``.

    env = make_env("tictactoe", {"question": "tictactoe X\\n", "seat": 0, "seed": 7},
                   opponent="random")
    env.reset()        # [user: "tictactoe X\\n123\\n456\\n789\\n"]
    env.step("5")      # observation [user: the board after O's reply], reward 0.0, not done
    ...                # the last step: reward +1 (win), 0 (draw), -1 (loss)

Example fields: ``seat`` (index or name), ``seed`` (int: the opponent's random choices, so an
episode is a pure function of the example and the model's turns, and the G environments of a
group reset alike), ``deal`` (Kuhn Poker: the two cards, 0 = J .. 2 = K; Negotiation: the two
seats' value vectors), ``prompt`` or
``question`` (text before the first state), optional ``opponent`` (overrides the option).
Examples come from the tasks ``data.source="tictactoe"`` / ``"kuhn_poker"`` / ``"negotiation"``
(``rljax.data.tasks.BoardGameTask``).

Each observation is the state rendered from the policy's seat after the opponent's reply
(``Game.render``, through ``state_format``). The move is ``Game.parse_move`` of the turn (a
cell "1".."9"; a poker word). A turn that names no move, or an illegal one, ends the episode
with reward ``illegal_penalty``. The rollout sums rewards: the game's return for the policy's
seat times ``reward_scale`` (poker: chips) on the last step.

Counters (``info``, summed per episode, ``env/<key>_mean`` in metrics): ``moves`` (model moves),
``plies`` (moves of both seats, on the last step: the game's length), ``wins``, ``draws``,
``losses`` (games played to the end; by the sign of the seat's return, so in Negotiation a
win is a deal worth something to the seat), ``illegal_moves`` (forfeits; ``unparsable`` the
part that named no move), ``payoff`` (the seat's unscaled return; poker: chips; Negotiation:
its share's value / 10), and per seat
``games_<seat>`` / ``wins_<seat>`` (e.g. ``wins_O``; the win rate as O is their ratio).
``game_trace`` plays the scripted player in the model's seat (the game's ``scripted`` kind,
"optimal" by default), for SFT warm-up.
"""
from __future__ import annotations

import random
from typing import Any, Mapping

import numpy as np

from rljax.envs import board_games as bg
from rljax.envs import propose_solve  # noqa: F401  (registers the game)
from rljax.envs.base import Message, StepResult, register_env
from rljax.envs.tool_env import example_prompt

__all__ = ["GameEnv", "game_trace", "GAME_ENVS", "NUM_ROLES", "role_key"]


class GameEnv:
    """One game of ``game`` (a ``board_games.Game``) with the policy in ``example["seat"]``.

    opponent: "random", "optimal" or "fair" (``board_games.make_player``; ``example["opponent"]``
    wins); opponent_options: its options (Kuhn Poker's ``alpha``); illegal_penalty: the reward
    of a forfeit (float, default -1); reward_scale: multiplies the game's return;
    state_format: how a rendered state becomes message text (must contain ``{state}``)."""

    def __init__(self, game: bg.Game, example: Mapping[str, Any], opponent: str = "random",
                 opponent_options: Mapping[str, Any] | None = None, illegal_penalty: float = -1.0,
                 reward_scale: float = 1.0, system_prompt: str | None = None,
                 state_format: str = "{state}"):
        if "{state}" not in state_format:
            raise ValueError(f"{game.name}: state_format must contain {{state}}, got {state_format!r}")
        self.game, self.example = game, dict(example)
        seat = self.example.get("seat", 0)
        if seat in game.seats:
            self.seat = game.seats.index(seat)
        elif str(seat).isdigit() and int(seat) < len(game.seats):   # JSON rows may hold "1"
            self.seat = int(seat)
        else:
            raise ValueError(f"{game.name}: seat {seat!r} is not one of {game.seats} or an "
                             f"index below {len(game.seats)}")
        self.seed = int(self.example.get("seed", 0))
        self.deal = self.example.get("deal")
        kind = str(self.example.get("opponent", opponent))
        self.opponent = bg.make_player(game, kind, **dict(opponent_options or {}))
        self.illegal_penalty, self.reward_scale = float(illegal_penalty), float(reward_scale)
        self.system_prompt, self.state_format = system_prompt, state_format
        self.state = None

    @property
    def role_key(self) -> int:
        """This episode's (game, seat) as a role key (``role_key``): what RAE keys on."""
        return role_key(self.game.name, self.seat)

    # The opponent's rng restarts at reset from the example's seed: reset is repeatable, and
    # the G episodes of a group face the same opponent wherever their moves agree.
    def reset(self) -> list[Message]:
        deal = tuple(self.deal) if self.deal is not None else self.game.deals()[0]
        self.rng = random.Random(self.seed)
        self.state, self.plies = self.game.initial(deal), 0
        self._opponent_moves()
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [{"role": "user", "content": example_prompt(self.example) + self._view()}]

    def _view(self) -> str:
        return self.state_format.format(state=self.game.render(self.state, self.seat))

    def _opponent_moves(self) -> None:
        game = self.game
        while not game.is_terminal(self.state) and game.to_move(self.state) != self.seat:
            self.state = game.apply(self.state, self.opponent(game, self.state, self.rng))
            self.plies += 1

    def step(self, model_turn: str) -> StepResult:
        game, seat_name = self.game, self.game.seats[self.seat]
        move = bg.read_move(game, model_turn)
        info = {"moves": 1}
        if move is None or move not in game.legal_moves(self.state):
            info.update(illegal_moves=1, unparsable=int(move is None), plies=self.plies,
                        **{f"games_{seat_name}": 1})
            return StepResult((), self.illegal_penalty, True, info)
        self.state = game.apply(self.state, move)
        self.plies += 1
        self._opponent_moves()
        if not game.is_terminal(self.state):
            return StepResult([{"role": "user", "content": self._view()}], 0.0, False, info)
        ret = game.returns(self.state)[self.seat]
        info.update(plies=self.plies, payoff=ret, wins=int(ret > 0), draws=int(ret == 0),
                    losses=int(ret < 0), **{f"games_{seat_name}": 1,
                                            f"wins_{seat_name}": int(ret > 0)})
        return StepResult((), ret * self.reward_scale, True, info)


def _factory(name: str):
    def make(example: Mapping[str, Any], **kwargs) -> GameEnv:
        return GameEnv(bg.get_game(name), example, **kwargs)
    make.__name__ = f"make_{name}_env"
    return make


GAME_ENVS = ("tictactoe", "kuhn_poker", "negotiation", "propose_solve")
MAX_ROLES = 2
# Role keys of role-conditioned advantages (``algorithms.role_advantages``): one per (game,
# role) of the built-in games, ``GAME_ENVS.index(game) * MAX_ROLES + role``. A seat's role is
# the seat itself unless the game maps seats to roles (``roles``: propose_solve's solvers
# share one).
NUM_ROLES = len(GAME_ENVS) * MAX_ROLES


def role_key(game: str, seat: int) -> int:
    """The role key of ``seat`` (index) in ``game`` (a name of ``GAME_ENVS``), in [0, NUM_ROLES)."""
    roles = getattr(bg.GAMES.get(game), "roles", None)
    role = int(seat) if roles is None or not 0 <= int(seat) < len(roles) else roles[int(seat)]
    if game not in GAME_ENVS or not 0 <= role < MAX_ROLES:
        raise ValueError(f"no role key for game {game!r} seat {seat!r}: games {GAME_ENVS}, "
                         f"roles 0..{MAX_ROLES - 1}")
    return GAME_ENVS.index(game) * MAX_ROLES + role


def game_trace(name: str, example: Mapping[str, Any], noise: float = 0.0,
               rng: np.random.Generator | None = None, **env_kwargs) -> list[Message]:
    """A whole game of environment ``name`` with the game's scripted player (``scripted``,
    "optimal" unless the game names another) in the model's seat, played on the real environment (so SFT rows are what a rollout shows):
    ``[user, assistant: move, user: state, ..., assistant: last move]``.

    ``noise`` in [0, 1]: each of the model seat's moves is, with this probability, a uniformly
    random legal move instead (drawn from ``rng``; 1.0: a warm-up on legal moves only). The
    Nash player's own chances (poker) also come from ``rng`` when given, else from the
    example's seed."""
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"game_trace: noise must be in [0, 1], got {noise}")
    if noise and rng is None:
        raise ValueError("game_trace: noise > 0 needs an rng (numpy Generator)")
    env = _factory(name)(example, **env_kwargs)
    game = env.game
    scripted = bg.make_player(game, getattr(game, "scripted", "optimal"),
                              **dict(env_kwargs.get("opponent_options") or {}))
    mine = random.Random(int(rng.integers(2 ** 62)) if rng is not None else env.seed + 1)
    messages = env.reset()
    while True:
        if noise and rng.random() < noise:
            move = bg.random_player(game, env.state, mine)
        else:
            move = scripted(game, env.state, mine)
        result = env.step(move)
        messages += [{"role": "assistant", "content": move}, *result.observation]
        if result.done:
            return messages


for _name in GAME_ENVS:
    register_env(_name, _factory(_name))
