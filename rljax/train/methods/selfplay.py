"""Training rollouts of board games whose other seats are language models
(``env.selfplay.mode``): ``"self"``, one policy in every seat, or ``"checkpoint"``, the policy in
the example's seat against a frozen earlier checkpoint of a run in the others.

Self-play: each example (a game: deal, seed) gives one group of G rows per seat, all from
``seat_example``s of it, and G matches: row j of every seat's group plays match j. Every row
trains; its tokens are only its seat's and its reward is only its seat's return, so with
``algo.adv_estimator=rae`` each row is judged against its (game, seat) baseline, and with GRPO
against the G games of its own seat. An iteration therefore draws ``rollout.batch_size /
(G * seats)`` examples.

Checkpoint opponent: the example's seat is the policy's (G rows, the batch), the other seats
are the frozen model's (``env.selfplay.workdir``, checkpoint ``env.selfplay.step``, sampled
at ``env.selfplay.temperature``, 0 = greedy), which is loaded once, keeps its own cache (on
the slot engine: its own slots), and never trains.

Held-out evaluation is unchanged: the environment's scripted opponent (``env.kwargs``), an
opponent the policy never trained against.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from rljax.errors import UserError
from rljax.train.core import sampler
from rljax.train.core.episodes import EpisodeLimits
from rljax.train.core.render import Renderer
from rljax.train.methods.matches import Side, run_matches

# SeatEnv options that may come from env.kwargs (the scripted env's opponent options do not).
SEAT_OPTIONS = ("illegal_penalty", "reward_scale", "system_prompt", "state_format")


def mode(cfg) -> str:
    """``env.selfplay.mode``: "off" (the environment's scripted opponent), "self" or
    "checkpoint"."""
    return str(cfg.env.selfplay.mode)


def num_seats(cfg) -> int:
    from rljax.envs import board_games
    return len(board_games.get_game(cfg.env.name).seats)


def examples_per_round(cfg, groups: int) -> int:
    """Examples one rollout round draws for ``groups`` groups of G rows: self-play turns each
    example into one group per seat."""
    return groups // num_seats(cfg) if mode(cfg) == "self" else groups


@dataclasses.dataclass
class Opponent:
    """A frozen model in the other seats."""
    model_cfg: Any
    params: Any
    temperature: float


def load_opponent(ctx) -> Opponent | None:
    """The checkpoint opponent of ``env.selfplay`` (None unless mode is "checkpoint")."""
    sp = ctx.cfg.env.selfplay
    if mode(ctx.cfg) != "checkpoint":
        return None
    return opponent_from_workdir(ctx, sp.workdir, int(sp.step), float(sp.temperature))


def opponent_from_workdir(ctx, workdir: str, step: int = 0, temperature: float = 0.0,
                          key: str = "env.selfplay") -> Opponent:
    """The run in ``workdir`` at checkpoint ``step`` (0 = its latest) as a frozen opponent:
    verified against its manifest, sharing the policy's tokenizer (one UserError line
    otherwise; ``key`` names the config section in it)."""
    from rljax.train.core import teacher
    model_cfg, params = teacher.load(_source(ctx, workdir, step, key), ctx.mesh)
    return Opponent(model_cfg, params, float(temperature))


def _source(ctx, workdir: str, step: int, key: str):
    """The opponent's ``teacher.Source``, checked to share the policy's tokenizer."""
    from rljax.train.core import teacher
    source = teacher.workdir_source(workdir, int(step), f"{key}.workdir={workdir!r}",
                                    f"{key}.step", what="the opponent")
    problem = teacher.tokenizer_mismatch(ctx.tokenizer, source.tokenizer)
    if problem:
        raise UserError(f"{key}.workdir={workdir!r} does not share the policy's tokenizer: "
                        f"{problem}")
    return source


def abstract_opponent(ctx) -> Opponent | None:
    """``load_opponent`` as ``rljax plan`` sees it: the architecture from the workdir's
    config, the parameters ``ShapeDtypeStruct``s with their shardings (no weight is read)."""
    from rljax.train.core import teacher
    sp = ctx.cfg.env.selfplay
    if mode(ctx.cfg) != "checkpoint":
        return None
    source = _source(ctx, sp.workdir, int(sp.step), "env.selfplay")
    model_cfg = teacher.model_config(source)
    return Opponent(model_cfg, teacher.abstract_params(model_cfg, ctx.mesh, source),
                    float(sp.temperature))


def opponent_programs(ctx, *, renderer: Renderer, limits: EpisodeLimits) -> list:
    """The checkpoint opponent's sampler programs (``rljax.train.core.programs.Program``;
    [] without one) over the other seats of one sampler call's examples ((seats - 1) x
    ``programs.sample_prompts`` prompts, G rows each): on the slot engine its own
    episode engine's ``sample/opponent_prefill`` and ``sample/opponent_decode`` (a slot per
    row, ``matches._EngineSide``), else the turn batches' ``sample/opponent_start`` and
    ``sample/opponent_turn`` (``matches._SideRun``). With partial rollouts its engine holds
    the pool's places (2 x a call's examples, a slot per row; its feed a carried row's whole
    trajectory). With a tree of the learner seat's first
    turns (``rollout.tree``, ``tree_matches``) the matches after the tree are on the episode
    engine whatever the sampler (its feed a whole trajectory), and the openings are played
    first on the static plies, one match per example (partial rollouts: one example a call):
    ``sample/opening_start`` and ``sample/opening_turn``. ``renderer``, ``limits``: the
    run's (``agent.make_renderer``, ``agent.limits``). Its parameters are held resident
    (``Program.held``, ``opponent``): loaded with the phase, kept to its end."""
    import jax
    from rljax import sampling
    from rljax.sampling import episode_engine, multiturn
    from rljax.train.core import programs as programs_lib
    opponent = abstract_opponent(ctx)
    if opponent is None:
        return []
    cfg, tok, g, lim = ctx.cfg, ctx.tokenizer, int(ctx.cfg.algo.num_generations), limits
    p, b = max(lim.prompt_buckets), (num_seats(cfg) - 1) * programs_lib.sample_prompts(cfg)
    p_tok = programs_lib.batch_struct(ctx.mesh, (b, p), "int32")
    p_mask = programs_lib.batch_struct(ctx.mesh, (b, p), bool)
    rng = jax.ShapeDtypeStruct((2,), "uint32", sharding=ctx.replicated)
    t, end = opponent.temperature, renderer.call_end
    kw = dict(num_samples=g, temperature=t, top_k=int(cfg.rollout.top_k) if t else 0,
              top_p=float(cfg.rollout.top_p) if t else 1.0,
              stop_sequences=multiturn.stop_sequences_of(tok, [end] if end else []))
    tree, partial = bool(cfg.rollout.tree.enabled), bool(cfg.rollout.partial)
    if partial:   # the pool's places: 2 x a call's examples, each matches' rows on an engine
        b *= 2    # (``partial_matches._SeatEngine``)
        p_tok = programs_lib.batch_struct(ctx.mesh, (b, p), "int32")
        p_mask = programs_lib.batch_struct(ctx.mesh, (b, p), bool)
    layout = multiturn.SlotLayout(prompt_len=p, turn_len=lim.turn_tokens,
                                  chunk_len=lim.chunk_tokens,
                                  max_turns=num_seats(cfg) * lim.max_turns)

    def plies(rows: int, samples: int) -> list:   # the static plies over ``rows`` prompts
        return multiturn.programs(
            opponent.model_cfg, opponent.params, programs_lib.batch_struct(
                ctx.mesh, (rows, p), "int32"), programs_lib.batch_struct(
                ctx.mesh, (rows, p), bool), rng, layout=layout, eos_id=tok.eos_id,
            pad_id=tok.pad_id, mesh=ctx.mesh, **dict(kw, num_samples=samples))
    if sampler.sampler_kind(cfg) == "slots" or tree or partial:
        made = episode_engine.programs(
            opponent.model_cfg, opponent.params, p_tok, p_mask, rng, slots=b * g,
            chunk_len=max(lim.chunk_tokens, lim.max_total_tokens) if tree or partial
            else lim.chunk_tokens, turn_len=lim.turn_tokens,
            length=lim.max_total_tokens + 1, chunk_steps=int(cfg.rollout.chunk_steps),
            stop_ids=sampling.merge_stop_ids(tok.eos_id, ()), **kw)
    else:
        made = plies(b, g)
    size = programs_lib.shard_bytes(opponent.params)
    out = [programs_lib.Program(f"sample/opponent_{name}", fn, args, size,
                                held=(("opponent", size),)) for name, fn, args in made]
    if cfg.rollout.tree.enabled:   # the openings: one match per example
        examples = 1 if cfg.rollout.partial else programs_lib.sample_prompts(cfg)
        out += [programs_lib.Program(f"sample/opening_{name}", fn, args, size,
                                     held=(("opponent", size),))
                for name, fn, args in plies((num_seats(cfg) - 1) * examples, 1)]
    return out


def opponent_side(opponent: Opponent, envs, g: int, top_k: int, top_p: float) -> Side:
    """The frozen opponent's rows ``envs`` (groups of ``g``): at its temperature, with the
    rollout's ``top_k`` / ``top_p`` when it samples (greedy: neither)."""
    t = opponent.temperature
    return Side(opponent.model_cfg, opponent.params, envs, g, t, top_k if t else 0,
                top_p if t else 1.0)


