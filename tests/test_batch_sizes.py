"""Batch sizes that cannot fit are refused before anything is built: one line naming the key,
whatever ``memory.check`` says."""
import os
import subprocess
import sys

import pytest

from rljax import config as config_lib
from rljax import plan as plan_lib
from tiny_config import tiny_config_source

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(**flat):
    cfg = config_lib.default_config()
    cfg.update_from_flattened_dict({"data.max_prompt_length": 100, "rollout.max_new_tokens": 28,
                                    **flat})
    return cfg


def test_the_rule_is_rows_times_tokens_times_8_bytes_against_host_memory():
    cfg = _cfg(**{"rollout.batch_size": 1024})
    need = 1024 * 128 * plan_lib.HOST_BYTES_PER_TOKEN     # exactly 1 MiB
    plan_lib.check_sizes(cfg, host_bytes=need)              # fits exactly
    with pytest.raises(plan_lib.DoesNotFit) as err:
        plan_lib.check_sizes(cfg, host_bytes=need - 1)
    assert str(err.value).startswith("rollout.batch_size=1024 cannot fit: 1024 rows x 128 tokens")
    assert "lower rollout.batch_size" in str(err.value)


def test_sft_and_eval_batches_are_bounded_too():
    cfg = _cfg(**{"rollout.batch_size": 8, "sft.steps": 1, "sft.batch_size": 10**9,
                  "sft.max_length": 64})
    with pytest.raises(plan_lib.DoesNotFit, match="sft.batch_size"):
        plan_lib.check_sizes(cfg, host_bytes=1 << 30)
    cfg = _cfg(**{"rollout.batch_size": 8, "eval.batch_size": 10**9})
    with pytest.raises(plan_lib.DoesNotFit, match="eval.batch_size"):
        plan_lib.check_sizes(cfg, host_bytes=1 << 30)


def test_train_refuses_an_impossible_batch_at_once_even_with_the_memory_check_off(tmp_path):
    config = tmp_path / "tiny.py"
    config.write_text(tiny_config_source())      # memory.check="off"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    out = subprocess.run(
        [sys.executable, "-m", "rljax.cli", "train", "--config", str(config), "--workdir",
         str(tmp_path / "run"), "--config.rollout.batch_size=1000000000000"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [out.stderr.strip()]
    assert "rollout.batch_size=1000000000000 cannot fit" in out.stderr
    assert not (tmp_path / "run").exists()   # nothing written
