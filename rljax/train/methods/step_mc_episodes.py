"""Step-level DPO pairs over an environment's turns (``data.pairs="step_mc"`` with
``env.name``): ``step_mc``'s Monte-Carlo step values where a step is one model turn.

1. Level 0: K = ``algo.num_generations`` episodes of each of B prompts (fork episodes from
   the prompt, ``vine_episodes.play_forks`` at turn 0: nothing replayed), scored by
   ``agent.score`` (the environment's rewards plus ``reward.names`` on the final answer).
   Prompt selection and dynamic sampling act on these groups as in ``step_mc``.
2. The best-reward episode of each prompt is the trajectory; its steps are its model turns.
3. Prefixes: every proper turn-boundary prefix of the trajectory (its turns 0 .. d-1 and the
   observation after turn d-1, for d = 1 .. ``algo.step_mc.max_steps`` - 1) gets K
   continuations: fork episodes that replay the prefix's turns through a fresh environment
   (as ``mcts_episodes``'s leaves do: it needs environments that answer the same turns the
   same way) and play from turn d to the episode's end.
4. Values: a prefix's value is the mean episode reward of its K continuations; each distinct
   turn d among them is a candidate, valued by the mean reward of the continuations that
   play it; the trajectory's own turn d also counts the next prefix's K continuations
   (``step_mc.level_pairs``).
5. Pairs: at each prefix chosen = its best candidate turn, rejected = its worst, when their
   values differ by more than ``algo.step_mc.min_value_gap``, laid out as ``data.pairs=
   'mcts'`` lays out sibling turns (``StepMCPairs.encode_pairs``): the DPO prompt is the
   rendered prompt ++ the episode so far (observations included; context, not scored) and the
   completions are the two turns.

In self-play (``env.selfplay``) an episode is a match seen from the example's learner seat
and a prefix's continuations replay the match, every seat's moves: ``step_mc_matches``.

Randomness: level 0's round r draws under ``step_mc.level0_key``, the prefixes under
``fold_in(step key, step_mc.PREFIXES)``; fork q of row i is engine row ``i * K + q`` under
that key (``play_forks``), so a resumed run samples the same episodes.

Shapes stay static: B prompts a round, ``B * (max_steps - 1)`` prefix rows (rows of missing
prefixes repeat a real one and are not counted), ``B * max_steps`` pairs.
"""
from __future__ import annotations

import time

import jax
import numpy as np

from rljax.train.methods import agent, mcts_episodes, vine_episodes
from rljax.train.methods.step_mc import (PREFIXES, StepMCPairs, level0_key, level_pairs,
                                         pair_metrics)


