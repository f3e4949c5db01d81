"""Value model (PPO critic): the transformer trunk plus a scalar head.

``value_params = {"trunk": <policy param tree without lm_head>, "head": {"kernel": [D], "bias": []}}``
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from rljax.models.config import ModelConfig
from rljax.models.transformer import init_params, param_logical_axes, trunk


def init_value_params(cfg: ModelConfig, rng: jax.Array, from_params: Optional[dict] = None):
    """Critic parameters. ``from_params`` (policy params) initialises the trunk with a copy of
    the policy's weights (copied so that donating one tree never invalidates the other); the
    LM head is dropped. The scalar head starts small (normal, init_std) with zero bias."""
    trunk_rng, head_rng = jax.random.split(rng)
    if from_params is None:
        src = init_params(cfg, trunk_rng)
        body = {k: v for k, v in src.items() if k != "lm_head"}
    else:
        body = jax.tree.map(jnp.copy, {k: v for k, v in from_params.items() if k != "lm_head"})
    kernel = cfg.init_std * jax.random.normal(head_rng, (cfg.hidden_size,), jnp.float32)
    head = {"kernel": kernel.astype(cfg.params_dtype), "bias": jnp.zeros((), cfg.params_dtype)}
    return {"trunk": body, "head": head}


def value_param_logical_axes(cfg: ModelConfig) -> dict:
    """Logical axes of ``init_value_params(cfg, ...)`` (same tree, tuples of names)."""
    axes = {k: v for k, v in param_logical_axes(cfg).items() if k != "lm_head"}
    return {"trunk": axes, "head": {"kernel": ("embed",), "bias": ()}}


def value_forward(cfg: ModelConfig, value_params: dict, tokens: jax.Array, attention_mask=None,
                  positions=None, lora_dropout_rng: Optional[jax.Array] = None,
                  image_embeds=None) -> jax.Array:
    """tokens int [B, T] -> float32 values [B, T] (value of the prefix ending at each token).
    ``lora_dropout_rng``: LoRA dropout on the trunk's adapters in a training pass (None = none;
    see ``trunk``); ``image_embeds`` [B, K, D]: a multimodal prompt's images, as ``trunk``."""
    hidden, _ = trunk(cfg, value_params["trunk"], tokens, attention_mask=attention_mask,
                      positions=positions, lora_dropout_rng=lora_dropout_rng,
                      image_embeds=image_embeds)
    head = value_params["head"]
    return (jnp.einsum("btd,d->bt", hidden.astype(jnp.float32), head["kernel"].astype(jnp.float32))
            + head["bias"].astype(jnp.float32))
