"""The built-in demo with tree sampling (docs/search.md): each prompt's 8 completions are the
leaves of one tree, and the TreePO advantage uses the tree.

Two roots per prompt decode their first token, then every path forks in two after each of
the next two tokens (2 * 2**2 = 8 leaves); the leaves finish the answer. Shared segments are
decoded once.

    rljax train --config configs/grpo_arithmetic_tree.py --workdir runs/tree
"""
import os

from rljax.config import config_from_file


def _demo():
    return config_from_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                         "grpo_arithmetic.py"))


def get_config():
    c = _demo()
    c.rollout.tree = dict(enabled=True, segment_tokens=1, branching=2, roots=2, max_leaves=8)
    c.algo.adv_estimator = "treepo"
    return c
