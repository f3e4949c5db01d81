"""Preference losses: the DPO family and the Bradley-Terry reward-model loss.

Inputs are summed log-probabilities of whole completions, [B] each.
"""
from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from rljax.algorithms.aggregation import safe_divide

Array = jnp.ndarray
sg = jax.lax.stop_gradient

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "simpo")


def dpo_loss(policy_chosen_logps: Array, policy_rejected_logps: Array,
             ref_chosen_logps: Optional[Array], ref_rejected_logps: Optional[Array],
             beta: float = 0.1, loss_type: str = "sigmoid", label_smoothing: float = 0.0, *,
             chosen_lengths: Optional[Array] = None, rejected_lengths: Optional[Array] = None,
             simpo_gamma: float = 0.5) -> Tuple[Array, Array, Array]:
    """Direct Preference Optimization and variants. All inputs [B]; returns
    (losses [B], chosen_rewards [B], rejected_rewards [B]); rewards are stop-gradient.

    With h = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l)) and
    eps = label_smoothing:

      "sigmoid" DPO (Rafailov et al. 2023): -log sig(beta h); with eps > 0 conservative DPO
                (Mitchell 2023, cDPO): -(1-eps) log sig(beta h) - eps log sig(-beta h).
      "robust"  robust DPO (Chowdhury et al. 2024, "Provably Robust DPO"):
                (-(1-eps) log sig(beta h) + eps log sig(-beta h)) / (1 - 2 eps).
      "hinge"   SLiC-HF (Zhao et al. 2023): max(0, 1 - beta h).
      "ipo"     IPO (Azar et al. 2023): (h - 1/(2 beta))^2, beta playing tau. IPO is defined on
                length-averaged log-probs; pass averages (or lengths) accordingly.
      "simpo"   SimPO (Meng et al. 2024), reference-free (ref_* ignored, may be None):
                -(1-eps) log sig(beta (lw - ll) - gamma) - eps log sig(-(...)) with lw, ll the
                length-normalised log-probs; gamma = simpo_gamma (target reward margin).

    chosen_lengths / rejected_lengths: completion lengths [B]; when given the policy (and
    reference) log-probs are divided by them (length-normalised). For "simpo" pass either the
    lengths or already length-normalised log-probs.
    Rewards: beta * (log pi - log pi_ref) per completion (beta * normalised log pi for simpo).
    """
    pc = jnp.asarray(policy_chosen_logps, jnp.float32)
    pr = jnp.asarray(policy_rejected_logps, jnp.float32)
    if loss_type == "simpo" or ref_chosen_logps is None:
        if loss_type != "simpo":
            raise ValueError(f"loss_type {loss_type!r} needs reference log-probs")
        rc = jnp.zeros_like(pc)
        rr = jnp.zeros_like(pr)
    else:
        rc = jnp.asarray(ref_chosen_logps, jnp.float32)
        rr = jnp.asarray(ref_rejected_logps, jnp.float32)
    if chosen_lengths is not None:
        lc = jnp.asarray(chosen_lengths, jnp.float32)
        pc, rc = safe_divide(pc, lc), safe_divide(rc, lc)
    if rejected_lengths is not None:
        lr_ = jnp.asarray(rejected_lengths, jnp.float32)
        pr, rr = safe_divide(pr, lr_), safe_divide(rr, lr_)

    chosen_logratio = pc - rc
    rejected_logratio = pr - rr
    h = chosen_logratio - rejected_logratio
    eps = label_smoothing
    ls = jax.nn.log_sigmoid
    if loss_type == "sigmoid":
        losses = -(1.0 - eps) * ls(beta * h) - eps * ls(-beta * h)
    elif loss_type == "robust":
        if not 0.0 <= eps < 0.5:
            raise ValueError(f"robust DPO needs 0 <= label_smoothing < 0.5, got {eps}")
        losses = (-(1.0 - eps) * ls(beta * h) + eps * ls(-beta * h)) / (1.0 - 2.0 * eps)
    elif loss_type == "hinge":
        losses = jax.nn.relu(1.0 - beta * h)
    elif loss_type == "ipo":
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    elif loss_type == "simpo":
        z = beta * h - simpo_gamma
        losses = -(1.0 - eps) * ls(z) - eps * ls(-z)
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; expected one of {DPO_LOSS_TYPES}")
    return losses, sg(beta * chosen_logratio), sg(beta * rejected_logratio)


def reward_model_loss(chosen_rewards: Array, rejected_rewards: Array, *,
                      margin: Optional[Array] = None, mask: Optional[Array] = None,
                      center_coef: float = 0.0) -> Tuple[Array, Array]:
    """Bradley-Terry pairwise reward-model loss (Ouyang et al. 2022), per pair
    -log sig(r_w - r_l - margin) (margin: Llama 2, Touvron et al. 2023), plus optionally
    center_coef * (r_w + r_l)^2 (reward centring, Eisenstein et al. 2023).

    All inputs [B]; mask [B] marks real pairs. Returns (weighted_sum, weight).
    """
    rw = jnp.asarray(chosen_rewards, jnp.float32)
    rl = jnp.asarray(rejected_rewards, jnp.float32)
    d = rw - rl
    if margin is not None:
        d = d - jnp.asarray(margin, jnp.float32)
    losses = -jax.nn.log_sigmoid(d)
    if center_coef:
        losses = losses + center_coef * (rw + rl) ** 2
    m = jnp.ones_like(rw, dtype=bool) if mask is None else jnp.asarray(mask).astype(bool)
    return jnp.where(m, losses, 0.0).sum(), m.astype(jnp.float32).sum()


def preference_accuracy(chosen_rewards: Array, rejected_rewards: Array,
                        mask: Optional[Array] = None) -> Tuple[Array, Array]:
    """(number of pairs with r_w > r_l, number of pairs)."""
    rw = jnp.asarray(chosen_rewards)
    m = jnp.ones_like(rw, dtype=bool) if mask is None else jnp.asarray(mask).astype(bool)
    return jnp.where(m, rw > jnp.asarray(rejected_rewards), False).sum().astype(jnp.float32), \
        m.astype(jnp.float32).sum()
