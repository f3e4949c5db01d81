"""Weights & Biases logging (logging.wandb) in offline mode: no network, files in the workdir."""
import glob
import os
import time

import pytest

pytest.importorskip("wandb")

from rljax.train import run  # noqa: E402
from rljax.train.core.metrics import MetricsWriter  # noqa: E402

from test_train_loop import DEVICES, tiny_cfg  # noqa: E402


def _run_files(workdir):
    return sorted(glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb")))


def _records(path, *needles, timeout_s=120):
    """The run file's bytes once they hold every needle: wandb's service process writes the
    file after ``finish()`` returns, so wait for it (generously) rather than read at once."""
    deadline = time.monotonic() + timeout_s
    while True:
        data = open(path, "rb").read()
        if all(n in data for n in needles) or time.monotonic() > deadline:
            return data
        time.sleep(0.1)


def test_writer_logs_config_and_curves_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # belt and braces: never the network
    options = {"project": "rljax-test", "mode": "offline", "name": "", "entity": "", "tags": ()}
    with MetricsWriter(tmp_path, tensorboard=False, console_every_s=1e9, wandb=options,
                       config={"algo": {"num_generations_marker": 7}}) as w:
        w.write(1, {"reward/mean": 0.25, "loss": 1.5, "note": [1, 2]})
        w.write(2, {"reward/mean": 0.5})
    files = _run_files(str(tmp_path))
    assert len(files) == 1
    data = _records(files[0], b"num_generations_marker", b"reward/mean", b"loss")
    assert b"num_generations_marker" in data  # the config
    assert b"reward/mean" in data and b"loss" in data  # the curves
    run_id = open(tmp_path / "wandb" / "rljax_run_id").read().strip()
    assert files[0].endswith(f"run-{run_id}.wandb")
    # A resumed writer continues the same W&B run.
    with MetricsWriter(tmp_path, tensorboard=False, console_every_s=1e9, wandb=options,
                       resume_step=2) as w:
        w.write(3, {"reward/mean": 0.75})
    assert all(f.endswith(f"run-{run_id}.wandb") for f in _run_files(str(tmp_path)))


def test_train_with_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = tiny_cfg(**{"sft.steps": 0, "steps": 1, "logging.wandb.project": "rljax-test",
                      "logging.wandb.mode": "offline"})
    workdir = str(tmp_path / "run")
    assert run.train(cfg, workdir, devices=DEVICES) == 0
    files = _run_files(workdir)
    assert len(files) == 1
    data = _records(files[0], b"num_generations", b"reward/mean", b"eval/accuracy")
    assert b"num_generations" in data and b"reward/mean" in data and b"eval/accuracy" in data
