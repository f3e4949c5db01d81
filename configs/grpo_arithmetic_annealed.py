"""GRPO with exploratory annealed decoding on multi-step arithmetic (tiny llama, CPU).

The task prints its work one operation per line ("3+4=7\n7-2=5"), so completions are ~12-16
tokens and a per-position temperature has room to act. Rollouts sample token t at the
temperature of ``rollout.temperature_schedule`` (here the "Let it Calm" exponential form, hot at
the first tokens and annealed towards the end); the trainer scores every token at the
temperature it was sampled at, so the first update's importance ratio is exactly 1. Set
``--config.rollout.temperature_schedule.name=constant`` for the fixed-temperature baseline
(``rollout.temperature``). Measured against it: bench/RESULTS.md.

    rljax train --config configs/grpo_arithmetic_annealed.py --workdir runs/annealed
"""
import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.steps = 40                       # GRPO iterations (after the warm-up)
    c.eval_every = 0                   # evaluated after the warm-up and at the end
    c.checkpoint_every = 20
    c.model = dict(preset="tiny", overrides=dict(
        num_layers=2, hidden_size=96, intermediate_size=256, num_heads=4, num_kv_heads=2,
        max_position_embeddings=64))
    c.tokenizer = dict(kind="char")
    c.data = dict(source="arithmetic", template="plain", max_prompt_length=8,
                  kwargs=dict(digits=1, operands=3, ops="+-", steps=True, eval_examples=256))
    c.rollout = dict(batch_size=128, max_new_tokens=16, temperature=1.0,
                     temperature_schedule=dict(name="exp", start=1.2, end=0.6, tokens=0))
    c.algo = dict(name="grpo", num_generations=8, beta=0.0, loss_agg_mode="token-mean",
                  adv_estimator="grpo")
    c.optimizer = dict(learning_rate=1e-4, max_grad_norm=1.0)
    c.reward = dict(names=("arithmetic",))
    c.sft = dict(steps=200, learning_rate=1e-3, batch_size=64, max_length=26)
    c.eval = dict(num_examples=256, batch_size=256)
    c.logging = dict(console_every_s=15.0)
    return c
