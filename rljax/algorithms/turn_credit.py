"""Per-turn credit for multi-turn episodes (``env.turn_discount``): each model turn keeps the
reward of the environment step it produced (the final answer's reward-function score goes to
the last turn), and is judged by its discounted return from that turn on.

Shapes: N episodes (prompt-major groups of G), T = the turn slots (``env.max_turns``),
M = trajectory slots after the prompt.

    turn_rewards  f32   [N, T]  r_{i,t}: reward of episode i's turn t (0 for turns not played)
    turns         int   [N]     turns played (every played turn has >= 1 model token)
    turn_ids      int   [N, M]  the turn of each model token, -1 elsewhere (observations)

GRPO family (``turn_advantages``): the return of turn t,
``R_{i,t} = sum_{k >= 0} gamma^k r_{i,t+k}`` (over the turns played), is compared with the
*group's episode returns* ``R_{j,0}`` (the G episodes share only their start state):

    grpo      A_{i,t} = (R_{i,t} - mean_j R_{j,0}) / (std_j R_{j,0} + eps)   ("group" scale;
              "batch": std over every R_{j,0} of the batch; "none": no division)
    dr_grpo   A_{i,t} =  R_{i,t} - mean_j R_{j,0}
    rloo      A_{i,t} =  R_{i,t} - mean_{j != i} R_{j,0}

and a group whose episode returns are all equal gets 0 on every turn (as in GRPO: no
comparison, no signal). Every model token of turn t gets A_{i,t} (``spread_over_turns``).
This rule keeps the outcome estimator's baseline and scale, so with gamma = 1 and only a final
reward (R_{i,t} = R_{i,0} for every t) it is exactly the outcome advantage; what changes is that
a turn is not credited for rewards paid before it, and with gamma < 1 a reward counts less the
more turns it lies ahead (fewer turns to the same reward score higher). MT-GRPO (Zeng et al.
2025, arXiv:2505.11821) instead normalises each turn position's rewards over the group; that
needs every episode to reach the same turns and does not reduce to outcome GRPO.

PPO (``turn_end_rewards``, ``turn_end_discounts``): r_{i,t} sits on the last model token of
turn t and GAE runs over model tokens only, with ``gamma`` at each turn's end
(``rljax.algorithms.gae``'s ``next_discount``).
"""
from __future__ import annotations

import numpy as np

from rljax.algorithms.advantages import get_advantage_estimator

# Sequence estimators with a group baseline and scale that per-turn returns plug into.
TURN_ESTIMATORS = ("grpo", "dr_grpo", "rloo")


def turn_returns(turn_rewards: np.ndarray, turns: np.ndarray, gamma: float) -> np.ndarray:
    """Discounted return from each played turn: f32 [N, T], 0 for turns not played.

    ``R_{i,t} = r_{i,t} + gamma * R_{i,t+1}`` with ``R_{i,turns_i} = 0`` (host numpy: T is a
    handful of turns, and an eager ``lax.scan`` would compile anew every iteration)."""
    rewards = np.asarray(turn_rewards, np.float32)
    played = np.arange(rewards.shape[1])[None, :] < np.asarray(turns)[:, None]
    returns = np.zeros_like(rewards)
    later = np.zeros(len(rewards), np.float32)
    for t in range(rewards.shape[1] - 1, -1, -1):
        later = np.where(played[:, t], rewards[:, t] + np.float32(gamma) * later, 0.0)
        returns[:, t] = later
    return returns


def turn_sums(token_values: np.ndarray, turn_ids: np.ndarray, num_turns: int) -> np.ndarray:
    """f32 [N, T]: the sum of ``token_values`` [N, M] over each turn's tokens (``turn_ids``
    int [N, M], -1 off model tokens); e.g. each turn's KL to the reference."""
    values = np.asarray(token_values, np.float32)
    ids = np.asarray(turn_ids)
    return np.stack([np.where(ids == t, values, 0.0).sum(-1) for t in range(num_turns)],
                    1).astype(np.float32)


def _group_scale(first: np.ndarray, group_size: int, estimator: str, scale_rewards: str,
                 eps: float, std_ddof: int, group_ids=None) -> np.ndarray:
    """f32 [N]: how much one unit of an episode's own return moves its advantage
    (1 / the estimator's scale), 0 in groups whose returns are all equal. ``group_ids`` int
    [N]: groups of their own sizes (knapsack allocation), else consecutive groups of
    ``group_size``."""
    if group_ids is not None:
        return _ragged_scale(first, np.asarray(group_ids), estimator, scale_rewards, eps,
                             std_ddof)
    g = first.astype(np.float64).reshape(-1, group_size)
    constant = g.max(axis=1) == g.min(axis=1)
    if estimator == "grpo" and scale_rewards == "group":
        scale = 1.0 / (g.std(axis=1, ddof=min(std_ddof, group_size - 1)) + eps)
    elif estimator == "grpo" and scale_rewards == "batch":
        scale = np.full(len(g), 1.0 / (g.std(ddof=min(std_ddof, g.size - 1)) + eps))
    else:   # grpo "none", dr_grpo, rloo: A is the return minus a baseline
        scale = np.ones(len(g))
    scale = np.where(constant, 0.0, scale)
    return np.repeat(scale, group_size).astype(np.float32)


