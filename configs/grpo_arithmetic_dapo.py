"""DAPO (Yu et al. 2025) on the built-in arithmetic demo: clip-higher (epsilon_high=0.28),
dynamic sampling (groups with all-equal rewards are dropped and more prompts sampled),
token-level loss, and the soft overlong penalty over the last tokens of the budget."""
import os

from rljax.config import config_from_file


def _demo():
    return config_from_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                         "grpo_arithmetic.py"))


def get_config():
    c = _demo()
    c.algo.epsilon = 0.2
    c.algo.epsilon_high = 0.28
    c.algo.beta = 0.0
    c.algo.loss_agg_mode = "token-mean"
    c.algo.dynamic_sampling = True
    c.algo.max_sampling_rounds = 3
    c.algo.overlong_buffer = 2        # penalise completions that use the last 2 of 6 tokens
    c.algo.overlong_penalty_factor = 1.0
    return c
