"""Self-play matches carried across iterations (``rollout.partial`` with ``env.selfplay``):
the playing side of ``episode_partial.EpisodePartialRounds``, which holds the places' recorded
turns and their order (its module docstring says how a place is rebuilt and continued).

    eps, groups, slot_steps, drawn, swaps = play_matches(pool, params, places, weights)
"""
from __future__ import annotations

import time

import numpy as np

from rljax.train.core.episodes import set_slot_temperatures
from rljax.train.core.sampler import rollout_temperatures
from rljax.train.methods import agent


def play_matches(pool, params, places, weights=None):
    """Self-play or against the checkpoint opponent: each place's G matches rebuilt (the
    recorded steps of every seat, the opponent's too, replayed in their order), then the
    seats' turns on the engines, one per model (``_SeatEngine``: a slot per row, as
    ``matches._engine_matches``), decoding a chunk each in turn, until enough places have
    every match over. Tree rollouts against the opponent: before the engines play, each
    place with no turn yet records its opening and tree as its first steps (``_grow_trees``).
    Returns as ``EpisodePartialRounds._play_episodes`` (the rows of every seat; the groups
    are the learner seats')."""
    from rljax.envs import step_all
    from rljax.sampling import episode_engine as ee
    from rljax.train.methods import matches, selfplay
    cfg, g, per = pool.ctx.cfg, pool.g, pool.rows
    metas = [pool.metas[j] for j in places]
    game, seat_rows, envs = selfplay.seat_envs(cfg, metas, pool.template,
                                               agent.env_kwargs(cfg), g)
    lim, ro = agent.limits(cfg), cfg.rollout
    max_plies = len(game.seats) * lim.max_turns
    policy = matches.Side(pool.ctx.model_cfg, params, envs, g, ro.temperature, ro.top_k,
                          ro.top_p, schedule=rollout_temperatures(cfg))
    run = matches._SideRun(policy, pool.ctx.tokenizer, pool._renderer, lim, max_plies,
                           pool.ctx.mesh)
    r = len(envs)
    decoding = np.zeros(r, bool)   # to move: observed, its turn not ended
    run.active[pool._unused(places)] = False   # matches past a group's size: never played
    time_env = [0.0]

    def top() -> list:
        """``_engine_matches``' loop head: settle, observe the seats to move; then a place
        whose matches cannot go on is over (its waiting seats truncated)."""
        new = run.seats_to_move(decoding, max_plies)
        run.settle()   # seats of a match a truncation just abandoned
        for n, j in enumerate(places):
            rows = np.arange(n * per, (n + 1) * per)
            if not decoding[rows].any():
                for i in rows[run.active[rows]]:
                    run._truncate(i)
                if pool.completed_at[j] < 0:
                    pool.completed_at[j] = pool.clock
        return new

    def step(rows, texts) -> None:
        t0 = time.perf_counter()
        results = step_all([run.envs[i] for i in rows], texts)
        time_env[0] += time.perf_counter() - t0
        for i, res in zip(rows, results):
            run.record(i, res)

    moves = sorted((m[0], n, k, m[1], m[2]) for n, j in enumerate(places)
                   for k, m in enumerate(pool.moves[j]))
    for chunk in sorted({m[0] for m in moves}):   # the recorded steps, chunk by chunk
        top()
        rows, texts = [], []
        for _, n, _, row, turn in (m for m in moves if m[0] == chunk):
            i, t = n * per + row, pool.turns[places[n]][row][turn]
            texts.append(run.turn_ended(i, list(t["ids"]), list(t["logps"]))[1])
            rows.append(i)
            decoding[i] = False
        step(rows, texts)
    new = top()
    grown = swapped = 0
    if pool.tree is not None and pool.opponent is not None:   # fresh places: their trees
        grown, swapped, new = _grow_trees(pool, params, places, run, decoding, top, step,
                                          new, weights)
    learners = [pool._learners(j) for j in places]
    groups = [[seats[k // g] for k in own[::g]] for own, seats in zip(learners, seat_rows)]
    done_places = lambda: sum(pool.completed_at[j] >= 0 for j in places)  # noqa: E731
    result = lambda: run.result(time_env[0])  # noqa: E731
    if done_places() >= pool.num_prompts or not decoding.any():
        return result(), groups, (0, 0), grown, swapped
    first = np.repeat(np.asarray(run.p_tok)[:, -1], g)
    draw = pool._draw_ids(places)
    mine = np.zeros(r, bool)   # the policy's rows (whole groups: an engine's page is a
    # group's prompt); the others the opponent's
    mine[np.concatenate([(n * per + own[::g] // g * g)[:, None] + np.arange(g)
                         for n, own in enumerate(learners)]).reshape(-1)] = True
    engines = [_SeatEngine(pool, run, lim, np.flatnonzero(mine), policy, frozen=False,
                           weights=weights)]
    if pool.opponent is not None:
        side = selfplay.opponent_side(pool.opponent, (), g, ro.top_k, ro.top_p)
        engines.append(_SeatEngine(pool, run, lim, np.flatnonzero(~mine), side, True))
    owner = [engines[0] if m else engines[-1] for m in mine]
    in_cache = np.zeros(r, bool)   # the slot's cache holds the row's trajectory
    on_slot = np.zeros(r, bool)
    busy = steps_run = drawn = 0

    def feed(new) -> None:
        """Puts each row now to move on its engine's slot: its new observation after the
        trajectory in the slot's cache, else the whole trajectory so far."""
        for i, before, obs in new + [(int(i), None, None) for i in
                                     np.flatnonzero(decoding & ~on_slot)]:
            if on_slot[i]:
                continue
            e = owner[i]
            opts = dict(row=e.slot[i], turn=run.envs[i].match.plies, draw=int(draw[i]),
                        budget=min(run.n, run.m_max - int(run.length[i])))
            if in_cache[i]:
                ee.resume(e.state, e.slot[i], lead=int(run.carry[i]), observation=obs,
                          cursor=before, **opts)
            else:
                ee.resume(e.state, e.slot[i], lead=int(first[i]), cursor=0,
                          observation=run.tokens[i, :run.length[i]], **opts)
            set_slot_temperatures(e.state, e.slot[i], run.turn_temperatures([i]))
            on_slot[i] = True

    while done_places() < pool.num_prompts:
        moved = False
        for e in engines:   # a decode chunk of each engine in turn
            feed(new)
            new = []
            if not e.state["live"].any():
                continue
            moved = True
            before_cursor = e.state["cursor"].copy()
            e.cache, e.state, ran = e.run_chunk(e.cache, e.state)
            pool.clock += 1
            busy += int((e.state["cursor"] - before_cursor).sum())
            steps_run += len(e.rows) * ran
            slots = np.flatnonzero(on_slot[e.rows] & ~e.state["live"])
            ended = e.rows[slots]
            on_slot[ended], decoding[ended], in_cache[ended] = False, False, True
            texts = []
            for k, i in zip(slots, ended):
                (n, row), t = divmod(int(i), per), int(e.state["t"][k])
                j = places[n]
                kept, text = run.turn_ended(i, e.state["tokens"][k, :t].tolist(),
                                            e.state["logps"][k])
                pool._record_turn(j, row, e.state["tokens"][k, :kept],
                                  e.state["logps"][k, :kept], frozen=e.frozen,
                                  versions=None if weights is None else e.chunks.drawn[k])
                pool.moves[j].append([pool.clock, row, len(pool.turns[j][row]) - 1])
                texts.append(text)
                drawn += t
            if len(ended):
                step(ended, texts)
            new = top()
            if done_places() >= pool.num_prompts:
                break
        if not moved:
            break
    live = sum(int(e.state["t"][on_slot[e.rows]].sum()) for e in engines)
    return (result(), groups, (busy, steps_run), drawn + live + grown,
            engines[0].chunks.swaps + swapped)


def _grow_trees(pool, params, places, run, decoding, top, step, new, weights=None):
    """Tree rollouts against the checkpoint opponent (``tree_matches``) in the pool: every
    place of ``places`` with no turn yet (admitted, or restarted as stale) plays its game's
    opening once (``_opening``), which each of its matches takes ply by ply as the opponent's
    recorded turns (frozen, log-prob 0), then grows the learner seat's first turns as trees
    of ``pool.unit`` leaves, one root per ``unit`` rows of its size, from the seat's prompt
    and first observation (``tree_episodes.FirstTurns``), recorded as its rows' first turns.
    Each ply and the tree's turns are steps of a clock tick of their own, the order a
    rebuild replays them in (``play_matches``), so a tree is carried whole and a carried
    place is rebuilt by replay. The noise is keyed by the place's admission:
    ``fold_in(pool._key, serial)``, the opening's folded with ``OPENING_STREAM``, the
    tree's with ``TREE_STREAM``. ``run``, ``decoding``, ``top``, ``step``, ``new``:
    ``play_matches``' rows, seats to move, loop head, step and the rows its last loop head
    set to move. Returns (tokens decoded, weight swaps, the rows the last loop head set to
    move: ``new`` unless a tree was grown; a row set to move before it is fed whole).
    ``weights``: in-flight updates (each tree token records its version)."""
    import jax
    from rljax import sampling
    from rljax.train.methods import tree_episodes, tree_matches
    cfg = pool.ctx.cfg
    per, lim, ro = pool.rows, agent.limits(cfg), cfg.rollout
    buckets = tuple(lim.prompt_buckets) + (max(lim.prompt_buckets) + lim.max_total_tokens,)
    decoded = swaps = 0
    for n, j in enumerate(places):
        if any(pool.turns[j]):
            continue
        key = jax.random.fold_in(pool._key, int(pool.serial[j]))
        rows, own = np.arange(n * per, (n + 1) * per), n * per + pool._learners(j)
        opening = _opening(pool, params, pool.metas[j],
                           jax.random.fold_in(key, tree_matches.OPENING_STREAM), lim)
        decoded += sum(map(len, opening))
        for ids in opening:   # the opponent's plies before the learner's first turn
            moving = rows[decoding[rows]]
            if not len(moving) or decoding[own].any():
                break
            new = _record_step(pool, j, n, run, decoding, top, step, moving, [ids] * len(
                moving), [np.zeros(len(ids), np.float32)] * len(moving), frozen=True)
        moving = own[decoding[own]]
        if not len(moving):   # the opening ended the matches (or left them no room)
            continue
        i = moving[0]   # (the group's rows share prompt and opening)
        context = run.prompt_ids[i] + run.tokens[i, :run.length[i]].tolist()
        p_tok, p_mask = sampling.pad_to_bucket([context], pad_id=pool.ctx.tokenizer.pad_id,
                                               buckets=buckets)
        first = tree_episodes.FirstTurns(
            pool.ctx, params, key, dict(pool.tree, roots=int(pool.sizes[j]) // pool.unit),
            lim.turn_tokens, weights=weights, temperature=ro.temperature, top_k=ro.top_k,
            top_p=ro.top_p, temperatures=rollout_temperatures(cfg))
        tokens, logps, lengths = (np.asarray(x) for x in first(p_tok, p_mask))
        drawn = first.out.get("versions")
        leaf = {int(i): k for k, i in enumerate(own)}   # leaf k: the group's k-th row
        cut = [min(int(lengths[leaf[i]]), run.m_max - int(run.length[i])) for i in moving]
        new = _record_step(pool, j, n, run, decoding, top, step, moving,
                           [tokens[leaf[i], :m] for i, m in zip(moving, cut)],
                           [logps[leaf[i], :m] for i, m in zip(moving, cut)],
                           versions=None if drawn is None else [
                               np.asarray(drawn)[leaf[i]] for i in moving])
        decoded += int(np.sum(first.out["decoded"]))
        swaps += int(first.out.get("swaps", 0))
    return decoded, swaps, new


def _record_step(pool, j, n, run, decoding, top, step, rows, ids, logps, frozen=False,
                 versions=None) -> list:
    """Rows ``rows`` (of place ``j``, the n-th of the call) end their turns with ``ids`` /
    ``logps`` (``versions``: each token's, in flight), recorded in the pool at a clock tick
    of their own, then step; returns ``top()``'s rows to move."""
    pool.clock += 1
    texts = []
    for k, i in enumerate(rows):
        kept, text = run.turn_ended(i, [int(x) for x in ids[k]], logps[k])
        row = int(i) - n * pool.rows
        pool._record_turn(j, row, ids[k][:kept], logps[k][:kept], frozen=frozen,
                          versions=None if versions is None else versions[k])
        pool.moves[j].append([pool.clock, row, len(pool.turns[j][row]) - 1])
        decoding[i] = False
        texts.append(text)
    step(rows, texts)
    return top()


def _opening(pool, params, example: dict, rng, lim) -> list[list[int]]:
    """``example``'s opening (``tree_matches.play_openings``): the ids of each ply before the
    learner seat's first turn, the opponent's seats played once on the static plies."""
    from rljax.train.methods import selfplay, tree_matches
    cfg, ro = pool.ctx.cfg, pool.ctx.cfg.rollout
    game, seat_rows, envs = selfplay.seat_envs(cfg, [example], pool.template,
                                               agent.env_kwargs(cfg), 1)
    sides, _ = selfplay.learner_sides(pool.ctx, params, game, [example], seat_rows, envs, 1,
                                      temperature=ro.temperature, top_k=ro.top_k,
                                      top_p=ro.top_p, opponent=pool.opponent, own_only=True)
    return tree_matches.play_openings(pool.ctx, sides, rng, renderer=pool._renderer,
                                      limits=lim, max_plies=len(game.seats) * lim.max_turns)[0]


class _SeatEngine:
    """One model's rows of the places' matches on an episode engine of its own (its pages,
    slot cache, parameters and sampling: ``side``): slot k holds row ``rows[k]`` for its whole
    match, its page its group's prompt. ``frozen``: a checkpoint opponent's engine, whose
    turns record no version (never stale, never trained)."""

    def __init__(self, pool, run, lim, rows: np.ndarray, side, frozen: bool, weights=None):
        groups = rows[::pool.g] // pool.g   # a group's G rows are all one model's
        self.rows, self.frozen = rows, bool(frozen)
        self.slot = {int(i): k for k, i in enumerate(rows)}
        self.cache, self.state, self.run_chunk, self.chunks = pool._engine_setup(
            lim, np.asarray(run.p_tok)[groups], np.asarray(run.p_mask)[groups], side.params,
            len(rows), side, weights)
        self.state["row"][:] = np.arange(len(rows))


