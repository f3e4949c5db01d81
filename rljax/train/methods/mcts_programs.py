"""The MCTS search's device side: its batch sizes on a mesh, its PRM scorer, and the programs
``rljax plan`` compiles for it.

A wave's sampler call (``mcts_search.MCTSSearch``) has ``search_rows`` prefix rows: the
round's prompts rounded up to a multiple of the data-parallel size (``data`` x ``fsdp``), so
its rows, their forks and their keys split evenly over the mesh; padding rows repeat the last
real one and are dropped. Each row is prefilled once at ``data.max_prompt_length +
rollout.max_new_tokens`` columns and forked ``max(algo.mcts.children, algo.mcts.rollouts)``
ways. With ``algo.mcts.value='prm'`` the PRM of ``algo.mcts.prm`` scores the new children
in batches of ``search_rows x children`` stepwise rows (``prm_scoring``: its trunk sharded
as the policy's and its batch over the data-parallel axes; over an environment's turns each
row is a trajectory of ``env.max_total_tokens`` columns).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax import sampling
from rljax.models import lora as lora_lib
from rljax.train.core import programs as programs_lib
from rljax.train.core import sampler as sampler_lib
from rljax.train.methods.prm_scoring import (  # noqa: F401 (PRMScorer, prm_scorer: here too)
    PRMScorer, load_prm_checkpoint, prm_scorer, prm_value, program as prm_program)


def search_rows(prompts: int, dp_size: int) -> int:
    """Prefix rows of a wave's sampler call: ``prompts`` (a wave expands at most one leaf per
    prompt) rounded up to a multiple of ``dp_size``."""
    return -(-int(prompts) // int(dp_size)) * int(dp_size)


def forks(cfg) -> int:
    """Continuations per prefix row: ``max(algo.mcts.children, algo.mcts.rollouts)``."""
    return max(int(cfg.algo.mcts.children), int(cfg.algo.mcts.rollouts))


def prefix_len(cfg) -> int:
    """Prompt columns of the sampler call: prompt ++ prefix, ``data.max_prompt_length +
    rollout.max_new_tokens``."""
    return int(cfg.data.max_prompt_length) + int(cfg.rollout.max_new_tokens)


# ----------------------------------------------------------------------------- the PRM

def load_prm(ctx) -> dict:
    """The latest checkpoint state of the PRM run in ``algo.mcts.prm``."""
    return load_prm_checkpoint(ctx, "algo.mcts.prm", ctx.cfg.algo.mcts.prm)


def scorer_rows(ctx, prompts: int) -> int:
    """Prefixes per PRM scoring batch: a wave's new children (``children`` per prefix row)."""
    return search_rows(prompts, ctx.dp_size) * int(ctx.cfg.algo.mcts.children)


def load_prm_scorer(ctx, rows: int) -> PRMScorer:
    """``prm_scorer`` of the PRM trained in ``algo.mcts.prm`` (its latest checkpoint)."""
    return prm_scorer(ctx, prm_value(ctx, load_prm(ctx)), rows)


# ----------------------------------------------------------------------------- the plan

def programs(ctx, params, resident: int, prompts: int) -> list:
    """The search's programs for ``rljax plan`` (``programs.Program``) with ``prompts`` prompts
    a round: ``mcts/sample``, one wave's sampler call (``search_rows`` prefix rows of
    ``prefix_len`` columns forked ``forks`` ways, ``rollout.max_new_tokens`` new tokens, a
    key per output row; the rows' noise is drawn inside it); with ``algo.mcts.value='prm'``,
    ``mcts/prm``, the PRM's pass over ``search_rows x children`` stepwise rows (its parameters
    are that program's non-resident arguments: not train state). Over an environment's turns
    the forks are episodes on the episode engine instead of ``mcts/sample``
    (``episode_programs``), over a game's matches matches (``match_programs``)."""
    cfg, mcfg, mesh, tok = ctx.cfg, ctx.model_cfg, ctx.mesh, ctx.tokenizer
    r, m = cfg.rollout, cfg.algo.mcts
    rows, s, p = search_rows(prompts, ctx.dp_size), forks(cfg), prefix_len(cfg)
    prm = ([prm_program(ctx, "mcts/prm", rows * int(m.children),
                        completion_len=programs_lib.completion_len(cfg))]
           if m.value == "prm" else [])
    if cfg.env.name and cfg.env.selfplay.mode != "off":   # forks of matches (mcts_matches)
        return match_programs(ctx, params, resident, prompts) + prm
    if cfg.env.name:   # forks of episodes (mcts_episodes)
        return episode_programs(ctx, params, resident, prompts) + prm
    merge = sampler_lib.merges_for_sampling(cfg, mcfg, params)

    def sample_fn(params, prompt_tokens, prompt_mask, key, row_keys):
        if merge:
            params = lora_lib.merge(mcfg, params)
        return sampling.generate(
            mcfg, params, prompt_tokens, prompt_mask, rng=key, num_samples=s,
            max_new_tokens=int(r.max_new_tokens), temperature=r.temperature, top_k=r.top_k,
            top_p=r.top_p, eos_id=ctx.stop_ids, pad_id=tok.pad_id, mesh=mesh,
            record_routes=bool(cfg.algo.get("routing_replay")), row_keys=row_keys)

    args = (params, programs_lib.batch_struct(mesh, (rows, p), jnp.int32),
            programs_lib.batch_struct(mesh, (rows, p), bool),
            jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=ctx.replicated),
            programs_lib.batch_struct(mesh, (rows * s, 2), jnp.uint32))
    return [programs_lib.Program("mcts/sample", jax.jit(sample_fn), args, resident)] + prm


