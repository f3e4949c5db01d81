"""On-policy distillation on the built-in demo: a 1-layer student learns 2-digit
addition/subtraction from the demo's 2-layer GRPO-trained model.

Train the teacher first (``configs/grpo_arithmetic.py``), then distill into a student with half
the layers after the same SFT warm-up:

    rljax train --config configs/grpo_arithmetic.py --workdir runs/demo
    rljax train --config configs/distill_arithmetic.py --workdir runs/distill \\
        [--config.algo.distill.teacher=runs/demo]

The teacher path, like every path of a config, is relative to the working directory: run both
commands from the same one. It is checked (its config, tokenizer and checkpoint) before the
warm-up starts.

The student samples 1024 completions per step (128 prompts x 8), the teacher scores every
sampled token, and the advantage of each token is minus its reverse KL to the teacher
(docs/algorithms.md, "On-policy distillation"). ``--config.algo.name=grpo`` (with
``--config.algo.distill.teacher=''``) is the same student trained by GRPO on the task reward.
"""
import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.steps = 300                      # distillation iterations
    c.eval_every = 20
    c.checkpoint_every = 100
    c.model = dict(preset="tiny", overrides=dict(
        num_layers=1, hidden_size=96, intermediate_size=256, num_heads=4, num_kv_heads=2,
        max_position_embeddings=64))
    c.tokenizer = dict(kind="char")
    c.data = dict(source="arithmetic", template="plain", max_prompt_length=8,
                  kwargs=dict(digits=2, operands=2, ops="+-", eval_examples=500))
    c.rollout = dict(batch_size=1024, max_new_tokens=6, temperature=1.0)
    c.algo = dict(name="distill", num_generations=8, beta=0.0, loss_agg_mode="token-mean",
                  adv_estimator="grpo", distill=dict(teacher="runs/demo"))
    c.optimizer = dict(learning_rate=3e-4, max_grad_norm=1.0)
    c.reward = dict(names=("arithmetic",))   # the accuracy metrics; no weight in the loss
    c.sft = dict(steps=400, learning_rate=1e-3, batch_size=64, max_length=16)
    c.eval = dict(num_examples=500, batch_size=250)
    c.logging = dict(console_every_s=15.0)
    return c
