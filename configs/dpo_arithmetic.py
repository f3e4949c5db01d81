"""Online iterative DPO on the built-in arithmetic task (1-digit + and -), on a CPU in ~1 minute.

A short SFT warm-up on verified solutions teaches the answer format. Each DPO step is then one
round of iterative DPO: sample ``num_generations`` completions for each of 64 prompts, rank
them with the arithmetic reward, pair the best with the worst (tied groups are skipped), take
one DPO step on those pairs, and refresh the reference to the current policy
(``algo.ref_update_every=1``). ``reward/mean`` (training samples) and ``eval/accuracy``
(greedy, held out; logged after the warm-up and at the end) show the improvement.

Offline DPO on pairs generated from the task (the correct answer vs a near-miss wrong one,
reference frozen at the warmed-up policy; held-out ``eval/pref_accuracy``)::

    rljax train --config configs/dpo_arithmetic.py --workdir runs/dpo_offline \\
        --config.algo.online=False --config.algo.ref_update_every=0 \\
        --config.rollout.batch_size=64

    rljax train --config configs/dpo_arithmetic.py --workdir runs/dpo
"""
import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.steps = 100                      # DPO rounds (after the warm-up's 60 steps)
    c.eval_every = 0                   # evaluated after the warm-up and at the end
    c.checkpoint_every = 50
    c.model = dict(preset="tiny", overrides=dict(
        num_layers=2, hidden_size=96, intermediate_size=256, num_heads=4, num_kv_heads=2,
        max_position_embeddings=64))
    c.tokenizer = dict(kind="char")
    c.data = dict(source="arithmetic", template="plain", max_prompt_length=8,
                  kwargs=dict(digits=1, operands=2, ops="+-", eval_examples=256))
    # Online: completions per round (64 prompts x 4). Offline: pairs per step.
    c.rollout = dict(batch_size=256, max_new_tokens=6, temperature=1.0)
    c.algo = dict(name="dpo", online=True, num_generations=4, ref_update_every=1,
                  loss_type="sigmoid", beta=0.1, label_smoothing=0.0, num_iterations=1)
    c.optimizer = dict(learning_rate=3e-4, max_grad_norm=1.0)
    c.reward = dict(names=("arithmetic",))
    c.sft = dict(steps=60, learning_rate=1e-3, batch_size=64, max_length=16)
    c.eval = dict(num_examples=256, batch_size=256)
    c.logging = dict(console_every_s=15.0)
    return c
