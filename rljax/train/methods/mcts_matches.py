"""MCTS over the learner seat's turns in self-play matches (``env.selfplay`` with
``sft.traces='mcts'`` or ``data.pairs='mcts'``): ``mcts_episodes``' search where the
environment is a match and the other seats' moves are part of it.

Each example's tree is one match of its game (its ``deal``) seen from the example's seat
(``selfplay.seat_of``), the *learner seat*; its prompt is that seat's, as the rollout renders
it (a seat that does not move first opens on its first observation). A node is a turn
boundary of the learner seat: its ``steps`` are the learner's model turns so far, and
``info[steps]["history"]`` the match's turns, every seat's ids in ply order, up to the
learner's next turn. Its children are the learner's next model turns.

A wave's forks are VinePPO's forks of self-play rows (``vine_matches.play_forks``): a fresh
match replays the leaf's history, each ply through its seat's environment, so the learner's
trajectory is the node's, then plays the match out on the episode engine with the policy in
every seat (or the checkpoint opponent of ``env.selfplay.mode='checkpoint'`` in the others).
A fork's reward is the learner seat's (``agent.score`` of the learner's row); the first turn
a fork plays is a child whose history is the fork's match up to the learner's turn after it
(``turn_plies``): the other seats' replies that fork sampled are the child's state.

A root whose learner seat does not move first has no history yet: in its first wave one
match is played from the start (the other seats' opening sampled as every fork samples them)
and its turns before the learner's first are the root's history, its learner trajectory up
to there (the first observation) the root's. A match that ends before the learner moves (a
forfeit) makes the root a terminal dead end with the learner's reward.

Randomness: as ``mcts_episodes`` (an opening is a wave of its own, keyed as one).
"""
from __future__ import annotations

import numpy as np

from rljax.train.methods import agent, mcts_episodes, selfplay, vine_matches
from rljax.train.methods.mcts_episodes import EpisodeSearch, EpisodeTree


def history_of(match_turns, plies: int) -> tuple:
    """The first ``plies`` plies of a match's turns int [max_plies, N] (-1 after each
    turn's ids) as a tuple of id tuples."""
    return tuple(tuple(int(x) for x in ply if x >= 0) for ply in np.asarray(match_turns)[:plies])


def played_plies(match_turns) -> int:
    """How many plies a match's turns int [max_plies, N] recorded."""
    return int((np.asarray(match_turns) >= 0).any(-1).sum())


def learner_prompt(cfg, renderer, tokenizer, template, example: dict) -> tuple[list, bool]:
    """``(prompt ids, moves first)`` of the example's learner seat (``selfplay.seat_of``) in
    a match of its game, as the rollout renders it (``template``: the rollout's): a seat that
    does not move first opens on its first observation."""
    game, _, envs = selfplay.seat_envs(cfg, [example], template, agent.env_kwargs(cfg), 1)
    env = envs[selfplay.seat_of(game, example)]
    first = env.reset()
    moves = bool(env.to_move())
    return tokenizer.encode(renderer.prompt(first, model_turn=moves)), moves


