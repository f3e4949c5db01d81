"""Advantage estimators, selected by name with ``get_advantage_estimator``.

Rewards are [N] with N = num_prompts * G, laid out as consecutive groups of G completions of
the same prompt. Every estimator takes ``fn(rewards, group_size, **options)``; there are two
kinds (``is_token_level(name)`` tells which):

Sequence level (``grpo``, ``dr_grpo``, ``rloo``, ``reinforce_pp_seq``,
``reinforce_pp_baseline_seq``): one advantage per completion, [N], broadcast over its tokens by
the policy loss. A group whose rewards are all equal (including G = 1) carries no learning
signal: its advantage is exactly 0, never NaN and never a rounding residue divided by eps.

Token level (``reinforce_pp``, ``reinforce_pp_baseline``): also take ``mask`` bool [N, T]
(the completion tokens that train) and optionally ``token_kl`` [N, T] with ``kl_coef`` (a
per-token KL penalty in the reward) and ``gamma``; they return [N, T], 0 where mask is False.
Their batch statistics are over tokens, so a completion weighs in proportion to its length.

Ragged groups (``rollout.allocation='knapsack'``: prompt i has its own G_i): the group
estimators and the batch-level ones also take ``group_ids`` int [N] (rows of a group share
an id; any ids, any order), and every group statistic is then over the group's own rows
(``RAGGED``). ``group_size`` is ignored when ``group_ids`` is given.

Tree estimators (``treepo`` [N], ``rover`` [N, T]; ``uses_tree(name)``) also take the sampled
tree's ``node_ids``: ``rljax.algorithms.tree_advantages``.

Also token level, with their own signatures: ``gae`` (PPO critic) and ``discounted_returns``,
both a reverse ``lax.scan`` over time.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import jax
import jax.numpy as jnp

from rljax.algorithms.aggregation import masked_whiten, safe_sqrt

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


def dense_group_ids(group_ids: Array) -> Array:
    """int [N] -> int [N]: the same groups numbered 0.. whatever ids the caller used, so
    segment ops over them can take the static bound ``num_segments=N``."""
    ids = jnp.asarray(group_ids, jnp.int32)
    _, dense = jnp.unique(ids, return_inverse=True, size=ids.shape[0])
    return dense.reshape(-1)


def _ragged(rewards: Array, group_ids: Array):
    """Per-row statistics of each row's own group: (r - group mean, group-is-constant,
    group sum of squared deviations, group size), all [N]; the centred value and the sum of
    squares are exactly 0 in a constant group."""
    r = jnp.asarray(rewards, jnp.float32)
    ids = jnp.asarray(group_ids, jnp.int32)
    if r.ndim != 1 or ids.shape != r.shape:
        raise ValueError(f"rewards [N] and group_ids [N] expected, got {r.shape}, {ids.shape}")
    n = r.shape[0]
    dense = dense_group_ids(ids)
    seg = lambda x: jax.ops.segment_sum(x, dense, num_segments=n)[dense]  # noqa: E731
    count = seg(jnp.ones_like(r))
    mean = seg(r) / count
    hi = jax.ops.segment_max(r, dense, num_segments=n)[dense]
    lo = jax.ops.segment_min(r, dense, num_segments=n)[dense]
    constant = hi == lo
    c = jnp.where(constant, 0.0, r - mean)
    ss = seg(c ** 2)
    return c, constant, ss, count


def _std(x: Array, axis, ddof: int) -> Array:
    n = x.size if axis is None else x.shape[axis]
    mean = x.mean(axis=axis, keepdims=axis is not None)
    ss = ((x - mean) ** 2).sum(axis=axis, keepdims=axis is not None)
    return safe_sqrt(ss / max(n - ddof, 1))


def grpo_advantages(rewards: Array, group_size: int, *, scale_rewards: str = "group",
                    eps: float = 1e-6, std_ddof: int = 1,
                    group_ids: Optional[Array] = None) -> Array:
    """GRPO outcome advantage (Shao et al. 2024, DeepSeekMath): (r - mean_group) / (std + eps).

    scale_rewards:
      "group": std of the prompt's group (the original GRPO).
      "batch": std of all rewards in the batch, group mean kept ("Lite PPO",
               Liu et al. 2025, "Tricks or Traps? A Deep Dive into RL for LLM Reasoning").
      "none":  no scaling (same as ``dr_grpo``).
    std_ddof=1 is the unbiased std (as torch.std in TRL / verl); 0 gives the population std.
    Returns [N].
    """
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', "
                         f"got {scale_rewards!r}")
    if group_ids is not None:
        c, constant, ss, count = _ragged(rewards, group_ids)
        if scale_rewards == "none":
            return c
        if scale_rewards == "group":
            std = safe_sqrt(ss / jnp.maximum(count - std_ddof, 1))
        else:
            std = _std(jnp.asarray(rewards, jnp.float32), None, std_ddof)
        return jnp.where(constant, 0.0, c / (std + eps))
    g = _groups(rewards, group_size)
    c, constant = _centered(g)
    if scale_rewards == "group":
        std = _std(g, 1, std_ddof)
    elif scale_rewards == "batch":
        std = _std(g.reshape(-1), None, std_ddof)
    else:   # "none"
        return c.reshape(-1)
    return jnp.where(constant, 0.0, c / (std + eps)).reshape(-1)


def dr_grpo_advantages(rewards: Array, group_size: int, *,
                       group_ids: Optional[Array] = None) -> Array:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): r - mean_group,
    no std scaling. Returns [N]."""
    if group_ids is not None:
        return _ragged(rewards, group_ids)[0]
    c, _ = _centered(_groups(rewards, group_size))
    return c.reshape(-1)


