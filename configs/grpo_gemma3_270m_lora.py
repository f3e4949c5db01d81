"""The Gemma 3 270M base recipe (configs/grpo_gemma3_270m.py) with LoRA adapters on the frozen
base: same task, reward and evals; the prompt ends with the sum itself ("Question: What is
57+8=?\\nAnswer: 57+8="), so the completion is the result; 36 iterations; only rank-16 adapters
on every projection train, with the larger learning rate LoRA needs.

    rljax train --config configs/grpo_gemma3_270m_lora.py --workdir runs/gemma3_lora

Measured on a 2-vCPU CPU (bench/RESULTS.md, registered before the runs, every run listed):
24.5% -> 53.5%, 49.0% and 51.0% held-out over seeds 6, 7 and 8; a run alone took
4 min 50 s (peak memory about 5.7 GB).
"""
import os

from rljax.config import config_from_file


def get_config():
    c = config_from_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                      "grpo_gemma3_270m.py"))
    c.model.lora = dict(rank=16, alpha=32.0)
    c.optimizer.learning_rate = 1e-4
    # Restating the sum in the prompt: with it in the completion, some seeds learned to
    # restate and others to answer bare (which this model mostly gets wrong).
    c.data.template = "<bos>Question: What is {question}?\nAnswer: {question}"
    c.steps = 36
    return c
