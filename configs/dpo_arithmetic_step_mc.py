"""Step-level DPO from Monte-Carlo step values on multi-step arithmetic (MCTS-DPO style), CPU.

The task prints its work left to right, one operation per line ("3+4=7\n7-2=5"), so a solution
has ``operands - 1`` steps ending in "\n" (``data.step_delimiter``). A short SFT warm-up teaches
the format. Each DPO step then: samples ``num_generations`` (K) solutions per prompt, takes the
best as the trajectory, cuts it into steps, samples K continuations from every step prefix (one
prefill per prefix, the KV cache forked K ways), values each candidate next step by the mean
reward of the continuations that start with it, and pairs the best with the worst next step at
each prefix (chosen/rejected = the two steps, the prompt and shared prefix as context). See
bench/RESULTS.md for how it compares with outcome-level online DPO at equal sampled tokens.

    rljax train --config configs/dpo_arithmetic_step_mc.py --workdir runs/step_dpo
"""
import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.steps = 40                       # DPO rounds (after the warm-up)
    c.eval_every = 0                   # evaluated after the warm-up and at the end
    c.checkpoint_every = 20
    c.model = dict(preset="tiny", overrides=dict(
        num_layers=2, hidden_size=96, intermediate_size=256, num_heads=4, num_kv_heads=2,
        max_position_embeddings=64))
    c.tokenizer = dict(kind="char")
    c.data = dict(source="arithmetic", template="plain", max_prompt_length=8,
                  kwargs=dict(digits=1, operands=3, ops="+-", steps=True, eval_examples=256),
                  pairs="step_mc", step_delimiter="\n")
    # 32 prompts x K=4 continuations per prefix.
    c.rollout = dict(batch_size=128, max_new_tokens=16, temperature=1.0)
    c.algo = dict(name="dpo", online=True, num_generations=4, ref_update_every=1,
                  loss_type="sigmoid", beta=0.1, num_iterations=1,
                  step_mc=dict(max_steps=2, min_value_gap=0.0))
    c.optimizer = dict(learning_rate=1e-4, max_grad_norm=1.0)
    c.reward = dict(names=("arithmetic",))
    c.sft = dict(steps=200, learning_rate=1e-3, batch_size=64, max_length=26)
    c.eval = dict(num_examples=256, batch_size=256)
    c.logging = dict(console_every_s=15.0)
    return c
