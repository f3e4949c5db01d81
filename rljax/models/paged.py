"""One decode step over independent slots whose prompts live in shared pages.

The static sampler keeps one KV cache row per completion: a prompt's keys and values are
copied into each of its G rows, and every row sits at the same cache position. A slot engine
(``rljax.sampling.engine``) keeps S decode slots that start and stop at different times, and
splits the cache in two:

* **prompt pages** ``{"k", "v"}``: per layer ``[pages, K, P, Dh]``, one page per prompt, written
  once by the prefill and read by all G of its samples (never stored per sample; a decode loop
  may hold a copy per slot while it runs, ``gather_pages``);
* **slot caches**: per layer ``[S, K, N, Dh]``, slot ``s`` holding the completion it decodes now;
  slot ``s`` writes its token's keys/values at its own index ``t[s]``.

A slot's query attends to its page's real prompt tokens and to its own completion slots
``<= t[s]``, in one softmax over both parts (scores and softmax in float32, as
``transformer.attention``). Stale entries above ``t[s]`` left by the slot's previous sample are
masked, so a reused slot needs no clearing. A sliding-window layer (gemma2/3) also masks keys
``sliding_window`` or more positions behind the query, in the page and in the slot alike, and
keeps its slot caches as rings of ``sliding_window`` entries (``kv_ring``) when N outgrows it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax.models import head, kv_ring, transformer as tfm
from rljax.models.attention import decode_scores, scale_scores
from rljax.models.config import ModelConfig


def prefill_pages(cfg: ModelConfig, params: dict, prompt_tokens: jax.Array,
                  prompt_mask: jax.Array, cache_dtype=None, image_embeds=None,
                  with_routes: bool = False) -> tuple:
    """Runs the prompts once and keeps their keys/values as pages.

    prompt_tokens: int32 [B, P], left-padded (prompt_mask bool [B, P]); ``image_embeds``
    [B, K, D] (optional): the prompts' image tokens, as ``transformer.trunk`` takes them (the
    decode steps after the prefill attend to the pages as to any keys). Returns
    ``(pages {"k", "v": tuple of L [B, K, P, Dh]}, logits float32 [B, V] at each prompt's last
    token)``, and with ``with_routes`` (a mixture of experts) each prompt token's experts in
    every layer, int32 [L, B, P, k].
    """
    b, p = prompt_tokens.shape
    cache = tfm.init_cache(cfg, b, p, dtype=cache_dtype)
    out = tfm.trunk(cfg, params, prompt_tokens, attention_mask=prompt_mask,
                    positions=tfm.default_positions(prompt_mask), cache=cache, cache_index=0,
                    image_embeds=image_embeds, with_moe_stats=with_routes)
    hidden, cache = out[:2]
    result = (tfm.unstack_cache(cache), head.logits_from_hidden(cfg, params, hidden[:, -1]))
    return result + (out[2]["ids"],) if with_routes else result


def init_slot_cache(cfg: ModelConfig, slots: int, length: int, dtype=None) -> dict:
    """Zeroed slot caches ``{"k", "v": tuple of L [slots, K, length, Dh]}``; a sliding-window
    layer's is a ring of ``sliding_window`` entries when ``length`` outgrows it
    (``kv_ring.init_layer_cache``)."""
    return kv_ring.init_layer_cache(cfg, slots, length, dtype=dtype)


def gather_pages(pages: dict, page_of: jax.Array) -> dict:
    """Each slot's page: ``{"k", "v": tuple of L [S, K, P, Dh]}`` from pages' ``[pages, K, P,
    Dh]`` and page_of int32 [S]. A decode loop whose slots keep their page for many steps
    gathers once and passes the result to ``slot_decode`` (``slot_pages``) instead of
    gathering every layer's page at every step (2 L gathers of [S, K, P, Dh] per step);
    ``refill_pages`` then updates the slots that change page. Costs S pages per layer of
    memory while the loop runs."""
    return {name: tuple(x[page_of] for x in c) for name, c in pages.items()}


def refill_pages(slot_pages: dict, pages: dict, page_of: jax.Array, take: jax.Array) -> dict:
    """``slot_pages`` (``gather_pages``) with slot s's entries set to page ``page_of[s]``
    where take bool [S]. One slot at a time, only the taken ones: a step without a refill
    copies nothing, and a refill copies one page per layer instead of all S slots' pages."""
    s = take.shape[0]
    slots = jnp.nonzero(take, size=s, fill_value=0)[0]   # the taken slots first

    def body(j, held):
        slot = slots[j]
        page = page_of[slot]
        return {name: tuple(jax.lax.dynamic_update_index_in_dim(
            h, jax.lax.dynamic_index_in_dim(x, page, keepdims=False).astype(h.dtype), slot, 0)
            for h, x in zip(held[name], pages[name])) for name in held}

    return jax.lax.fori_loop(0, jnp.sum(take, dtype=jnp.int32), body, slot_pages)


