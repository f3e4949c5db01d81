"""Multi-turn episodes on decode slots: a turn that ends frees no other row from waiting.

The static multi-turn sampler (``sampling.multiturn``) runs turn k of every episode as one
batch: the batch decodes until its slowest turn stops, and the host steps the environments only
then. Here each of S slots holds one episode for its whole life and decodes at its own pace:

    pages, page_mask, page_len = episode_engine.prefill(cfg, params, prompt_tokens, prompt_mask)
    cache = paged.init_slot_cache(cfg, S, max_total_tokens + 1)
    state = episode_engine.empty_state(S, chunk_len=O, turn_len=N)
    # host: episode_engine.start(state, s, row, prompt_last_token, budget) on a free slot
    cache, state, steps = episode_engine.run_chunk(cfg, params, pages, page_mask, page_len,
                                                   cache, state, rng, num_samples=G, ...)
    # host: slots whose turn ended (occupied, not live) are read back, the environment steps,
    # then episode_engine.resume(state, s, ...) feeds the observation, or the slot is freed.

Every step each live slot feeds one token at its own cache index and either feeds the next
token of its pending observation (teacher forcing: the logits are not used) or samples. So an
observation enters the cache token by token while the other slots keep decoding, and a slot
whose turn ended waits only until the end of the chunk for the host.

Cache layout per slot (compact: what the host cut after a tool call is overwritten): index 0
holds the prompt's last token (the page holds the others), index j + 1 the trajectory's token j
(model and observation tokens alike), at position ``page_len + index``. As in
``sampling.multiturn``, a turn's last token has no keys/values when the turn ends; it leads the
next observation.

Randomness: token t of turn k of row r reads ``draw.row_draw(fold_in(fold_in(rng, k), t), r,
V)``, the draw ``sampling.multiturn`` makes for that row: the slot, the chunk size and the
order in which turns end change nothing. A caller may key a row's draw by another id
(``resume(..., draw=d)``: partial rollouts key it by the group's admission, so a carried
episode draws the same noise whichever iteration and row it plays in).
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rljax import distributed as dist, models
from rljax.models import paged
from rljax.sampling.draw import row_draw, row_temperature, sample_logits

# Host-side slot state (numpy); ``run_chunk`` takes and returns it as a dict of arrays.
#   row     int32 [S]     episode row held (-1: free)
#   draw    int32 [S]     the id its noise is keyed by (the row, unless the caller says)
#   prev    int32 [S]     the token fed at the next step
#   cursor  int32 [S]     the slot-cache index ``prev`` is written at
#   feed    int32 [S, O]  tokens to feed after ``prev`` before sampling (the observation)
#   feed_n, feed_i int32 [S]  how many of them, how many fed
#   turn    int32 [S]     the episode's turn;  t int32 [S]: tokens sampled in it
#   budget  int32 [S]     tokens the turn may sample
#   live    bool  [S]     decoding (False: free, or the turn ended and waits for the host)
#   tokens  int32 [S, N], logps f32 [S, N]: the turn's tokens and sampler log-probs
#   stopped bool  [S]     the turn ended on a stop id or stop sequence
#   temp    f32   [S, N]  optional (a temperature schedule): the temperature of each token
#                         of the slot's turn (the host sets it at start / resume)


def empty_state(slots: int, chunk_len: int, turn_len: int, pad_id: int = 0) -> dict:
    """Every slot free."""
    s, o, n = int(slots), int(chunk_len), int(turn_len)
    i32 = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
    return dict(row=np.full(s, -1, np.int32), draw=i32(s), prev=i32(s), cursor=i32(s),
                feed=i32(s, o), feed_n=i32(s), feed_i=i32(s), turn=i32(s), t=i32(s),
                budget=i32(s), live=np.zeros(s, bool), tokens=np.full((s, n), pad_id, np.int32),
                logps=np.zeros((s, n), np.float32), stopped=np.zeros(s, bool))


def start(state: dict, slot: int, row: int, first_token: int, budget: int) -> None:
    """Slot ``slot`` starts episode ``row``: it feeds the prompt's last token, then samples."""
    resume(state, slot, row=row, lead=first_token, observation=(), cursor=0, turn=0,
           budget=budget)