def seat_examples(cfg, examples, template):
    """(game, seat examples by (example, seat)) with prompts rendered for their seat."""
    from rljax.envs import board_games
    from rljax.envs.selfplay import seat_example
    game = board_games.get_game(cfg.env.name)
    rows = []
    for ex in examples:
        per_seat = []
        for s in range(len(game.seats)):
            sx = seat_example(ex, s, game)
            if template is not None:
                sx["prompt"] = template(sx)
            per_seat.append(sx)
        rows.append(per_seat)
    return game, rows


def seat_envs(cfg, examples, template, env_kwargs: dict, g: int):
    """``(game, seat examples by (example, seat), seat environments)``: each example's G
    matches, a ``SeatEnv`` per seat of each, ordered (example, seat, match); they take the
    ``SEAT_OPTIONS`` of ``env_kwargs`` and ``env.selfplay.forfeit_reward``."""
    from rljax.envs.selfplay import Match, SeatEnv
    game, seat_rows = seat_examples(cfg, examples, template)
    kw = {k: v for k, v in env_kwargs.items() if k in SEAT_OPTIONS}
    kw["forfeit_reward"] = float(cfg.env.selfplay.forfeit_reward)
    envs = []
    for ex, per_seat in zip(examples, seat_rows):
        matches = [Match(game, ex.get("deal")) for _ in range(g)]
        envs += [SeatEnv(m, sx, s, **kw) for s, sx in enumerate(per_seat) for m in matches]
    return game, seat_rows, envs


