"""The programs a phase runs, stated without data or weights: what ``rljax plan`` compiles.

Every phase class has ``programs(ctx, steps) -> (abstract state, [Program])``: the jitted
functions its iterations call, each with abstract inputs (``jax.ShapeDtypeStruct`` carrying the
run's shardings) at the worst-case shapes of the config (the longest prompt bucket, the full
completion slot). ``ctx`` is a ``setup.Context`` whose ``params`` may be abstract (the
plan's); the phase builds its programs with the same builders and ``init_state`` its
iterations use, so the plan compiles what training runs. The rollout's sampler and log-prob
passes, shared by the RL phases, are stated here (``sampler_programs``, ``logps_program``;
the multi-turn sampler is planned as one sampler pass over its KV cache, ``sampler_len``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from rljax import models, sampling
from rljax.sampling import tree as tree_sampling
from rljax import sharding as shd
from rljax.train.core import length_groups, sampler as sampler_lib, state as state_lib, steps
from rljax.train.core.buckets import pair_prompt_len, prompt_buckets


@dataclasses.dataclass(frozen=True)
class Program:
    """One jitted program of a phase: ``fn.lower(*args)`` compiles it. ``resident``: per-device
    bytes of ``args`` that are train state living on the device for the whole phase (counted
    once in the plan's peak); ``copies``: instances running at once (``algo.update_streams``);
    ``held``: ``(name, per-device bytes)`` of frozen models among ``args`` that the phase holds
    from its start to its end without training or checkpointing them (a game's checkpoint
    opponent): the plan adds them to its resident parts, and ``resident`` counts them."""
    name: str
    fn: Callable
    args: tuple
    resident: int
    copies: int = 1
    held: tuple = ()


def shard_bytes(tree: Any) -> int:
    """Per-device bytes of a pytree of ``ShapeDtypeStruct``/arrays with shardings (the
    largest shard, i.e. the most loaded device)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = tuple(leaf.shape)
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None and shape:
            shape = tuple(sharding.shard_shape(shape))
        total += models.quant.nbytes(shape, leaf.dtype)   # 4-bit types: two per byte
    return total


def phase_state(ctx, init_state: Callable) -> state_lib.TrainState:
    """The abstract state of a phase (``init_state`` of the run's initial state), with the
    run's shardings: what the phase's programs take."""
    initial = state_lib.TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=ctx.params,
                                   opt_state=None, rng=jax.ShapeDtypeStruct((2,), jnp.uint32))
    shape = jax.eval_shape(init_state, initial)
    return state_lib.abstract_train_state(shape, ctx.state_shardings(shape))


def batch_struct(mesh, shape, dtype) -> jax.ShapeDtypeStruct:
    """A batch leaf ``[B, ...]`` split over the data-parallel axes (``sharding.shard_batch``)."""
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype),
                                sharding=shd.batch_sharding(mesh, tuple(shape)))


def prompt_len(cfg) -> int:
    """The longest prompt bucket P."""
    return max(prompt_buckets(cfg.data.max_prompt_length))


def tree_prompt_len(cfg) -> int:
    """Prompt columns of a tree of first turns: P, or against a game's checkpoint opponent
    (``tree_matches``) P + ``env.max_total_tokens``, the bucket a seat that does not move
    first grows its tree in (its prompt ++ the opening's plies and first observation)."""
    p = prompt_len(cfg)
    if cfg.env.name and cfg.env.selfplay.mode == "checkpoint":
        return p + int(cfg.env.max_total_tokens)
    return p


def completion_len(cfg) -> int:
    """Completion columns N of a training row: ``rollout.max_new_tokens``, or with an
    environment the whole trajectory after the prompt (``env.max_total_tokens``)."""
    return int(cfg.env.max_total_tokens) if cfg.env.name else int(cfg.rollout.max_new_tokens)


