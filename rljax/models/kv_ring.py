"""Ring buffers for the KV cache of sliding-window layers.

A sliding-window (local) layer attends to its last ``window`` positions only, so its keys and
values older than that are never read again. A decode cache of S slots (prompt + completion)
keeps them anyway; here such a layer keeps ``R = window`` slots instead: the key/value of
global cache slot ``s`` lives in ring slot ``s % R``. Global (full-attention) layers keep all
S slots. For Gemma 3 1B (22 of 26 layers local, a 512-position window) the cache of a 4k-token
completion shrinks by 74% (``kv_cache_bytes`` gives the numbers; ``rljax plan`` prints them;
``bench/kv_ring.py`` compiles the sampler both ways).

A ring layer attends over ``concat(ring, new keys)``: the R slots written before this call
(``ring_columns`` says which global slot each holds) then the T new ones, with the trunk's
[B, T, S] mask gathered at those global slots; only then are the new keys written in. So a
prefill chunk longer than the window still sees every key its queries need.

This relies on a row's valid slots being contiguous after its first one (left padding, then
the prompt and its completion), so that R slots hold every key within ``window`` positions.
Multi-turn caches (invalid slots between turns) and the slot engine's pages keep full caches.

Shapes: B rows, K kv heads, R ring slots, S global slots, T new tokens, Dh head size.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp


def ring_size(cfg, slots: int) -> Optional[int]:
    """Ring slots of ``cfg``'s local layers in a cache of ``slots`` global slots: the window,
    or None where no layer is local, every layer is (a model of fewer layers than its
    local:global period: ``trunk`` reads the global slot count off a full-length layer's
    cache, so one must stay), or the whole cache fits in the window anyway."""
    window = cfg.sliding_window
    local = cfg.local_layers
    if not any(local) or all(local) or window is None or window >= slots:
        return None
    return int(window)


def init_layer_cache(cfg, batch_size: int, slots: int, dtype=None) -> dict:
    """Zeroed per-layer KV cache ``{"k", "v": tuple of L [B, K, S_l, Dh]}``: ``S_l = slots`` for
    global layers, ``ring_size`` for local ones (the form ``transformer.unstack_cache`` gives,
    which ``trunk`` reads layer by layer)."""
    ring = ring_size(cfg, slots)
    dtype = cfg.compute_dtype if dtype is None else dtype
    kinds = cfg.local_layers or (False,) * cfg.num_layers
    shapes = [(batch_size, cfg.num_kv_heads, ring if (local and ring) else slots, cfg.head_dim)
              for local in kinds]
    return {name: tuple(jnp.zeros(s, dtype) for s in shapes) for name in ("k", "v")}


def kv_cache_bytes(cfg, rows: int, slots: int, dtype=None, ring: bool = True) -> int:
    """Bytes of the keys and values of ``rows`` rows over ``slots`` global slots, with local
    layers in rings (``ring``) or at full length."""
    size = ring_size(cfg, slots) if ring else None
    kinds = cfg.local_layers or (False,) * cfg.num_layers
    per_slot = 2 * rows * cfg.num_kv_heads * cfg.head_dim * \
        jnp.dtype(cfg.compute_dtype if dtype is None else dtype).itemsize
    return int(sum(per_slot * (size if (local and size) else slots) for local in kinds))


def ring_columns(cache_index: jax.Array, ring: int) -> tuple[jax.Array, jax.Array]:
    """The global slot each ring slot holds before a call writing at ``cache_index``: the latest
    slot ``s < cache_index`` with ``s % ring == r``. Returns ``(slots int32 [R] clipped at 0,
    valid bool [R])``; a slot is invalid where nothing was written there yet."""
    r = jnp.arange(ring, dtype=jnp.int32)
    last = cache_index - 1
    slots = last - jnp.mod(last - r, ring)
    return jnp.maximum(slots, 0), slots >= 0


def ring_attend(buf_k: jax.Array, buf_v: jax.Array, k: jax.Array, v: jax.Array,
                mask: jax.Array, cache_index: jax.Array):
    """Keys, values and mask for one ring layer's attention, and its updated buffers.

    buf_k, buf_v: [B, K, R, Dh] (the layer's ring); k, v: [B, T, K, Dh] (this call's new keys
    and values, cache slots ``[cache_index, cache_index + T)``); mask: bool [B, T, S] over the
    global slots (causality, padding and window already applied).
    Returns ``(keys [B, K, R + T, Dh], values [B, K, R + T, Dh], mask [B, T, R + T],
    new buf_k, new buf_v)``.
    """
    ring, t = buf_k.shape[2], k.shape[1]
    cols, valid = ring_columns(cache_index, ring)
    new_cols = cache_index + jnp.arange(t, dtype=jnp.int32)
    mask = jnp.concatenate([jnp.take(mask, cols, axis=2) & valid[None, None, :],
                            jax.lax.dynamic_slice_in_dim(mask, cache_index, t, axis=2)], axis=2)
    new_k = k.astype(buf_k.dtype).swapaxes(1, 2)   # [B, K, T, Dh]
    new_v = v.astype(buf_v.dtype).swapaxes(1, 2)
    keys = jnp.concatenate([buf_k, new_k], axis=2)
    values = jnp.concatenate([buf_v, new_v], axis=2)
    return keys, values, mask, _write(buf_k, new_k, new_cols), _write(buf_v, new_v, new_cols)


def _write(buf: jax.Array, new: jax.Array, cols: jax.Array) -> jax.Array:
    """``new`` [B, K, T, Dh] of global slots ``cols`` [T] into ring ``buf`` [B, K, R, Dh]: the
    last min(T, R) of them (older ones would be overwritten within this call)."""
    ring, t = buf.shape[2], new.shape[2]
    if t == 1:   # the decode step: one slot, written in place
        zero = jnp.int32(0)
        return jax.lax.dynamic_update_slice(buf, new, (zero, zero, cols[0] % ring, zero))
    keep = min(t, ring)
    return buf.at[:, :, cols[t - keep:] % ring].set(new[:, :, t - keep:])
