"""The Gemma 3 270M base recipe (configs/grpo_gemma3_270m.py) with LoRA adapters on the frozen
base: same task, prompts, reward and evals, 30 iterations instead of 20; only rank-16 adapters on
every projection train, with the larger learning rate LoRA needs.

    rljax train --config configs/grpo_gemma3_270m_lora.py --workdir runs/gemma3_lora
"""
import os

from rljax.config import config_from_file


def get_config():
    c = config_from_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                      "grpo_gemma3_270m.py"))
    c.model.lora = dict(rank=16, alpha=32.0)
    c.optimizer.learning_rate = 1e-4
    c.steps = 30
    return c
