"""KL-divergence estimators (Schulman 2020, "Approximating KL Divergence"), per token.

Estimators of KL(pi || pi_ref) from tokens sampled from pi, written with
log_ratio = log pi(y_t) - log pi_ref(y_t) and r = pi_ref / pi = exp(-log_ratio):

  k1  = log_ratio                 unbiased, high variance, can be negative.
  k2  = 0.5 * log_ratio ** 2      biased, low variance; its gradient is the KL gradient
                                  on-policy (the "mse" penalty).
  k3  = (r - 1) - log r           unbiased, low variance, always >= 0 ("low_var_kl";
                                  the GRPO paper's KL term).
  k3+ = k2 + sg(k3 - k2)          straight-through: the value of k3, the gradient of k2
                                  (alias "k3_st"), so the loss term reports the unbiased k3
                                  while its gradient is the unbiased KL gradient.
  abs = |log_ratio|

All take ``fn(logps, ref_logps, *, log_ratio_clamp=..., max_value=...)`` -> [B, T]
(unmasked; aggregate with a mask). Only k3 (and the k3 value inside k3+) has an exp: its log
ratio is clamped to +-log_ratio_clamp (default 20, as verl) so exp cannot overflow, and its
value to max_value=10. k1, k2 and abs (and the k2 gradient of k3+) have nothing to protect and
are not clamped by default (log_ratio_clamp=None): at log ratio 30, k1 = 30 and k2 = 450 with
gradients 1 and 30, so the penalty keeps pulling back exactly the tokens that drifted furthest
(a clamp would cap the value and make the gradient 0 there). Inputs must be finite.
Use them as a loss term (``combine_token_losses``) or as a per-token reward penalty
(``kl_penalized_rewards``).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import jax
import jax.numpy as jnp

Array = jnp.ndarray
sg = jax.lax.stop_gradient


def _log_ratio(logps, ref_logps, clamp):
    lr = jnp.asarray(logps, jnp.float32) - jnp.asarray(ref_logps, jnp.float32)
    return jnp.clip(lr, -clamp, clamp) if clamp is not None else lr


def _cap(x, max_value):
    return x if max_value is None else jnp.clip(x, -max_value, max_value)


def kl_k1(logps, ref_logps, *, log_ratio_clamp: Optional[float] = None,
          max_value: Optional[float] = None) -> Array:
    """k1 = log pi - log pi_ref. [B, T]."""
    return _cap(_log_ratio(logps, ref_logps, log_ratio_clamp), max_value)


def kl_k2(logps, ref_logps, *, log_ratio_clamp: Optional[float] = None,
          max_value: Optional[float] = None) -> Array:
    """k2 = 0.5 * (log pi - log pi_ref) ** 2; gradient (log pi - log pi_ref) grad log pi.
    [B, T]."""
    lr = _log_ratio(logps, ref_logps, log_ratio_clamp)
    return _cap(0.5 * lr * lr, max_value)


def kl_k3(logps, ref_logps, *, log_ratio_clamp: Optional[float] = 20.0,
          max_value: Optional[float] = 10.0) -> Array:
    """k3 = (r - 1) - log r, r = pi_ref / pi, with the log ratio clamped to
    +-log_ratio_clamp before the exp and the value to +-max_value. [B, T]."""
    neg = -_log_ratio(logps, ref_logps, log_ratio_clamp)   # log r, r = pi_ref / pi
    return _cap(jnp.expm1(neg) - neg, max_value)


def kl_k3_st(logps, ref_logps, *, log_ratio_clamp: Optional[float] = 20.0,
             max_value: Optional[float] = 10.0) -> Array:
    """k3+ = k2 + sg(k3 - k2): the value of k3 (clamped as ``kl_k3``), the gradient of the
    unclamped k2. [B, T]."""
    k2 = kl_k2(logps, ref_logps)
    k3 = kl_k3(logps, ref_logps, log_ratio_clamp=log_ratio_clamp, max_value=max_value)
    return k2 + sg(k3 - k2)


def kl_abs(logps, ref_logps, *, log_ratio_clamp: Optional[float] = None,
           max_value: Optional[float] = None) -> Array:
    """|log pi - log pi_ref|. [B, T]."""
    return _cap(jnp.abs(_log_ratio(logps, ref_logps, log_ratio_clamp)), max_value)


_KL_ESTIMATORS: Dict[str, Callable[..., Array]] = {
    "k1": kl_k1, "kl": kl_k1,
    "k2": kl_k2, "mse": kl_k2,
    "k3": kl_k3, "low_var_kl": kl_k3,
    "k3+": kl_k3_st, "k3_st": kl_k3_st,
    "abs": kl_abs,
}


def kl_estimator_names() -> tuple[str, ...]:
    """The KL estimators' names (aliases included)."""
    return tuple(_KL_ESTIMATORS)


def get_kl_estimator(name: str) -> Callable[..., Array]:
    """KL estimator by name: k1 (kl), k2 (mse), k3 (low_var_kl), k3+ (k3_st), abs."""
    try:
        return _KL_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown kl_estimator {name!r}; expected one of {sorted(_KL_ESTIMATORS)}")


def kl_penalized_rewards(token_rewards: Array, logps: Array, ref_logps: Array, mask: Array,
                         kl_coef: float, estimator: str = "k1", **options) -> Array:
    """Per-token reward with a KL penalty (PPO-RLHF, Ouyang et al. 2022; REINFORCE++):
    r_t - kl_coef * sg(kl_t) on real tokens, 0 elsewhere. [B, T]."""
    kl = sg(get_kl_estimator(estimator)(logps, ref_logps, **options))
    m = jnp.asarray(mask).astype(bool)
    return jnp.where(m, jnp.asarray(token_rewards, jnp.float32) - kl_coef * kl, 0.0)
