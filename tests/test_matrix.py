"""The workload x rollout-mode matrix: which combinations a config may ask for, and the one
line that refuses the others (docs/design.md lists them with the reason).

Where the 27 cells that run are trained, and where each workload resumes exactly after a stop:
- text: test_train_loop.py, test_engine.py, test_partial.py, test_async.py (each resumed);
- tool agents: test_agent_train.py (static and asynchronous on the engine resumed, slot engine),
  test_episode_partial.py (partial rollouts resumed);
- self-play: test_selfplay.py (static, resumed with its role baselines; slot engine; partial
  rollouts against a checkpoint resumed), test_episode_partial.py (partial rollouts resumed)
  and below (asynchronous);
- images: test_vision_run.py (static, slot engine; partial rollouts and asynchronous resumed);
- routing replay: test_moe.py (static, slot engine, PPO over tool episodes; asynchronous
  resumed), test_multiturn.py (the episodes' recorded routes), test_distill.py (slot engine);
- PPO: test_train_ppo.py (static; partial rollouts and asynchronous resumed) and below (slot
  engine);
- distillation: test_distill.py (static, slot engine; partial rollouts and asynchronous
  resumed)."""
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
    ("moe + routing replay", "slots + partial"): "routing_replay=true is not supported",
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
    assert len(REFUSED) == 1   # of 28; docs/design.md says why
    with open(os.path.join(ROOT, "docs", "design.md")) as f:
        design = f.read()
    for needle in ("27 of 28 cells",
                   "are carried at turn boundaries",
                   "routing replay with partial rollouts has no meaning"):
        assert needle in design, needle


TINY = ["--config.steps=2", "--config.sft.steps=0", "--config.rollout.batch_size=8",
        "--config.eval.num_examples=4", "--config.eval.batch_size=4", "--config.eval_every=0",
        "--config.checkpoint_every=0", "--config.checkpoint.async_save=False",
        "--config.logging.tensorboard=False", "--config.mesh.data=1",
        "--config.model.overrides.num_layers=1", "--config.model.overrides.hidden_size=32",
        "--config.model.overrides.intermediate_size=64"]


@pytest.mark.parametrize("workload, mode, extra", [
    # The cells no workload's own file trains: two iterations each.
    ("ppo", "slots", ["--config.algo.mini_batch_size=4"]),
    ("self-play", "asynchronous", ["--config.algo.num_generations=2",
                                   "--config.rollout.max_new_tokens=8"]),
])
def test_cells_not_trained_elsewhere_train_two_iterations(workload, mode, extra, tmp_path):
    import jax
    from rljax.train import run
    from rljax.train.core.metrics import read_metrics

    path, overrides = WORKLOADS[workload]
    cfg = config.load_config(os.path.join(ROOT, "configs", path),
                             overrides + MODES[mode] + TINY + extra)
    assert run.train(cfg, str(tmp_path), devices=jax.devices()[:1]) == 0
    rl = [r for r in read_metrics(str(tmp_path)) if "reward/mean" in r]
    assert len(rl) == 2
    if mode == "slots":
        assert all(0 < r["rollout/slot_utilisation"] <= 1 for r in rl)
    if mode == "asynchronous":
        assert [r["rollout/sample_version"] for r in rl] == [0, 0]
