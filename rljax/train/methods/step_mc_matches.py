"""Step-level DPO pairs over the learner seat's turns in self-play matches
(``data.pairs="step_mc"`` with ``env.selfplay``): ``step_mc_episodes``' pairs where an episode
is a match seen from the example's seat (``selfplay.seat_of``), the *learner seat*, and its
steps are the learner's model turns; the other seats' moves are part of the environment.

1. Level 0: K matches of each of B examples from the start (``vine_matches.play_forks`` with
   no fork turn: fresh matches of the example's game, its ``deal``), the policy in every seat
   (or the checkpoint opponent of ``env.selfplay.mode='checkpoint'`` in the others). A
   match's reward is the learner seat's (``agent.score`` of the learner's row); prompt
   selection and dynamic sampling act on these groups as in ``step_mc``.
2. The best match of each example is the trajectory: the learner's model turns, the match's
   turns (every seat's ids in ply order, ``match_turns``) and the ply of each learner turn
   in them (``turn_plies``), as ``mcts_matches``' nodes keep them.
3. Prefixes: every proper learner-turn prefix (d = 1 .. ``algo.step_mc.max_steps`` - 1) gets
   K continuations: match forks (``vine_matches.play_forks`` at the learner's turn d) that
   replay the trajectory's history up to the learner's turn d, every seat's plies, each
   through its seat's environment (the other seats' replies included), then play the match
   out as level 0 does.
4. Values: the learner seat's rewards. The candidates at prefix d are the continuations'
   learner turn d played from the trajectory's state, i.e. whose match up to it is the
   trajectory's (``same_state``): at a prefix every fork (it replays it); at the root, for a
   learner seat that does not move first, only the level-0 matches whose opening (the other
   seats' moves before the learner's first) is the trajectory's. The trajectory's own turn d
   also counts the next prefix's continuations (``step_mc.level_pairs``) only when the other
   seats' replies are the state's alone (a greedy checkpoint opponent,
   ``env.selfplay.temperature=0``): otherwise the next prefix replays the trajectory's
   sampled replies, and the trajectory was picked for its reward.
5. Pairs: as ``step_mc_episodes``': the DPO prompt is the learner's prompt ++ its trajectory
   before turn d (the other seats' moves are in the observations it saw; at the root of a
   seat that does not move first, its opening observation), the completions its two turns.

Randomness: as ``step_mc_episodes``: level 0's round r draws under ``step_mc.level0_key``,
the prefixes under ``fold_in(step key, step_mc.PREFIXES)``; ``play_forks`` keys each fork by
its place in its batch under the batch's key, so a resumed run samples the same matches.
``rollout/tokens`` counts every seat's sampled tokens (the replayed ones not),
``completion/length_mean`` the learner's at level 0.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from rljax.train.methods import agent, mcts_episodes, selfplay, vine_matches
from rljax.train.methods.mcts_matches import history_of, learner_prompt, played_plies
from rljax.train.methods.step_mc_episodes import EpisodeStepMCPairs


class MatchPlay(NamedTuple):
    """A match seen from its learner seat (a ``played`` record of ``EpisodeStepMCPairs``)."""
    turns: list       # the learner's model turns: (turn ids, trajectory after it) each
    history: tuple    # the match's turns, every seat's ids (tuples) in ply order
    plies: tuple      # the ply of each learner turn in ``history``
    lead: tuple       # the learner's trajectory before its turn 0 (observations)


def match_play(eps: dict, row: int) -> MatchPlay:
    """Learner row ``row`` of ``vine_matches.play_forks``' matches as a ``MatchPlay``."""
    turns = mcts_episodes.played_turns(eps, row)
    match_turns = eps["match_turns"][row]
    plies = tuple(int(p) for p in eps["turn_plies"][row][:len(turns)])
    first = np.flatnonzero(eps["turn_ids"][row] == 0)
    end = int(first[0]) if first.size else int(eps["mask"][row].sum())
    return MatchPlay(turns, history_of(match_turns, played_plies(match_turns)), plies,
                     tuple(int(x) for x in eps["tokens"][row][:end]))


def state_at(play: MatchPlay, d: int) -> tuple | None:
    """The match's history up to the learner's turn d (None: it has no turn d)."""
    return play.history[:play.plies[d]] if d < len(play.turns) else None


