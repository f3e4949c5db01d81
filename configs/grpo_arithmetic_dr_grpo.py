"""Dr. GRPO (Liu et al. 2025) on the built-in arithmetic demo: no std scaling of advantages and
a constant length normaliser (``seq-mean-token-sum-norm``) instead of 1/|o_i|."""
import os

from rljax.config import config_from_file


def _demo():
    return config_from_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                         "grpo_arithmetic.py"))


def get_config():
    c = _demo()
    c.algo.adv_estimator = "dr_grpo"
    c.algo.loss_agg_mode = "seq-mean-token-sum-norm"
    return c
