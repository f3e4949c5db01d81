"""MetricsWriter (jsonl, TensorBoard, console), read/truncate, and `plot` PNG output."""
import io
import json
import math
import os

import jax.numpy as jnp
import numpy as np

from rljax.train.core.metrics import (MetricsWriter, format_duration, host_fraction, read_metrics,
                                 to_python)
from rljax.train.core.plot import panels, plot_metrics


def test_jsonl_content_and_conversions(tmp_path):
    out = io.StringIO()
    with MetricsWriter(tmp_path, total_steps=3, console_every_s=0, stream=out) as writer:
        writer.write(1, {"reward/mean": jnp.float32(0.5), "loss": np.float64(1.25),
                         "count": np.int32(4), "kl": jnp.array([0.1]), "hist": np.arange(3),
                         "bad": float("nan"), "flag": np.bool_(True)})
        writer.write(2, {"eval/accuracy": 0.75})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    first, second = json.loads(lines[0]), json.loads(lines[1])
    assert first == {"step": 1, "reward/mean": 0.5, "loss": 1.25, "count": 4,
                     "kl": first["kl"], "hist": [0, 1, 2], "bad": None, "flag": True}
    assert math.isclose(first["kl"], 0.1, rel_tol=1e-6)
    assert second == {"step": 2, "eval/accuracy": 0.75}
    assert read_metrics(tmp_path) == [first, second]
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path))
    assert "step 1/3" in out.getvalue() and "reward/mean 0.5" in out.getvalue()


def test_console_is_throttled_but_prints_first_and_last(tmp_path):
    out = io.StringIO()
    with MetricsWriter(tmp_path, total_steps=50, console_every_s=3600, tensorboard=False,
                       stream=out) as writer:
        for step in range(1, 51):
            writer.write(step, {"loss": 1.0 / step})
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("step 1/50") and lines[1].startswith("step 50/50")
    assert "steps/s" in lines[1] and "ETA 0s" in lines[1]


def test_disabled_writer_writes_nothing(tmp_path):
    with MetricsWriter(tmp_path / "w", enabled=False) as writer:
        assert writer.write(3, {"loss": 1.0}) == {"step": 3, "loss": 1.0}
    assert not os.path.exists(tmp_path / "w")


def test_resume_drops_steps_after_checkpoint_and_torn_line(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False, stream=io.StringIO()) as writer:
        for step in range(1, 6):
            writer.write(step, {"loss": float(step)})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # killed mid-write
    with MetricsWriter(tmp_path, tensorboard=False, resume_step=3,
                       stream=io.StringIO()) as writer:
        writer.write(4, {"loss": 40.0})
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


def test_helpers():
    assert to_python(jnp.float32(float("inf"))) is None
    assert to_python({"a": np.float32(2.0)}) == {"a": 2.0}
    assert format_duration(3725) == "1h02m" and format_duration(75) == "1m15s"


def test_plot_writes_png(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False, stream=io.StringIO()) as writer:
        for step in range(1, 61):
            record = {"reward/mean": step / 60, "loss": 1.0 / step, "kl": 0.01 * step}
            if step % 20 == 0:
                record["eval/accuracy"] = step / 100
            writer.write(step, record)
    out = plot_metrics(str(tmp_path), str(tmp_path / "plots" / "curves.png"))
    with open(out, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_plot_leaves_out_flat_series(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False, stream=io.StringIO()) as writer:
        for step in range(1, 11):
            writer.write(step, {"loss": 1.0 / step, "train/skipped_total": 0,
                                "clip/frac": 0.25, "kl": 0.0})
        writer.write(10, {"eval/accuracy": 0.5})  # one eval point: drawn
    from rljax.train.core.metrics import numeric_series

    keys, flat = panels(numeric_series(read_metrics(tmp_path)))
    assert keys == ["eval/accuracy", "loss"]
    assert flat == {"clip/frac": 0.25, "kl": 0.0, "train/skipped_total": 0}
    assert os.path.getsize(plot_metrics(str(tmp_path))) > 1000


def test_host_fraction_is_the_share_without_pending_device_work():
    assert host_fraction(2.0, 0.5) == 0.75
    assert host_fraction(1.0, 0.0) == 1.0
    assert host_fraction(1.0, 1.5) == 0.0   # pending over-counts: clipped, never negative
    assert host_fraction(0.0, 0.0) == 0.0
