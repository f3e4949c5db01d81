"""Advantage estimators.

Outcome-reward estimators take rewards [N] with N = num_prompts * G, laid out as consecutive
groups of G completions of the same prompt, and return advantages [N] (broadcast over tokens
by the policy loss). Select them by name with ``get_advantage_estimator``; all share the
signature ``fn(rewards, group_size, **options) -> advantages``.

A group whose rewards are all equal (including G = 1) carries no learning signal: its
advantage is exactly 0, never NaN and never a rounding residue divided by eps.

Token-level: ``gae`` (PPO critic) and ``discounted_returns`` (REINFORCE++ with per-token
KL-shaped rewards), both with a reverse ``lax.scan`` over time.
"""
from __future__ import annotations

from typing import Callable, Dict, Tuple

import jax
import jax.numpy as jnp

from rljax.algorithms.aggregation import safe_sqrt

Array = jnp.ndarray


def _groups(rewards: Array, group_size: int) -> Array:
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [num_prompts * G], got shape {rewards.shape}")
    if group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(
            f"group_size={group_size} must divide the number of rewards {rewards.shape[0]}")
    return rewards.reshape(-1, group_size)


def _centered(g: Array) -> Tuple[Array, Array]:
    """(r - group mean, group-is-constant [P,1]); exactly 0 in constant groups."""
    constant = g.max(axis=1, keepdims=True) == g.min(axis=1, keepdims=True)
    c = g - g.mean(axis=1, keepdims=True)
    return jnp.where(constant, 0.0, c), constant


def _std(x: Array, axis, ddof: int) -> Array:
    n = x.size if axis is None else x.shape[axis]
    mean = x.mean(axis=axis, keepdims=axis is not None)
    ss = ((x - mean) ** 2).sum(axis=axis, keepdims=axis is not None)
    return safe_sqrt(ss / max(n - ddof, 1))


def grpo_advantages(rewards: Array, group_size: int, *, scale_rewards: str = "group",
                    eps: float = 1e-6, std_ddof: int = 1) -> Array:
    """GRPO outcome advantage (Shao et al. 2024, DeepSeekMath): (r - mean_group) / (std + eps).

    scale_rewards:
      "group": std of the prompt's group (the original GRPO).
      "batch": std of all rewards in the batch, group mean kept ("Lite PPO",
               Liu et al. 2025, "Tricks or Traps? A Deep Dive into RL for LLM Reasoning").
      "none":  no scaling (same as ``dr_grpo``).
    std_ddof=1 is the unbiased std (as torch.std in TRL / verl); 0 gives the population std.
    Returns [N].
    """
    g = _groups(rewards, group_size)
    c, constant = _centered(g)
    if scale_rewards == "group":
        std = _std(g, 1, std_ddof)
    elif scale_rewards == "batch":
        std = _std(g.reshape(-1), None, std_ddof)
    elif scale_rewards == "none":
        return c.reshape(-1)
    else:
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale_rewards!r}")
    return jnp.where(constant, 0.0, c / (std + eps)).reshape(-1)


def dr_grpo_advantages(rewards: Array, group_size: int) -> Array:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): r - mean_group,
    no std scaling. Returns [N]."""
    c, _ = _centered(_groups(rewards, group_size))
    return c.reshape(-1)


def rloo_advantages(rewards: Array, group_size: int) -> Array:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics"): leave-one-out baseline.

    A_i = r_i - 1/(G-1) sum_{j != i} r_j  (= G/(G-1) (r_i - mean)). With G = 1 there is no
    baseline to form and the advantage is 0. Returns [N].
    """
    g = _groups(rewards, group_size)
    if group_size == 1:
        return jnp.zeros_like(g).reshape(-1)
    c, _ = _centered(g)
    return (c * (group_size / (group_size - 1))).reshape(-1)


def _whiten(x: Array, eps: float) -> Array:
    constant = x.max() == x.min()
    mean = x.mean()
    std = _std(x, None, 0)
    return jnp.where(constant, 0.0, (x - mean) / (std + eps))


