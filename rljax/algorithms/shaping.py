"""Rollout shaping helpers: overlong penalty, truncation masking, dynamic-sampling filter,
and the unbiased pass@k estimator."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

Array = jnp.ndarray


def overlong_penalty(lengths: Array, max_len: int, buffer_len: int,
                     factor: float = 1.0) -> Array:
    """DAPO soft overlong punishment (Yu et al. 2025), added to the task reward. [B] -> [B]:

        0                                      if L <= max_len - buffer_len
        ((max_len - buffer_len) - L) / buffer_len   if max_len - buffer_len < L <= max_len
        -1                                     if L > max_len
    times ``factor``.
    """
    if buffer_len <= 0 or buffer_len > max_len:
        raise ValueError(f"need 0 < buffer_len <= max_len, got {buffer_len}, {max_len}")
    L = jnp.asarray(lengths, jnp.float32)
    expected = max_len - buffer_len
    pen = jnp.where(L <= expected, 0.0, (expected - L) / buffer_len)
    pen = jnp.where(L > max_len, -1.0, pen)
    return factor * pen


def mask_truncated(mask: Array, truncated: Array) -> Array:
    """Overlong filtering (DAPO): drop every token of truncated completions (no EOS within the
    budget) from the loss. mask [B, T], truncated bool [B] -> mask [B, T]."""
    return jnp.asarray(mask).astype(bool) & ~jnp.asarray(truncated).astype(bool)[:, None]


def is_truncated(tokens: Array, mask: Array, eos_id: int) -> Array:
    """bool [B]: the completion has no EOS among its real tokens."""
    m = jnp.asarray(mask).astype(bool)
    return ~((jnp.asarray(tokens) == eos_id) & m).any(axis=-1)


def nonzero_variance_groups(rewards, group_size: int):
    """DAPO dynamic sampling: bool [num_groups], True where the group's rewards are not all
    equal (groups with all-equal rewards give zero advantage and no gradient). Works on NumPy
    (host-side filtering) and jax arrays alike."""
    xp = jnp if isinstance(rewards, jax.Array) else np
    r = xp.asarray(rewards).reshape(-1, group_size)
    return r.max(axis=1) > r.min(axis=1)


def pass_at_k(n, c, k: int):
    """Unbiased pass@k (Chen et al. 2021, "Evaluating LLMs Trained on Code"), NumPy.

    n: samples per problem, c: correct samples (scalars or arrays, broadcast).
    pass@k = 1 - C(n - c, k) / C(n, k), computed as 1 - prod_{i=n-c+1}^{n} (1 - k / i)
    for numerical stability; 1 when n - c < k. Requires k <= n.
    """
    n_arr, c_arr = np.broadcast_arrays(np.asarray(n, np.int64), np.asarray(c, np.int64))
    if np.any(k > n_arr):
        raise ValueError("pass_at_k needs k <= n")
    if np.any((c_arr < 0) | (c_arr > n_arr)):
        raise ValueError("pass_at_k needs 0 <= c <= n")
    out = np.empty(n_arr.shape, np.float64)
    for idx in np.ndindex(n_arr.shape):
        nn, cc = int(n_arr[idx]), int(c_arr[idx])
        if nn - cc < k:
            out[idx] = 1.0
        else:
            out[idx] = 1.0 - np.prod(1.0 - k / np.arange(nn - cc + 1, nn + 1, dtype=np.float64))
    return out if out.shape else float(out)