def sampler_len(cfg) -> int:
    """Tokens after the prompt in the sampler's KV cache (with an environment: T turns of
    observation chunk O + turn tokens, ``multiturn.SlotLayout``; a board game whose seats are
    models, ``env.selfplay``: a turn's slots per ply, T per seat of its 2 seats)."""
    r, env = cfg.rollout, cfg.env
    if not env.name:
        return int(r.max_new_tokens)
    turns = int(env.max_turns) * (2 if env.selfplay.mode != "off" else 1)
    return turns * (int(env.max_obs_tokens) + 1 + int(env.max_turn_tokens or r.max_new_tokens))


def image_fields(cfg, model_cfg) -> dict:
    """A model with a vision tower: ``{"pixels": ((I, C, S, S), float32)}``, each row's
    ``data.max_images`` images at the tower's size (``image_inputs.ImageInputs.pixels``);
    a text model: {}."""
    v = model_cfg.vision
    if v is None:
        return {}
    return {"pixels": ((int(cfg.data.max_images), v.num_channels, v.image_size,
                        v.image_size), jnp.float32)}


def with_images(ctx, batch: dict, rows: int) -> dict:
    """``batch`` plus its abstract ``pixels`` [rows, I, C, S, S] when the model reads images."""
    return {**batch, **{k: batch_struct(ctx.mesh, (rows, *tail), dtype)
                        for k, (tail, dtype) in image_fields(ctx.cfg, ctx.model_cfg).items()}}


def sequence_batch(ctx, rows: int) -> dict:
    """Abstract ``tokens``/``mask`` [rows, P+N] and ``loss_mask`` [rows, N] (rollout layout),
    and ``pixels`` for a model with a vision tower."""
    p, n, mesh = prompt_len(ctx.cfg), completion_len(ctx.cfg), ctx.mesh
    return with_images(ctx, {"tokens": batch_struct(mesh, (rows, p + n), jnp.int32),
                             "mask": batch_struct(mesh, (rows, p + n), bool),
                             "loss_mask": batch_struct(mesh, (rows, n), bool)}, rows)


def pair_batch(ctx, pairs: int) -> dict:
    """Abstract preference batch of ``pairs`` pairs (``data.encode_preference`` +
    ``pair_mask``; DPO, reward models): prompts [pairs, P] (``buckets.pair_prompt_len``: the
    longest bucket, or a step pair's context), chosen / rejected completions [pairs, C] of
    ``rollout.max_new_tokens``."""
    p, c, mesh = pair_prompt_len(ctx.cfg), int(ctx.cfg.rollout.max_new_tokens), ctx.mesh
    out = {"pair_mask": batch_struct(mesh, (pairs,), bool)}
    for key, width in (("prompt", p), ("chosen", c), ("rejected", c)):
        for field, dtype in (("tokens", jnp.int32), ("mask", bool)):
            out[f"{key}_{field}"] = batch_struct(mesh, (pairs, width), dtype)
    return out


def sampler_copies(ctx, phase: str, state) -> dict:
    """Per-device bytes the sampler of asynchronous RL keeps beside the train state when both
    share one mesh (the update donates the state's arrays, so the sampler reads copies): the
    policy (``sampler_params``), and with GRPO's KL in the reward the reference
    (``sampler_reference``). {} otherwise (on a rollout mesh of its own, its programs carry
    the copy as their resident argument)."""
    cfg = ctx.cfg
    if (phase != cfg.algo.name or not cfg.algo.get("asynchronous", False)
            or ctx.rollout_mesh is not None):
        return {}
    parts = {"sampler_params": shard_bytes(state.params)}
    if sampler_lib.scores_kl(cfg.algo) and state.ref_params is not None:
        parts["sampler_reference"] = shard_bytes(state.ref_params)
    return parts


def sample_prompts(cfg) -> int:
    """Prompts of one sampler call: ``rollout.micro_batch_size / G``, else the batch's."""
    r = cfg.rollout
    return int(r.micro_batch_size or r.batch_size) // int(cfg.algo.num_generations)


def held_parts(programs: list[Program]) -> dict:
    """The frozen models ``programs`` hold for their phase (``Program.held``), by name."""
    return {name: size for p in programs for name, size in p.held}


