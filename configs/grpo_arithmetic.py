"""Built-in demo: a tiny llama trained from scratch on 2-digit addition/subtraction, on a CPU.

A short SFT warm-up on verified solutions teaches the answer format, then GRPO improves the
held-out greedy accuracy (``eval/accuracy`` is logged right after the warm-up and at the end).

    rljax train --config configs/grpo_arithmetic.py --workdir runs/demo
"""
import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.steps = 800                      # GRPO iterations
    c.eval_every = 100
    c.checkpoint_every = 100
    c.model = dict(preset="tiny", overrides=dict(
        num_layers=2, hidden_size=96, intermediate_size=256, num_heads=4, num_kv_heads=2,
        max_position_embeddings=64))
    c.tokenizer = dict(kind="char")
    c.data = dict(source="arithmetic", template="plain", max_prompt_length=8,
                  kwargs=dict(digits=2, operands=2, ops="+-", eval_examples=500))
    c.rollout = dict(batch_size=1024, max_new_tokens=6, temperature=1.0)
    # epsilon / epsilon_high unset: the policy loss's own clip range (PPO's 0.2 here), so
    # variants that change algo.policy_loss get theirs.
    c.algo = dict(name="grpo", num_generations=8, beta=0.0,
                  loss_agg_mode="token-mean", adv_estimator="grpo")
    c.optimizer = dict(learning_rate=3e-4, max_grad_norm=1.0)
    c.reward = dict(names=("arithmetic",))
    c.sft = dict(steps=400, learning_rate=1e-3, batch_size=64, max_length=16)
    c.eval = dict(num_examples=500, batch_size=250)
    c.logging = dict(console_every_s=15.0)
    return c
