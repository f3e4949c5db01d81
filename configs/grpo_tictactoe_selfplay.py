"""Board-game self-play: the tiny llama of ``configs/grpo_tictactoe.py`` plays TicTacToe against
itself. The same SFT warm-up on games of random legal moves, then GRPO where one policy plays
both seats (``env.selfplay.mode='self'``): every game gives one training episode per seat (its
own moves as turns, the board after the other seat's move as observations, its own result as
reward). Advantages: GRPO's group of G games per seat, or with
``--config.algo.adv_estimator=rae`` SPIRAL's role-conditioned baseline per seat (an EMA of the
seat's returns, kept in the train state).

The policy never plays the scripted opponents during training; held-out evaluation plays the
random one (``eval/wins_mean`` with ``eval/wins_ci95_low`` / ``_high``, per seat
``eval/win_rate_X``), and ``bench/games_eval.py`` any checkpoint against random, minimax or
another checkpoint.

    rljax train --config configs/grpo_tictactoe_selfplay.py --workdir runs/ttt_self
    rljax train --config configs/grpo_tictactoe_selfplay.py --workdir runs/ttt_self_rae \\
        --config.algo.adv_estimator=rae
    python bench/games_eval.py --workdir runs/ttt_self --opponents random,optimal
"""
import os

from rljax.config import config_from_file


def get_config():
    c = config_from_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                      "grpo_tictactoe.py"))
    c.steps = 40                       # self-play iterations (8 games x 2 seats x G=4 each)
    c.eval_every = 20
    c.checkpoint_every = 50
    c.checkpoint = dict(max_to_keep=10)
    c.rollout.batch_size = 64
    c.algo.num_generations = 4
    c.env.selfplay = dict(mode="self")
    return c