def sampler_programs(ctx, params, resident: int, *, with_eval: bool = True) -> list[Program]:
    """``sample`` (``rollout.micro_batch_size / G`` prompts of the longest bucket, G samples
    each, or G tree leaves; a tree's prompts ``tree_prompt_len``) and ``eval`` (the held-out generation at ``eval.batch_size`` /
    ``eval.max_new_tokens``). LoRA on a float32 base samples from a merged copy
    (``sampler.sampling_params``): the merge runs inside these programs so the copy counts."""
    cfg, mcfg, mesh, tok = ctx.cfg, ctx.model_cfg, ctx.mesh, ctx.tokenizer
    r, g, p = cfg.rollout, int(cfg.algo.num_generations), prompt_len(cfg)
    n_sample = sampler_len(cfg)
    chunk = sample_prompts(cfg)
    tree = tree_sampling.options_from_config(r.tree, g)
    if tree is not None and r.allocation == "knapsack":   # the budget's trees of one root each
        from rljax.config.rollout import knapsack_limits, knapsack_step   # (methods.allocation)
        g = knapsack_step(cfg)
        chunk, tree = knapsack_limits(cfg)[0] // g, dict(tree, roots=1)
    merge = sampler_lib.merges_for_sampling(cfg, mcfg, params)
    for_sampling = (lambda q: models.lora.merge(mcfg, q)) if merge else (lambda q: q)
    rng = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=ctx.replicated)

    def sample_fn(params, prompt_tokens, prompt_mask, key, image_embeds=None):
        kw = dict(rng=key, max_new_tokens=n_sample, temperature=r.temperature, top_k=r.top_k,
                  top_p=r.top_p, eos_id=ctx.stop_ids, pad_id=tok.pad_id, mesh=mesh)
        if tree is not None:
            return tree_sampling.generate(mcfg, for_sampling(params), prompt_tokens,
                                          prompt_mask, **tree, **kw)
        if image_embeds is not None:
            kw["image_embeds"] = image_embeds
        return sampling.generate(mcfg, for_sampling(params), prompt_tokens, prompt_mask,
                                 num_samples=g, **kw)

    def prompts(b, p=p):
        """The sampler's inputs for b prompts of p columns: tokens, mask (and, with a vision
        tower, the ``image_embeds`` the tower's own program makes of their pixels)."""
        out = (batch_struct(mesh, (b, p), jnp.int32), batch_struct(mesh, (b, p), bool))
        return out if mcfg.vision is None else out + (image_embeds_struct(ctx, b),)
    sampled = jax.eval_shape(for_sampling, params) if merge else params
    kind = sampler_lib.sampler_kind(cfg, tree is not None)
    out: list[Program] = []
    if tree is not None and cfg.env.name:   # a tree of first turns (methods.tree_episodes)
        n_sample = int(cfg.env.max_turn_tokens or r.max_new_tokens)
    if cfg.env.name and (kind in ("slots", "partial") or tree is not None):
        # Episodes on the episode engine (with a tree: after its leaves' first turns).
        from rljax.sampling import episode_engine
        e = cfg.env
        # Partial rollouts: 2 x chunk groups in flight, a carried episode's whole trajectory
        # fed again through the observation feed (methods.episode_partial).
        places, feed = chunk, int(e.max_obs_tokens) + 1
        if r.partial:   # (with a tree: its places' first turns grown, then carried)
            places, feed = 2 * chunk, max(feed, int(e.max_total_tokens))
        elif tree is not None:   # each leaf's trajectory fed whole
            feed = max(feed, int(e.max_total_tokens))
        p_tok, p_mask, *_ = prompts(places)
        # A game's matches hold a slot per row for the whole match (``matches._EngineSide``;
        # partial rollouts: every place's, ``partial_matches._SeatEngine``).
        slots = (places * g if e.selfplay.mode != "off"
                 else sampler_lib.engine_slots(cfg, chunk * g))
        out = [Program(f"sample/episode_{name}", fn, args, resident) for name, fn, args in
               episode_engine.programs(
                   mcfg, sampled, p_tok, p_mask, rng, num_samples=g, slots=slots,
                   chunk_len=feed,
                   turn_len=int(e.max_turn_tokens or r.max_new_tokens),
                   length=int(e.max_total_tokens) + 1,
                   chunk_steps=r.chunk_steps, temperature=r.temperature, top_k=r.top_k,
                   top_p=r.top_p, stop_ids=sampling.merge_stop_ids(tok.eos_id, ()),
                   scheduled=r.temperature_schedule.name != "constant")]
    if kind == "partial" and not cfg.env.name:   # the partial-rollout pool's two programs, over its 2 x chunk places
        from rljax.sampling import partial as partial_lib
        from rljax.train.core.partial import make_pool
        _, _, *embeds = prompts(2 * chunk)
        out = [Program(f"sample/{name}", fn, args, resident) for name, fn, args in
               partial_lib.programs(make_pool(ctx, chunk), sampled, rng,
                                    embeds[0] if embeds else None)]
    elif kind == "tree_slots":   # the slot engine's two, at the tree's widest level (partial
        # rollouts: over the pool's 2 x chunk trees, sampling.tree_partial)
        # (a checkpoint opponent's places grow a tree each, one prompt: partial_matches)
        trees = (1 if cfg.env.selfplay.mode == "checkpoint" else 2 * chunk) if r.partial \
            else chunk
        p_tok, p_mask = prompts(trees, tree_prompt_len(cfg))[:2]
        kw = dict(chunk_steps=r.chunk_steps, slots=sampler_lib.engine_slots(cfg, chunk * g),
                  temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
                  eos_id=ctx.stop_ids, pad_id=tok.pad_id)
        out += [Program(f"sample/{name}", fn, args, resident) for name, fn, args in
                sampling.tree_engine.programs(mcfg, sampled, p_tok, p_mask, rng,
                                             max_new_tokens=n_sample, **tree, **kw)]
    elif kind == "slots" and not cfg.env.name:   # the slot engine's two
        p_tok, p_mask, *embeds = prompts(chunk)
        kw = dict(max_new_tokens=n_sample, num_samples=g, chunk_steps=r.chunk_steps,
                  slots=sampler_lib.engine_slots(cfg, chunk * g), temperature=r.temperature,
                  top_k=r.top_k, top_p=r.top_p, eos_id=ctx.stop_ids, pad_id=tok.pad_id)
        out = [Program(f"sample/{name}", fn, args, resident) for name, fn, args in
               # (a merged LoRA copy is planned at its shapes, without the base's sharding)
               sampling.engine.programs(mcfg, sampled, p_tok, p_mask, rng, **kw,
                                        image_embeds=embeds[0] if embeds else None)]
    elif kind in ("static", "tree"):
        p_tok, p_mask, *embeds = prompts(chunk, tree_prompt_len(cfg) if tree else p)
        out += [Program("sample", jax.jit(sample_fn), (params, p_tok, p_mask, rng, *embeds),
                        resident)]
    if mcfg.vision is not None:
        out.append(image_embed_program(ctx, params, "sample/images",
                                       2 * chunk if kind == "partial" else chunk))
    if with_eval:
        e = cfg.eval

        def eval_fn(params, prompt_tokens, prompt_mask, key, image_embeds=None):
            return sampling.generate(
                mcfg, for_sampling(params), prompt_tokens, prompt_mask, rng=key,
                max_new_tokens=e.max_new_tokens or n_sample, temperature=e.temperature,
                top_k=r.top_k if e.temperature else 0, top_p=r.top_p if e.temperature else 1.0,
                eos_id=ctx.stop_ids, pad_id=tok.pad_id, num_samples=e.num_samples, mesh=mesh,
                image_embeds=image_embeds)
        p_tok, p_mask, *embeds = prompts(e.batch_size)
        out.append(Program("eval", jax.jit(eval_fn), (params, p_tok, p_mask, rng, *embeds),
                           resident))
        if mcfg.vision is not None:
            out.append(image_embed_program(ctx, params, "eval/images", int(e.batch_size)))
    return out


