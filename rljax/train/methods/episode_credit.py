"""The credit of multi-turn episodes beyond one outcome per episode, as rollout stages
(``credit_stages``): per-turn advantages with ``env.turn_discount`` (``TurnCredit``), a
baseline per role for the role estimator (``RoleBaseline``, RAE) and, for PPO's reward
rollout, the turn-end rewards GAE reads (``TurnEndRewards``).
"""
from __future__ import annotations

import jax
import numpy as np

from rljax import algorithms
from rljax.algorithms import turn_credit
from rljax.errors import UserError
from rljax.train.core.rollout import RolloutStage


class TurnCredit(RolloutStage):
    """GRPO with ``env.turn_discount``: per-turn advantages f32 [R, M]
    (``turn_credit.turn_advantages`` over the discounted turn returns, each turn's reward
    less ``beta`` x its own tokens' KL with ``algo.kl_in_reward``, the episode outcome
    normalised by the rollout's estimator; over each row's ``group_ids`` when groups have
    sizes of their own), every model token of turn t getting turn t's, 0 outside the tokens
    that train."""

    name = "turn_credit"

    def __init__(self, cfg):
        self.cfg = cfg

    def advantages(self, rollout, state, rewards, mask, rows, batch) -> np.ndarray:
        a, gamma = self.cfg.algo, self.cfg.env.turn_discount
        turn_rewards = rows["turn_rewards"]
        if "token_kl" in rows:   # algo.kl_in_reward: each turn pays beta x its tokens' KL
            turn_rewards = turn_rewards - a.beta * turn_credit.turn_sums(
                rows["token_kl"], rows["turn_ids"], turn_rewards.shape[1])
        returns = turn_credit.turn_returns(turn_rewards, rows["turns"], gamma)
        # Groups of their own sizes (knapsack allocation): each episode's group id.
        inputs = rows.get("estimator_inputs") or None
        group_ids = None if inputs is None else inputs.get("group_ids")
        per_turn = turn_credit.turn_advantages(
            returns, rows["turns"], rollout.g, estimator=a.adv_estimator,
            scale_rewards=a.scale_rewards, group_ids=group_ids,
            outcome=rollout.advantages(returns[:, 0], inputs=inputs))
        adv = turn_credit.spread_over_turns(per_turn, rows["turn_ids"])
        return np.where(mask, adv, 0.0).astype(np.float32)


class RoleBaseline(RolloutStage):
    """An estimator with a baseline per role (``algorithms.uses_roles``: ``rae``): each
    episode's role key (``env.role_key``) and ``state.role_baseline`` in, advantages f32 [R]
    out; the new baseline leaves in ``batch["role_baseline"]`` for the phase to put into the
    state, and the metrics add ``rae/baseline_<key>`` for the roles seen.

    The baselines move with the episodes that train this step (rows with a token in the loss
    mask), as SPIRAL's move with the batch they train on: a group dynamic sampling dropped,
    a group that only pads the batch or a masked truncated episode neither moves them nor
    gets an advantage (0); a partial rollout's carried episode moves them in the step it
    completes and trains. So the baselines are a function of the batches that trained, which
    the train state checkpoints with them."""

    name = "role_baseline"

    def __init__(self, cfg):
        self.cfg = cfg
        self._estimator = None   # jitted on first use
        self._new = None         # this call's new baseline f32 [K]

    def advantages(self, rollout, state, rewards, mask, rows, batch) -> np.ndarray:
        a, roles = self.cfg.algo, rows["roles"]
        baseline = getattr(state, "role_baseline", None)
        if baseline is None:
            raise UserError(f"algo.adv_estimator={a.adv_estimator!r} needs the role baseline "
                            "in the train state (the GRPO phase makes it)")
        k = int(np.shape(baseline)[0])
        if (roles < 0).any() or (roles >= k).any():
            raise UserError(f"algo.adv_estimator={a.adv_estimator!r} needs each episode's "
                            f"role key in [0, {k}); env {self.cfg.env.name!r} gave "
                            f"{sorted(set(roles.tolist()))} (a game environment has "
                            "role_key)")
        if self._estimator is None:
            estimator = algorithms.get_advantage_estimator(a.adv_estimator)
            g = rollout.g
            opts = {"alpha": float(a.rae_alpha)} if a.adv_estimator == "rae" else {}
            self._estimator = jax.jit(lambda r, ro, b: estimator(r, g, roles=ro, baseline=b,
                                                                 **opts))
        trains = np.asarray(mask, bool).any(-1)   # [R]: the episodes that train
        adv, new = self._estimator(np.asarray(rewards, np.float32)[trains], roles[trains],
                                   np.asarray(jax.device_get(baseline), np.float32))
        self._new = batch["role_baseline"] = np.asarray(new, np.float32)
        out = np.zeros(len(roles), np.float32)
        out[trains] = np.asarray(adv, np.float32)
        return out

    def metrics(self, rounds, rows) -> dict:
        return {f"rae/baseline_{k}": float(self._new[k]) for k in np.unique(rows["roles"])}


class TurnEndRewards(RolloutStage):
    """PPO with ``env.turn_discount``: ``batch["token_rewards"]`` f32 [R, M] (each turn's
    reward on its last model token) and ``next_discount`` f32 [R, M] (the turn discount there,
    1 elsewhere) for GAE over model tokens; the reward rollout's ``rewards`` stay the
    episodes' outcomes."""

    name = "turn_rewards"

    def __init__(self, cfg):
        self.gamma = cfg.env.turn_discount

    def finish_batch(self, batch, rows) -> None:
        batch["token_rewards"] = turn_credit.turn_end_rewards(rows["turn_rewards"],
                                                              rows["turn_ids"])
        batch["next_discount"] = turn_credit.turn_end_discounts(rows["turn_ids"], self.gamma)


def credit_stages(cfg, rewards_only: bool = False) -> list:
    """The episodes' credit beyond one outcome per episode, as rollout stages: the role
    estimator (``rae``) or per-turn advantages (``env.turn_discount``); for PPO's reward
    rollout (``rewards_only``) the turn-end rewards GAE takes. [] for outcome credit."""
    if rewards_only:
        return [TurnEndRewards(cfg)] if cfg.env.turn_discount is not None else []
    if algorithms.uses_roles(cfg.algo.adv_estimator):
        return [RoleBaseline(cfg)]
    return [TurnCredit(cfg)] if cfg.env.turn_discount is not None else []