class EpisodeStepMCPairs(StepMCPairs):
    """``StepMCPairs`` whose samples are episodes of ``env.name`` and whose steps are their
    model turns (module docstring). An episode is held as its ``played`` record
    (``mcts_episodes.played_turns``: ``(turn ids, trajectory after it)`` per model turn); the
    hooks ``_play``, ``turns_of``, ``candidates`` and ``context`` are what self-play matches
    (``step_mc_matches``) play and read differently."""

    # The trajectory's own turn d is valued with the next prefix's continuations too
    # (``level_pairs``): they replay turn d, and the environment answers it one way.
    chain = True

    def __init__(self, ctx, iterator):
        super().__init__(ctx, iterator)
        self.renderer = agent.make_renderer(ctx.cfg, ctx.tokenizer)
        self._spent = 0   # tokens the level-0 rounds of a step sampled (``first_level``)

    def _prompt_ids(self, example: dict) -> list[int]:
        """The example's episode prompt (``mcts_episodes.episode_prompt_ids``)."""
        return mcts_episodes.episode_prompt_ids(self.cfg, self.renderer, self.ctx.tokenizer,
                                                example)

    def _play(self, params, examples: list[dict], prompt_ids: list, trajectories: list,
              depths: list[int], key):
        """K episodes of each row r: the first ``depths[r]`` turns of ``trajectories[r]`` (a
        ``played`` record; None: nothing) replayed, then played from model turn ``depths[r]``
        to the end. Returns ``(rewards f32 [R * K], played records, sampled tokens int
        [R * K], tokens sampled in all int [R * K])``, row-major."""
        turns = [[] if t is None else [turn for turn, _ in t[:d]]
                 for t, d in zip(trajectories, depths)]
        rnd = {"examples": examples, "prompt_ids": prompt_ids,
               **mcts_episodes.turns_layout(turns, self.ctx.tokenizer.pad_id)}
        points = [(r, 0, 0, d) for r, d in enumerate(depths)]
        eps, _ = vine_episodes.play_forks(self.ctx, params, rnd, points, self.k, 1, key)
        owners = [ex for ex in examples for _ in range(self.k)]
        total, _, result = agent.score(self.reward_fn, eps, owners, 1)
        if result is not None:
            self.monitor.observe(result)
        replayed = [sum(len(t) for t in ts) for ts in turns]
        sampled = eps["model_tokens"] - np.repeat(replayed, self.k)
        played = [mcts_episodes.played_turns(eps, i) for i in range(len(points) * self.k)]
        return np.asarray(total, np.float32), played, sampled, sampled

    @staticmethod
    def turns_of(played) -> list[tuple]:
        """A played record's model turns, ``(turn ids, trajectory after it)`` each."""
        return played

    def candidates(self, d: int, played: list, rewards, trajectory) -> list[tuple]:
        """``(turn d ids, reward)`` of the continuations at prefix d that play turn d (each
        does: the replayed environment is the trajectory's, which went on past d)."""
        return [(self.turns_of(p)[d][0], x) for p, x in zip(played, rewards)
                if len(self.turns_of(p)) > d]

    def context(self, prompt_ids: list[int], trajectory, d: int) -> list[int]:
        """The DPO prompt of a pair at prefix d: the prompt ++ the trajectory before turn d
        (its turns 0 .. d-1 and the observations after them)."""
        return list(prompt_ids) + (list(self.turns_of(trajectory)[d - 1][1]) if d else [])

    def _level0_round(self, params, rng, r: int) -> tuple[list, np.ndarray]:
        """Round ``r`` of level 0: K episodes of each of the iterator's next prompts. Items as
        ``StepMCPairs``'s, the completions being the episodes' ``played`` records."""
        examples, k = next(self.iterator), self.k
        prompt_ids = [self._prompt_ids(ex) for ex in examples]
        rewards_, played, sampled, spent = self._play(
            params, examples, prompt_ids, [None] * len(examples), [0] * len(examples),
            level0_key(rng, r))
        self._spent += int(spent.sum())
        return [(examples[i], prompt_ids[i], rewards_[i * k:(i + 1) * k],
                 played[i * k:(i + 1) * k], sampled[i * k:(i + 1) * k])
                for i in range(len(examples))], rewards_

    def first_level(self, state, step: int):
        """``StepMCPairs.first_level``, its tokens every token its rounds sampled (in a match
        every seat's: ``_play``'s)."""
        self._spent = 0
        return super().first_level(state, step)._replace(tokens=self._spent)

    def __call__(self, state, step: int) -> tuple[dict, dict]:
        t0 = time.perf_counter()
        k = self.k
        first = self.first_level(state, step)
        r0, played0 = first.rewards, first.completions
        # Level 0's best episode per prompt is the trajectory.
        trajectories = [played0[i * k + int(np.argmax(r0[i]))] for i in range(len(r0))]
        depths = [range(1, min(len(self.turns_of(t)), self.max_steps)) for t in trajectories]
        levels = [(i, d) for i in np.flatnonzero(first.trains) for d in depths[i]]
        static_rows = self.num_prompts * (self.max_steps - 1)
        tokens, tokens_padding, row_of = first.tokens, 0, {lv: r for r, lv in enumerate(levels)}
        if levels and static_rows:
            rows = levels + [levels[-1]] * (static_rows - len(levels))   # static shapes
            r1, played1, _, spent = self._play(
                state.params, [first.examples[i] for i, _ in rows],
                [first.prompt_ids[i] for i, _ in rows], [trajectories[i] for i, _ in rows],
                [d for _, d in rows], jax.random.fold_in(first.rng, PREFIXES))
            real = len(levels) * k
            tokens += int(spent[:real].sum())
            tokens_padding = int(spent[real:].sum())

        pairs, prefix_values = [], []
        for i in np.flatnonzero(first.trains):
            traj, own = trajectories[i], self.turns_of(trajectories[i])
            # (continuations' episodes, their rewards) of the root, then of each prefix
            nodes = [(played0[i * k:(i + 1) * k], r0[i])]
            nodes += [(played1[r * k:(r + 1) * k], r1[r * k:(r + 1) * k])
                      for r in (row_of[(i, d)] for d in depths[i])]
            prefix_values += [float(np.mean(rs)) for _, rs in nodes]   # V = mean of K
            # Candidates at prefix d: the continuations' turn d, and the trajectory's own.
            level = []
            for d, (played, rs) in enumerate(nodes):
                cands = self.candidates(d, played, rs, traj)
                level.append(([turn for turn, _ in cands], [x for _, x in cands],
                              own[d][0] if d < len(own) else ()))
            for d, chosen, rejected, gap in level_pairs(
                    level, float(self.cfg.algo.step_mc.min_value_gap), chain=self.chain):
                pairs.append((self.context(first.prompt_ids[i], traj, d), chosen, rejected,
                              gap, d))
        metrics = pair_metrics(first, pairs, len(levels),
                               [len(self.turns_of(t)) for t in trajectories], prefix_values,
                               tokens, tokens_padding)
        metrics["time/sample_and_score"] = time.perf_counter() - t0
        return self.encode_pairs(pairs), metrics
