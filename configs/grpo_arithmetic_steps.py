"""GRPO on multi-step arithmetic (tiny llama, CPU): the baseline for tree sampling on longer
completions (docs/search.md, "Measured"; the runs: bench/LOG.md).

The task prints its work one operation per line ("3+4=7\n7-2=5"), so completions are ~12
tokens (stop token included) instead of the demo's ~3: a shared first segment is a small part
of an answer, which is where tree sampling is meant to help. 200 SFT warm-up steps, then GRPO
at learning rate 1e-4 (3e-4 lost accuracy on this task in the step-DPO pilots).
``configs/grpo_arithmetic_steps_tree.py`` is the same run with tree sampling.

    rljax train --config configs/grpo_arithmetic_steps.py --workdir runs/steps
"""
import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.steps = 100                      # GRPO iterations (after the warm-up)
    c.eval_every = 0                   # evaluated after the warm-up and at the end
    c.checkpoint_every = 0
    c.model = dict(preset="tiny", overrides=dict(
        num_layers=2, hidden_size=96, intermediate_size=256, num_heads=4, num_kv_heads=2,
        max_position_embeddings=64))
    c.tokenizer = dict(kind="char")
    c.data = dict(source="arithmetic", template="plain", max_prompt_length=8,
                  kwargs=dict(digits=1, operands=3, ops="+-", steps=True, eval_examples=500))
    c.rollout = dict(batch_size=256, max_new_tokens=16, temperature=1.0)
    c.algo = dict(name="grpo", num_generations=8, beta=0.0, loss_agg_mode="token-mean",
                  adv_estimator="grpo")
    c.optimizer = dict(learning_rate=1e-4, max_grad_norm=1.0)
    c.reward = dict(names=("arithmetic",))
    c.sft = dict(steps=200, learning_rate=1e-3, batch_size=64, max_length=26)
    c.eval = dict(num_examples=500, batch_size=250)
    c.logging = dict(console_every_s=15.0)
    return c
