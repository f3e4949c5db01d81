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
all equal (or that has fewer than two steps) gets a process term of exactly 0. Groups may have
sizes of their own (``group_ids``, knapsack allocation): a group's statistics are over its own
rows.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from rljax.algorithms.advantages import (dense_group_ids, grpo_advantages,
                                         register_advantage_estimator)
from rljax.algorithms.aggregation import safe_sqrt

Array = jnp.ndarray


def _row_groups(n: int, group_size: int, group_ids: Optional[Array]) -> Array:
    """int [N]: each row's group numbered 0..; consecutive groups of ``group_size`` rows, or
    the groups of ``group_ids`` (any ids, any order) when given."""
    if group_ids is not None:
        return dense_group_ids(group_ids)
    if group_size < 1 or n % group_size:
        raise ValueError(f"group_size={group_size} must divide the number of rows {n}")
    return jnp.arange(n) // group_size


def process_advantages(step_rewards: Array, step_ends: Array, group_size: int,
                       eps: float = 1e-6, std_ddof: int = 1,
                       group_ids: Optional[Array] = None) -> Array:
    """Per-token process advantages (the DeepSeekMath formula above).

    Args:
      step_rewards: f32 [N, T], each step's reward at its last token (read only where
        ``step_ends``).
      step_ends: bool [N, T], the last token of every step of each completion.
      group_size: G; rows are consecutive groups of G completions of one prompt (ignored
        when ``group_ids`` is given).
      std_ddof: 1 for the unbiased std over the group's steps (as GRPO's outcome std).
      group_ids: optional int [N], each row's group (groups of their own sizes,
        ``rollout.allocation='knapsack'``); R is then every step reward of the row's group.
    Returns:
      f32 [N, T]: the sum of the normalised step rewards at or after each position (tokens
      after a completion's last step end get 0).
    """
    e = jnp.asarray(step_ends).astype(bool)
    n, _ = e.shape
    ids = _row_groups(n, group_size, group_ids)

    def group(x, op=jax.ops.segment_sum):   # per-row values [N] -> their group's, [N, 1]
        return op(x, ids, num_segments=n)[ids][:, None]

    r = jnp.where(e, jnp.asarray(step_rewards, jnp.float32), 0.0)
    count = group(e.sum(axis=1).astype(jnp.float32))
    mean = group(r.sum(axis=1)) / jnp.maximum(count, 1.0)
    dev = jnp.where(e, r - mean, 0.0)
    std = safe_sqrt(group((dev ** 2).sum(axis=1)) / jnp.maximum(count - std_ddof, 1.0))
    big = group(jnp.where(e, r, -jnp.inf).max(axis=1), jax.ops.segment_max)
    small = group(jnp.where(e, r, jnp.inf).min(axis=1), jax.ops.segment_min)
    constant = (count < 2) | (big == small)
    norm = jnp.where(constant, 0.0, dev / (std + eps))
    # Return-to-go along the completion: a reverse cumulative sum.
    return jnp.flip(jnp.cumsum(jnp.flip(norm, axis=1), axis=1), axis=1)


def grpo_process_advantages(rewards: Array, group_size: int, *, mask: Array,
                            step_rewards: Array, step_ends: Array,
                            process_weight: float = 1.0, scale_rewards: str = "group",
                            token_kl: Optional[Array] = None, kl_coef: float = 0.0,
                            gamma: float = 1.0, eps: float = 1e-6,
                            group_ids: Optional[Array] = None) -> Array:
    """GRPO's outcome advantage plus ``process_weight`` times the process advantage.

    Args:
      rewards: f32 [N] outcome rewards, consecutive groups of ``group_size``, or the groups
        of ``group_ids`` int [N] (groups of their own sizes; both terms' statistics are then
        over each group's own rows).
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
    outcome = grpo_advantages(rewards, group_size, scale_rewards=scale_rewards, eps=eps,
                              group_ids=group_ids)
    process = process_advantages(step_rewards, step_ends, group_size, eps=eps,
                                 group_ids=group_ids)
    adv = outcome[:, None] + process_weight * process
    return jnp.where(jnp.asarray(mask, bool), adv, 0.0)


register_advantage_estimator("grpo_process", grpo_process_advantages, token_level=True,
                             group_ids=True)