def rloo_advantages(rewards: Array, group_size: int, *,
                    group_ids: Optional[Array] = None) -> Array:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics"): leave-one-out baseline.

    A_i = r_i - 1/(G-1) sum_{j != i} r_j  (= G/(G-1) (r_i - mean)). With G = 1 there is no
    baseline to form and the advantage is 0. Returns [N].
    """
    if group_ids is not None:
        c, _, _, count = _ragged(rewards, group_ids)
        return jnp.where(count > 1, c * count / jnp.maximum(count - 1, 1), 0.0)
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


def reinforce_pp_seq_advantages(rewards: Array, group_size: int = 1, *,
                                eps: float = 1e-6, group_ids: Optional[Array] = None) -> Array:
    """Per-sequence REINFORCE++ variant: (r - mean_batch) / std_batch over the N outcome
    rewards, one advantage per completion. Returns [N].

    Not the published algorithm (that is ``reinforce_pp``, which whitens token-level returns,
    so each completion weighs by its length). Use this one to weigh every completion equally
    in the batch statistics, whatever its length: long completions do not dominate the mean
    and std. The baseline is the batch mean; ``group_size`` is only checked.
    """
    if group_ids is not None:   # no group statistic: the groups' sizes do not matter
        return _whiten(jnp.asarray(rewards, jnp.float32), eps)
    g = _groups(rewards, group_size)
    return _whiten(g.reshape(-1), eps)


def reinforce_pp_baseline_seq_advantages(rewards: Array, group_size: int, *,
                                         eps: float = 1e-6,
                                         group_ids: Optional[Array] = None) -> Array:
    """Per-sequence REINFORCE++-baseline variant: subtract the group mean, then divide by the
    batch std of the centred values, one advantage per completion. Returns [N].

    Not the published algorithm (that is ``reinforce_pp_baseline``, token level). Here every
    completion weighs equally whatever its length, and a constant-reward group gets exactly 0
    (in the token-level version the token-weighted batch mean of the centred returns is
    generally not 0, so constant groups get a small nonzero advantage). It is GRPO with the
    batch std ("Lite PPO") up to the population std. The batch mean of group-centred values
    is 0 by construction, so whitening reduces to dividing by their batch std.
    """
    if group_ids is not None:
        c = _ragged(rewards, group_ids)[0]
    else:
        c = _centered(_groups(rewards, group_size))[0].reshape(-1)
    std = _std(c, None, 0)
    return jnp.where(c.max() == c.min(), 0.0, c / (std + eps))


def outcome_token_rewards(rewards: Array, mask: Array, token_kl: Optional[Array] = None,
                          kl_coef: float = 0.0) -> Array:
    """Per-token rewards from outcome rewards: ``rewards`` [N] on each row's last True token of
    ``mask`` [N, T], minus ``kl_coef * token_kl`` [N, T] (constant, stop-gradient) on every
    True token. [N, T], 0 where mask is False (and all 0 in a row with no True token)."""
    m = jnp.asarray(mask).astype(bool)
    rewards = jnp.asarray(rewards, jnp.float32)
    if m.ndim != 2 or rewards.shape != m.shape[:1]:
        raise ValueError(f"rewards [N] and mask [N, T] expected, got {rewards.shape} and "
                         f"{m.shape}")
    t = m.shape[1]
    last = t - 1 - jnp.argmax(m[:, ::-1], axis=1)
    r = jnp.where(jnp.arange(t)[None, :] == last[:, None], rewards[:, None], 0.0)
    if token_kl is not None and kl_coef:
        r = r - kl_coef * jax.lax.stop_gradient(jnp.asarray(token_kl, jnp.float32))
    return jnp.where(m, r, 0.0)


def reinforce_pp_advantages(rewards: Array, group_size: int = 1, *, mask: Array,
                            token_kl: Optional[Array] = None, kl_coef: float = 0.0,
                            gamma: float = 1.0, eps: float = 1e-8,
                            group_ids: Optional[Array] = None) -> Array:
    """REINFORCE++ (Hu et al. 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning
    Large Language Models"), token level, as in the paper, OpenRLHF and verl.

    Args:
      rewards: float [N] outcome rewards.
      group_size: only checked (the baseline is the batch).
      mask: bool [N, T], the completion tokens that train; only they enter the returns and
        the batch statistics.
      token_kl: optional float [N, T] per-token KL estimate (e.g. ``get_kl_estimator("k1")``
        of the old and reference log-probs), treated as a constant.
      kl_coef: its weight in the reward (``algo.beta`` with ``algo.kl_in_reward``).
      gamma: discount of the return.
    Returns:
      float [N, T], 0 where mask is False:

        r_{i,t} = -kl_coef * kl_{i,t} + [t = last real token of i] * rewards_i
        G_{i,t} = sum_{s >= t} gamma^(s - t) r_{i,s}   over real tokens (``discounted_returns``)
        A_{i,t} = (G_{i,t} - mean) / (std + eps)   mean, std over every real token of the
                                                   batch (``masked_whiten``)

    With no KL and gamma = 1, G_{i,t} = rewards_i at every token, and the whitening weighs
    completion i by its number of tokens. If all returns are equal the result is exactly 0.
    """
    if group_ids is None:   # no group statistic: only the layout is checked
        _groups(rewards, group_size)
    m = jnp.asarray(mask).astype(bool)
    r = outcome_token_rewards(rewards, m, token_kl, kl_coef)
    return masked_whiten(discounted_returns(r, m, gamma), m, eps=eps)


def reinforce_pp_baseline_advantages(rewards: Array, group_size: int, *, mask: Array,
                                     token_kl: Optional[Array] = None, kl_coef: float = 0.0,
                                     gamma: float = 1.0, eps: float = 1e-8,
                                     group_ids: Optional[Array] = None) -> Array:
    """REINFORCE++-baseline (Hu et al. 2025), token level: the outcome rewards minus their
    group mean (r_i - mean_group(r), exactly 0 in a constant group), then as
    ``reinforce_pp``: per-token KL penalty, return-to-go, whitening over every real token of
    the batch. Arguments as ``reinforce_pp_advantages``. Returns [N, T].

    A constant group's completions still get -mean / std of the batch whitening (the
    token-weighted mean of the centred returns is not 0 when lengths differ), as in the paper.
    """
    if group_ids is not None:
        c = _ragged(rewards, group_ids)[0]
    else:
        c = _centered(_groups(rewards, group_size))[0].reshape(-1)
    return reinforce_pp_advantages(c, 1, mask=mask, token_kl=token_kl,
                                   kl_coef=kl_coef, gamma=gamma, eps=eps)


_ADVANTAGE_ESTIMATORS: Dict[str, Callable[..., Array]] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp_seq": reinforce_pp_seq_advantages,
    "reinforce_pp_baseline_seq": reinforce_pp_baseline_seq_advantages,
    "reinforce_pp": reinforce_pp_advantages,
    "reinforce_pp_baseline": reinforce_pp_baseline_advantages,
}
# Estimators that take mask [N, T] (and token_kl, kl_coef, gamma) and return [N, T].
_TOKEN_LEVEL = {"reinforce_pp", "reinforce_pp_baseline"}
# Estimators that take ``group_ids`` [N] (ragged groups, ``uses_group_ids``).
RAGGED = {"grpo", "dr_grpo", "rloo", "reinforce_pp_seq", "reinforce_pp_baseline_seq",
          "reinforce_pp", "reinforce_pp_baseline"}
# Estimators that need the sampled tree (``node_ids`` [N, D+1], token level also
# ``segments`` [T]): ``rljax.algorithms.tree_advantages`` registers them.
_TREE: set = set()
# Estimators with a baseline per role kept across steps (``uses_roles``):
# ``rljax.algorithms.role_advantages`` registers "rae".
_ROLES: set = set()


def get_advantage_estimator(name: str) -> Callable[..., Array]:
    """Advantage estimator by name: fn(rewards [N], group_size, **options) -> [N], or [N, T]
    for the token-level ones (``is_token_level``), which also take ``mask=[N, T]``."""
    try:
        return _ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown adv_estimator {name!r}; expected one of "
                         f"{sorted(_ADVANTAGE_ESTIMATORS)} (or 'gae' for PPO with a critic)")


def advantage_estimator_names() -> tuple[str, ...]:
    """Registered advantage estimators, built-ins first (``gae`` is PPO's, not listed)."""
    return tuple(_ADVANTAGE_ESTIMATORS)


def is_token_level(name: str) -> bool:
    """True if estimator ``name`` takes ``mask`` (and ``token_kl``, ``kl_coef``, ``gamma``) and
    returns [N, T] advantages; False for the per-completion ones (and unknown names)."""
    return name in _TOKEN_LEVEL


def takes_group_ids(name: str) -> bool:
    """True if estimator ``name`` takes ``group_ids`` int [N] for groups of different sizes
    (``rollout.allocation='knapsack'``)."""
    return name in RAGGED


def uses_tree(name: str) -> bool:
    """True if estimator ``name`` also takes the sampled tree: ``node_ids`` int [N, D+1] (and,
    token level, ``segments`` int [T]); it needs ``rollout.tree.enabled``."""
    return name in _TREE


def uses_roles(name: str) -> bool:
    """True if estimator ``name`` keeps a baseline per role across steps: it takes
    ``roles`` int [N] (each sample's role key, ``role_advantages.role_keys``) and
    ``baseline`` f32 [K] and returns ``(advantages [N], new baseline [K])``; the trainer keeps
    the baseline in its state (``TrainState.role_baseline``)."""
    return name in _ROLES


def register_advantage_estimator(name: str, fn: Callable[..., Array], *,
                                 token_level: bool = False, tree: bool = False,
                                 roles: bool = False, group_ids: bool = False) -> None:
    """Adds ``fn`` under ``name``; ``token_level=True`` for the [N, T] interface,
    ``tree=True`` if it takes the tree structure (``uses_tree``), ``roles=True`` if it takes
    per-sample roles and a baseline state (``uses_roles``), ``group_ids=True`` if it takes
    groups of different sizes (``takes_group_ids``)."""
    _ADVANTAGE_ESTIMATORS[name] = fn
    for flag, names in ((token_level, _TOKEN_LEVEL), (tree, _TREE), (roles, _ROLES),
                        (group_ids, RAGGED)):
        if flag:
            names.add(name)
        else:
            names.discard(name)


# --------------------------------------------------------------------------- token level

def gae(rewards: Array, values: Array, mask: Array, gamma: float = 1.0,
        lam: float = 0.95, next_discount: Optional[Array] = None) -> Tuple[Array, Array]:
    """Generalized Advantage Estimation (Schulman et al. 2016), masked, per token.

    Args:
      rewards: float [B, T] per-token rewards (typically the outcome reward at the last real
        token, optionally minus a per-token KL penalty).
      values: float [B, T] critic values V(s_t).
      mask: bool [B, T]; True for real (trainable) tokens.
      next_discount: optional float [B, T], an extra factor on gamma for the step from token
        t to the next real token (multi-turn PPO: ``env.turn_discount`` on each turn's last
        model token, 1 elsewhere); None = 1 everywhere.
    Returns:
      (advantages [B, T], returns [B, T]) with returns = advantages + values; both 0 where
      mask is False.

    Recursion over the real tokens only: for a real token t whose next real token is t',
        delta_t = r_t + gamma_t * V(t') - V(t),   A_t = delta_t + gamma_t * lam * A_t',
    gamma_t = gamma * next_discount_t.
    Masked positions are skipped (their rewards and values are ignored, and they do not
    break the chain, e.g. tool-output tokens inside a completion). At the last real token of a
    row the episode terminates: V(next) = 0 and A(next) = 0.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    values = jnp.asarray(values, jnp.float32)
    m = jnp.asarray(mask).astype(bool)
    discount = (jnp.ones_like(rewards) if next_discount is None
                else jnp.asarray(next_discount, jnp.float32)) * gamma

    def step(carry, xs):
        next_v, next_a = carry
        r, v, mk, d = xs
        delta = r + d * next_v - v
        a = delta + d * lam * next_a
        new_carry = (jnp.where(mk, v, next_v), jnp.where(mk, a, next_a))
        return new_carry, jnp.where(mk, a, 0.0)

    zeros = jnp.zeros(rewards.shape[0], jnp.float32)
    _, adv_t = jax.lax.scan(step, (zeros, zeros), (rewards.T, values.T, m.T, discount.T),
                            reverse=True)
    adv = adv_t.T
    returns = jnp.where(m, adv + values, 0.0)
    return adv, returns


def discounted_returns(rewards: Array, mask: Array, gamma: float = 1.0) -> Array:
    """Per-token discounted return-to-go over real tokens: G_t = r_t + gamma * G_t'.

    Used by ``reinforce_pp`` (Hu et al. 2025) on per-token rewards (``outcome_token_rewards``:
    outcome reward at the last token minus a per-token KL penalty), then whitened over the
    batch with ``masked_whiten``. Masked positions are skipped and get 0. Shapes [B, T].
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
