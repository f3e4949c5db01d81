"""Negotiation self-play: the tiny llama of ``configs/grpo_tictactoe.py`` (with room for longer
games) plays both seats of a split-the-pool negotiation against itself
(``rljax.envs.board_games.Negotiation``: 1 book, 2 hats, 3 balls, private values worth 10 to
each seat; "propose a b c" keeps a books, b hats and c balls and offers the rest, "accept"
takes the standing offer; no deal after 6 moves pays nothing). SFT warm-up on games of random
legal moves, then GRPO with one policy in both seats (``env.selfplay.mode='self'``): each game
gives one episode per seat, paid its share's value / 10. An unreadable or illegal move forfeits
at -1. Not zero-sum: both seats gain from a deal that gives each the items it values more.

Held-out evaluation plays the scripted fair negotiator (accepts an offer worth half its total,
otherwise asks for the fewest items worth 6): ``eval/payoff_mean`` is the policy's share.

    rljax train --config configs/grpo_negotiation_selfplay.py --workdir runs/nego_self
    python bench/games_eval.py --workdir runs/nego_self --opponents random,fair
"""
import os

from rljax.config import config_from_file


def get_config():
    c = config_from_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                      "grpo_tictactoe_selfplay.py"))
    c.model.overrides.max_position_embeddings = 256
    # Prompt "negotiation P2\n" + "pool 1 2 3, values 5 1 1, offer 1 2 0, left 5\n": 61 tokens.
    c.data = dict(source="negotiation", template="plain", max_prompt_length=64,
                  kwargs=dict(seat="any", eval_examples=200))
    # A seat moves at most 3 times ("propose 1 2 3" + EOS) and sees at most 2 more states.
    c.env = dict(name="negotiation", max_turns=3, max_total_tokens=144, max_turn_tokens=14,
                 max_obs_tokens=48, kwargs=dict(opponent="fair", illegal_penalty=-1.0),
                 selfplay=dict(mode="self"))
    c.rollout.max_new_tokens = 14
    c.sft.max_length = 208
    return c
