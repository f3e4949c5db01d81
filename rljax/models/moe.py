"""Mixture-of-experts MLP: top-k routing, dropless grouped dispatch, load-balancing statistics.

Shapes: N tokens (the flattened leading axes), D ``hidden_size``, E ``num_experts``, k
``num_experts_per_tok``, F ``moe_intermediate_size``. Per-layer parameters::

    "router": [D, E]                          # logits = x @ router
    "expert_gate", "expert_up": [E, D, F]     # expert e: down(silu(x @ gate_e) * (x @ up_e))
    "expert_down": [E, F, D]

Dispatch is dropless (no capacity, no token is ever dropped): the N*k (token, expert)
assignments are sorted by expert so each expert's rows are contiguous, and the three expert
matmuls are grouped matmuls (``jax.lax.ragged_dot``: group e multiplies its rows by expert e's
weights) over those N*k rows. The outputs are put back in token order, weighted and summed.
Work is N*k rows whatever the routing, unlike a dense one-hot dispatch (N*E rows).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from rljax.models.config import ModelConfig


def layer_shapes(cfg: ModelConfig) -> dict:
    """The MoE MLP's per-layer parameter shapes and logical axes (``expert``: the axis expert
    parallelism shards; ``expert_choice``: the router's output, kept whole)."""
    d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    return {
        "router": ((d, e), ("embed", "expert_choice")),
        "expert_gate": ((e, d, f), ("expert", "embed", "mlp")),
        "expert_up": ((e, d, f), ("expert", "embed", "mlp")),
        "expert_down": ((e, f, d), ("expert", "mlp", "embed")),
    }


def route(cfg: ModelConfig, router: jax.Array, x: jax.Array,
          replay: Optional[jax.Array] = None) -> tuple:
    """Top-k routing of x [N, D] -> ``(ids int32 [N, k], weights float32 [N, k], probs
    float32 [N, E])``.

    ``probs`` = softmax of the float32 router logits; ``ids`` the k most probable experts
    (descending), ``weights`` their probabilities, renormalised to sum to 1 when
    ``cfg.norm_topk_prob`` (qwen3_moe; olmoe uses them as they are).

    ``replay`` int [N, k] (routing replay): use these experts instead of the top-k; the
    weights are still the current router's probabilities of the replayed experts, so the
    router keeps its gradient.
    """
    logits = jnp.dot(x, router.astype(x.dtype), preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    if replay is None:
        weights, ids = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    else:
        ids = jnp.clip(replay.astype(jnp.int32), 0, cfg.num_experts - 1)
        weights = jnp.take_along_axis(probs, ids, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), weights, probs


def grouped_experts(p: dict, x: jax.Array, ids: jax.Array, weights: jax.Array) -> jax.Array:
    """Dropless expert computation: x [N, D], ids int [N, k], weights [N, k] -> [N, D] =
    ``sum_j weights[:, j] * expert_{ids[:, j]}(x)`` (weights applied in ``x.dtype``)."""
    n, k = ids.shape
    num_experts = p["expert_gate"].shape[0]
    flat = ids.reshape(-1)                                   # [N*k], assignment a = token*k + j
    order = jnp.argsort(flat, stable=True)                   # assignments grouped by expert
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)   # rows per expert [E]
    rows = x[order // k]                                     # [N*k, D], each row its token
    gate = jax.lax.ragged_dot(rows, p["expert_gate"], sizes)
    up = jax.lax.ragged_dot(rows, p["expert_up"], sizes)
    out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, p["expert_down"], sizes)   # [N*k, D]
    # Back to assignment order (the inverse permutation), then weight and sum each token's k.
    out = jnp.zeros_like(out).at[order].set(out).reshape(n, k, -1)
    return jnp.sum(out * weights.astype(x.dtype)[..., None], axis=1)


def moe_mlp(cfg: ModelConfig, p: dict, h: jax.Array, token_mask: Optional[jax.Array] = None,
            replay: Optional[jax.Array] = None) -> tuple:
    """The MoE MLP on h [..., D] -> ``(out [..., D], stats)``.

    ``token_mask`` bool [...] (None = all real): which tokens count in the statistics.
    ``replay`` int [..., k]: routing replay (see ``route``).
    ``stats``: ``{"ids": int32 [..., k], "assigned": f32 [E] (real tokens' assignments per
    expert), "prob": f32 [E] (summed router probabilities of real tokens), "tokens": f32 []}``,
    what ``load_balance`` and the per-expert metrics are computed from.
    """
    lead, d = h.shape[:-1], h.shape[-1]
    x = h.reshape(-1, d)
    ids, weights, probs = route(cfg, p["router"], x,
                                None if replay is None else replay.reshape(x.shape[0], -1))
    out = grouped_experts(p, x, ids, weights).reshape(h.shape)
    real = (jnp.ones(x.shape[0], jnp.float32) if token_mask is None
            else token_mask.reshape(-1).astype(jnp.float32))
    one_hot = jax.nn.one_hot(ids, cfg.num_experts, dtype=jnp.float32)   # [N, k, E]
    stats = {"ids": ids.reshape(lead + (ids.shape[-1],)),
             "assigned": jnp.einsum("n,nke->e", real, one_hot),
             "prob": jnp.einsum("n,ne->e", real, probs),
             "tokens": jnp.sum(real)}
    return out, stats


def load_balance(cfg: ModelConfig, stats: dict) -> tuple:
    """The Switch-Transformer load-balancing loss from per-layer ``stats`` (``moe_mlp``'s,
    stacked over L layers) -> ``(loss f32 [], fractions f32 [E])``.

    As transformers computes it for ``router_aux_loss_coef``: over every layer's real tokens,
    ``f_e`` = top-k assignments to expert e per token, ``P_e`` = mean router probability of e,
    ``loss = E * sum_e f_e * P_e`` (k when perfectly balanced). ``fractions`` = ``f_e / k``,
    the share of assignments expert e received (sums to 1). The loss's gradient flows
    through ``P`` (the router), not through the discrete counts."""
    tokens = jnp.maximum(jnp.sum(stats["tokens"]), 1.0)
    f = jax.lax.stop_gradient(jnp.sum(stats["assigned"], axis=0)) / tokens
    prob = jnp.sum(stats["prob"], axis=0) / tokens
    loss = cfg.num_experts * jnp.sum(f * prob)
    return loss, f / cfg.num_experts_per_tok
