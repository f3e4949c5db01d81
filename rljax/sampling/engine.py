"""Slot engine: S decode slots that are refilled as their completions stop.

    out, stats = sampling.engine.generate(cfg, params, prompt_tokens, prompt_mask, rng=key,
                                   max_new_tokens=N, num_samples=G, eos_id=tok.eos_id,
                                   slots=64, chunk_steps=16)
    # out: a SampleOutput exactly as sampling.generate returns it (row i * G + g)
    # stats: EngineStats (decode steps, slot utilisation)

The static sampler decodes all B*G rows until the longest one stops; with long, uneven
completions most of its row-steps decode rows that have already stopped. Here:

1. **Prefill** (one program): every prompt runs once; its keys/values become a *page* that its
   G samples share (``models.paged``), and each row's first token is drawn from the prompt's
   last logits, as the static sampler draws it.
2. **Decode in chunks** (one program, reused): S slots each decode their own row, at their own
   step, for up to ``chunk_steps`` steps. A slot whose row stops goes idle.
3. **Refill** (on device, every step): an idle slot takes the next queued row (a row is a page
   index, a row id and its first token: nothing is copied or recomputed). The host only
   relaunches the chunk program until every row has stopped.

Randomness depends only on (rng, row, step): token t of row r reads the noise that the static
sampler draws for it (``draw_noise(fold_in(rng, t), B*G, V)[r]``, all drawn before the loop),
so the slot a row lands in, the chunk size and the refill order change nothing, and where both
programs round the logits alike the tokens equal the static sampler's. Greedy decoding gives
the static sampler's tokens wherever its logits are not tied within float32 rounding.

Several processes (SPMD): every process runs this loop on the same prompts, the programs on
the parameters' global mesh. The host's decisions (which rows wait, when to relaunch) read
only the programs' global outputs (``distributed.to_host``), so every process takes the same
ones and the processes stay in step; every process gets every row.
"""
from __future__ import annotations

import dataclasses
import functools
from collections import deque
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rljax import distributed as dist, models
from rljax import sharding as shd
from rljax.models import paged
from rljax.sampling.core import SampleOutput, merge_stop_ids
from rljax.sampling.draw import (NOISE_AHEAD_MAX_ELEMENTS, check_temperatures, noise_ahead,
                                 noise_ahead_size, row_temperature, sample_logits)


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """What a ``generate`` call decoded.

    rows: B*G completions; slots: S; chunks: decode programs run; decode_steps: their steps
    (each advances every slot, busy or idle); useful_steps: the tokens the decode steps
    produced (all tokens but each row's first, which the prefill draws).
    """
    rows: int
    slots: int
    chunks: int
    decode_steps: int
    useful_steps: int
    # With ``weights``: int32 [B*G, N], the version of the weights that drew each token
    # (positions past a row's length hold the first), and how often they changed.
    versions: np.ndarray | None = None
    swaps: int = 0

    @property
    def slot_utilisation(self) -> float:
        """Useful token-steps over slot-steps (1 = no slot ever idle)."""
        return self.useful_steps / max(1, self.slots * self.decode_steps)


def static_utilisation(lengths: np.ndarray) -> float:
    """What a static batch of these completion lengths keeps busy: tokens over rows x the
    longest row (the decode steps it runs until the slowest row stops)."""
    lengths = np.asarray(lengths)
    return float(lengths.sum() / max(1, lengths.size * lengths.max(initial=1)))


class VersionPolls:
    """In-flight weights polled across several engine calls (a tree's levels, a batch's prompt
    chunks): ``weights`` as it is, counting every change of version between two polls
    (``swaps``), at a call's first poll too (``generate`` counts only those between its own
    decode chunks)."""

    def __init__(self, weights: Callable[[], tuple[Any, int]]):
        self.weights, self.last, self.swaps = weights, None, 0

    def __call__(self) -> tuple[Any, int]:
        params, version = self.weights()
        self.swaps += int(self.last is not None and version != self.last)
        self.last = version
        return params, version