def same_state(play: MatchPlay, trajectory: MatchPlay, d: int) -> bool:
    """``play``'s learner turn d was played where the trajectory's was: the same match up
    to it."""
    at = state_at(play, d)
    return at is not None and at == state_at(trajectory, d)


def layout_histories(histories: list[tuple], max_plies: int) -> np.ndarray:
    """Histories (id tuples per ply) as ``match_turns`` int [R, max_plies, N], -1 after each
    ply's ids (what ``vine_matches.play_forks`` replays)."""
    width = max([len(ids) for h in histories for ids in h] + [1])
    out = np.full((len(histories), max_plies, width), -1, np.int32)
    for r, history in enumerate(histories):
        for ply, ids in enumerate(history):
            out[r, ply, :len(ids)] = ids
    return out


class MatchStepMCPairs(EpisodeStepMCPairs):
    """``EpisodeStepMCPairs`` over the learner seat's turns in self-play matches (module
    docstring)."""

    def __init__(self, ctx, iterator):
        super().__init__(ctx, iterator)
        sp = ctx.cfg.env.selfplay
        self.chain = sp.mode == "checkpoint" and float(sp.temperature) == 0.0
        self.max_plies = selfplay.num_seats(ctx.cfg) * agent.limits(ctx.cfg).max_turns
        self._players = None

    @property
    def players(self) -> tuple:
        """(data template, checkpoint opponent or None) as the rollout's episode rounds hold
        them, built again if the source moved to another context (asynchronous DPO samples
        on the sampler's)."""
        if self._players is None or self._players[0] is not self.ctx:
            rounds = agent.EpisodeRounds(self.ctx)
            self._players = (self.ctx, rounds.template, rounds.opponent)
        return self._players[1:]

    def _prompt_ids(self, example: dict) -> list[int]:
        return learner_prompt(self.cfg, self.renderer, self.ctx.tokenizer, self.players[0],
                              example)[0]

    def _play(self, params, examples: list[dict], prompt_ids: list, trajectories: list,
              depths: list[int], key):
        """K matches of each row r: a fresh match (``trajectories[r]`` None) or the
        trajectory's match replayed up to the learner's turn ``depths[r]``, played out.
        Returns as ``EpisodeStepMCPairs._play``, the records ``MatchPlay``s and the tokens
        sampled in all every seat's."""
        k, (template, opponent) = self.k, self.players
        histories = [() if t is None else state_at(t, d) for t, d in zip(trajectories, depths)]
        rnd = {"examples": examples,
               "match_turns": layout_histories(histories, self.max_plies),
               # a fork starts at turn d's first token: no lead-in to read from these
               "tokens": np.zeros((len(examples), 1), np.int32),
               "turn_ids": np.full((len(examples), 1), -1, np.int32)}
        points = [(r, 0, 0, None if t is None else d)
                  for r, (t, d) in enumerate(zip(trajectories, depths))]
        eps, _ = vine_matches.play_forks(self.ctx, params, rnd, points, k, key, template,
                                         opponent)
        owners = [ex for ex in examples for _ in range(k)]
        total, _, result = agent.score(self.reward_fn, eps, owners, 1)
        if result is not None:
            self.monitor.observe(result)
        learner = [0 if t is None else sum(len(turn) for turn, _ in t.turns[:d])
                   for t, d in zip(trajectories, depths)]
        sampled = eps["model_tokens"] - np.repeat(learner, k)
        spent = ((eps["match_turns"] >= 0).sum((1, 2))
                 - np.repeat([sum(map(len, h)) for h in histories], k))
        played = [match_play(eps, i) for i in range(len(points) * k)]
        return np.asarray(total, np.float32), played, sampled, spent

    @staticmethod
    def turns_of(played: MatchPlay) -> list[tuple]:
        return played.turns

    def candidates(self, d: int, played: list, rewards, trajectory) -> list[tuple]:
        """``(learner turn d ids, reward)`` of the matches that played turn d from the
        trajectory's state (``same_state``)."""
        return [(p.turns[d][0], x) for p, x in zip(played, rewards)
                if same_state(p, trajectory, d)]

    def context(self, prompt_ids: list[int], trajectory: MatchPlay, d: int) -> list[int]:
        """The learner's prompt ++ its trajectory before turn d (before turn 0: its
        opening observation, when it does not move first)."""
        return super().context(prompt_ids, trajectory, d) if d else (
            list(prompt_ids) + list(trajectory.lead))
