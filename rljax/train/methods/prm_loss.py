"""The process reward model's loss: binary cross-entropy of the value head's logit at each
labelled step end (``algorithms.process_reward_loss``: TRL PRMTrainer's two-class token
classification with one logit), on a stepwise batch (``rljax.data.stepwise``). The PRM phase
trains on it (``phases.prm``), and so does the search's refit (``methods.prm_refit``).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from rljax import algorithms, models
from rljax.train.core import steps
from rljax.train.methods.prm_rerank import step_logits


def label_mask(batch: dict) -> jax.Array:
    """Labelled tokens of real rows, bool [B, C]."""
    return batch["label_mask"].astype(bool) & batch["row_mask"].astype(bool)[:, None]


def prm_loss(model_cfg: models.ModelConfig, params: Any, state, batch: dict):
    """Micro-batch PRM loss in the ``steps.accumulate`` convention (``params`` are value
    params): ``((BCE sum over labelled tokens, their number), metric pairs)``; metrics:
    step_accuracy (sign of the logit agrees with label > 0.5), score/mean (sigmoid of the
    logits), label/mean."""
    rng = None if state is None else steps.training_dropout_rng(model_cfg, state, batch)
    logits = step_logits(model_cfg, params, batch, rng)
    m = label_mask(batch)
    loss_sum, weight = algorithms.process_reward_loss(logits, batch["labels"], m)
    correct, _ = algorithms.step_accuracy(logits, batch["labels"], m)
    msum = lambda x: jax.lax.stop_gradient(jnp.where(m, x, 0.0).sum())  # noqa: E731
    metrics = {"step_accuracy": (correct, weight),
               "score/mean": (msum(jax.nn.sigmoid(logits)), weight),
               "label/mean": (msum(batch["labels"].astype(jnp.float32)), weight)}
    return (loss_sum, weight), metrics