def generate(cfg: models.ModelConfig, params: Any, prompt_tokens: Any, prompt_mask: Any, *,
             rng: jax.Array, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, eos_id: int | Sequence[int] | None = None, pad_id: int = 0,
             num_samples: int = 1, stop_ids: Sequence[int] = (), min_new_tokens: int = 0,
             slots: int = 64, chunk_steps: int = 16, cache_dtype: Any = None,
             temperatures: Any = None,
             weights: Callable[[], tuple[Any, int]] | None = None,
             image_embeds: Any = None,
             record_routes: bool = False, noise: Any = None,
             live: Any = None) -> tuple[SampleOutput, EngineStats]:
    """Samples ``num_samples`` completions per prompt with ``slots`` refilled decode slots.

    Arguments as ``sampling.generate`` (prompt_tokens int32 [B, P] left-padded, prompt_mask
    bool [B, P]), plus:
      slots: S, decode slots (at most B*G are used).
      chunk_steps: decode steps per program run (refills happen inside it; the host only
        relaunches the program until every row stopped, one small read-back per run).
      weights: in-flight weight updates: called before the prefill and between decode chunks,
        returns ``(params, version)`` (``params`` of the same structure and shardings); the
        next chunk decodes with them. Slots keep the keys and values their row computed
        under earlier weights (as PipelineRL does: nothing is recomputed), and the logps
        recorded are those the drawing weights gave, i.e. the behaviour policy's.
        ``EngineStats.versions`` says which version drew each token. ``params`` is unused.
      image_embeds: [B, K, D] (optional): each prompt's image embeddings, prefilled with it
        into its page (``sampling.generate``'s argument).
      record_routes: a mixture of experts: also return every token's experts
        (``SampleOutput.routes`` int32 [B*G, P+N, L, k], ``sampling.generate``'s layout), for
        routing replay in the update.
      noise: float32 [N, B*G, W] (optional): token t of row r reads ``noise[t, r]`` instead
        of the draw from ``rng`` (``sampling.tree_engine`` passes its tree's draws).
      live: bool [B*G] (optional): only these rows decode past their first token; the others
        are prefilled with the batch (the programs keep one shape) and their outputs are to be
        ignored (a tree's stopped paths).

    Returns ``(SampleOutput with B*G rows, EngineStats)``.
    """
    if max_new_tokens < 1 or num_samples < 1 or slots < 1 or chunk_steps < 1:
        raise ValueError(f"max_new_tokens, num_samples, slots and chunk_steps must be >= 1, got "
                         f"{max_new_tokens}, {num_samples}, {slots}, {chunk_steps}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if record_routes and not cfg.is_moe:
        raise ValueError("record_routes needs a mixture-of-experts model")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    prompt_tokens = np.asarray(prompt_tokens, np.int32)
    prompt_mask = np.asarray(prompt_mask, bool)
    models.transformer.check_token_ids(cfg, prompt_tokens, prompt_mask,
                                       what="generate: prompt_tokens")
    b = prompt_tokens.shape[0]
    if temperatures is not None:   # [N], or [B * G, N]: each row its own
        temperatures = check_temperatures(temperatures, max_new_tokens,
                                          b * int(num_samples))
    n, g = int(max_new_tokens), int(num_samples)
    rows = b * g
    s = min(int(slots), rows)
    greedy = temperatures is None and temperature == 0.0
    draw = dict(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                stop_ids=merge_stop_ids(eos_id, stop_ids), pad_id=int(pad_id),
                min_new_tokens=int(min_new_tokens))
    if greedy:
        noise = None
    elif noise is not None:
        noise = jnp.asarray(noise, jnp.float32)
    elif noise_ahead_size(n, rows, cfg.vocab_size) <= NOISE_AHEAD_MAX_ELEMENTS:
        noise = _draw_noise_ahead(rng, n, rows, cfg.vocab_size)
    else:
        raise ValueError(f"the slot engine draws all noise ahead; {n} tokens x {rows} rows x "
                         f"vocabulary {cfg.vocab_size} exceed NOISE_AHEAD_MAX_ELEMENTS")

    version = 0
    if weights is not None:
        params, version = weights()
    layers = unstacked(params)
    # Traced on the parameters' mesh: the MoE dispatch splits the experts' work over it.
    mesh = params_mesh(params)
    with shd.tracing_mesh(mesh):
        pages, first, first_logp, first_done, prompt_routes = _prefill(
            cfg, params, jnp.asarray(prompt_tokens), jnp.asarray(prompt_mask), rng, noise,
            temperatures, image_embeds, num_samples=g, cache_dtype=_dtype_name(cache_dtype),
            record_routes=bool(record_routes), **draw)
    out = dict(tokens=jnp.full((rows, n), draw["pad_id"], jnp.int32).at[:, 0].set(first),
               logps=jnp.zeros((rows, n), jnp.float32).at[:, 0].set(first_logp),
               lengths=jnp.ones((rows,), jnp.int32), done=first_done)
    if record_routes:   # each fed token's experts, written by the decode chunks
        out["routes"] = jnp.zeros((rows, n, cfg.num_layers, cfg.num_experts_per_tok),
                                  jnp.int32)
    page_mask = jnp.asarray(prompt_mask)
    page_len = jnp.asarray(prompt_mask.sum(-1).astype(np.int32))
    cache = paged.init_slot_cache(cfg, s, n, dtype=cache_dtype)
    # The rows still to decode, in order; a slot takes the next one the step after its row
    # stops (on device: no host round trip per refill).
    done_host = dist.to_host(first_done)
    live = np.ones(rows, bool) if live is None else np.asarray(live, bool)
    waiting = (np.flatnonzero(~done_host & live).astype(np.int32) if n > 1 else
               np.zeros(0, np.int32))
    queue = jnp.asarray(np.pad(waiting, (0, rows - waiting.size)))
    slot_state = (jnp.zeros(s, jnp.int32), jnp.zeros(s, jnp.int32), jnp.zeros(s, jnp.int32),
                  jnp.zeros(s, bool), jnp.int32(0))
    chunks = steps = swaps = 0
    busy = waiting.size > 0
    versions = None
    if weights is not None:   # each token's version, filled chunk by chunk on the host
        versions, written = np.full((rows, n), version, np.int32), np.ones(rows, np.int32)
    while busy:
        if weights is not None and chunks:
            new_params, now = weights()
            swaps, version = swaps + (now != version), now
            if new_params is not params:
                params, layers = new_params, unstacked(new_params)
        with shd.tracing_mesh(mesh):
            cache, out, slot_state, ran, busy = decode_chunk(
                cfg, layers, pages, page_mask, page_len, cache, out, slot_state, first, queue,
                jnp.int32(waiting.size), noise, temperatures, max_new_tokens=n, num_samples=g,
                chunk_steps=int(chunk_steps), **draw)
        chunks, steps, busy = chunks + 1, steps + int(ran), bool(busy)
        if versions is not None:
            length = dist.to_host(out["lengths"])
            pos = np.arange(n)[None, :]
            versions[(pos >= written[:, None]) & (pos < length[:, None])] = version
            written = length
    lengths = out["lengths"]
    mask = jnp.arange(n)[None, :] < lengths[:, None]
    routes = None
    if record_routes:   # the prompts' [L, B, P, k] fanned out to rows, then the completions'
        routes = jnp.concatenate([jnp.repeat(jnp.transpose(prompt_routes, (1, 2, 0, 3)), g, 0),
                                  out["routes"]], axis=1)
    result = SampleOutput(tokens=out["tokens"], logps=out["logps"], mask=mask, lengths=lengths,
                          truncated=~out["done"], routes=routes)
    useful = int(dist.to_host(lengths)[live].sum()) - int(live.sum())
    return result, EngineStats(rows=rows, slots=s, chunks=chunks, decode_steps=steps,
                               useful_steps=useful, versions=versions, swaps=swaps)


def params_mesh(params: Any):
    """The mesh ``params`` are laid out on (their first leaf's ``NamedSharding`` over more
    than one device), or None: what the engine's programs are traced on."""
    for leaf in jax.tree.leaves(params):
        mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
        if isinstance(mesh, jax.sharding.Mesh) and mesh.size > 1:
            return mesh
    return None


@jax.jit
def unstacked(params: Any) -> Any:
    """``models.unstack_layers(params)`` as arrays of their own, for the decode chunks.

    Given stacked weights, ``decode_chunk`` copies every layer's weights out of the stacks
    at each call (XLA:CPU materialises the slices): a copy of all weights every
    ``chunk_steps`` decode steps. Done once per weights instead, the chunks read the
    per-layer arrays in place. This holds a second copy of the weights while decoding, as the
    static sampler does inside its program."""
    return models.unstack_layers(params)


def _dtype_name(dtype) -> str | None:
    return None if dtype is None else jnp.dtype(dtype).name


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _draw_noise_ahead(rng, n, rows, vocab):
    return noise_ahead(rng, n, rows, vocab, greedy=False)


def picker(temperature, top_k, top_p, stop_ids, min_new_tokens, noise, temperatures, rng):
    """pick(logits [R, V], t int32 [R], row int32 [R]) -> (tokens [R], logps [R]): the static
    sampler's draw for token t of each row (its noise row, its temperature, its stop rule).
    Shared with the partial-rollout pool (``sampling.partial``)."""
    stop = jnp.asarray(stop_ids, jnp.int32) if stop_ids else None

    def pick(logits, t, row):
        if temperatures is None:
            temp = temperature
            score_temp = models.scoring_temperature(temperature)
        else:
            temp = row_temperature(temperatures, t, row)
            score_temp = temp
        opts = dict(temperature=temp, top_k=top_k, top_p=top_p,
                    noise=None if noise is None else noise[t, row])
        if stop is None or min_new_tokens == 0:
            return sample_logits(rng, logits, **opts)
        forbid = (jnp.zeros(logits.shape[-1], bool).at[stop].set(True)[None, :]
                  & (t < min_new_tokens)[:, None])
        masked = jnp.where(forbid, jnp.finfo(jnp.float32).min, logits)
        tok, _ = sample_logits(rng, masked, **opts)
        logp_all = jax.nn.log_softmax(logits / score_temp, axis=-1)
        return tok, jnp.take_along_axis(logp_all, tok[:, None], axis=-1)[:, 0]

    def is_stop(tok):
        if stop is None:
            return jnp.zeros(tok.shape, bool)
        return jnp.any(tok[:, None] == stop[None, :], axis=-1)

    return pick, is_stop


DRAW_ARGS = ("temperature", "top_k", "top_p", "stop_ids", "pad_id", "min_new_tokens")


@functools.partial(jax.jit, static_argnames=("cfg", "num_samples", "cache_dtype",
                                             "record_routes") + DRAW_ARGS)
def _prefill(cfg, params, prompt_tokens, prompt_mask, rng, noise, temperatures,
             image_embeds=None, *, num_samples, cache_dtype, temperature, top_k, top_p, stop_ids,
             pad_id, min_new_tokens, record_routes=False):
    """Pages of the B prompts and each of the B*G rows' first token (prompt-major rows), and
    with ``record_routes`` the prompts' experts [L, B, P, k] (else None)."""
    pages, logits, *routes = paged.prefill_pages(cfg, params, prompt_tokens, prompt_mask,
                                                 cache_dtype, image_embeds, record_routes)
    logits = jnp.repeat(logits, num_samples, axis=0)
    rows = logits.shape[0]
    pick, is_stop = picker(temperature, top_k, top_p, stop_ids, min_new_tokens, noise,
                            temperatures, jax.random.fold_in(rng, 0))
    tok, logp = pick(logits, jnp.zeros((rows,), jnp.int32), jnp.arange(rows))
    return pages, tok, logp, is_stop(tok), (routes[0] if routes else None)


@functools.partial(jax.jit, donate_argnames=("cache", "out"),
                   static_argnames=("cfg", "max_new_tokens", "num_samples", "chunk_steps")
                   + DRAW_ARGS)
def decode_chunk(cfg, params, pages, page_mask, page_len, cache, out, slot_state, first, queue,
                  queued, noise, temperatures, *, max_new_tokens, num_samples, chunk_steps,
                  temperature, top_k, top_p, stop_ids, pad_id, min_new_tokens):
    """Up to ``chunk_steps`` decode steps; every step first gives each idle slot the next
    queued row. Returns early when no slot is busy and the queue is empty.

    slot_state: (row int32 [S], step int32 [S] (the token index sampled next), prev int32 [S]
    (the token fed next), active bool [S], taken int32 (rows of the queue already given out)).
    first: int32 [R], each row's first token; queue: int32 [R], the rows to decode in order
    (the first ``queued``). out: tokens/logps [R, N], lengths [R], done [R], written at each
    busy slot's (row, step); with ``out["routes"]`` int32 [R, N, L, k], each fed token's
    experts too. ``params`` stacked or, cheaper per call, already unstacked (``unstacked``).
    Returns ``(cache, out, slot_state, steps run, busy)``. The
    partial-rollout pool (``sampling.partial``) runs it too, with slots already holding rows.
    """
    n, g = max_new_tokens, num_samples
    rows = out["lengths"].shape[0]
    params = models.unstack_layers(params)
    pick, is_stop = picker(temperature, top_k, top_p, stop_ids, min_new_tokens, noise,
                            temperatures, None)

    def cond(carry):
        i, _, _, (_, _, _, active, taken), _ = carry
        return (i < chunk_steps) & (jnp.any(active) | (taken < queued))

    def body(carry):
        i, cache, out, (row, t, prev, active, taken), held = carry
        # Refill: the k-th idle slot takes queue[taken + k] while rows remain.
        rank = jnp.cumsum(~active) - 1
        take = ~active & (taken + rank < queued)
        new = queue[jnp.clip(taken + rank, 0, rows - 1)]
        row, t = jnp.where(take, new, row), jnp.where(take, 1, t)
        prev, active = jnp.where(take, first[new], prev), active | take
        taken = taken + jnp.sum(take, dtype=jnp.int32)
        page = row // g
        held = paged.refill_pages(held, pages, page, take)
        # Feed token t-1 (slot-cache index t-1, position prompt_len + t - 1), sample token t.
        index = jnp.where(active, t - 1, n)   # idle slots write nothing
        hidden, cache, *routes = paged.slot_decode(cfg, params, prev, page_len[page] + t - 1,
                                                   index, pages, page_mask, page, cache,
                                                   "routes" in out, slot_pages=held)
        logits = models.logits_from_hidden(cfg, params, hidden)
        tok, logp = pick(logits, jnp.minimum(t, n - 1), row)
        stop = is_stop(tok)
        at = jnp.where(active, row, rows)     # idle slots write out of range: dropped
        out = dict(
            out, tokens=out["tokens"].at[at, t].set(tok, mode="drop"),
            logps=out["logps"].at[at, t].set(logp, mode="drop"),
            lengths=out["lengths"].at[at].add(1, mode="drop"),
            done=out["done"].at[at].set(stop, mode="drop"))
        if routes:   # token t-1's experts (the one fed this step)
            out["routes"] = out["routes"].at[at, t - 1].set(routes[0], mode="drop")
        active = active & ~stop & (t + 1 < n)
        return i + 1, cache, out, (row, t + 1, tok, active, taken), held

    # Each slot's page, gathered once per chunk (slots may hold rows from the last chunk) and
    # refreshed only for the slots a refill gives a new row: a slot keeps its page for its
    # whole row, so gathering the pages at every step copied the same values again.
    held = paged.gather_pages(pages, slot_state[0] // g)
    i, cache, out, slot_state, _ = jax.lax.while_loop(
        cond, body, (jnp.int32(0), cache, out, slot_state, held))
    busy = jnp.any(slot_state[3]) | (slot_state[4] < queued)
    return cache, out, slot_state, i, busy


def programs(cfg: models.ModelConfig, params: Any, prompt_tokens: Any, prompt_mask: Any,
             rng: Any, *, max_new_tokens: int, num_samples: int, slots: int, chunk_steps: int,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             eos_id: int | Sequence[int] | None = None, pad_id: int = 0,
             stop_ids: Sequence[int] = (), min_new_tokens: int = 0,
             cache_dtype: Any = None, image_embeds: Any = None) -> list[tuple[str, Any, tuple]]:
    """The engine's two programs for a memory plan: ``[(name, jitted fn, abstract args)]``,
    ``fn.lower(*args)`` compiling what ``generate`` runs for prompts of this shape
    (``prefill``: the pages and first tokens; ``decode``: one chunk over the pages, the slot
    caches and the rows' outputs). Inputs may be ``jax.ShapeDtypeStruct``s."""
    b, p = prompt_tokens.shape
    n, g = int(max_new_tokens), int(num_samples)
    rows = b * g
    s = min(int(slots), rows)
    static = dict(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                  stop_ids=merge_stop_ids(eos_id, stop_ids), pad_id=int(pad_id),
                  min_new_tokens=int(min_new_tokens))
    dtype = _dtype_name(cache_dtype)
    noise = None
    if temperature != 0.0:
        noise = jax.eval_shape(lambda key: noise_ahead(key, n, rows, cfg.vocab_size, False), rng)

    def prefill(params, tokens, mask, key, noise, image_embeds=None):
        return _prefill(cfg, params, tokens, mask, key, noise, None, image_embeds,
                        num_samples=g, cache_dtype=dtype, **static)

    images = () if image_embeds is None else (image_embeds,)
    pages, first, *_ = jax.eval_shape(prefill, params, prompt_tokens, prompt_mask, rng, noise,
                                      *images)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    out = dict(tokens=i32(rows, n), logps=jax.ShapeDtypeStruct((rows, n), jnp.float32),
               lengths=i32(rows), done=jax.ShapeDtypeStruct((rows,), bool))
    cache = jax.eval_shape(lambda: paged.init_slot_cache(cfg, s, n, dtype=cache_dtype))
    slot_state = (i32(s), i32(s), i32(s), jax.ShapeDtypeStruct((s,), bool), i32())

    def decode(params, pages, page_mask, page_len, cache, out, slot_state, first, queue,
               queued, noise):
        return decode_chunk(cfg, params, pages, page_mask, page_len, cache, out, slot_state,
                             first, queue, queued, noise, None, max_new_tokens=n,
                             num_samples=g, chunk_steps=int(chunk_steps), **static)

    mesh = params_mesh(params)
    return [("prefill", jax.jit(shd.traced_on(prefill, mesh)),
             (params, prompt_tokens, prompt_mask, rng, noise, *images)),
            ("decode", jax.jit(shd.traced_on(decode, mesh), donate_argnums=(4, 5)),
             (params, pages, prompt_mask, i32(b), cache, out, slot_state, first, i32(rows), i32(),
              noise))]
