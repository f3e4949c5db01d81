"""On-policy distillation signals: the student's own samples scored by a frozen teacher.

Per token t of a completion sampled from the student pi (log-probs ``logps``), with the
teacher's log-probs ``teacher_logps`` of the same sampled tokens:

  reverse KL   k_t = log pi(y_t) - log pi_T(y_t)      a one-sample estimate of
                                                      KL(pi(.|y_<t) || pi_T(.|y_<t))
  advantage    A_t = -k_t                             discount 0: token t is credited with its
                                                      own KL only (the published on-policy
                                                      distillation form; GKD, arXiv 2306.13649)

Minimising the sequence reverse KL by policy gradient with these advantages pulls the student
toward the teacher on the student's own states, so there is no train/test mismatch of prefixes.

Full-distribution term (GKD's generalised Jensen-Shannon divergence), over the teacher's top-k
tokens S_t at each position, both distributions renormalised over S_t (P teacher, Q student):

  M      = beta P + (1 - beta) Q
  JSD_b  = beta KL(P || M) + (1 - beta) KL(Q || M)     0 < beta < 1
  JSD_0  = KL(P || Q)  (forward),  JSD_1 = KL(Q || P)  (reverse)

(the two limits, where the mixture formula itself is 0, are the KLs it interpolates between,
as GKD describes beta). Gradients flow through the student's log-probs only.

All functions are per token, unmasked; aggregate with a mask (``aggregate``), so the losses
are exact under micro-batching.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jnp.ndarray


def reverse_kl_tokens(logps: Array, teacher_logps: Array) -> Array:
    """k_t = log pi(y_t) - log pi_T(y_t) per sampled token, f32 [B, N]."""
    return jnp.asarray(logps, jnp.float32) - jnp.asarray(teacher_logps, jnp.float32)


def distill_advantages(logps: Array, teacher_logps: Array, mask: Array,
                       task_advantages: Array | None = None, *, kl_weight: float = 1.0,
                       reward_weight: float = 0.0) -> Array:
    """Per-token advantages [B, N]: ``-kl_weight * k_t + reward_weight * A_task``, 0 outside
    ``mask``. ``logps`` are the student's log-probs before the update (no gradient flows
    through an advantage). ``task_advantages`` [B] (one per completion, broadcast over its
    tokens) or [B, N]; None or ``reward_weight=0`` leaves the task reward out."""
    adv = -kl_weight * jax.lax.stop_gradient(reverse_kl_tokens(logps, teacher_logps))
    if task_advantages is not None and reward_weight:
        task = jnp.asarray(task_advantages, jnp.float32)
        adv = adv + reward_weight * (task[:, None] if task.ndim == 1 else task)
    return jnp.where(mask, adv, 0.0)


def _kl(log_p: Array, log_q: Array) -> Array:
    """KL(p || q) over the last axis from finite log-probabilities (top-k log-probs are)."""
    return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)


def generalized_jsd_tokens(student_logps: Array, teacher_logps: Array,
                           beta: float = 0.5) -> Array:
    """GKD's generalised JSD per position over a token subset: f32 [B, N].

    ``student_logps``, ``teacher_logps``: f32 [B, N, K], each model's log-probs of the same K
    token ids (the teacher's top-k); both are renormalised over those K before comparing.
    ``beta`` in [0, 1]: 0 = KL(teacher || student), 1 = KL(student || teacher)."""
    log_q = jnp.asarray(student_logps, jnp.float32)
    log_p = jax.lax.stop_gradient(jnp.asarray(teacher_logps, jnp.float32))
    log_q = log_q - jax.nn.logsumexp(log_q, axis=-1, keepdims=True)
    log_p = log_p - jax.nn.logsumexp(log_p, axis=-1, keepdims=True)
    beta = float(beta)
    if beta == 0.0:
        return _kl(log_p, log_q)
    if beta == 1.0:
        return _kl(log_q, log_p)
    log_m = jnp.logaddexp(log_p + jnp.log(beta), log_q + jnp.log1p(-beta))
    return beta * _kl(log_p, log_m) + (1.0 - beta) * _kl(log_q, log_m)


def teacher_agreement(tokens: Array, teacher_argmax: Array, mask: Array) -> tuple[Array, Array]:
    """(number of sampled tokens equal to the teacher's most likely token, tokens) over
    ``mask``: a (sum, weight) pair, summed over micro-batches / hosts and divided once."""
    m = jnp.asarray(mask, bool)
    hits = jnp.where(m, jnp.asarray(tokens) == jnp.asarray(teacher_argmax), False)
    return hits.sum().astype(jnp.float32), m.sum().astype(jnp.float32)
