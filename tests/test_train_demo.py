"""The built-in demo config end to end through the CLI, with fewer steps (slow; run in CI)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_demo_config_pipeline(tmp_path):
    workdir = tmp_path / "demo"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
               XLA_FLAGS=os.environ.get("RLJAX_TEST_COMPILER_FLAGS", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "rljax.cli", "train", "--config", "configs/grpo_arithmetic.py",
         "--workdir", str(workdir), "--config.sft.steps=30", "--config.steps=3",
         "--config.rollout.batch_size=32", "--config.eval.num_examples=24",
         "--config.eval.batch_size=24",
         "--config.eval_every=0"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    evals = [r for r in records if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [30, 33]
    assert all(0.0 <= r["eval/accuracy"] <= 1.0 and r["eval/num_examples"] == 24 for r in evals)
    rl = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in rl] == [31, 32, 33]
    sft = [r for r in records if "sft/loss" in r]
    assert sft[-1]["sft/loss"] < sft[0]["sft/loss"]
    assert {"config.json", "char_tokenizer.json", "checkpoints"} <= set(os.listdir(workdir))
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(workdir))

    # The run's artifacts work with the other commands.
    out = subprocess.run([sys.executable, "-m", "rljax.cli", "eval", "--workdir", str(workdir),
                          "--config.eval.num_examples=20"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["step"] == 33 and result["eval/num_examples"] == 20
    hf = tmp_path / "hf"
    out = subprocess.run([sys.executable, "-m", "rljax.cli", "export", "--workdir", str(workdir),
                          "--out", str(hf)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert (hf / "config.json").exists() and list(hf.glob("*.safetensors"))
    out = subprocess.run([sys.executable, "-m", "rljax.cli", "sample", "--workdir", str(workdir),
                          "--prompt", "12+7="], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("--- prompt ---\n12+7=\n--- completion ---\n")
