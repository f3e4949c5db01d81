"""Role-conditioned advantages for games: a baseline per (game, role).

When one policy plays several seats of a zero-sum game (self-play), a trajectory gives a
return for each seat, and seats differ in what they can expect: the first mover of TicTacToe
wins more often against a random player, Kuhn Poker's first seat loses 1/18 per hand under
equilibrium play. A single baseline over all seats would credit a seat for its position, not its
moves. SPIRAL (Liu et al. 2025, arXiv:2506.24119) keeps one baseline per (game, role), an
exponential moving average of that role's returns, and subtracts it:

    b_k <- alpha * b_k + (1 - alpha) * R        A = R - b_k      (k = the trajectory's role)

updating before subtracting (alpha = 0.95 in the paper). Here the update takes a batch at
once: each role seen in the batch moves towards the *mean* return of its trajectories in the
batch; roles absent from the batch keep their baseline (``rae_update``).

The baseline state is an f32 array [K] over role keys (``role_keys``: game * num_seats + seat)
passed in and returned, so the functions are pure and jit-able; the trainer keeps it in its
state beside the optimizer's (and checkpoints it). ``role_mean_advantages`` is the stateless
variant: the batch's own per-role mean as the baseline.

Registered as the advantage estimator ``"rae"`` (``rae_estimator``, flag ``roles``: the
trainer passes each sample's role key and the baseline from its state, and stores the new
baseline back into ``TrainState.role_baseline``, so it is checkpointed and a resumed run
continues with the same baselines). Against a scripted opponent GRPO's group of G episodes of
one example (same game, seat and opponent seed) already is a per-role baseline; RAE matters
when one policy plays every seat, and it works with G = 1.
"""
from __future__ import annotations

import jax.numpy as jnp

from rljax.algorithms.advantages import register_advantage_estimator

Array = jnp.ndarray

__all__ = ["role_keys", "rae_update", "rae_advantages", "rae_step", "role_mean_advantages",
           "rae_estimator"]


def role_keys(game_ids: Array, seats: Array, num_seats: int) -> Array:
    """Role key per trajectory, int32 [N]: ``game_id * num_seats + seat`` (both int [N])."""
    return (jnp.asarray(game_ids, jnp.int32) * int(num_seats)
            + jnp.asarray(seats, jnp.int32))


def _role_sums(returns: Array, roles: Array, num_roles: int) -> tuple[Array, Array]:
    """(sum of returns, count) per role key, f32 [K] each."""
    returns = jnp.asarray(returns, jnp.float32)
    roles = jnp.asarray(roles, jnp.int32)
    if returns.ndim != 1 or returns.shape != roles.shape:
        raise ValueError(f"returns and roles must be 1-D of one length, got {returns.shape} "
                         f"and {roles.shape}")
    sums = jnp.zeros(num_roles, jnp.float32).at[roles].add(returns)
    counts = jnp.zeros(num_roles, jnp.float32).at[roles].add(1.0)
    return sums, counts


def rae_update(baseline: Array, returns: Array, roles: Array, *, alpha: float = 0.95) -> Array:
    """The new baselines f32 [K]: for each role k in the batch,
    ``alpha * baseline[k] + (1 - alpha) * mean(returns[roles == k])``; the others unchanged.

    baseline: f32 [K]; returns: f32 [N] (each trajectory's return for its role); roles: int [N]
    in [0, K)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"rae: alpha must be in [0, 1], got {alpha}")
    baseline = jnp.asarray(baseline, jnp.float32)
    sums, counts = _role_sums(returns, roles, baseline.shape[0])
    seen = counts > 0
    mean = sums / jnp.maximum(counts, 1.0)
    return jnp.where(seen, alpha * baseline + (1.0 - alpha) * mean, baseline)


def rae_advantages(returns: Array, roles: Array, baseline: Array) -> Array:
    """``returns - baseline[roles]``, f32 [N]."""
    return (jnp.asarray(returns, jnp.float32)
            - jnp.asarray(baseline, jnp.float32)[jnp.asarray(roles, jnp.int32)])


def rae_step(baseline: Array, returns: Array, roles: Array, *, alpha: float = 0.95
             ) -> tuple[Array, Array]:
    """SPIRAL's order: update the baselines with this batch, then subtract them.
    Returns (advantages f32 [N], new baseline f32 [K])."""
    new = rae_update(baseline, returns, roles, alpha=alpha)
    return rae_advantages(returns, roles, new), new


def role_mean_advantages(returns: Array, roles: Array, num_roles: int) -> Array:
    """Stateless variant: each return minus the mean return of its role in this batch,
    f32 [N] (a role with one trajectory gets 0)."""
    sums, counts = _role_sums(returns, roles, int(num_roles))
    mean = sums / jnp.maximum(counts, 1.0)
    return rae_advantages(returns, roles, mean)


def rae_estimator(rewards: Array, group_size: int, *, roles: Array, baseline: Array,
                  alpha: float = 0.95) -> tuple[Array, Array]:
    """The estimator ``"rae"``: ``rae_step`` in the registry's calling convention.

    rewards: f32 [N] (each sample's return for its role); group_size: unused (the baseline is
    per role, not per group: G may be 1); roles: int [N] in [0, K); baseline: f32 [K].
    Returns (advantages f32 [N], new baseline f32 [K])."""
    del group_size
    return rae_step(baseline, rewards, roles, alpha=alpha)


register_advantage_estimator("rae", rae_estimator, roles=True)