def resume(state: dict, slot: int, *, row: int, lead: int, observation, cursor: int, turn: int,
           budget: int, draw: int | None = None) -> None:
    """Slot ``slot`` continues episode ``row`` at turn ``turn``: it feeds ``lead`` (the last
    kept token of the turn before) at cache index ``cursor``, then ``observation``'s tokens
    (at most O), then samples up to ``budget`` tokens, its noise keyed by ``draw`` (default:
    ``row``)."""
    obs = np.asarray(observation, np.int32)
    if obs.size > state["feed"].shape[1]:
        raise ValueError(f"observation of {obs.size} tokens > chunk width "
                         f"{state['feed'].shape[1]}")
    state["row"][slot], state["prev"][slot], state["cursor"][slot] = row, lead, cursor
    state["draw"][slot] = row if draw is None else draw
    state["feed"][slot, :obs.size] = obs
    state["feed_n"][slot], state["feed_i"][slot] = obs.size, 0
    state["turn"][slot], state["t"][slot], state["budget"][slot] = turn, 0, budget
    state["live"][slot], state["stopped"][slot] = budget > 0, False
    state["logps"][slot] = 0.0


def free(state: dict, slot: int) -> None:
    state["row"][slot], state["live"][slot] = -1, False


@functools.partial(jax.jit, static_argnames=("cfg", "cache_dtype", "record_routes"))
def _prefill(cfg, params, prompt_tokens, prompt_mask, cache_dtype, record_routes=False,
             image_embeds=None):
    out = paged.prefill_pages(cfg, params, prompt_tokens[:, :-1], prompt_mask[:, :-1],
                              cache_dtype, image_embeds=image_embeds, with_routes=record_routes)
    return (out[0], out[2]) if record_routes else out[0]


def prefill(cfg: models.ModelConfig, params: Any, prompt_tokens, prompt_mask,
            cache_dtype=None, record_routes: bool = False, image_embeds=None) -> tuple:
    """Pages of every prompt but its last token (which each episode feeds first).

    prompt_tokens: int32 [B, P] left-padded (P >= 2), prompt_mask bool [B, P]; image_embeds
    [B, K, D] (a model with a vision tower): each prompt's image embeddings. Returns
    ``(pages, page_mask bool [B, P - 1], page_len int32 [B])``, and with ``record_routes`` (a
    mixture of experts) the paged tokens' experts, int32 [B, P - 1, L, k]."""
    prompt_tokens = np.asarray(prompt_tokens, np.int32)
    prompt_mask = np.asarray(prompt_mask, bool)
    if prompt_tokens.shape[1] < 2:
        raise ValueError(f"prompt bucket {prompt_tokens.shape[1]} must be >= 2")
    dtype = None if cache_dtype is None else jnp.dtype(cache_dtype).name
    out = _prefill(cfg, params, jnp.asarray(prompt_tokens), jnp.asarray(prompt_mask), dtype,
                   bool(record_routes), image_embeds)
    mask = prompt_mask[:, :-1]
    result = (out[0] if record_routes else out, jnp.asarray(mask),
              jnp.asarray(mask.sum(-1).astype(np.int32)))
    return result + (jnp.transpose(out[1], (1, 2, 0, 3)),) if record_routes else result


def init_routes(cfg: models.ModelConfig, cache: dict) -> dict:
    """``cache`` (``paged.init_slot_cache``) that also records routes: ``"routes"`` int32
    [S, C, L, k], the experts each slot's cache index was written with (routing replay;
    ``run_chunk`` writes them as it feeds tokens, C the slot cache's length)."""
    s = cache["k"][0].shape[0]
    length = max(c.shape[2] for c in cache["k"])
    return dict(cache, routes=jnp.zeros((s, length, cfg.num_layers, cfg.num_experts_per_tok),
                                        jnp.int32))