def _ragged_scale(first: np.ndarray, group_ids: np.ndarray, estimator: str,
                  scale_rewards: str, eps: float, std_ddof: int) -> np.ndarray:
    """``_group_scale`` over the rows sharing each id of ``group_ids`` int [N] (any sizes,
    any order; a group of one is constant)."""
    first = first.astype(np.float64)
    scale = np.ones(len(first))
    if estimator == "grpo" and scale_rewards == "batch":
        scale[:] = 1.0 / (first.std(ddof=min(std_ddof, first.size - 1)) + eps)
    for gid in np.unique(group_ids):
        rows = group_ids == gid
        r = first[rows]
        if r.max() == r.min():
            scale[rows] = 0.0
        elif estimator == "grpo" and scale_rewards == "group":
            scale[rows] = 1.0 / (r.std(ddof=min(std_ddof, r.size - 1)) + eps)
    return scale.astype(np.float32)


def turn_advantages(returns: np.ndarray, turns: np.ndarray, group_size: int, *,
                    estimator: str = "grpo", scale_rewards: str = "group",
                    eps: float = 1e-6, std_ddof: int = 1,
                    outcome: np.ndarray | None = None,
                    group_ids: np.ndarray | None = None) -> np.ndarray:
    """Per-turn advantages f32 [N, T] from per-turn returns [N, T] (module docstring), 0 for
    turns not played.

    Computed as the outcome estimator on the episode returns R_{i,0} plus
    ``(R_{i,t} - R_{i,0}) * scale``: the outcome advantage is reused bit for bit, so with
    R_{i,t} = R_{i,0} the result equals ``get_advantage_estimator(estimator)`` exactly.
    ``outcome``: that estimator's advantages f32 [N] of ``returns[:, 0]`` when the caller
    already has them (the rollout's jitted estimator), else computed here. ``group_ids`` int
    [N]: each episode's group when groups have sizes of their own (knapsack allocation;
    ``group_size`` is then ignored)."""
    if estimator not in TURN_ESTIMATORS:
        raise ValueError(f"per-turn returns support adv_estimator in {TURN_ESTIMATORS}, "
                         f"got {estimator!r}")
    returns = np.asarray(returns, np.float32)
    first = returns[:, 0]
    opts = {"scale_rewards": scale_rewards, "eps": eps, "std_ddof": std_ddof} \
        if estimator == "grpo" else {}
    if group_ids is not None:
        opts["group_ids"] = group_ids
    if outcome is None:
        outcome = get_advantage_estimator(estimator)(first, group_size, **opts)
    outcome = np.asarray(outcome, np.float32)
    scale = _group_scale(first, group_size, estimator, scale_rewards, eps, std_ddof, group_ids)
    adv = outcome[:, None] + (returns - first[:, None]) * scale[:, None]
    played = np.arange(returns.shape[1])[None, :] < np.asarray(turns)[:, None]
    return np.where(played, adv, 0.0).astype(np.float32)


def spread_over_turns(per_turn: np.ndarray, turn_ids: np.ndarray) -> np.ndarray:
    """Every model token gets its turn's value: f32 [N, M], 0 where ``turn_ids`` < 0."""
    picked = np.take_along_axis(np.asarray(per_turn, np.float32),
                                np.maximum(turn_ids, 0), axis=1)
    return np.where(turn_ids >= 0, picked, 0.0).astype(np.float32)


def turn_ends(turn_ids: np.ndarray) -> np.ndarray:
    """bool [N, M]: the last model token of each turn. A turn's model tokens are contiguous
    (an observation or the padding follows them), so it is where the next slot's id differs."""
    turn_ids = np.asarray(turn_ids)
    nxt = np.concatenate([turn_ids[:, 1:], np.full((len(turn_ids), 1), -1, turn_ids.dtype)], 1)
    return (turn_ids >= 0) & (nxt != turn_ids)


def turn_end_rewards(turn_rewards: np.ndarray, turn_ids: np.ndarray) -> np.ndarray:
    """Token rewards f32 [N, M]: r_{i,t} on the last model token of turn t, 0 elsewhere."""
    return np.where(turn_ends(turn_ids), spread_over_turns(turn_rewards, turn_ids),
                    0.0).astype(np.float32)


def turn_end_discounts(turn_ids: np.ndarray, gamma: float) -> np.ndarray:
    """f32 [N, M]: ``gamma`` on the last model token of each turn (the step to the next turn's
    first token is discounted once per turn), 1 elsewhere."""
    return np.where(turn_ends(turn_ids), np.float32(gamma), np.float32(1.0)).astype(np.float32)