def seat_of(game, example) -> int:
    """The seat index of ``example["seat"]`` (a name or an index; default 0)."""
    seat = example.get("seat", 0)
    return game.seats.index(seat) if seat in game.seats else int(seat)


def play(ctx, params, examples: list[dict], rng, *, renderer: Renderer,
         limits: EpisodeLimits, env_kwargs: dict, num_samples: int, temperature: float,
         top_k: int = 0, top_p: float = 1.0, template=None, opponent: Opponent | None = None,
         weights=None, prefixes=None, tree: dict | None = None) -> tuple[dict, list[dict]]:
    """The policy's episodes of this round's matches and the example of each of its groups:
    ``(eps, group examples)``; ``eps`` has ``run_episodes``' fields and ``roles``.

    Self-play: groups ordered (example, seat); with ``opponent``: one group per example (its
    seat), the opponent's rows played and dropped. ``template``: the data template, to render
    each seat's prompt (None: the examples' ``question``). ``renderer``, ``limits``,
    ``env_kwargs``: the run's (``agent.make_renderer``, ``agent.limits``, ``agent.env_kwargs``;
    the seat environments take ``SEAT_OPTIONS`` of the last). ``weights``: the policy's
    in-flight weight updates on the slot engine (``matches.run_matches``; the opponent's
    weights stay frozen).

    ``prefixes`` (hints, ``guidance``: one id list per example, each a failed group's seat
    example): one group per example, its seat's, in fresh matches, the hint after the
    seat's first observation (``matches.Side.prefixes``); the other seats are the
    opponent's, or in self-play the policy's on a side of their own (the round's parameters,
    no hint), played and dropped. The chunk of a first turn widens by a turn's tokens
    (``limits.turn_tokens``), the room a hint has (``guidance.Guide``).

    ``tree`` (``sampling.tree.options_from_config``; with ``opponent``): each group's first
    turns of its seat are one tree's leaves, its matches sharing their opening
    (``tree_matches``)."""
    cfg, g = ctx.cfg, int(num_samples)
    game, seat_rows, envs = seat_envs(cfg, examples, template, env_kwargs, g)
    sides, groups = learner_sides(ctx, params, game, examples, seat_rows, envs, g,
                                  temperature=temperature, top_k=top_k, top_p=top_p,
                                  opponent=opponent, prefixes=prefixes,
                                  own_only=opponent is not None or prefixes is not None)
    if prefixes is not None:
        limits = dataclasses.replace(limits, chunk_tokens=limits.chunk_tokens
                                     + limits.turn_tokens)
    if tree is not None:   # the sides again over one match per example: its opening's
        from rljax.train.methods import tree_matches
        _, rows_1, envs_1 = seat_envs(cfg, examples, template, env_kwargs, 1)
        opening, _ = learner_sides(ctx, params, game, examples, rows_1, envs_1, 1,
                                   temperature=temperature, top_k=top_k, top_p=top_p,
                                   opponent=opponent, own_only=True)
        return tree_matches.play_tree(
            ctx, params, rng, max_plies=len(game.seats) * limits.max_turns, sides=sides,
            opening=opening, g=g, tree=tree, renderer=renderer, limits=limits,
            weights=weights, options=dict(temperature=temperature, top_k=top_k, top_p=top_p,
                                          temperatures=sampler.rollout_temperatures(cfg))), \
            groups
    engine = sampler.episode_engine(cfg, len(envs))
    eps = run_matches(sides, ctx.tokenizer, renderer=renderer, limits=limits,
                      max_plies=len(game.seats) * limits.max_turns, rng=rng, mesh=ctx.mesh,
                      engine=engine, weights=weights)[0]
    return eps, groups