def _stop_hits(tokens, t, stop_ids, stop_seqs):
    """bool [S]: token ``t[s]`` of each slot's turn ends it (a stop id, or the last token of a
    stop sequence). tokens int32 [S, N]."""
    s, n = tokens.shape
    tok = jnp.take_along_axis(tokens, jnp.clip(t, 0, n - 1)[:, None], axis=1)[:, 0]
    hit = jnp.zeros((s,), bool)
    if stop_ids:
        hit = jnp.any(tok[:, None] == jnp.asarray(stop_ids, jnp.int32)[None, :], axis=-1)
    for seq in stop_seqs:
        k = len(seq)
        at = jnp.clip(t[:, None] - k + 1 + jnp.arange(k)[None, :], 0, n - 1)
        window = jnp.take_along_axis(tokens, at, axis=1)
        hit |= (t + 1 >= k) & jnp.all(window == jnp.asarray(seq, jnp.int32)[None, :], axis=-1)
    return hit


_STATIC = ("cfg", "num_samples", "chunk_steps", "temperature", "top_k", "top_p", "stop_ids",
           "stop_seqs")


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("cache",))
def _chunk(cfg, params, pages, page_mask, page_len, cache, state, rng, *, num_samples,
           chunk_steps, temperature, top_k, top_p, stop_ids, stop_seqs):
    params = models.unstack_layers(params)
    length = max(c.shape[2] for c in cache["k"])
    s, n = state["tokens"].shape
    o = state["feed"].shape[1]

    def noise_of(row, turn, t):
        key = jax.random.fold_in(jax.random.fold_in(rng, turn), t)
        return row_draw(key, row, cfg.vocab_size)

    def cond(carry):
        i, _, st = carry
        return (i < chunk_steps) & jnp.any(st["live"])

    def body(carry):
        i, cache, st = carry
        live, cursor = st["live"], st["cursor"]
        page = jnp.maximum(st["row"], 0) // num_samples
        index = jnp.where(live, cursor, length)   # free and waiting slots write nothing
        kv = {"k": cache["k"], "v": cache["v"]}
        out = paged.slot_decode(cfg, params, st["prev"], page_len[page] + cursor, index, pages,
                                page_mask, page, kv, with_routes="routes" in cache,
                                slot_pages=held)
        hidden = out[0]
        if "routes" in cache:   # the fed token's experts at its cache index
            routes = cache["routes"].at[jnp.arange(s), index].set(out[2], mode="drop")
            cache = dict(out[1], routes=routes)
        else:
            cache = out[1]
        logits = models.logits_from_hidden(cfg, params, hidden)
        feeding = live & (st["feed_i"] < st["feed_n"])
        sampling = live & ~feeding
        noise = None
        if temperature != 0.0:
            noise = jax.vmap(noise_of)(st["draw"], st["turn"], st["t"])
        t = st["t"]
        temp = temperature if "temp" not in st else row_temperature(
            st["temp"], jnp.clip(t, 0, n - 1), jnp.arange(s))
        tok, logp = sample_logits(None, logits, temperature=temp, top_k=top_k,
                                  top_p=top_p, noise=noise)
        at = sampling[:, None] & (jnp.arange(n)[None, :] == t[:, None])
        tokens = jnp.where(at, tok[:, None], st["tokens"])
        logps = jnp.where(at, logp[:, None], st["logps"])
        stop = sampling & _stop_hits(tokens, t, stop_ids, stop_seqs)
        t = t + sampling
        ended = sampling & (stop | (t >= st["budget"]))
        fed = jnp.take_along_axis(st["feed"], jnp.clip(st["feed_i"], 0, o - 1)[:, None],
                                  axis=1)[:, 0]
        st = dict(st, tokens=tokens, logps=logps, t=t, cursor=cursor + live,
                  prev=jnp.where(feeding, fed, jnp.where(sampling, tok, st["prev"])),
                  feed_i=st["feed_i"] + feeding, stopped=st["stopped"] | stop,
                  live=live & ~ended)
        return i + 1, cache, st

    # A slot's row (so its page) changes only between chunks, on the host: each slot's page is
    # gathered once here rather than every layer's page at every step.
    held = paged.gather_pages(pages, jnp.maximum(state["row"], 0) // num_samples)
    steps, cache, state = jax.lax.while_loop(cond, body, (jnp.int32(0), cache, state))
    return cache, state, steps


def run_chunk(cfg: models.ModelConfig, params: Any, pages: dict, page_mask, page_len,
              cache: dict, state: dict, rng: jax.Array, *, num_samples: int, chunk_steps: int,
              temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
              stop_ids=(), stop_sequences=()) -> tuple[dict, dict, int]:
    """Up to ``chunk_steps`` steps of every live slot (fewer when no slot is live).

    pages, page_mask, page_len: from ``prefill``; a slot of row r reads page r // num_samples.
    cache: ``paged.init_slot_cache(cfg, S, L)`` with L > every episode's cache length
    (donated); with ``init_routes`` it records each fed token's experts. state: the host's slot state (``empty_state``); returned as numpy after the
    chunk. stop_ids: merged EOS and stop ids; stop_sequences: token-id tuples that end a turn.
    Returns ``(cache, state, steps run)``."""
    cache, out, steps = _chunk(
        cfg, params, pages, page_mask, page_len, cache,
        {k: jnp.asarray(v) for k, v in state.items()}, rng, num_samples=int(num_samples),
        chunk_steps=int(chunk_steps), temperature=float(temperature), top_k=int(top_k),
        top_p=float(top_p), stop_ids=tuple(int(i) for i in stop_ids),
        stop_seqs=tuple(tuple(int(i) for i in q) for q in stop_sequences if len(q)))
    out, steps = dist.to_host_tree((out, steps))   # (several processes: the global values)
    return cache, {k: np.array(v) for k, v in out.items()}, int(steps)


def programs(cfg: models.ModelConfig, params: Any, prompt_tokens, prompt_mask, rng, *,
             num_samples: int, slots: int, chunk_len: int, turn_len: int, length: int,
             chunk_steps: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             stop_ids=(), stop_sequences=(), scheduled: bool = False
             ) -> list[tuple[str, Any, tuple]]:
    """The episode engine's two programs for a memory plan: ``[(name, jitted fn, abstract
    args)]`` (``prefill``: the prompt pages; ``decode``: one chunk over S slots of ``length``
    cache entries), as ``prefill`` and ``run_chunk`` compile them for prompts of this shape.
    Inputs may be ``jax.ShapeDtypeStruct``s. ``scheduled``: the slots carry their turns'
    temperatures (a temperature schedule: the state's ``temp``)."""
    b, p = prompt_tokens.shape
    s = min(int(slots), b * int(num_samples))
    static = dict(num_samples=int(num_samples), chunk_steps=int(chunk_steps),
                  temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                  stop_ids=tuple(int(i) for i in stop_ids),
                  stop_seqs=tuple(tuple(int(i) for i in q) for q in stop_sequences if len(q)))

    def prefill_fn(params, tokens, mask):
        return _prefill(cfg, params, tokens, mask, None)

    pages = jax.eval_shape(prefill_fn, params, prompt_tokens, prompt_mask)
    state = {k: jax.ShapeDtypeStruct(v.shape, v.dtype)
             for k, v in empty_state(s, chunk_len, turn_len).items()}
    if scheduled:
        state["temp"] = jax.ShapeDtypeStruct((s, turn_len), jnp.float32)
    cache = jax.eval_shape(lambda: paged.init_slot_cache(cfg, s, int(length)))
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731

    def decode(params, pages, page_mask, page_len, cache, state, rng):
        return _chunk(cfg, params, pages, page_mask, page_len, cache, state, rng, **static)

    return [("prefill", jax.jit(prefill_fn), (params, prompt_tokens, prompt_mask)),
            ("decode", jax.jit(decode, donate_argnums=(4,)),
             (params, pages, jax.ShapeDtypeStruct((b, p - 1), bool), i32(b), cache, state,
              rng))]