def _write(cache: jax.Array, new: jax.Array, index: jax.Array) -> jax.Array:
    """cache [S, K, N, Dh] with ``new`` [S, K, Dh] written at slot s's own index ``index[s]``."""
    s = cache.shape[0]
    return cache.at[jnp.arange(s), :, index].set(new.astype(cache.dtype), mode="drop",
                                                 unique_indices=True)


def slot_attention(q: jax.Array, k_page: jax.Array, v_page: jax.Array, page_mask: jax.Array,
                   k: jax.Array, v: jax.Array, own_mask: jax.Array, scale=None,
                   softcap=None) -> jax.Array:
    """One query per slot over its prompt page and its own completion, one softmax.

    q: [S, H, Dh]; k_page, v_page: [S, K, P, Dh] (each slot's page); page_mask: bool [S, P];
    k, v: [S, K, N, Dh] (the slot caches); own_mask: bool [S, N]. Returns [S, H, Dh] in
    ``q.dtype``. ``scale``, ``softcap``: as ``attention.scale_scores``.
    """
    s, h, dh = q.shape
    kv = k.shape[1]
    q = q.reshape(s, kv, h // kv, dh)
    # Matrix-vector products and a multiply-sum for the values, as the static decode step
    # (``attention._decode_attention_cpu``): XLA:CPU runs the batched [G, Dh] dots slowly
    # (per decode step of the toy bench/engine.py model at 32 slots: 1.9 vs 2.2 ms).
    s_page = decode_scores(q, k_page)
    s_own = decode_scores(q, k)
    s_page = jnp.where(page_mask[:, None, None, :], scale_scores(s_page, dh, scale, softcap),
                       tfm._MASK_VALUE)
    s_own = jnp.where(own_mask[:, None, None, :], scale_scores(s_own, dh, scale, softcap),
                      tfm._MASK_VALUE)
    probs = jax.nn.softmax(jnp.concatenate([s_page, s_own], axis=-1), axis=-1)
    p = k_page.shape[2]
    out = (jnp.sum(probs[..., :p, None] * v_page.astype(jnp.float32)[:, :, None], axis=-2)
           + jnp.sum(probs[..., p:, None] * v.astype(jnp.float32)[:, :, None], axis=-2))
    return out.reshape(s, h, dh).astype(q.dtype)


def slot_decode(cfg: ModelConfig, params: dict, tokens: jax.Array, positions: jax.Array,
                index: jax.Array, pages: dict, page_mask: jax.Array, page_of: jax.Array,
                cache: dict, with_routes: bool = False, slot_pages: dict | None = None) -> tuple:
    """Feeds one token per slot.

    tokens, positions, index, page_of: int32 [S] (the token, its position in the sequence, the
    slot-cache index it is written at, the slot's page); pages from ``prefill_pages``;
    page_mask: bool [pages, P]; cache from ``init_slot_cache``. ``params`` unstacked
    (``transformer.unstack_layers``). Slots whose index is out of range write nothing (idle
    slots pass N). Returns ``(hidden [S, D] in cfg.dtype, cache)``, and with ``with_routes``
    (a mixture of experts) the fed tokens' experts in every layer, int32 [S, L, k].
    ``slot_pages``: each slot's page already gathered (``gather_pages(pages, page_of)``), read
    instead of ``pages``; ``page_of`` still selects the page masks.
    """
    n = max(c.shape[2] for c in cache["k"])
    own_mask = jnp.arange(n)[None, :] <= index[:, None]
    slot_page_mask = page_mask[page_of]
    positions = positions[:, None].astype(jnp.int32)
    rope = tfm.rope_tables(positions, tfm.rope_inv_freq(cfg), cfg.compute_dtype)
    kinds = cfg.local_layers
    if kinds:
        # Window over sequence positions: the page's keys sit at its prompt positions, slot
        # index j at the position of the slot's token minus (index - j).
        page_pos = tfm.default_positions(slot_page_mask)                       # [S, P]
        own_pos = positions - index[:, None] + jnp.arange(n)[None, :]          # [S, N]
        w = cfg.sliding_window
        local_masks = (slot_page_mask & tfm.window_mask(positions, page_pos, w)[:, 0],
                       own_mask & tfm.window_mask(positions, own_pos, w)[:, 0])
        rope_local = tfm.local_rope(cfg, positions, rope)
        ring = kv_ring.ring_size(cfg, n)
        if ring:
            # Ring entry j holds the slot's latest completion index c <= index with c % R == j
            # (this step's token is written before attending); c < 0: nothing of this sample.
            held = index[:, None] - jnp.mod(index[:, None] - jnp.arange(ring)[None, :], ring)
            ring_pos = positions - index[:, None] + held
            local_masks = (local_masks[0],
                           (held >= 0) & tfm.window_mask(positions, ring_pos, w)[:, 0])
            # Idle slots (index n) must still write nothing.
            ring_index = jnp.where(index < n, jnp.mod(index, ring), ring)
    x = tfm.embed_tokens(cfg, params, tokens[:, None])
    lora_list = (params["lora"]["layers"] if "lora" in params
                 else (None,) * len(params["layers"]))
    ks, vs = list(cache["k"]), list(cache["v"])
    moe_io = {"stats": []} if with_routes else None
    for i, (p, lp) in enumerate(zip(params["layers"], lora_list)):
        masks, r = (slot_page_mask, own_mask), rope
        if kinds and kinds[i]:
            masks, r = local_masks, rope_local

        def attend(q, k, v, i=i, masks=masks):   # q [S, 1, H, Dh]; k, v [S, 1, K, Dh]
            at = ring_index if ks[i].shape[2] < n else index
            ks[i] = _write(ks[i], k[:, 0], at)
            vs[i] = _write(vs[i], v[:, 0], at)
            if slot_pages is None:
                k_page, v_page = pages["k"][i][page_of], pages["v"][i][page_of]
            else:
                k_page, v_page = slot_pages["k"][i], slot_pages["v"][i]
            attn = slot_attention(q[:, 0], k_page.astype(q.dtype), v_page.astype(q.dtype),
                                  masks[0],
                                  ks[i].astype(q.dtype), vs[i].astype(q.dtype), masks[1],
                                  cfg.attn_scale, cfg.attn_logit_softcapping)
            return attn[:, None]

        x = tfm.block(cfg, tfm._cast_layer(cfg, p), x, r, attend, lp, moe_io=moe_io)
    x = tfm.rms_norm(x, params["final_norm"], cfg.rms_norm_eps, cfg.norm_plus_one)
    out = (x[:, 0], {"k": tuple(ks), "v": tuple(vs)})
    if with_routes:   # per layer [S, 1, k] -> [S, L, k]
        out += (jnp.stack([st["ids"][:, 0] for st in moe_io["stats"]], axis=1),)
    return out
