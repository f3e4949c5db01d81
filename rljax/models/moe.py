"""Mixture-of-experts MLP: top-k routing, dropless grouped dispatch, load-balancing statistics.

Shapes: N tokens (the flattened leading axes), D ``hidden_size``, E ``num_experts``, k
``num_experts_per_tok``, F ``moe_intermediate_size``. Per-layer parameters::

    "router": [D, E]                          # logits = x @ router
    "expert_gate", "expert_up": [E, D, F]     # expert e: down(silu(x @ gate_e) * (x @ up_e))
    "expert_down": [E, F, D]

Dispatch (``moe_dispatch``): each device sorts its own tokens' (token, expert) assignments by
expert, sends the rows to the devices that hold those experts (``all_to_all`` over the mesh's
``expert`` axis, none without one), which run the three expert matmuls as grouped matmuls
(``jax.lax.ragged_dot``) on the rows they received; the outputs come back, are weighted and
summed. Dropless by default; ``cfg.moe_capacity_factor`` caps the rows per device;
``cfg.moe_plan_balanced`` (``rljax plan`` only) swaps the grouped matmuls for a stand-in
with their cost at a balanced load.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from rljax.models import moe_dispatch
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


def moe_mlp(cfg: ModelConfig, p: dict, h: jax.Array, token_mask: Optional[jax.Array] = None,
            replay: Optional[jax.Array] = None) -> tuple:
    """The MoE MLP on h [..., D] -> ``(out [..., D], stats)``.

    ``token_mask`` bool [...] (None = all real): which tokens count in the statistics.
    ``replay`` int [..., k]: routing replay (see ``route``).
    ``stats``: ``{"ids": int32 [..., k], "assigned": f32 [E] (real tokens' assignments per
    expert), "prob": f32 [E] (summed router probabilities of real tokens), "tokens": f32 [],
    "dropped": f32 [] (real tokens' assignments past ``cfg.moe_capacity_factor``'s capacity,
    0 when dropless)}``, what ``load_balance`` and the per-expert metrics are computed from.
    """
    lead, d = h.shape[:-1], h.shape[-1]
    x = h.reshape(-1, d)
    ids, weights, probs = route(cfg, p["router"], x,
                                None if replay is None else replay.reshape(x.shape[0], -1))
    real = (jnp.ones(x.shape[0], jnp.float32) if token_mask is None
            else token_mask.reshape(-1).astype(jnp.float32))
    out, dropped = moe_dispatch.dispatch(p, x, ids, weights, real, cfg.moe_capacity_factor,
                                         balanced=cfg.moe_plan_balanced)
    out = out.reshape(h.shape)
    one_hot = jax.nn.one_hot(ids, cfg.num_experts, dtype=jnp.float32)   # [N, k, E]
    stats = {"ids": ids.reshape(lead + (ids.shape[-1],)),
             "assigned": jnp.einsum("n,nke->e", real, one_hot),
             "prob": jnp.einsum("n,ne->e", real, probs),
             "tokens": jnp.sum(real), "dropped": dropped}
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
