"""Per-token policy-gradient losses, selected by name with ``get_policy_loss``.

Every loss has the signature

    loss_tokens, metrics = fn(logps, old_logps, advantages, mask, **options)

  logps:       float [B, T] log pi_theta(y_t | ...) of the sampled tokens (differentiated).
  old_logps:   float [B, T] log-probs of the behaviour policy pi_old (constants), or None for
               the on-policy single-update case (then old = stop_gradient(logps)).
  advantages:  float [B] (one per sequence, broadcast over tokens) or [B, T].
  mask:        bool [B, T], True for completion tokens that count.
  loss_tokens: float [B, T], 0 where mask is False; aggregate with ``aggregate``.
  metrics:     dict name -> (sum, count) over masked tokens, so they too accumulate exactly
               across micro-batches (``finalize_metrics`` turns them into means).

Options common to all losses: ``sampler_logps`` + ``tis_cap`` (truncated importance sampling
towards the sampler, see ``tis_weights``), ``log_ratio_clamp`` (bound on |log ratio| before
exp; beyond it the ratio, and its gradient, saturate).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import jax
import jax.numpy as jnp

from rljax.algorithms.aggregation import safe_divide

Array = jnp.ndarray
Metrics = Dict[str, Tuple[Array, Array]]

sg = jax.lax.stop_gradient


def _prep(logps, old_logps, advantages, mask):
    logps = jnp.asarray(logps, jnp.float32)
    old = sg(logps) if old_logps is None else sg(jnp.asarray(old_logps, jnp.float32))
    adv = sg(jnp.asarray(advantages, jnp.float32))
    if adv.ndim == 1:
        adv = adv[:, None]
    adv = jnp.broadcast_to(adv, logps.shape)
    m = jnp.asarray(mask).astype(bool)
    # Masked slots may hold garbage (e.g. -inf log-probs of padding): neutralise them so that
    # neither values nor gradients see them.
    logps = jnp.where(m, logps, 0.0)
    old = jnp.where(m, old, 0.0)
    adv = jnp.where(m, adv, 0.0)
    return logps, old, adv, m


def _metric(x: Array, m: Array) -> Tuple[Array, Array]:
    return jnp.where(m, x, 0.0).astype(jnp.float32).sum(), m.astype(jnp.float32).sum()


def log_importance_ratio(logps: Array, old_logps: Array, mask: Array, level: str = "token",
                         log_ratio_clamp: float = 20.0) -> Array:
    """log(pi / pi_old) per token [B, T].

    level="token": log pi(y_t) - log pi_old(y_t)  (PPO).
    level="sequence": GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"), token
      form: log s_i + log pi(y_t) - sg(log pi(y_t)), with the length-normalised sequence ratio
      log s_i = 1/|y_i| sum_t (log pi - log pi_old). Its value is s_i at every token of the
      sequence, its gradient at token t is s_i * grad log pi(y_t) (GSPO-token with a sequence
      advantage).
    The (sequence) log-ratio is clamped to +-log_ratio_clamp before use.
    """
    m = mask.astype(bool)
    lr = jnp.where(m, logps - old_logps, 0.0)
    if level == "token":
        return jnp.clip(lr, -log_ratio_clamp, log_ratio_clamp)
    if level == "sequence":
        n = m.sum(axis=-1, keepdims=True).astype(jnp.float32)
        seq = jnp.clip(safe_divide(lr.sum(axis=-1, keepdims=True), n),
                       -log_ratio_clamp, log_ratio_clamp)
        return jnp.where(m, sg(seq) + logps - sg(logps), 0.0)
    raise ValueError(f"ratio level must be 'token' or 'sequence', got {level!r}")


def tis_weights(old_logps: Array, sampler_logps: Array, mask: Array, cap: float = 2.0,
                log_ratio_clamp: float = 20.0) -> Array:
    """Truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework Secretly
    Brings You Off-Policy RL Training"): w_t = min(pi_old(y_t) / pi_sampler(y_t), cap),
    a constant (stop-gradient) per-token weight correcting sampler/trainer mismatch. [B, T]."""
    lr = jnp.clip(sg(old_logps) - sg(sampler_logps), -log_ratio_clamp, log_ratio_clamp)
    return jnp.where(mask.astype(bool), jnp.minimum(jnp.exp(lr), cap), 0.0)


def _apply_tis(loss, old, sampler_logps, tis_cap, m, log_ratio_clamp, metrics):
    if sampler_logps is None:
        return loss
    w = tis_weights(old, jnp.asarray(sampler_logps, jnp.float32), m,
                    cap=jnp.inf if tis_cap is None else tis_cap,
                    log_ratio_clamp=log_ratio_clamp)
    metrics["tis_weight"] = _metric(w, m)
    return loss * w


def ppo_loss(logps: Array, old_logps: Optional[Array], advantages: Array, mask: Array, *,
             epsilon: float = 0.2, epsilon_high: Optional[float] = None,
             clip_ratio_c: Optional[float] = None, ratio_level: str = "token",
             sampler_logps: Optional[Array] = None, tis_cap: Optional[float] = None,
             log_ratio_clamp: float = 20.0) -> Tuple[Array, Metrics]:
    """PPO clipped surrogate (Schulman et al. 2017), per token [B, T]:

        l_t = max(-A r, -A clip(r, 1 - epsilon, 1 + epsilon_high))

    epsilon_high: upper clip ("clip-higher", DAPO, Yu et al. 2025); default = epsilon.
    clip_ratio_c: dual-clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games"): for
      A < 0 the loss is additionally capped at -A * clip_ratio_c (> 1).
    ratio_level: "token" (PPO / GRPO) or "sequence" (GSPO; use a small epsilon, e.g. 3e-4/4e-4).

    Metrics: clipfrac_low (r < 1-eps, A < 0), clipfrac_high (r > 1+eps_high, A > 0),
    clipfrac_dual (dual-clip active), approx_kl (k3 estimate of KL(pi_old || pi):
    (r - 1) - log r with r the token ratio), and tis_weight when TIS is used.
    """
    eps_low = epsilon
    eps_high = epsilon if epsilon_high is None else epsilon_high
    logps, old, adv, m = _prep(logps, old_logps, advantages, mask)
    log_r = log_importance_ratio(logps, old, m, ratio_level, log_ratio_clamp)
    ratio = jnp.exp(log_r)
    l_unclipped = -adv * ratio
    l_clipped = -adv * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = jnp.maximum(l_unclipped, l_clipped)
    metrics: Metrics = {}
    r = sg(ratio)
    metrics["clipfrac_low"] = _metric((r < 1.0 - eps_low) & (adv < 0), m)
    metrics["clipfrac_high"] = _metric((r > 1.0 + eps_high) & (adv > 0), m)
    if clip_ratio_c is not None:
        if clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c}")
        cap = -adv * clip_ratio_c
        dual = (adv < 0) & (loss > cap)
        loss = jnp.where(adv < 0, jnp.minimum(loss, cap), loss)
        metrics["clipfrac_dual"] = _metric(dual, m)
    else:
        metrics["clipfrac_dual"] = _metric(jnp.zeros_like(m), m)
    tok_lr = jnp.clip(sg(logps - old), -log_ratio_clamp, log_ratio_clamp)
    metrics["approx_kl"] = _metric(jnp.expm1(tok_lr) - tok_lr, m)
    loss = _apply_tis(loss, old, sampler_logps, tis_cap, m, log_ratio_clamp, metrics)
    return jnp.where(m, loss, 0.0), metrics


def gspo_loss(logps, old_logps, advantages, mask, *, epsilon: float = 3e-4,
              epsilon_high: Optional[float] = 4e-4, **options) -> Tuple[Array, Metrics]:
    """GSPO (Zheng et al. 2025): ``ppo_loss`` with the length-normalised sequence ratio (token
    form, see ``log_importance_ratio``) and the paper's clip range 3e-4 / 4e-4. Pair with
    sequence advantages and ``seq-mean-token-mean`` aggregation, as in the paper."""
    return ppo_loss(logps, old_logps, advantages, mask, epsilon=epsilon,
                    epsilon_high=epsilon_high, ratio_level="sequence", **options)


def cispo_loss(logps: Array, old_logps: Optional[Array], advantages: Array, mask: Array, *,
               epsilon: Optional[float] = None, epsilon_high: float = 0.28,
               sampler_logps: Optional[Array] = None, tis_cap: Optional[float] = None,
               log_ratio_clamp: float = 20.0) -> Tuple[Array, Metrics]:
    """CISPO (MiniMax-M1, 2025): l_t = -sg(clip(r_t, 1 - epsilon, 1 + epsilon_high)) A_t log pi(y_t).

    The importance weight is clipped and detached, so every token keeps a gradient
    (A * w * grad log pi). epsilon=None means no lower bound (the paper's choice); the
    loss value itself is a surrogate, only its gradient is meaningful.
    Metrics: clipfrac_low / clipfrac_high (weight clipped), approx_kl, tis_weight.
    """
    logps, old, adv, m = _prep(logps, old_logps, advantages, mask)
    lr = jnp.clip(sg(logps - old), -log_ratio_clamp, log_ratio_clamp)
    r = jnp.exp(lr)
    lo = 0.0 if epsilon is None else 1.0 - epsilon
    w = jnp.clip(r, lo, 1.0 + epsilon_high)
    loss = -w * adv * logps
    metrics: Metrics = {
        "clipfrac_low": _metric(r < lo, m),
        "clipfrac_high": _metric(r > 1.0 + epsilon_high, m),
        "clipfrac_dual": _metric(jnp.zeros_like(m), m),
        "approx_kl": _metric(jnp.expm1(lr) - lr, m),
    }
    loss = _apply_tis(loss, old, sampler_logps, tis_cap, m, log_ratio_clamp, metrics)
    return jnp.where(m, loss, 0.0), metrics


_POLICY_LOSSES: Dict[str, Callable[..., Tuple[Array, Metrics]]] = {
    "ppo": ppo_loss,
    "vanilla": ppo_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
}


def get_policy_loss(name: str) -> Callable[..., Tuple[Array, Metrics]]:
    """Policy loss by name: "ppo" (alias "vanilla"; GRPO/DAPO/dual-clip via options), "gspo",
    "cispo". Signature: fn(logps, old_logps, advantages, mask, **options)."""
    try:
        return _POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown policy_loss {name!r}; expected one of {sorted(_POLICY_LOSSES)}")


def register_policy_loss(name: str, fn: Callable[..., Tuple[Array, Metrics]]) -> None:
    """Makes ``algo.policy_loss=name`` use ``fn(logps, old_logps, advantages, mask,
    **options)``."""
    _POLICY_LOSSES[name] = fn


def policy_loss_names() -> tuple[str, ...]:
    """Registered policy losses, built-ins first."""
    return tuple(_POLICY_LOSSES)


def combine_token_losses(pg_tokens: Array, mask: Array, *, kl_tokens: Optional[Array] = None,
                         kl_coef: float = 0.0, entropy_tokens: Optional[Array] = None,
                         entropy_coef: float = 0.0) -> Array:
    """Total per-token loss: pg + kl_coef * kl - entropy_coef * entropy, 0 where masked.

    Every aggregation mode is linear in the per-token loss, so aggregating this sum equals
    the sum of separately aggregated terms (same (sum, weight) bookkeeping).
    """
    m = jnp.asarray(mask).astype(bool)
    total = pg_tokens
    if kl_tokens is not None and kl_coef:
        total = total + kl_coef * jnp.where(m, kl_tokens, 0.0)
    if entropy_tokens is not None and entropy_coef:
        total = total - entropy_coef * jnp.where(m, entropy_tokens, 0.0)
    return jnp.where(m, total, 0.0)


def finalize_metrics(metrics: Metrics) -> Dict[str, Array]:
    """{name: (sum, count)} -> {name: sum / count} (0 for empty)."""
    return {k: safe_divide(s, c) for k, (s, c) in metrics.items()}
