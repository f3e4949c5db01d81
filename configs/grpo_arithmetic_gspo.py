"""GSPO (Zheng et al. 2025) on the built-in arithmetic demo: the length-normalised sequence
importance ratio with the paper's tight clip range, sequence-level aggregation, and two
updates per rollout batch so the ratio actually moves away from 1."""
import os

from rljax.config import config_from_file


def _demo():
    return config_from_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                         "grpo_arithmetic.py"))


def get_config():
    c = _demo()
    c.algo.policy_loss = "gspo"
    c.algo.importance_sampling_level = "sequence"
    # algo.epsilon / epsilon_high unset: gspo's own 3e-4 / 4e-4 (written to config.json)
    c.algo.loss_agg_mode = "seq-mean-token-mean"
    c.algo.num_iterations = 2
    return c