def learner_sides(ctx, params, game, examples, seat_rows, envs, g: int, *, temperature: float,
                  top_k: int, top_p: float, opponent: Opponent | None = None, prefixes=None,
                  own_only: bool = False) -> tuple[list[Side], list[dict]]:
    """``(sides, group examples)`` of ``seat_envs``' matches: side 0 the policy's learner
    rows (every seat's, or with ``own_only`` each example's own seat's, hinted with its
    ``prefixes`` when given), side 1 the other seats' rows (when any): the ``opponent``'s, or
    the policy's, unhinted."""
    mine, theirs, groups, hints = [], [], [], []
    for n, (ex, per_seat) in enumerate(zip(examples, seat_rows)):
        own = seat_of(game, ex) if own_only else None
        for s, sx in enumerate(per_seat):
            rows = envs[(n * len(per_seat) + s) * g:(n * len(per_seat) + s + 1) * g]
            if own is None or s == own:
                mine += rows
                groups.append(sx)
                hints += [[] if prefixes is None else list(prefixes[n])] * g
            else:
                theirs += rows
    cfg, schedule = ctx.cfg, sampler.rollout_temperatures(ctx.cfg)
    sides = [Side(ctx.model_cfg, params, mine, g, temperature, top_k, top_p,
                  schedule=schedule, record_routes=bool(cfg.algo.get("routing_replay")),
                  prefixes=None if prefixes is None else hints)]
    if opponent is not None:
        sides.append(opponent_side(opponent, theirs, g, top_k, top_p))
    elif theirs:   # the other seats, the policy's, unhinted
        sides.append(Side(ctx.model_cfg, params, theirs, g, temperature, top_k, top_p,
                          schedule=schedule))
    return sides, groups


def seat_trace(cfg, example: dict, env_kwargs: dict, rng=None,
               moves: list | None = None) -> tuple[list[dict], list[float]]:
    """The scripted episode of ``example``'s seat in self-play (what ReLIFT and mixed-policy
    demonstrations train on): a match of its game (its ``deal``) with the game's scripted
    player (``board_games.make_player``, "optimal" unless the game names another) in every
    seat, seen from the example's seat as its ``SeatEnv`` shows it to the rollout: ``(messages,
    the seat's reward for each of its moves)``; a result that reaches the seat after another
    seat's move (``finish``) is added to its last move's, as ``run_matches`` credits it.
    ``env_kwargs``: the run's (``agent.env_kwargs``: the seats take its ``SEAT_OPTIONS``, the
    scripted player its ``opponent_options``). ``sft.trace_noise`` makes each of the seat's
    moves a random legal one with that probability (drawn from ``rng``, a numpy Generator).
    ``moves``: a list to which each ply's ``(seat, move text)`` is appended, every seat's (the
    scripted match a VinePPO fork of the demonstration replays)."""
    import random

    import numpy as np
    from rljax.envs import board_games as bg
    from rljax.envs.selfplay import Match, SeatEnv, seat_example
    game = bg.get_game(cfg.env.name)
    kw = env_kwargs
    player = bg.make_player(game, getattr(game, "scripted", "optimal"),
                            **dict(kw.get("opponent_options") or {}))
    seat_kw = {k: v for k, v in kw.items() if k in SEAT_OPTIONS}
    own, match = seat_of(game, example), Match(game, example.get("deal"))
    envs = [SeatEnv(match, example if s == own else seat_example(example, s, game), s,
                    forfeit_reward=float(cfg.env.selfplay.forfeit_reward), **seat_kw)
            for s in range(len(game.seats))]
    rng = rng if rng is not None else np.random.default_rng(int(example.get("seed", 0)))
    chances = random.Random(int(rng.integers(2 ** 62)))
    noise = float(cfg.sft.trace_noise)
    me = envs[own]
    messages, rewards, first = me.reset(), [], True
    while not match.over():
        seat = match.to_move()
        if seat != own:
            move = player(game, match.state, chances)
            envs[seat].step(move)
            if moves is not None:
                moves.append((seat, move))
            continue
        if not first or match.plies:   # a seat that waited sees the state as an observation
            messages += me.observe()
        first = False
        move = (bg.random_player(game, match.state, chances) if noise and rng.random() < noise
                else player(game, match.state, chances))
        messages.append({"role": "assistant", "content": move})
        if moves is not None:
            moves.append((own, move))
        rewards.append(float(me.step(move).reward))
    if not me.done and rewards:
        rewards[-1] += float(me.finish().reward)
    return messages, rewards
