"""VinePPO step advantages from Monte-Carlo values of step prefixes (Kazemnejad et al. 2025,
"VinePPO: Refining Credit Assignment in RL Training of LLMs", arXiv 2410.01679).

A completion is cut into reasoning steps a_0 .. a_{S-1}; s_t is the prompt followed by the
steps before t (s_0 is the prompt alone). K continuations are sampled from every s_t and its
value is their mean reward, V(s_t) = 1/K sum_k R(s_t ++ eta_k). Each token of step t gets

    A_t = r_t + gamma V(s_{t+1}) - V(s_t),   t < S - 1 : r_t = 0,  A_t = V(s_{t+1}) - V(s_t)
                                             t = S - 1 : s_S is terminal, V(s_S) = 0, and
                                                         r_{S-1} = R (the completion's own
                                                         reward):   A_{S-1} = R - V(s_{S-1})

(gamma = 1, as in the paper). The continuations only estimate values; they do not train.
Registered as the token-level estimator ``vineppo``; the rollout that samples the forks is
``rljax.train.methods.vine``.
"""
from __future__ import annotations

import jax.numpy as jnp

from rljax.algorithms.advantages import register_advantage_estimator

Array = jnp.ndarray


def vineppo_advantages(rewards: Array, group_size: int = 1, *, mask: Array, step_ids: Array,
                       step_values: Array, num_steps: Array, token_kl=None,
                       kl_coef: float = 0.0, gamma: float = 1.0, group_ids=None) -> Array:
    """Per-token VinePPO advantages.

    Args:
      rewards: f32 [R], each completion's own outcome reward R.
      group_size, group_ids: unused (each completion has its own values, so groups of any
        sizes do: ``rollout.allocation='knapsack'``).
      mask: bool [R, N], the completion tokens that train.
      step_ids: int [R, N], the step each completion token belongs to (0-based; -1 for
        tokens outside the completion).
      step_values: f32 [R, S], V(s_t) of the completion's prefix before step t (t < its
        ``num_steps``; other entries are ignored).
      num_steps: int [R], the completion's number of steps S_i (>= 1 where it has tokens).
      token_kl, kl_coef, gamma: only gamma = 1 and no KL in the reward are supported (the
        KL to the reference is a loss term, ``algo.beta``); anything else raises.
    Returns: f32 [R, N], A_t of each token's step, 0 where mask is False.
    """
    if gamma != 1.0 or (token_kl is not None and kl_coef):
        raise ValueError("vineppo_advantages: gamma must be 1 and no KL in the reward")
    values = jnp.asarray(step_values, jnp.float32)
    r = jnp.asarray(rewards, jnp.float32)
    s = values.shape[1]
    later = jnp.concatenate([values[:, 1:], jnp.zeros_like(values[:, :1])], axis=1)
    last = jnp.arange(s)[None, :] + 1 >= jnp.asarray(num_steps)[:, None]
    step_adv = jnp.where(last, r[:, None], later) - values                 # [R, S]
    ids = jnp.asarray(step_ids)
    adv = jnp.take_along_axis(step_adv, jnp.clip(ids, 0, s - 1), axis=1)
    return jnp.where(jnp.asarray(mask, bool) & (ids >= 0), adv, 0.0)


register_advantage_estimator("vineppo", vineppo_advantages, token_level=True, group_ids=True)
