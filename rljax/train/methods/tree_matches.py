"""Tree rollouts of self-play matches against the checkpoint opponent (``rollout.tree`` with
``env.selfplay.mode='checkpoint'``): a learner group's G matches fork within the learner
seat's first model turn, every ``rollout.tree.segment_tokens`` tokens, and each leaf's match
is played on to its end, so the tree estimators (``treepo`` ...) read the leaves' seat rewards.

A group's G leaves share everything before the fork, so its matches share the plies before
the learner's first turn (the opening: the other seats' moves when the learner does not move
first; none when it does):

1. the opening is played once per example, in a match of its own (``play_openings``: the
   opponent's seats on the static plies, the learner seat waiting for its turn), and
   replayed into each of the group's G matches (``matches.replay_match``);
2. the learner seat's first turn of its G matches is the G leaves of one tree
   (``tree_episodes.FirstTurns``: the static tree sampler or the slot engine), grown from
   its prompt and its first observation (with hints, the hint after it);
3. each match is played on on the episode engine (``matches._engine_matches``, the learner's
   and the opponent's seats each on an engine of their own), every trajectory so far fed.

An opening that ends its match (the opponent forfeits) leaves its group no first turn: its
tree is grown and dropped, the learner's rows have no tokens, as the matches' rows have.

With partial rollouts (``rollout.partial``) a fresh place of the pool does steps 1 and 2 for
its example, its noise keyed by its admission, and records the opening's plies and the tree's
leaves as its matches' first steps (``partial_matches._grow_trees``): the tree is carried
whole, and a carried place is rebuilt by replaying them with the engine's later steps.

Self-play (``mode='self'``) has no such tree: row j of every seat's group plays match j, so
a later seat's first turn follows an earlier seat's leaves, which differ by match.
"""
from __future__ import annotations

import jax
import numpy as np

from rljax import sampling
from rljax.train.core import sampler
from rljax.train.core.episodes import EngineOptions
from rljax.train.methods import matches, tree_episodes

# The openings' noise is the round key's folded with this (the tree's: ``TREE_STREAM``;
# the matches' after the first turn: the key itself), so the three draw apart.
OPENING_STREAM = 0x0BE


