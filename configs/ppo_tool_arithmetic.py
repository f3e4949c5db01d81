"""PPO with a critic over multi-turn episodes: the calculator demo of
``configs/grpo_tool_arithmetic.py`` (same model, data, environment, SFT warm-up on scripted
tool episodes, same seed) with GRPO replaced by PPO.

The critic is initialised from the warmed-up policy (same trunk, fresh scalar head); its values,
the rewards and GAE live on the model's own tokens only (tool results are context, skipped by
the recursion), the reward (``arithmetic`` on the final answer) sits on the episode's last model
token. One sample per prompt (no groups: the critic is the baseline), 2 epochs x 2 minibatches
per rollout, whitened advantages, clipped policy and value losses, no KL (as the GRPO run).
Numbers: bench/LOG.md (2026-11-23, the agent demos).

    rljax train --config configs/ppo_tool_arithmetic.py --workdir runs/ppo_tools
"""
import os

from rljax.config import config_from_file


def get_config():
    c = config_from_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                      "grpo_tool_arithmetic.py"))
    c.algo = dict(name="ppo", adv_estimator="gae", num_generations=1, beta=0.0,
                  gamma=1.0, lam=0.95, epsilon=0.2, vf_coef=0.5, cliprange_value=0.2,
                  num_iterations=2, mini_batch_size=128, loss_agg_mode="token-mean")
    # The GRPO run's gentle start (the warm-up's call format breaks under a large first step);
    # the critic's fresh head learns faster.
    c.optimizer = dict(learning_rate=1e-4, critic_learning_rate=1e-3, warmup_steps=10,
                       max_grad_norm=1.0)
    return c
