"""The workload x rollout-mode matrix: which combinations a config may ask for, and the one
line that refuses the others (docs/design.md lists them with the reason). The cells that train
are trained in their workloads' own files (test_agent_train.py: episodes on the slot engine
and asynchronous episodes resumed exactly; test_async.py, test_partial.py, test_vision_run.py (asynchronous with images resumed exactly),
test_moe.py (routing replay, also on the slot engine and asynchronous), test_train_ppo.py (also asynchronous, resumed exactly), test_distill.py (also asynchronous and with partial rollouts, resumed exactly), test_selfplay.py: self-play on the slot engine plays the static plies' games)."""
import os
import re

import pytest

from rljax import config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOADS = {
    "text": ("grpo_arithmetic.py", []),
    "tool agent": ("grpo_tool_arithmetic.py", []),
    "self-play": ("grpo_tictactoe_selfplay.py", []),
    "images": ("grpo_vlm_shapes.py", []),
    "moe + routing replay": ("grpo_arithmetic_moe.py", ["--config.algo.routing_replay=true"]),
    "ppo": ("ppo_arithmetic.py", []),
    "distillation": ("distill_arithmetic.py", []),
}
MODES = {
    "static": [],
    "slots": ["--config.rollout.engine=slots"],
    "slots + partial": ["--config.rollout.engine=slots", "--config.rollout.partial=true"],
    "asynchronous": ["--config.algo.asynchronous=true"],
}
# None: the cell validates. Otherwise a fragment of its one-line refusal.
REFUSED = {
    ("tool agent", "slots + partial"): "rollout.partial=true cannot be combined with env.name",
    ("self-play", "slots + partial"): "rollout.partial=true cannot be combined with env.name",
    ("images", "slots + partial"): "rollout.partial=True does not carry images",
    ("moe + routing replay", "slots + partial"): "routing_replay=true is not supported",
    ("ppo", "slots + partial"): "rollout.partial=true needs algo.name='grpo' or 'distill' (got "
                                   "'ppo')",
}


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_matrix_cells_validate_or_are_refused_in_one_line(workload):
    path, extra = WORKLOADS[workload]
    for mode, overrides in MODES.items():
        load = lambda: config.validate(config.load_config(  # noqa: E731
            os.path.join(ROOT, "configs", path), extra + overrides))
        expected = REFUSED.get((workload, mode))
        if expected is None:
            load()
            continue
        with pytest.raises(config.ConfigError, match=re.escape(expected)) as err:
            load()
        assert "\n" not in str(err.value), (workload, mode)


def test_refused_cells_are_the_documented_few():
    assert len(REFUSED) == 5   # of 28; docs/design.md says why for each
    with open(os.path.join(ROOT, "docs", "design.md")) as f:
        design = f.read()
    for needle in ("23 of 28 cells", "episodes with partial rollouts",
                   "images with partial rollouts",
                   "routing replay with partial rollouts has no meaning",
                   "PPO with partial rollouts"):
        assert needle in design, needle
