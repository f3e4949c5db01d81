"""PPO with a critic on the built-in arithmetic task (1-digit + and -), on a CPU in ~3 minutes.

A short SFT warm-up on verified solutions teaches the answer format; PPO then trains the policy
and a critic (initialised from the warmed-up policy: same trunk, fresh scalar head) with GAE on
token-level rewards (the arithmetic reward at the last token, minus a per-token KL penalty to
the reference), whitened advantages, clipped policy and value losses, 2 epochs x 2 minibatches
per rollout. ``reward/mean`` (training samples) and ``eval/accuracy`` (greedy, held out; logged
after the warm-up and at the end) show the improvement.

    rljax train --config configs/ppo_arithmetic.py --workdir runs/ppo
"""
import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.steps = 100                      # PPO iterations (after the warm-up's 60 steps)
    c.eval_every = 80                  # global steps: after the warm-up, at 80, at the end
    c.checkpoint_every = 80
    c.model = dict(preset="tiny", overrides=dict(
        num_layers=2, hidden_size=96, intermediate_size=256, num_heads=4, num_kv_heads=2,
        max_position_embeddings=64))
    c.tokenizer = dict(kind="char")
    c.data = dict(source="arithmetic", template="plain", max_prompt_length=8,
                  kwargs=dict(digits=1, operands=2, ops="+-", eval_examples=256))
    c.rollout = dict(batch_size=128, max_new_tokens=6, temperature=1.0)
    c.algo = dict(name="ppo", adv_estimator="gae", num_generations=1, beta=0.01,
                  kl_in_reward=True, kl_estimator="k1", gamma=1.0, lam=0.95, epsilon=0.2,
                  vf_coef=0.5, cliprange_value=0.2, num_iterations=2, mini_batch_size=64,
                  loss_agg_mode="token-mean")
    c.optimizer = dict(learning_rate=2e-4, critic_learning_rate=1e-3, max_grad_norm=1.0)
    c.reward = dict(names=("arithmetic",))
    c.sft = dict(steps=60, learning_rate=1e-3, batch_size=64, max_length=16)
    c.eval = dict(num_examples=256, batch_size=256)
    c.logging = dict(console_every_s=15.0)
    return c
