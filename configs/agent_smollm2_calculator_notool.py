"""Baseline of ``configs/agent_smollm2_calculator.py``: the same model (SmolLM2-135M-Instruct,
LoRA rank 16), task, seeds and budget (SFT warm-up steps, batch and learning rate; GRPO
iterations, batch, group size and learning rate) without the calculator: the SFT warm-up is on
answer-only solutions (``What is 123*456=`` -> ``56088``, through the same chat template), then
single-turn GRPO.

Answer-only SFT rather than none: the tool arm's warm-up also teaches the answer format (just
the number, then ``<|im_end|>``), and the shipped model often answers in prose that the 16-token
cut or the reward's number parsing can lose; the same warm-up budget spent on the bare answer
gives the no-tool arm that format too, so the comparison is about the tool alone.

    rljax train --config configs/agent_smollm2_calculator_notool.py --workdir runs/smollm2_notool

Measured (seeds 0, 1, 2 on the 2-core CPU): held-out greedy accuracy 12% for the shipped
model, 4% / 0% / 2% after the warm-up, 10% / 6% / 4% after GRPO (the tool run: 98% / 100% /
96%); about 2 min 20 s per run. Numbers: bench/RESULTS.md, bench/LOG.md.
"""
import os

from rljax.config import config_from_file


def get_config():
    c = config_from_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                      "agent_smollm2_calculator.py"))
    c.env = dict(name="")                          # single-turn: the answer in one go
    c.data.max_prompt_length = 32
    c.data.kwargs = dict(c.data.kwargs.to_dict(), system_prompt="Answer with just the number.")
    c.rollout.max_new_tokens = 16                  # a 6-digit product and <|im_end|>, or prose
    c.sft.env_traces = False                       # SFT on the bare answer
    c.sft.max_length = 32 + 16
    return c
