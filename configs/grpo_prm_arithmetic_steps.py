"""PRM-shaped GRPO on multi-step arithmetic (tiny llama, CPU): ``configs/grpo_arithmetic_steps.py``
with ``algo.adv_estimator='grpo_process'``. A process reward model trained by
``configs/prm_arithmetic_steps.py`` (the same model and warm-up) scores every step of every
sample; each token's advantage is GRPO's outcome advantage plus the group-normalised step
scores from its step on (docs/tree_search.md, "PRM-shaped GRPO").

    rljax train --config configs/prm_arithmetic_steps.py --workdir runs/prm
    rljax train --config configs/grpo_prm_arithmetic_steps.py --workdir runs/grpo_prm \
        --config.algo.process_reward.prm=runs/prm
"""
import os

from rljax.config import config_from_file


def get_config():
    c = config_from_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                      "grpo_arithmetic_steps.py"))
    c.data.step_delimiter = "\n"
    c.algo.adv_estimator = "grpo_process"
    c.algo.process_reward = dict(prm="runs/prm", weight=1.0)
    return c
