"""PPO critic loss (Schulman et al. 2017) with optional value clipping.

    l_t = 0.5 * max((V_t - R_t)^2, (clip(V_t, V_old - c, V_old + c) - R_t)^2)

without clipping (clip_range=None) l_t = 0.5 * (V_t - R_t)^2. Aggregated like the policy
loss, returning (weighted_sum, weight).
"""
from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from rljax.algorithms.aggregation import aggregate

Array = jnp.ndarray


def value_loss_tokens(values: Array, old_values: Optional[Array], returns: Array, mask: Array,
                      clip_range: Optional[float] = None) -> Tuple[Array, Array]:
    """Per-token critic loss [B, T] and a bool [B, T] "clipped branch was taken" indicator."""
    m = jnp.asarray(mask).astype(bool)
    v = jnp.where(m, jnp.asarray(values, jnp.float32), 0.0)
    ret = jax.lax.stop_gradient(jnp.where(m, jnp.asarray(returns, jnp.float32), 0.0))
    l1 = (v - ret) ** 2
    if clip_range is None:
        return jnp.where(m, 0.5 * l1, 0.0), jnp.zeros_like(m)
    if old_values is None:
        raise ValueError("value clipping (clip_range) needs old_values")
    old = jax.lax.stop_gradient(jnp.where(m, jnp.asarray(old_values, jnp.float32), 0.0))
    vc = jnp.clip(v, old - clip_range, old + clip_range)
    l2 = (vc - ret) ** 2
    return jnp.where(m, 0.5 * jnp.maximum(l1, l2), 0.0), m & (l2 > l1)


def value_loss(values: Array, old_values: Optional[Array], returns: Array, mask: Array, *,
               clip_range: Optional[float] = None, agg_mode: str = "token-mean",
               max_len: Optional[int] = None) -> Tuple[Array, Array]:
    """PPO value loss, all inputs [B, T]; returns (weighted_sum, weight)."""
    tokens, _ = value_loss_tokens(values, old_values, returns, mask, clip_range)
    return aggregate(tokens, jnp.asarray(mask), agg_mode, max_len=max_len)
