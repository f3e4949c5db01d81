"""Advantage estimators over sampled trees (``rljax.sampling.tree``), registered by name.

A prompt's group is the G leaves of its tree. Besides the rewards [N] (N = prompts * G,
consecutive groups), they take ``node_ids`` int [N, D+1]: the node each leaf belongs to at each
level (ids need only be distinct within a group; level D may be the leaf itself). Any tree
shape works, balanced or not: subtrees are found by comparing node ids.

``treepo`` (sequence level, [N]): TreePO (Li et al. 2025, "TreePO: Bridging the Gap of Policy
Optimization and Efficacy and Inference Efficiency with Heuristic Tree-based Modeling"): a
leaf's advantage averages its reward relative to every subgroup it belongs to (the whole group
and the leaves under each of its ancestors), then is divided by the group std.

``rover`` (token level, [N, T]): values of the uniform-random policy over the sampled tree, in
the spirit of ROVER (He et al. 2025, "Random Policy Valuation is Enough for LLM Reasoning with
Verifiable Rewards"): a leaf's value is its reward, a node's value the mean of its children's
values; every token of segment j of a leaf gets value(level-j node) - value(its parent).
"""
from __future__ import annotations

import jax.numpy as jnp

from rljax.algorithms.advantages import _groups, _std, register_advantage_estimator

Array = jnp.ndarray


def _tree_groups(rewards: Array, group_size: int, node_ids: Array):
    """(rewards [P, G], same [P, G, G, D+1] bool: leaves i, i' share their level-j node)."""
    g = _groups(rewards, group_size)
    nid = jnp.asarray(node_ids, jnp.int32)
    if nid.ndim != 2 or nid.shape[0] != rewards.shape[0]:
        raise ValueError(f"node_ids must be [N, D+1] with N = {rewards.shape[0]}, got "
                         f"{nid.shape}")
    nid = nid.reshape(g.shape[0], group_size, -1)
    return g, nid[:, :, None, :] == nid[:, None, :, :]


def treepo_advantages(rewards: Array, group_size: int, *, node_ids: Array,
                      eps: float = 1e-6, std_ddof: int = 1) -> Array:
    """TreePO tree advantage, one per leaf. Returns [N].

    For leaf i with reward R_i, the subgroups S are the whole group and the leaf sets of its
    ancestor nodes that hold >= 2 leaves and fewer than the whole group (a single-root
    tree's root is the group itself; counting it twice would double the global term):

        A_i = mean_{S containing i} (R_i - mean_{l in S} R_l)
        Â_i = A_i / (std_group(A) + eps)        (std with ``std_ddof``, as ``grpo``)

    A leaf's tokens all get Â_i. In a balanced tree every leaf has the same number of
    subgroups, so averaging or summing them (the paper's aggregation) differs by a constant
    factor the std normalisation removes. A group whose rewards are all equal gets exactly 0.
    With every leaf its own root (``branching`` 1), it is ``grpo_advantages``.
    """
    g, same = _tree_groups(rewards, group_size, node_ids)
    size = same.sum(axis=2)                                               # [P, G, D+1]
    sub_mean = jnp.einsum("pild,pl->pid", same.astype(jnp.float32), g) / size
    use = (size >= 2) & (size < group_size)
    local = jnp.where(use, g[:, :, None] - sub_mean, 0.0).sum(axis=-1)
    centred = g - g.mean(axis=1, keepdims=True)
    a = (centred + local) / (1.0 + use.sum(axis=-1))
    constant = g.max(axis=1, keepdims=True) == g.min(axis=1, keepdims=True)
    a = jnp.where(constant, 0.0, a)
    return jnp.where(constant, 0.0, a / (_std(a, 1, std_ddof) + eps)).reshape(-1)


def tree_values(rewards: Array, group_size: int, *, node_ids: Array) -> Array:
    """Values of the uniform-random policy over each group's sampled tree.

    Returns [N, D+2]: column 0 the root value (the mean of the level-0 nodes' values), column
    j+1 the value of the leaf's level-j node; the last column is the leaf's own value (its
    reward, when level D is the leaf itself). A node's value is the unweighted mean of its
    children's values, however many leaves each child holds:

        V(node) = mean_{c in children(node)} V(c)

    computed per leaf as sum_{l under node} V(child of l) / |leaves of that child| divided by
    sum_{l under node} 1 / |leaves of that child| (each child counted once).
    """
    g, same = _tree_groups(rewards, group_size, node_ids)
    depth = same.shape[-1] - 1
    size = same.sum(axis=2).astype(jnp.float32)                           # [P, G, D+1]
    v = jnp.einsum("pil,pl->pi", same[..., depth].astype(jnp.float32), g) / size[..., depth]
    values = [v]                                          # level D: the mean of its leaves
    whole = jnp.ones(same.shape[:3], bool)
    for j in range(depth - 1, -2, -1):   # level j's node from its level-(j+1) children
        members = same[..., j] if j >= 0 else whole                       # [P, G, G]
        w = members.astype(jnp.float32) / size[:, None, :, j + 1]
        v = jnp.einsum("pil,pl->pi", w, v) / w.sum(axis=2)
        values.append(v)
    return jnp.stack(values[::-1], axis=-1).reshape(-1, depth + 2)


def rover_advantages(rewards: Array, group_size: int, *, mask: Array, node_ids: Array,
                     segments: Array, token_kl: Array | None = None, kl_coef: float = 0.0,
                     gamma: float = 1.0) -> Array:
    """ROVER-style token advantages from the uniform-random policy's values on the tree.

    Args:
      rewards: float [N] outcome rewards.
      group_size: G leaves per prompt.
      mask: bool [N, T], the completion tokens that train.
      node_ids: int [N, D+1] (module doc).
      segments: int [T], the tree level of each completion position
        (``sampling.tree.segment_of_position``).
      token_kl, kl_coef, gamma: the token-level interface's; a per-token KL in the reward
        and discounting are not defined on tree values: only ``kl_coef=0`` (or no
        ``token_kl``) and ``gamma=1`` are accepted (``algo.kl_in_reward`` is refused by
        the config check).
    Returns:
      float [N, T], 0 where mask is False: a token of segment j gets
      ``V(level-j node) - V(level-(j-1) node)`` (``tree_values``; level -1 is the root), so
      a leaf's segment advantages sum to ``R_i - V(root)``. A constant group gets exactly 0.
    """
    if gamma != 1.0:
        raise ValueError(f"rover: gamma must be 1, got {gamma}")
    if token_kl is not None and kl_coef:
        raise ValueError("rover: a per-token KL in the reward is not supported (kl_coef != 0)")
    values = tree_values(rewards, group_size, node_ids=node_ids)          # [N, D+2]
    seg_adv = values[:, 1:] - values[:, :-1]                              # [N, D+1]
    g = _groups(rewards, group_size)
    constant = (g.max(axis=1) == g.min(axis=1)).repeat(group_size)
    seg_adv = jnp.where(constant[:, None], 0.0, seg_adv)
    adv = jnp.take(seg_adv, jnp.asarray(segments, jnp.int32), axis=1)     # [N, T]
    return jnp.where(jnp.asarray(mask).astype(bool), adv, 0.0)


register_advantage_estimator("treepo", treepo_advantages, tree=True)
register_advantage_estimator("rover", rover_advantages, token_level=True, tree=True)
