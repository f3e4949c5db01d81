"""Lite PPO (Liu et al. 2025, "Tricks or Traps? A Deep Dive into RL for LLM Reasoning") on the
built-in arithmetic demo: the critic-free PPO loss with only two tricks,

* advantages: subtract the prompt group's mean reward, divide by the std of all rewards in
  the batch (``algo.scale_rewards="batch"``: group mean, batch std), and
* token-level aggregation of the loss (``algo.loss_agg_mode="token-mean"``),

and nothing else: no KL to a reference, no clip-higher, no dynamic sampling, no overlong
filtering. Everything else is the demo's (``configs/grpo_arithmetic.py``)."""
import os

from rljax.config import config_from_file


def _demo():
    return config_from_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                         "grpo_arithmetic.py"))


def get_config():
    c = _demo()
    c.algo.adv_estimator = "grpo"      # group-centred outcome advantage ...
    c.algo.scale_rewards = "batch"     # ... over the std of the batch's rewards
    c.algo.loss_agg_mode = "token-mean"
    c.algo.policy_loss = "ppo"         # the vanilla clipped PPO objective
    c.algo.beta = 0.0
    c.algo.dynamic_sampling = False
    c.algo.mask_truncated_completions = False
    return c