class MatchSearch(EpisodeSearch):
    """``EpisodeSearch`` over the learner seat's turns in self-play matches (module
    docstring)."""

    def __init__(self, ctx, rows: int, prm_scorer=None):
        super().__init__(ctx, rows, prm_scorer)
        # The rollout's seat prompts and opponent (the episode round source holds them).
        rounds = agent.EpisodeRounds(ctx)
        self.template, self.opponent = rounds.template, rounds.opponent
        lim = agent.limits(ctx.cfg)
        self.max_plies = selfplay.num_seats(ctx.cfg) * lim.max_turns
        self.turn_tokens = lim.turn_tokens

    def new_tree(self, example: dict) -> EpisodeTree:
        prompt_ids, moves = learner_prompt(self.cfg, self.renderer, self.ctx.tokenizer,
                                           self.template, example)
        tree = EpisodeTree(example, prompt_ids)   # moves first: nothing to replay
        tree.info[()].update(trajectory=(), model=(), turn_ids=(),
                             history=() if moves else None)
        return tree

    def _wave(self, params, leaves: list, round_key) -> None:
        """Opens the roots without a history (``_open``), then expands as ``EpisodeSearch``;
        a root whose opening ended the match is backed up as terminal instead."""
        closed = [t for t, path in leaves if t.info[path[-1].steps]["history"] is None]
        if closed:
            self._open(params, closed, round_key)
        for t, path in leaves:
            if path[-1].terminal:
                t.backup_terminal(path)
                t.simulations += 1
        live = [(t, path) for t, path in leaves if not path[-1].terminal]
        if live:
            super()._wave(params, live, round_key)

    def _open(self, params, trees: list, round_key) -> None:
        """One match per tree from its start (a wave of its own): the turns before the
        learner's first are the root's history, the learner's trajectory before it the
        root's; a match over before then makes the root terminal with its reward."""
        rnd = {"examples": [t.example for t in trees],
               "tokens": np.zeros((len(trees), 1), np.int32),
               "turn_ids": np.full((len(trees), 1), -1, np.int32)}
        points = [(i, 0, 0, None) for i in range(len(trees))]   # fresh matches
        eps = self._play_matches(params, rnd, points, 1, self.next_wave_key(round_key))
        total, _, result = agent.score(self.reward_fn, eps, [t.example for t in trees], 1)
        if result is not None:
            self.monitor.observe(result)
        for j, t in enumerate(trees):
            info, ply = t.info[()], int(eps["turn_plies"][j, 0])
            if ply < 0:   # the match ended before the learner's first turn
                t.root.expanded = t.root.terminal = True
                info.update(history=history_of(eps["match_turns"][j], played_plies(
                    eps["match_turns"][j])), reward=float(total[j]))
                t.root_rewards = np.full(self.forks, total[j], np.float32)
                continue
            end = int(np.argmax(eps["turn_ids"][j] == 0))   # the learner's first turn
            info.update(history=history_of(eps["match_turns"][j], ply),
                        trajectory=tuple(int(x) for x in eps["tokens"][j][:end]),
                        model=(False,) * end, turn_ids=(-1,) * end)

    def _play_forks(self, params, nodes: list, rnd: dict, points: list, key) -> dict:
        """Each leaf's match replayed from its history and played out (``forks`` times)."""
        turns = np.full((len(nodes), self.max_plies, self.turn_tokens), -1, np.int32)
        for i, (t, node) in enumerate(nodes):
            for ply, ids in enumerate(t.info[node.steps]["history"]):
                turns[i, ply, :len(ids)] = ids
        return self._play_matches(params, dict(rnd, match_turns=turns), points, self.forks,
                                  key)

    def _play_matches(self, params, rnd: dict, points: list, k: int, key) -> dict:
        eps, decoded = vine_matches.play_forks(self.ctx, params, rnd, points, k, key,
                                               self.template, self.opponent)
        self.sampler_calls += 1
        self.tokens += int(decoded)
        return eps

    def _child(self, eps: dict, row: int, depth: int):
        """``EpisodeSearch._child`` plus the child's ``history``: the fork's match up to
        the learner's turn after turn ``depth`` (all of it when the learner has none)."""
        child = super()._child(eps, row, depth)
        if child is None:
            return None
        step, prior, last, info = child
        plies = eps["turn_plies"][row]
        nxt = int(plies[depth + 1]) if depth + 1 < len(plies) else -1
        turns = eps["match_turns"][row]
        info["history"] = history_of(turns, nxt if nxt >= 0 else played_plies(turns))
        return step, prior, last, info


def turn_searcher(ctx, prompts: int, prm_scorer=None) -> EpisodeSearch:
    """The run's search over an environment's turns (``mcts_episodes.searcher``): with
    ``env.selfplay`` over the learner seat's turns in matches (``MatchSearch``)."""
    selfplay_on = ctx.cfg.env.selfplay.mode != "off"
    return mcts_episodes.searcher(ctx, prompts, prm_scorer,
                                  search=MatchSearch if selfplay_on else None)