def image_embed_program(ctx, params, name: str, prompts: int) -> Program:
    """The vision tower's pass over ``prompts`` prompts' pixels [prompts, I, C, S, S] that
    gives the sampler its ``image_embeds`` (``image_inputs.ImageInputs.embeds``); its
    resident argument: the tower."""
    from rljax.train.core import image_inputs
    fn = image_inputs.embed_fn(ctx.model_cfg)
    pixels = with_images(ctx, {}, prompts)["pixels"]
    return Program(name, fn, (params["vision"], pixels), shard_bytes(params["vision"]))


def image_embeds_struct(ctx, prompts: int) -> jax.ShapeDtypeStruct:
    """Abstract ``image_embeds`` [prompts, I*M, D] (the tower's output for the sampler)."""
    v, mcfg = ctx.model_cfg.vision, ctx.model_cfg
    k = int(ctx.cfg.data.max_images) * v.mm_tokens_per_image
    return batch_struct(ctx.mesh, (prompts, k, mcfg.hidden_size), mcfg.compute_dtype)


def kv_cache_note(ctx, human: Callable[[int], str]) -> str:
    """One line for the plan: the KV cache of one rollout micro-batch's sampling (the whole
    batch, before any split over devices), and what rings for sliding-window layers save
    (``models.kv_ring``; the static sampler's and the slot engine's, not the multi-turn or
    tree samplers', whose caches stay full)."""
    cfg, mcfg = ctx.cfg, ctx.model_cfg
    r, g, p, n = cfg.rollout, int(cfg.algo.num_generations), prompt_len(cfg), sampler_len(cfg)
    prompts = sample_prompts(cfg)
    ringed = not cfg.env.name and tree_sampling.options_from_config(r.tree, g) is None
    if sampler_lib.sampler_kind(cfg) in ("slots", "partial") and ringed:
        slots = sampler_lib.engine_slots(cfg, prompts * g)
        what = f"{prompts} prompt pages x {p} + {slots} slots x {n}"
        size = lambda ring: (models.kv_cache_bytes(mcfg, prompts, p, ring=False)
                             + models.kv_cache_bytes(mcfg, slots, n, ring=ring))
    else:
        what = f"{prompts * g} rows x {p + n} slots"
        size = lambda ring: models.kv_cache_bytes(mcfg, prompts * g, p + n, ring=ring and ringed)
    line = (f"KV cache while sampling: {human(size(True))} ({what}, "
            f"{jnp.dtype(mcfg.compute_dtype).name})")
    if size(True) < size(False):
        line += (f"; sliding-window layers keep rings of {mcfg.sliding_window} slots "
                 f"({human(size(False))} without)")
    return line


