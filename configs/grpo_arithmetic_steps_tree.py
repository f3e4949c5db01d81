"""Multi-step arithmetic with tree sampling and the TreePO advantage (docs/search.md).

Same run as ``configs/grpo_arithmetic_steps.py`` except the rollout: each prompt's 8
completions are the leaves of one tree. Two roots decode the first 4 tokens (for "3+4=7\n7-2=5"
that is "3+4=", a copy of the prompt: sharing it costs no diversity), then every path forks in
two after tokens 4 and 8, so the first partial result is drawn by 4 paths and the rest of the
answer by all 8 leaves.

    rljax train --config configs/grpo_arithmetic_steps_tree.py --workdir runs/steps_tree
"""
import os

from rljax.config import config_from_file


def _steps():
    return config_from_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                         "grpo_arithmetic_steps.py"))


def get_config():
    c = _steps()
    c.rollout.tree = dict(enabled=True, segment_tokens=4, branching=2, roots=2, max_leaves=8)
    c.algo.adv_estimator = "treepo"
    return c
