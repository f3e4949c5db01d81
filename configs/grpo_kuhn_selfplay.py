"""Kuhn Poker self-play: the tiny llama of ``configs/grpo_tictactoe.py`` plays both seats of
Kuhn Poker against itself. SFT warm-up on hands of random legal moves, then GRPO where one
policy plays P1 and P2 (``env.selfplay.mode='self'``): every hand gives one training episode
per seat (its own moves as turns, its card and the moves so far as observations, its chips as
reward). An illegal or unreadable move forfeits the hand at -2 chips (the worst legal result).
``--config.algo.adv_estimator=rae`` uses SPIRAL's role-conditioned baseline instead of the
group's.

The policy never plays a scripted opponent in training; held-out evaluation plays the random
one, and ``bench/games_eval.py --opponents random,optimal`` any checkpoint against random or
the Nash strategy (``payoff_played``: chips per hand).

    rljax train --config configs/grpo_kuhn_selfplay.py --workdir runs/kuhn_self
    python bench/games_eval.py --workdir runs/kuhn_self --opponents random,optimal
"""
import os

from rljax.config import config_from_file


def get_config():
    c = config_from_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                      "grpo_tictactoe_selfplay.py"))
    # Prompt "kuhn_poker P2\n" + "card K, moves: check\n": 35 tokens.
    c.data = dict(source="kuhn_poker", template="plain", max_prompt_length=48,
                  kwargs=dict(seat="any", eval_examples=200))
    # A seat moves at most twice (a word + EOS each) and sees at most one more state.
    c.env = dict(name="kuhn_poker", max_turns=2, max_total_tokens=64, max_turn_tokens=6,
                 max_obs_tokens=28, kwargs=dict(opponent="random", illegal_penalty=-2.0),
                 selfplay=dict(mode="self"))
    c.rollout.max_new_tokens = 6
    c.sft.max_length = 112
    return c
