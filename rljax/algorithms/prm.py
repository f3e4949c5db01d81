"""Process reward model (PRM) loss and step-score aggregation.

A PRM scores every step of a solution: one logit per token, read at the token that ends each
step (TRL's PRMTrainer labels that token and gives every other token the ignore label -100).
TRL trains a two-class token classifier with cross-entropy over the labelled tokens; a scalar
logit ``s`` is the same model with class logits ``(0, s)``:

    CE((0, s), y) = -y log sigmoid(s) - (1 - y) log(1 - sigmoid(s)) = BCE(s, y)

so ``process_reward_loss`` is binary cross-entropy with logits over the labelled positions.
Soft labels ``y`` in [0, 1] (Math-Shepherd's fraction of correct continuations) use the same
formula. Returns ``(sum, weight)`` so micro-batches and shards add up exactly; the mean over
labelled tokens (TRL's reduction) is ``sum / weight``.
"""
from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp

Array = jnp.ndarray

STEP_SCORE_MODES = ("min", "last", "mean", "prod")


def process_reward_loss_tokens(logits: Array, labels: Array, mask: Array) -> Array:
    """Per-token BCE with logits [B, T] (0 where ``mask`` [B, T] is False); labels [B, T] in
    [0, 1] are constants (no gradient)."""
    m = jnp.asarray(mask).astype(bool)
    s = jnp.asarray(logits, jnp.float32)
    y = jax.lax.stop_gradient(jnp.asarray(labels, jnp.float32))
    # -y log sig(s) - (1-y) log sig(-s), written with log_sigmoid for stability at large |s|.
    tokens = -(y * jax.nn.log_sigmoid(s) + (1.0 - y) * jax.nn.log_sigmoid(-s))
    return jnp.where(m, tokens, 0.0)


def process_reward_loss(logits: Array, labels: Array, mask: Array) -> Tuple[Array, Array]:
    """PRM loss over labelled step-end tokens: (sum of BCE, number of labelled tokens)."""
    m = jnp.asarray(mask).astype(bool)
    return process_reward_loss_tokens(logits, labels, m).sum(), m.sum().astype(jnp.float32)


def step_accuracy(logits: Array, labels: Array, mask: Array) -> Tuple[Array, Array]:
    """(count of labelled tokens where ``logit > 0`` agrees with ``label > 0.5``, count)."""
    m = jnp.asarray(mask).astype(bool)
    agree = (jnp.asarray(logits) > 0) == (jnp.asarray(labels) > 0.5)
    return jnp.where(m, agree, False).sum().astype(jnp.float32), m.sum().astype(jnp.float32)


def aggregate_step_scores(probs: Array, mask: Array, mode: str = "min") -> Array:
    """One score per completion from its step scores: probs [B, S] (probability each step is
    good), mask [B, S] (real steps) -> [B]. ``min`` (the weakest step, as in Lightman et al.
    and Math-Shepherd), ``last`` (the last real step), ``mean``, ``prod``. A row without steps
    scores 0."""
    if mode not in STEP_SCORE_MODES:
        raise ValueError(f"step score mode {mode!r} is not one of {STEP_SCORE_MODES}")
    p = jnp.asarray(probs, jnp.float32)
    m = jnp.asarray(mask).astype(bool)
    any_step = m.any(axis=1)
    if mode == "min":
        out = jnp.where(m, p, jnp.inf).min(axis=1)
    elif mode == "prod":
        out = jnp.where(m, p, 1.0).prod(axis=1)
    elif mode == "mean":
        out = jnp.where(m, p, 0.0).sum(axis=1) / jnp.maximum(m.sum(axis=1), 1)
    else:  # last: argmax of the reversed row finds its last True
        last = m.shape[1] - 1 - jnp.argmax(m[:, ::-1], axis=1)
        out = jnp.take_along_axis(p, last[:, None], axis=1)[:, 0]
    return jnp.where(any_step, out, 0.0)


def auroc(scores, labels) -> float:
    """Area under the ROC curve of ``scores`` [N] separating ``labels`` [N] (truthy =
    positive): the probability that a random positive outscores a random negative, ties
    counted half (Mann-Whitney U with average ranks). NaN without both classes. Host numpy."""
    import numpy as np  # host-side metric; the rest of the module is jax
    s = np.asarray(scores, np.float64).reshape(-1)
    y = np.asarray(labels).reshape(-1).astype(bool)
    pos, neg = int(y.sum()), int((~y).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s), np.float64)
    sorted_s = s[order]
    i = 0
    while i < len(s):  # average rank over each run of tied scores
        j = i
        while j + 1 < len(s) and sorted_s[j + 1] == sorted_s[i]:
            j += 1
        ranks[order[i:j + 1]] = 0.5 * (i + j) + 1.0
        i = j + 1
    return float((ranks[y].sum() - pos * (pos + 1) / 2.0) / (pos * neg))
