"""Baseline of ``configs/grpo_tool_arithmetic.py``: the same model, task, seeds and budget (SFT
warm-up steps, GRPO iterations, batch) without the calculator: SFT on answer-only solutions,
then single-turn GRPO. Numbers: bench/RESULTS.md.

    rljax train --config configs/grpo_tool_arithmetic_notool.py --workdir runs/notool
"""
import os

from rljax.config import config_from_file


def get_config():
    c = config_from_file(os.path.join(os.path.dirname(__file__), "grpo_tool_arithmetic.py"))
    c.env = dict(name="")                      # single-turn: the answer in one go
    c.rollout.max_new_tokens = 8               # a 6-digit product and EOS
    c.sft.env_traces = False                   # SFT on "123*456=" -> "56088"
    c.sft.max_length = 16
    return c