def fork_batch(cfg, prompts: int) -> int:
    """Forks of a wave's batch over matches (``vine_matches.play_forks``): a wave's
    ``prompts x forks`` fork points (a leaf per tree), ``rollout.slots`` of them a batch
    (else a quarter)."""
    n = int(prompts) * forks(cfg)
    return max(1, min(sampler_lib.engine_slots(cfg, n), n))


def _engine(ctx, name: str, model_cfg, params, pages: int, slots: int, resident: int,
            t: float, top_k: int, top_p: float, scheduled: bool, *, num_samples: int = 1,
            chunk_len: int, held: tuple = ()) -> list:
    """``mcts/{name}_prefill`` and ``mcts/{name}_decode``: the episode engine's programs over
    ``pages`` prompt pages of the longest bucket and ``slots`` slots of an episode's tokens,
    its feed ``chunk_len`` tokens, sampling at ``t`` / ``top_k`` / ``top_p``."""
    from rljax import sampling
    from rljax.sampling import episode_engine, multiturn
    from rljax.train.methods import agent
    cfg, tok = ctx.cfg, ctx.tokenizer
    lim, end = agent.limits(cfg), agent.make_renderer(cfg, tok).call_end
    p = programs_lib.prompt_len(cfg)
    made = episode_engine.programs(
        model_cfg, params, programs_lib.batch_struct(ctx.mesh, (pages, p), jnp.int32),
        programs_lib.batch_struct(ctx.mesh, (pages, p), bool),
        jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=ctx.replicated),
        num_samples=num_samples, slots=slots, chunk_len=chunk_len, turn_len=lim.turn_tokens,
        length=lim.max_total_tokens + 1, chunk_steps=int(cfg.rollout.chunk_steps),
        temperature=t, top_k=top_k, top_p=top_p,
        stop_ids=sampling.merge_stop_ids(tok.eos_id, ()),
        stop_sequences=multiturn.stop_sequences_of(tok, [end] if end else []),
        scheduled=scheduled)
    return [programs_lib.Program(f"mcts/{name}_{kind}", fn, args, resident, held=held)
            for kind, fn, args in made]


def _policy(ctx, params) -> tuple:
    """(the sampled parameters: LoRA merged where sampling merges it, as the forks do once;
    temperature, top_k, top_p, whether a schedule sets the turns' temperatures)."""
    cfg, mcfg, r = ctx.cfg, ctx.model_cfg, ctx.cfg.rollout
    if sampler_lib.merges_for_sampling(cfg, mcfg, params):
        params = jax.eval_shape(lambda q: lora_lib.merge(mcfg, q), params)
    return params, (r.temperature, int(r.top_k), float(r.top_p),
                    r.temperature_schedule.name != "constant")


def episode_programs(ctx, params, resident: int, prompts: int) -> list:
    """The search's programs over an environment's turns (``mcts_episodes``): a wave's forks
    are played on the episode engine (``vine_episodes.play_forks``), a page per leaf's prompt
    (a leaf per tree, padded to a multiple of ``rollout.batch_size``), each page's ``forks``
    episodes on ``rollout.slots`` slots (else a quarter of them, at most a wave's
    ``prompts x forks``), the feed a replayed trajectory: ``mcts/episode_prefill`` and
    ``mcts/episode_decode``."""
    from rljax.train.methods import agent
    cfg, k = ctx.cfg, forks(ctx.cfg)
    lim, batch = agent.limits(cfg), int(cfg.rollout.batch_size)
    pages = -(-int(prompts) // batch) * batch
    slots = max(1, min(sampler_lib.engine_slots(cfg, pages * k), int(prompts) * k))
    params, policy = _policy(ctx, params)
    return _engine(ctx, "episode", ctx.model_cfg, params, pages, slots, resident, *policy,
                   num_samples=k, chunk_len=max(lim.chunk_tokens, lim.max_total_tokens))


def match_programs(ctx, params, resident: int, prompts: int) -> list:
    """The search's programs over a game's matches (``mcts_matches``): each batch of forks
    (``fork_batch`` matches) is played on the episode engine, a side per model with a slot
    per row, its feed a replayed trajectory (``matches._engine_matches``): the learner seat's
    rows on the policy's engine, ``mcts/episode_prefill`` and ``mcts/episode_decode``; the
    other seats' on the checkpoint opponent's (``mcts/opponent_*``, its parameters held), or
    in self-play on the policy's (one program with the learner's for two seats, else
    ``mcts/seats_*``)."""
    from rljax.train.methods import agent, selfplay
    cfg, lim = ctx.cfg, agent.limits(ctx.cfg)
    per = fork_batch(cfg, prompts)
    others = (selfplay.num_seats(cfg) - 1) * per
    # (a first turn's chunk has room for a hint, as ``selfplay.play`` gives it)
    width = max(lim.chunk_tokens + lim.turn_tokens, lim.max_total_tokens)
    params, policy = _policy(ctx, params)
    out = _engine(ctx, "episode", ctx.model_cfg, params, per, per, resident, *policy,
                  chunk_len=width)
    opponent = selfplay.abstract_opponent(ctx)
    if opponent is not None:
        t, size = opponent.temperature, programs_lib.shard_bytes(opponent.params)
        r = cfg.rollout
        out += _engine(ctx, "opponent", opponent.model_cfg, opponent.params, others, others,
                       size, t, int(r.top_k) if t else 0, float(r.top_p) if t else 1.0, False,
                       chunk_len=width, held=(("opponent", size),))
    elif others != per:
        out += _engine(ctx, "seats", ctx.model_cfg, params, others, others, resident, *policy,
                       chunk_len=width)
    return out