def play_tree(ctx, params, rng, *, max_plies: int, sides: list, opening: list, g: int,
              tree: dict, renderer, limits, options: dict, weights=None):
    """``selfplay.play``'s matches with a tree of the learner seat's first turns per group
    (module docstring): the learner side's dict (``run_episodes``' fields, ``roles``,
    ``match_turns``). ``sides``: ``selfplay.learner_sides``' (own seat only: side 0 the
    learner's G rows per example, side 1 the opponent's, G matches per example);
    ``opening``: the same sides over one match per example (``play_openings``);
    ``options``: temperature, top_k, top_p, ``temperatures`` (the rollout's schedule or
    None) for the tree; ``weights``: in-flight weight updates (the tree's versions and
    swaps join the engine's)."""
    from rljax.envs import step_all
    log: dict = {}
    runs = [matches._SideRun(s, ctx.tokenizer, renderer, limits, max_plies, ctx.mesh, log)
            for s in sides]
    where = {(id(env.match), env.seat): (side, i) for side, run in enumerate(runs)
             for i, env in enumerate(run.envs)}
    openings = play_openings(ctx, opening, jax.random.fold_in(rng, OPENING_STREAM),
                             renderer=renderer, limits=limits, max_plies=max_plies)
    learner = runs[0]
    for i in range(len(learner.envs)):
        matches.replay_match(runs, where, i, openings[i // g], 0, until_over=True)
    for run in runs:
        run.settle()
    moving = [i for i in range(len(learner.envs)) if learner.active[i]
              and learner.next_observation(i) is not None]
    # Each group's tree grows from its first row's prompt and trajectory so far (the group's
    # rows share them: the same opening); a group whose matches are over grows one unused.
    contexts = [learner.prompt_ids[i] + learner.tokens[i, :learner.length[i]].tolist()
                for i in range(0, len(learner.envs), g)]
    buckets = tuple(limits.prompt_buckets) + (max(limits.prompt_buckets)
                                              + limits.max_total_tokens,)
    p_tok, p_mask = sampling.pad_to_bucket(contexts, pad_id=ctx.tokenizer.pad_id,
                                           buckets=buckets)
    first = tree_episodes.FirstTurns(ctx, params, rng, tree, limits.turn_tokens,
                                     weights=weights, **options)
    tokens, logps, lengths = (np.asarray(x) for x in first(p_tok, p_mask))
    drawn, spans = first.out.get("versions"), {}
    for i in moving:   # (a turn's budget: at most the trajectory's room)
        n = min(int(lengths[i]), limits.max_total_tokens - int(learner.length[i]))
        spans[i] = (len(learner.prompt_ids[i]), int(learner.length[i]), n)
        text = learner.turn_ended(i, tokens[i, :n].tolist(), logps[i, :n],
                                  None if drawn is None else np.asarray(drawn)[i, :n])[1]
        learner.record(i, learner.envs[i].step(text))
    engine = EngineOptions(slots=sum(len(run.envs) for run in runs),
                           chunk_steps=int(ctx.cfg.rollout.chunk_steps))
    out = matches._engine_matches(runs, rng, max_plies, step_all, engine, weights,
                                  width=max(limits.chunk_tokens, limits.max_total_tokens))[0]
    # Sampled per group: the tree's first turns (shared segments once), then the matches'.
    out["decoded"] = tree_episodes.group_decoded(first.out["decoded"][:len(contexts)],
                                                 out["model_mask"], out["turn_ids"])
    if "swaps" in out:
        out["swaps"] += first.out["swaps"]
    if "routes" in out:
        out["routes"] = with_tree_routes(out["routes"], np.asarray(first.out["routes"]),
                                         learner.p_tok.shape[1], p_tok.shape[1], spans)
    return out


def with_tree_routes(routes: np.ndarray, tree_routes: np.ndarray, p: int, p_tree: int,
                     spans: dict) -> np.ndarray:
    """Routing replay: the learner rows' routes int32 [R, p+M, L, k] (the engine's, every
    token it fed, laid out as the training rows: prompt bucket p, then the trajectory) with
    each tree row's prompt, opening and first turn, but the turn's last token, taken from
    the tree's ``tree_routes`` [R, p_tree+N, L, k] (its own prompt bucket p_tree holding
    prompt ++ opening, then the turn), the routes that drew the first turn's tokens.
    ``spans``: row -> (its prompt's tokens a, trajectory tokens before the turn t, the
    turn's tokens n). A row whose match ended on its first turn never reached the engine:
    the tree's are its only routes after the prompt."""
    out = np.array(routes, copy=True)
    for i, (a, t, n) in spans.items():
        out[i, p - a:p + t + n - 1] = tree_routes[i, p_tree - a - t:p_tree + n - 1]
    return out


def play_openings(ctx, sides: list, rng, *, renderer, limits,
                  max_plies: int) -> list[list[list[int]]]:
    """Each example's opening: the plies of its match before the learner seat's first turn
    (or to its end), played once on the static plies by the other seats' ``sides`` (1 ...;
    side 0, the learner's seats, waits), one match per example. Returns per example the ids
    of each opening ply in order (empty when the learner moves first)."""
    from rljax.envs import step_all
    log: dict = {}
    runs = [matches._SideRun(s, ctx.tokenizer, renderer, limits, max_plies, ctx.mesh, log)
            for s in sides]
    learner = runs[0]
    for ply in range(max_plies):
        for run in runs:
            run.settle()
        if all(env.match.over() or env.to_move() for env in learner.envs):
            break
        moved = [(run, *run.decode(ply, jax.random.fold_in(jax.random.fold_in(rng, k), ply)))
                 for k, run in enumerate(runs) if k]
        results = iter(step_all([run.envs[i] for run, rows, _ in moved for i in rows],
                                [t for _, _, texts in moved for t in texts]))
        for run, rows, _ in moved:
            for i in rows:
                run.record(i, next(results))
    return [list(log.get(id(env.match), [])) for env in learner.envs]