def logps_program(ctx, params, resident: int) -> Program:
    """``logps``: the rollout's old / reference log-prob pass, built as ``rollout.Rollout``
    builds it (host-planned micro-batches when ``length_groups.host_planned``: one
    micro-batch's program at its largest layout; else the whole batch in row-chunks)."""
    cfg, mesh = ctx.cfg, ctx.mesh
    a, total = cfg.algo, int(cfg.rollout.batch_size)
    micro = a.micro_batch_size or a.mini_batch_size or total
    opts = dict(temperature=cfg.rollout.temperature, num_micro=total // micro, mesh=mesh,
                param_shardings=ctx.param_shardings)
    if not length_groups.host_planned(a):
        return Program("logps", steps.build_logps_fn(ctx.model_cfg, **opts),
                       (params, sequence_batch(ctx, total)), resident)
    grouped = length_groups.build_logps_fn(ctx.model_cfg, algo_cfg=a, **opts)
    fn, part = grouped.program(total, prompt_len(cfg), completion_len(cfg), _logps_fields(ctx))
    return Program("logps", fn, (params, part), resident, copies=grouped.copies(total))


def _logps_fields(ctx) -> dict:
    """Per-row fields the log-prob pass reads besides the sequence layout."""
    fields = image_fields(ctx.cfg, ctx.model_cfg)
    if ctx.cfg.rollout.temperature_schedule.name != "constant":
        fields["temperatures"] = ((completion_len(ctx.cfg),), jnp.float32)
    return fields


def with_shardings(tree, shardings):
    """``ShapeDtypeStruct`` leaves of ``tree`` carrying ``shardings`` (a matching tree)."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        tree, shardings)

