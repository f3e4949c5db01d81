"""DPO on the built-in arithmetic task, on a CPU in a few minutes.

A short SFT warm-up on verified solutions teaches the answer format; offline DPO then trains on
preference pairs generated from the task: the correct answer (chosen) against a near-miss wrong
one (rejected; an off-by-a-few or one-digit change). The reference is the warmed-up policy.
``eval/pref_accuracy`` (implicit reward of chosen > rejected on held-out pairs) and
``eval/accuracy`` (greedy task accuracy) are logged after the warm-up and at the end.

Online iterative DPO on the same task: ``--config.algo.online=True`` (pairs = best vs worst of
``algo.num_generations`` samples ranked by the arithmetic reward; the reference is refreshed
every ``algo.ref_update_every`` rounds).

    rljax train --config configs/dpo_arithmetic.py --workdir runs/dpo
"""
import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.steps = 60                       # DPO steps
    c.eval_every = 30
    c.checkpoint_every = 30
    c.model = dict(preset="tiny", overrides=dict(
        num_layers=2, hidden_size=96, intermediate_size=256, num_heads=4, num_kv_heads=2,
        max_position_embeddings=64))
    c.tokenizer = dict(kind="char")
    c.data = dict(source="arithmetic", template="plain", max_prompt_length=8,
                  kwargs=dict(digits=2, operands=2, ops="+-", eval_examples=256))
    c.rollout = dict(batch_size=64, max_new_tokens=6, temperature=1.0)  # pairs per step
    c.algo = dict(name="dpo", loss_type="sigmoid", beta=0.1, label_smoothing=0.0,
                  num_generations=4, num_iterations=1, ref_update_every=0)
    c.optimizer = dict(learning_rate=3e-4, max_grad_norm=1.0)
    c.reward = dict(names=("arithmetic",))
    c.sft = dict(steps=100, learning_rate=1e-3, batch_size=64, max_length=16)
    c.eval = dict(num_examples=256, batch_size=256)
    c.logging = dict(console_every_s=15.0)
    return c
