"""`rljax train` as a user runs it: one-line errors before anything compiles, SIGTERM saves a
checkpoint and exits 0, and the next run resumes from it."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tiny_config import tiny_config_source

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = tiny_config_source(
    steps=1_000_000,  # ends only by SIGTERM, however slowly the test gets to send it
    rollout=dict(batch_size=16), memory=dict(check="auto"))


def rljax(*args, **kw):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
               XLA_FLAGS=os.environ.get("RLJAX_TEST_COMPILER_FLAGS", ""))
    return subprocess.Popen([sys.executable, "-m", "rljax.cli", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


@pytest.fixture
def tiny_config(tmp_path):
    path = tmp_path / "tiny.py"
    path.write_text(TINY)
    return str(path)


def _bad_model_dir(tmp_path):
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    return str(d)


@pytest.mark.parametrize("override,needle", [
    ("--config.algo.bogus_knob=1", "algo.bogus_knob"),
    ("--config.rollout.batch_size=18", "not divisible by algo.num_generations"),
    ("--config.model.path=/nonexistent/model", "model.path"),
    ("MODEL_TYPE", "unsupported model_type 'gpt2'"),
])
def test_user_errors_are_one_line_without_traceback(tiny_config, tmp_path, override, needle):
    if override == "MODEL_TYPE":
        override = f"--config.model.path={_bad_model_dir(tmp_path)}"
    proc = rljax("train", "--config", tiny_config, "--workdir", str(tmp_path / "w"), override)
    out, err = proc.communicate(timeout=300)  # no compile, but imports on a busy machine
    assert proc.returncode == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("rljax: error:"), err
    assert needle in lines[0]
    assert "Traceback" not in err
    assert not os.path.isdir(tmp_path / "w" / "checkpoints")


def test_sigterm_saves_a_checkpoint_and_the_next_run_resumes(tiny_config, tmp_path):
    workdir = tmp_path / "run"
    proc = rljax("train", "--config", tiny_config, "--workdir", str(workdir))
    metrics = workdir / "metrics.jsonl"
    # Poll for two steps' metrics. The bound only catches a hang (compiling takes seconds);
    # reaching it is a failure of its own, not a SIGTERM sent at an arbitrary point.
    deadline = time.monotonic() + 600
    while not (metrics.exists() and sum(1 for _ in open(metrics)) >= 2):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("no 2 steps within 600 s:\n" + proc.communicate()[1][-3000:])
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert "stopped by SIGTERM" in err and "Traceback" not in err
    saved = sorted(int(p) for p in os.listdir(workdir / "checkpoints") if p.isdigit())
    assert saved, "no checkpoint after SIGTERM"
    stopped_at = saved[-1]

    # Resume with one more step than was done: it continues, it does not start over.
    proc = rljax("train", "--workdir", str(workdir), f"--config.steps={stopped_at + 1}")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert f"resumed at step {stopped_at}" in err
    steps = [json.loads(line)["step"] for line in open(metrics)]
    assert steps[-1] == stopped_at + 1 and steps.count(stopped_at + 1) == 2  # train + eval
    assert steps == sorted(steps)
