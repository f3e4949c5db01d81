"""Attention kernels and masks: grouped-query attention over a whole sequence or a KV cache,
score scaling and soft-capping, and the sliding-window (local attention) masks.

Shapes: B batch, T queries, S keys, H query heads, K key/value heads, Dh head size.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

# Large finite negative instead of -inf: rows whose keys are all masked (left-padding queries)
# then give a uniform softmax instead of NaN, which would poison gradients through `where`.
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def scale_scores(scores: jax.Array, head_dim: int, scale: Optional[float] = None,
                 softcap: Optional[float] = None) -> jax.Array:
    """float32 q.k scores times ``scale`` (None: ``head_dim ** -0.5``), then, with ``softcap``,
    ``softcap * tanh(scores / softcap)`` (Gemma 2's attention-logit soft-capping)."""
    scores = scores * (head_dim ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    return scores


def window_mask(q_pos: jax.Array, k_pos: jax.Array, window: int) -> jax.Array:
    """bool ``q_pos[..., :, None] - k_pos[..., None, :] < window``: the keys a sliding-window
    layer may see (the query itself and the ``window - 1`` before it; causality and padding
    are masked separately). q_pos int [..., T], k_pos int [..., S] -> [..., T, S]."""
    return (q_pos[..., :, None] - k_pos[..., None, :]) < window


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
              kv_layout: str = "bskd", impl: str = "xla", scale: Optional[float] = None,
              softcap: Optional[float] = None) -> jax.Array:
    """Grouped-query attention.

    q: [B, T, H, Dh]; k, v: [B, S, K, Dh] (``kv_layout="bskd"``) or, in the KV cache's layout,
    [B, K, S, Dh] (``"bksd"``), with H % K == 0; mask: bool [B, T, S] (True = attend).
    Returns [B, T, H, Dh] in ``q.dtype``. Scores and softmax in float32; ``scale`` and
    ``softcap`` as ``scale_scores``.

    The contractions are written in the keys' own layout: for the cache, scores contract Dh (the
    minor axis of q and k) and the output contracts S (the major axis of v), so each layer's
    cache slice reaches the dots as a contiguous block instead of a transposed copy of the whole
    S extent at every decode step.

    ``impl="cudnn"`` (``"auto"`` where it applies: GPU, bf16/fp16, ``"bskd"``, no soft-cap)
    runs the fused kernel of ``jax.nn.dot_product_attention``, which never writes the
    [B, H, T, S] scores.
    """
    if kv_layout == "bskd" and softcap is None and _use_cudnn(impl, q.dtype):
        return _cudnn_attention(q, k, v, mask, scale)
    b, t, h, dh = q.shape
    kv = k.shape[kv_layout.index("k")]
    q = q.reshape(b, t, kv, h // kv, dh)
    if t == 1 and kv_layout == "bksd" and jax.default_backend() == "cpu":
        return _decode_attention_cpu(q, k, v, mask, scale, softcap).reshape(b, t, h, dh)
    scores = jnp.einsum(f"btkgd,{kv_layout}->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scale_scores(scores, dh, scale, softcap)
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum(f"bkgts,{kv_layout}->btkgd", probs, v)
    return out.reshape(b, t, h, dh)


def _decode_attention_cpu(q, k, v, mask, scale=None, softcap=None):
    """One query per row against the KV cache: q [B, 1, K, G, Dh]; k, v [B, K, S, Dh]; mask
    [B, 1, S]. Returns [B, 1, K, G, Dh] in ``q.dtype``.

    The probabilities-times-values contraction is a multiply and a sum over S instead of a
    dot: XLA:CPU runs that dot as many tiny batched matrix products (G rows each). At
    SmolLM2's decode shape one layer's attention took 3.7 ms that way and 0.9 ms this way
    (a microbenchmark; in place, ``bench/decode_step.py``; both in bench/RESULTS.md).
    """
    scores = decode_scores(q[:, 0], k)
    scores = scale_scores(scores, q.shape[-1], scale, softcap)
    scores = jnp.where(mask[:, :, None, :], scores, _MASK_VALUE)   # mask [B, 1, S] -> [B, 1, 1, S]
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.sum(probs[..., None] * v.astype(jnp.float32)[:, :, None], axis=-2)
    return out[:, None].astype(q.dtype)


def decode_scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """float32 scores of one query per row: q [B, K, G, Dh], k [B, K, S, Dh] -> [B, K, G, S].

    On XLA:CPU one matrix-vector product per query head of a group: faster there than the
    batched [G, Dh] x [Dh, S] products (0.52 vs 0.69 ms per layer at SmolLM2's decode shape,
    G = 3). Elsewhere one batched einsum.
    """
    if jax.default_backend() != "cpu":
        return jnp.einsum("bkgd,bksd->bkgs", q, k, preferred_element_type=jnp.float32)
    return jnp.stack([jnp.einsum("bkd,bksd->bks", q[:, :, i], k,
                                 preferred_element_type=jnp.float32)
                      for i in range(q.shape[2])], axis=2)


def _use_cudnn(impl: str, dtype) -> bool:
    if impl == "xla":
        return False
    fits = jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
    if impl == "cudnn" and not fits:
        raise ValueError("attention_impl='cudnn' needs a GPU and bfloat16/float16 compute "
                         f"(backend {jax.default_backend()!r}, dtype {jnp.dtype(dtype).name}); "
                         "use 'auto' to fall back to 'xla' elsewhere")
    return fits


def _cudnn_attention(q, k, v, mask, scale=None):
    # A left-padding query row has no key to attend to (every earlier slot is padding); a fully
    # masked row is undefined in the fused kernel, so such rows attend to themselves. Their
    # outputs are never read by a real token (real queries never attend padding keys).
    t, s = mask.shape[1], mask.shape[2]
    mask = mask | jnp.eye(t, s, k=s - t, dtype=bool)[None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale,
                                        implementation="cudnn")
