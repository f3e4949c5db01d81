"""The built-in demo with a mixture of experts: the same task, warm-up and GRPO run as
``configs/grpo_arithmetic.py``, the dense MLP replaced by 8 SwiGLU experts, 2 per token, each
half as wide, so every token runs through as many MLP parameters as in the dense demo (plus a
96 x 8 router per layer).

    rljax train --config configs/grpo_arithmetic_moe.py --workdir runs/demo_moe
"""
import os

from rljax.config import config_from_file


def _demo():
    return config_from_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                         "grpo_arithmetic.py"))


def get_config():
    c = _demo()
    c.model.preset = "tiny-moe"
    c.model.overrides = dict(num_layers=2, hidden_size=96, num_heads=4, num_kv_heads=2,
                             max_position_embeddings=64, num_experts=8,
                             num_experts_per_tok=2, moe_intermediate_size=128)
    c.algo.moe_aux_loss_coef = 0.01   # keeps the experts in use (metric moe/load_balance)
    return c
