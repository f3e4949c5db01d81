"""VinePPO's forks of self-play rows (``env.selfplay``): a fork at a seat's turn replays its
match's history, every seat's moves so far, and plays the match on with the current policy
in every seat (or the checkpoint opponent in the others); the step's value is that seat's
mean reward over its forks.

A self-play row is one seat of one match (``selfplay.play``), and its round carries the
match's turns, every seat's ids in ply order (``match_turns``, recorded by ``matches``). The
fork of step t, which starts at trajectory token ``start`` inside the seat's model turn k
(``vine_episodes.step_layout``), is a match of its own:

1. a fresh match of the row's game (its ``deal``), a ``SeatEnv`` per seat, replays the turns
   played before the seat's turn k, each through its seat's environment, every seat's
   trajectory rebuilt as the rollout lays it out (``matches._SideRun``: observations
   rendered, a hinted row's hint after its first observation), so the forked seat's is its
   row's up to turn k;
2. on the episode engine (``matches._engine_matches``, a side per model: the learner seats,
   the other seats) each seat's trajectory so far is fed, the forked seat's with turn k's
   tokens before ``start``; the policy samples the rest of that turn and the match plays on
   to its end, the other seats by the policy (self-play) or the checkpoint opponent;
3. the fork's reward is the forked seat's, an episode's (``agent.score``), as the row's own
   reward R is.

The search over a match's turns (``mcts_matches``) plays its nodes' forks with ``play_forks``
too: a node's fork point starts at a turn's first token, and a fork with no turn (None) plays
a fresh match from its start.

Forks are played in batches of ``rollout.slots`` forks (else a quarter of them), the last
padded by repeating its last fork (played, then dropped): a slot per seat of each, one
program shape. A fork's noise is keyed by its place in its batch under the batch's key (the
stage's, folded with the batch's index): the forks depend on the valued rows only, so a
resumed run values as the straight one.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from rljax.train.core.episodes import EngineOptions
from rljax.train.core.sampler import engine_slots, sampling_params
from rljax.train.methods import agent, matches, selfplay


def players(rollout):
    """(data template, checkpoint opponent or None) of the rollout's episode round source
    (knapsack allocation holds it as its ``episodes``)."""
    source = getattr(rollout.rounds, "episodes", None) or rollout.rounds
    return source.template, source.opponent


def play_forks(ctx, params, rnd: dict, forks: list, k: int, rng, template, opponent):
    """The K forks of each fork point of ``forks`` ((row, step, start, turn) of ``rnd``, a
    round of self-play rows with ``match_turns``; turn None: a fresh match), fork-major:
    ``(the forked seats' rows, as ``run_episodes`` gives them, tokens sampled)``; in batches
    (module docstring). ``template``, ``opponent``: the rollout's (``players``)."""
    points = [f for f in forks for _ in range(k)]
    per = max(1, min(engine_slots(ctx.cfg, len(points)), len(points)))
    params = sampling_params(ctx, params)   # (LoRA merged once, where it is)
    parts, decoded = [], 0
    for b, at in enumerate(range(0, len(points), per)):
        batch = points[at:at + per]
        batch = batch + batch[-1:] * (per - len(batch))
        eps, spent = _play_batch(ctx, params, rnd, batch, jax.random.fold_in(rng, b),
                                 template, opponent)
        parts.append(_rows(eps, min(per, len(points) - at)))
        decoded += spent
    return _concat(parts), decoded


def _play_batch(ctx, params, rnd: dict, points: list, rng, template, opponent):
    """One batch of forks (``play_forks``): replayed, then played on the episode engine;
    ``(the forked seats' rows, tokens the batch sampled, every seat's)``."""
    from rljax.envs import step_all
    cfg = ctx.cfg
    lim = agent.limits(cfg)
    # (room for a hinted row's hint after its first observation, as ``selfplay.play`` has)
    lim = dataclasses.replace(lim, chunk_tokens=lim.chunk_tokens + lim.turn_tokens)
    r = cfg.rollout
    examples = [rnd["examples"][i] for i, *_ in points]
    game, seat_rows, envs = selfplay.seat_envs(cfg, examples, template, agent.env_kwargs(cfg), 1)
    hints = rnd.get("hint_prefixes", {})
    sides, _ = selfplay.learner_sides(
        ctx, params, game, examples, seat_rows, envs, 1,
        temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, opponent=opponent,
        prefixes=[hints.get(i, []) for i, *_ in points], own_only=True)
    max_plies = len(game.seats) * lim.max_turns
    renderer, log = agent.make_renderer(cfg, ctx.tokenizer), {}
    runs = [matches._SideRun(s, ctx.tokenizer, renderer, lim, max_plies, ctx.mesh, log)
            for s in sides]
    where = {(id(env.match), env.seat): (side, i) for side, run in enumerate(runs)
             for i, env in enumerate(run.envs)}
    tokens, turn_ids = rnd["tokens"], rnd["turn_ids"]
    for n, (i, _, start, turn) in enumerate(points):
        if turn is None:   # a fresh match
            continue
        matches.replay_match(runs, where, n, rnd["match_turns"][i], turn)
        first = int(np.argmax(turn_ids[i] == turn))   # turn k's tokens before the fork
        runs[0].lead_in[n] = tokens[i, first:start].tolist()
    before = sum(int(run.model_mask.sum()) for run in runs) + sum(map(len, runs[0].lead_in))
    out = matches._engine_matches(runs, rng, max_plies, step_all,
                                  EngineOptions(slots=len(envs),
                                                chunk_steps=int(r.chunk_steps)),
                                  None, width=max(lim.chunk_tokens, lim.max_total_tokens))
    return out[0], sum(int(o["model_tokens"].sum()) for o in out) - before


def _rows(eps: dict, n: int) -> dict:
    """The first ``n`` rows of ``eps`` (a batch's real forks; its padding dropped)."""
    rows = len(eps["prompts"])
    return {key: (v[:n] if isinstance(v, (np.ndarray, list)) and len(v) == rows else v)
            for key, v in eps.items()}


def _concat(parts: list[dict]) -> dict:
    """The batches' rows as one ``run_episodes``-style dict (per-row fields joined)."""
    rows = len(parts[0]["prompts"])
    out = dict(parts[0])
    for key, v in parts[0].items():
        if isinstance(v, np.ndarray) and v.ndim and len(v) == rows:
            out[key] = np.concatenate([p[key] for p in parts])
        elif isinstance(v, list) and len(v) == rows:
            out[key] = [x for p in parts for x in p[key]]
    out["time_env"] = sum(p["time_env"] for p in parts)
    return out
