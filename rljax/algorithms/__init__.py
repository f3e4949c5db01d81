"""rljax.algorithms: RL post-training math as small pure jax functions, chosen by name.

Registries:
  get_advantage_estimator(name)  grpo, dr_grpo, rloo, reinforce_pp_seq,
                                 reinforce_pp_baseline_seq ([N], one per completion);
                                 reinforce_pp, reinforce_pp_baseline ([N, T], token level:
                                 is_token_level(name)); treepo ([N]), rover ([N, T]) over
                                 a sampled tree (uses_tree(name): take node_ids);
                                 rae ([N], a baseline per role kept across steps:
                                 uses_roles(name): take roles and baseline);
                                 grpo_process ([N, T]: GRPO plus a PRM's step rewards,
                                 process_advantages)
  get_policy_loss(name)          ppo (vanilla), gspo, cispo
  get_kl_estimator(name)         k1 (kl), k2 (mse), k3 (low_var_kl), k3+ (k3_st), abs
  distill_advantages, generalized_jsd_tokens  on-policy distillation (per token)
  aggregate(loss_tokens, mask, mode)  token-mean, seq-mean-token-mean, seq-mean-token-sum,
                                      seq-mean-token-sum-norm

Process reward models: ``process_reward_loss`` (BCE at step-end tokens, TRL PRMTrainer's
two-class cross-entropy written with one logit) and ``aggregate_step_scores`` (min, last,
mean, prod of a completion's step scores).

Multi-turn episodes: ``rljax.algorithms.turn_credit`` (per-turn discounted returns, their
GRPO-family advantages, turn-end rewards and discounts for GAE; numpy, host side).

Games: ``rljax.algorithms.role_advantages`` (role-conditioned advantages, SPIRAL's RAE: an EMA
baseline per (game, role) passed in and returned; registered as the estimator "rae", which
takes each sample's role and the baseline: ``uses_roles(name)``; the trainer keeps the baseline
in ``TrainState.role_baseline``).

Losses return (weighted_sum, weight): sum both over micro-batches / shards, divide once.
Depends on jax and numpy only.
"""
from rljax.algorithms.advantages import (
    discounted_returns,
    dr_grpo_advantages,
    gae,
    advantage_estimator_names,
    get_advantage_estimator,
    grpo_advantages,
    is_token_level,
    outcome_token_rewards,
    register_advantage_estimator,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    reinforce_pp_baseline_seq_advantages,
    reinforce_pp_seq_advantages,
    rloo_advantages,
    takes_group_ids,
    uses_roles,
    uses_tree,
)
from rljax.algorithms.tree_advantages import (  # registers "treepo" and "rover"
    rover_advantages,
    tree_values,
    treepo_advantages,
)
from rljax.algorithms.vine import vineppo_advantages  # registers "vineppo"
from rljax.algorithms.process_advantages import (  # registers "grpo_process"
    grpo_process_advantages,
    process_advantages,
)
from rljax.algorithms.role_advantages import (  # registers "rae"
    rae_advantages,
    rae_estimator,
    rae_step,
    rae_update,
    role_keys,
    role_mean_advantages,
)
from rljax.algorithms.aggregation import (
    AGGREGATION_MODES,
    aggregate,
    finalize,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    safe_divide,
)
from rljax.algorithms.distill import (
    distill_advantages,
    generalized_jsd_tokens,
    reverse_kl_tokens,
    teacher_agreement,
)
from rljax.algorithms.entropy import entropy_from_logits, entropy_from_logps
from rljax.algorithms.kl import (
    get_kl_estimator,
    kl_estimator_names,
    kl_abs,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_k3_st,
    kl_penalized_rewards,
)
from rljax.algorithms.policy_losses import (
    cispo_loss,
    combine_token_losses,
    finalize_metrics,
    get_policy_loss,
    policy_loss_names,
    gspo_loss,
    log_importance_ratio,
    ppo_loss,
    register_policy_loss,
    tis_weights,
)
from rljax.algorithms.preference import (
    DPO_LOSS_TYPES,
    dpo_loss,
    preference_accuracy,
    reward_model_loss,
)
from rljax.algorithms.prm import (
    STEP_SCORE_MODES,
    aggregate_step_scores,
    auroc,
    process_reward_loss,
    process_reward_loss_tokens,
    step_accuracy,
)
from rljax.algorithms.shaping import (
    is_truncated,
    mask_truncated,
    nonzero_variance_groups,
    overlong_penalty,
    pass_at_k,
)
from rljax.algorithms.value import value_loss, value_loss_tokens

__all__ = [n for n in dir() if not n.startswith("_")]