def reinforce_pp_advantages(rewards: Array, group_size: int = 1, *, eps: float = 1e-6) -> Array:
    """REINFORCE++ (Hu et al. 2025): global batch whitening, (r - mean_batch) / std_batch.

    group_size is only checked (the baseline is the whole batch). Returns [N].
    """
    g = _groups(rewards, group_size)
    return _whiten(g.reshape(-1), eps)


def reinforce_pp_baseline_advantages(rewards: Array, group_size: int, *,
                                     eps: float = 1e-6) -> Array:
    """REINFORCE++-baseline (Hu et al. 2025): subtract the group mean, then whiten the centred
    values over the whole batch. The batch mean of group-centred values is 0 by construction,
    so whitening reduces to dividing by their batch std; constant groups stay exactly 0.
    Returns [N]."""
    c, _ = _centered(_groups(rewards, group_size))
    c = c.reshape(-1)
    std = _std(c, None, 0)
    return jnp.where(c.max() == c.min(), 0.0, c / (std + eps))


_ADVANTAGE_ESTIMATORS: Dict[str, Callable[..., Array]] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
    "reinforce_pp_baseline": reinforce_pp_baseline_advantages,
}


def get_advantage_estimator(name: str) -> Callable[..., Array]:
    """Outcome advantage estimator by name: fn(rewards [N], group_size, **options) -> [N]."""
    try:
        return _ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown adv_estimator {name!r}; expected one of "
                         f"{sorted(_ADVANTAGE_ESTIMATORS)} (or 'gae' for PPO with a critic)")


def register_advantage_estimator(name: str, fn: Callable[..., Array]) -> None:
    _ADVANTAGE_ESTIMATORS[name] = fn


# --------------------------------------------------------------------------- token level

def gae(rewards: Array, values: Array, mask: Array, gamma: float = 1.0,
        lam: float = 0.95) -> Tuple[Array, Array]:
    """Generalized Advantage Estimation (Schulman et al. 2016), masked, per token.

    Args:
      rewards: float [B, T] per-token rewards (typically the outcome reward at the last real
        token, optionally minus a per-token KL penalty).
      values: float [B, T] critic values V(s_t).
      mask: bool [B, T]; True for real (trainable) tokens.
    Returns:
      (advantages [B, T], returns [B, T]) with returns = advantages + values; both 0 where
      mask is False.

    Recursion over the real tokens only: for a real token t whose next real token is t',
        delta_t = r_t + gamma * V(t') - V(t),   A_t = delta_t + gamma * lam * A_t'.
    Masked positions are skipped (their rewards and values are ignored, and they do not
    break the chain, e.g. tool-output tokens inside a completion). At the last real token of a
    row the episode terminates: V(next) = 0 and A(next) = 0.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    values = jnp.asarray(values, jnp.float32)
    m = jnp.asarray(mask).astype(bool)

    def step(carry, xs):
        next_v, next_a = carry
        r, v, mk = xs
        delta = r + gamma * next_v - v
        a = delta + gamma * lam * next_a
        new_carry = (jnp.where(mk, v, next_v), jnp.where(mk, a, next_a))
        return new_carry, jnp.where(mk, a, 0.0)

    zeros = jnp.zeros(rewards.shape[0], jnp.float32)
    _, adv_t = jax.lax.scan(step, (zeros, zeros), (rewards.T, values.T, m.T), reverse=True)
    adv = adv_t.T
    returns = jnp.where(m, adv + values, 0.0)
    return adv, returns


def discounted_returns(rewards: Array, mask: Array, gamma: float = 1.0) -> Array:
    """Per-token discounted return-to-go over real tokens: G_t = r_t + gamma * G_t'.

    Used by REINFORCE++ (Hu et al. 2025) with per-token rewards (outcome reward at the last
    token minus a per-token KL penalty), then whitened over the batch with
    ``masked_whiten``. Masked positions are skipped and get 0. Shapes [B, T].
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    m = jnp.asarray(mask).astype(bool)

    def step(nxt, xs):
        r, mk = xs
        g = r + gamma * nxt
        return jnp.where(mk, g, nxt), jnp.where(mk, g, 0.0)

    _, ret = jax.lax.scan(step, jnp.zeros(rewards.shape[0], jnp.float32), (rewards.T, m.T),
                          reverse=True)
    return ret.T
