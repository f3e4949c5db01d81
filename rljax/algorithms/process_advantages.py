"""GRPO with process rewards: per-step rewards from a process reward model (PRM) on ordinary
samples, added to the outcome advantage (registered as the token-level estimator
``grpo_process``).

Process supervision in DeepSeekMath's GRPO (Shao et al. 2024, section 4.1.3): a group's G
completions have step rewards r_{i,j} (the PRM's score of step j of completion i, placed at
the step's last token). They are normalised over the whole group's steps,

    r~_{i,j} = (r_{i,j} - mean(R)) / std(R)        R = every step reward of the group,

and each token's process advantage is the sum of the normalised rewards of its step and the
steps after it,

    P_{i,t} = sum_{j : end(j) >= t} r~_{i,j}.

The outcome reward still decides correctness: the advantage is GRPO's outcome advantage plus
the process term,

    A_{i,t} = (R_i - mean_group R) / (std_group R + eps) + w * P_{i,t}       (w = process weight)

so with w = 0 it is exactly ``grpo`` broadcast over the tokens. A group whose step rewards are
all equal (or that has fewer than two steps) gets a process term of exactly 0.
"""
from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from rljax.algorithms.advantages import grpo_advantages, register_advantage_estimator
from rljax.algorithms.aggregation import safe_sqrt

Array = jnp.ndarray


def process_advantages(step_rewards: Array, step_ends: Array, group_size: int,
                       eps: float = 1e-6, std_ddof: int = 1) -> Array:
    """Per-token process advantages (the DeepSeekMath formula above).

    Args:
      step_rewards: f32 [N, T], each step's reward at its last token (read only where
        ``step_ends``).
      step_ends: bool [N, T], the last token of every step of each completion.
      group_size: G; rows are consecutive groups of G completions of one prompt.
      std_ddof: 1 for the unbiased std over the group's steps (as GRPO's outcome std).
    Returns:
      f32 [N, T]: the sum of the normalised step rewards at or after each position (tokens
      after a completion's last step end get 0).
    """
    e = jnp.asarray(step_ends).astype(bool)
    n, t = e.shape
    if group_size < 1 or n % group_size:
        raise ValueError(f"group_size={group_size} must divide the number of rows {n}")
    r = jnp.where(e, jnp.asarray(step_rewards, jnp.float32), 0.0).reshape(-1, group_size * t)
    g = e.reshape(-1, group_size * t)
    count = g.sum(axis=1, keepdims=True).astype(jnp.float32)
    mean = r.sum(axis=1, keepdims=True) / jnp.maximum(count, 1.0)
    dev = jnp.where(g, r - mean, 0.0)
    std = safe_sqrt((dev ** 2).sum(axis=1, keepdims=True) / jnp.maximum(count - std_ddof, 1.0))
    big, small = jnp.where(g, r, -jnp.inf).max(1, keepdims=True), jnp.where(g, r, jnp.inf).min(
        1, keepdims=True)
    constant = (count < 2) | (big == small)
    norm = jnp.where(constant, 0.0, dev / (std + eps)).reshape(n, t)
    # Return-to-go along the completion: a reverse cumulative sum.
    return jnp.flip(jnp.cumsum(jnp.flip(norm, axis=1), axis=1), axis=1)


def grpo_process_advantages(rewards: Array, group_size: int, *, mask: Array,
                            step_rewards: Array, step_ends: Array,
                            process_weight: float = 1.0, scale_rewards: str = "group",
                            token_kl: Optional[Array] = None, kl_coef: float = 0.0,
                            gamma: float = 1.0, eps: float = 1e-6) -> Array:
    """GRPO's outcome advantage plus ``process_weight`` times the process advantage.

    Args:
      rewards: f32 [N] outcome rewards, consecutive groups of ``group_size``.
      mask: bool [N, T], the completion tokens that train.
      step_rewards, step_ends: f32 / bool [N, T], as ``process_advantages``.
      process_weight: w, the weight of the process term.
      scale_rewards: the outcome advantage's scaling (``grpo_advantages``).
      token_kl, kl_coef, gamma: only gamma = 1 and no KL in the reward are supported (the KL
        to the reference is a loss term, ``algo.beta``); anything else raises.
    Returns: f32 [N, T], 0 where mask is False.
    """
    if gamma != 1.0 or (token_kl is not None and kl_coef):
        raise ValueError("grpo_process_advantages: gamma must be 1 and no KL in the reward")
    outcome = grpo_advantages(rewards, group_size, scale_rewards=scale_rewards, eps=eps)
    process = process_advantages(step_rewards, step_ends, group_size, eps=eps)
    adv = outcome[:, None] + process_weight * process
    return jnp.where(jnp.asarray(mask, bool), adv, 0.0)


register_advantage_estimator("grpo_process", grpo_process_advantages, token_level=True)
