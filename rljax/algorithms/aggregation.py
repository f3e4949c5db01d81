"""Loss aggregation modes: per-token losses [B, T] -> (weighted_sum, weight).

Every mode returns a numerator and a denominator instead of a mean, so the trainer can sum
both over micro-batches and data-parallel shards and divide once at the end. That makes the
final loss (and its gradient) independent of how the batch was split, as long as the split is
along the batch (sequence) axis.

Modes (names as in verl's ``loss_agg_mode``):

``token-mean``
    sum_{b,t} l[b,t] m[b,t]  /  sum_{b,t} m[b,t].  DAPO's token-level loss (Yu et al. 2025).
``seq-mean-token-mean``
    per-sequence token mean, then mean over sequences. The original GRPO objective
    (Shao et al. 2024, DeepSeekMath): 1/G sum_i 1/|o_i| sum_t.
``seq-mean-token-sum``
    per-sequence token sum, then mean over sequences.
``seq-mean-token-sum-norm``
    per-sequence token sum divided by a *constant* ``max_len`` (default: T), then mean over
    sequences. Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): removes the
    length bias of 1/|o_i|.

For the ``seq-mean-*`` modes the weight is the number of sequences that have at least one
unmasked token (fully-masked rows are padding and count for nothing), and the sum is the sum of
per-sequence values. Because each sequence's value depends only on its own row, splitting the
batch into micro-batches changes neither the total sum nor the total weight.
"""
from __future__ import annotations

from typing import Optional, Tuple

import jax.numpy as jnp

Array = jnp.ndarray

AGGREGATION_MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def safe_divide(num: Array, den: Array) -> Array:
    """num / den, with 0 where den == 0 (no NaN, gradient-safe)."""
    den = jnp.asarray(den)
    ok = den != 0
    return jnp.where(ok, num / jnp.where(ok, den, 1), 0.0)


def aggregate(
    loss_tokens: Array,
    mask: Array,
    mode: str = "token-mean",
    *,
    max_len: Optional[int] = None,
) -> Tuple[Array, Array]:
    """Aggregate per-token losses into (weighted_sum, weight).

    Args:
      loss_tokens: float [B, T] per-token loss.
      mask: bool or float [B, T]; 1 for tokens that count.
      mode: one of ``AGGREGATION_MODES``.
      max_len: constant normaliser for ``seq-mean-token-sum-norm`` (default T). Pass the
        configured maximum completion length so every micro-batch uses the same constant.

    Returns:
      (weighted_sum, weight), both float32 scalars. The loss is ``weighted_sum / weight``
      after summing both over micro-batches / shards (see ``safe_divide``).
    """
    if loss_tokens.ndim != 2 or mask.shape != loss_tokens.shape:
        raise ValueError(
            f"aggregate expects loss_tokens [B,T] and mask of the same shape, got "
            f"{loss_tokens.shape} and {mask.shape}")
    m = mask.astype(loss_tokens.dtype)
    # jnp.where (not multiplication) so that inf/nan in masked slots cannot leak.
    masked = jnp.where(m > 0, loss_tokens * m, 0.0)
    if mode == "token-mean":
        return masked.sum(), m.sum()
    tok_count = m.sum(axis=-1)
    seq_valid = (tok_count > 0).astype(loss_tokens.dtype)
    seq_sum = masked.sum(axis=-1)
    if mode == "seq-mean-token-mean":
        per_seq = safe_divide(seq_sum, tok_count)
    elif mode == "seq-mean-token-sum":
        per_seq = seq_sum
    elif mode == "seq-mean-token-sum-norm":
        norm = loss_tokens.shape[-1] if max_len is None else max_len
        per_seq = seq_sum / norm
    else:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; expected one of {AGGREGATION_MODES}")
    return (per_seq * seq_valid).sum(), seq_valid.sum()


def safe_sqrt(x: Array) -> Array:
    """sqrt with a finite (zero) gradient at 0."""
    pos = x > 0
    return jnp.where(pos, jnp.sqrt(jnp.where(pos, x, 1.0)), 0.0)


def masked_sum(x: Array, mask: Array) -> Array:
    return jnp.where(mask > 0, x, 0.0).sum()


def masked_mean(x: Array, mask: Array, axis=None) -> Array:
    """Mean of x over mask (0 where the mask is empty)."""
    m = mask.astype(jnp.float32)
    return safe_divide(jnp.where(m > 0, x, 0.0).sum(axis=axis), m.sum(axis=axis))


def masked_var(x: Array, mask: Array, ddof: int = 0) -> Array:
    """Variance of x over the masked entries (all axes); 0 when fewer than ddof+1 entries."""
    m = mask.astype(jnp.float32)
    n = m.sum()
    mean = masked_mean(x, m)
    sq = jnp.where(m > 0, (x - mean) ** 2, 0.0).sum()
    return safe_divide(sq, jnp.maximum(n - ddof, 0.0))


def masked_whiten(x: Array, mask: Array, *, shift_mean: bool = True, eps: float = 1e-8) -> Array:
    """(x - mean) / (std + eps) over the masked entries (all axes); masked slots are 0.

    If all masked entries are equal there is no signal to normalise: the result is exactly 0
    (``shift_mean``) or x unchanged (``shift_mean=False``), never a rounding residue / eps.
    """
    m = mask.astype(jnp.float32) > 0
    mean = masked_mean(x, m)
    std = safe_sqrt(masked_var(x, m))
    hi = jnp.where(m, x, -jnp.inf).max()
    lo = jnp.where(m, x, jnp.inf).min()
    constant = ~(hi > lo)
    if shift_mean:
        out = jnp.where(constant, 0.0, (x - mean) / (std + eps))
    else:
        out = jnp.where(constant, x, x / (std + eps))
    return jnp.where(m, out, 0.0)


def finalize(weighted_sum: Array, weight: Array) -> Array:
    """The loss from accumulated (weighted_sum, weight)."""
    return safe_divide(weighted_sum, weight)
