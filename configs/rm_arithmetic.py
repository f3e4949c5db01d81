"""Reward-model training on preference pairs from the arithmetic task (1-digit + and -; CPU, <1 min).

Pairs: the correct answer (chosen) against a near-miss wrong one (rejected). The reward model is
a value-head transformer (trunk + scalar head; score = value at the last real token) trained
with the Bradley-Terry loss; ``eval/accuracy`` is the fraction of held-out pairs it ranks
correctly (0.5 = chance). Without an SFT warm-up the trunk starts from random weights. Held-out
pairs come from problems never seen in training, but the 1-digit held-out set is small (22
problems); use ``data.kwargs.digits=2`` for a larger one.

    rljax train --config configs/rm_arithmetic.py --workdir runs/rm
"""
import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.steps = 300                      # reward-model updates
    c.eval_every = 100
    c.checkpoint_every = 100
    c.model = dict(preset="tiny", overrides=dict(
        num_layers=2, hidden_size=96, intermediate_size=256, num_heads=4, num_kv_heads=2,
        max_position_embeddings=64))
    c.tokenizer = dict(kind="char")
    c.data = dict(source="arithmetic", template="plain", max_prompt_length=8,
                  kwargs=dict(digits=1, operands=2, ops="+-", eval_examples=512))
    c.rollout = dict(batch_size=64, max_new_tokens=6)   # pairs per step
    c.algo = dict(name="rm", num_generations=1)
    c.optimizer = dict(learning_rate=1e-3, max_grad_norm=1.0)
    c.reward = dict(names=("arithmetic",))
    c.eval = dict(num_examples=512, batch_size=256)
    c.logging = dict(console_every_s=15.0)
    return c
