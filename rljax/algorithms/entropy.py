"""Per-token entropy of the policy from logits, memory-conscious.

H(softmax(z)) = logsumexp(z) - sum_v softmax(z)_v z_v. The [B, T, V] logits are processed in
chunks of the sequence axis; each chunk runs under ``jax.checkpoint`` so the backward pass
recomputes the softmax of one chunk instead of keeping [B, T, V] probabilities alive.
The entropy bonus coefficient is applied in ``combine_token_losses``.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

Array = jnp.ndarray


@jax.checkpoint
def _entropy_chunk(z: Array) -> Array:
    z = z.astype(jnp.float32)
    mx = jax.lax.stop_gradient(z.max(axis=-1, keepdims=True))
    e = jnp.exp(z - mx)
    s = e.sum(axis=-1)
    # -inf logits (masked vocabulary) have e = 0; keep 0 * -inf out of value and gradient.
    zc = jnp.where(e > 0, z - mx, 0.0)
    # logsumexp - E_p[z], with E_p[z] = sum e z / s; shifting by mx cancels.
    return jnp.log(s) - (e * zc).sum(axis=-1) / s


def entropy_from_logits(logits: Array, *, temperature: float = 1.0,
                        chunk_size: Optional[int] = 256) -> Array:
    """Entropy [B, T] of softmax(logits / temperature); logits [B, T, V] (any float dtype).

    chunk_size: positions of the T axis per chunk (None: one chunk). Static Python slicing,
    so no padded copy of the logits is made.
    """
    if temperature != 1.0:
        logits = logits / temperature
    t = logits.shape[1]
    if chunk_size is None or chunk_size >= t:
        return _entropy_chunk(logits)
    parts = [_entropy_chunk(logits[:, i:i + chunk_size]) for i in range(0, t, chunk_size)]
    return jnp.concatenate(parts, axis=1)


def entropy_from_logps(logps_full: Array) -> Array:
    """Entropy [..] from normalised log-probabilities [.., V]: -sum p log p (0 log 0 = 0)."""
    p = jnp.exp(logps_full)
    return -jnp.where(p > 0, p * logps_full, 0.0).sum(axis=-1)
