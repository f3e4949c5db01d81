"""A `gs://` workdir, without network: the whole run (config.json, char tokenizer, metrics.jsonl,
TensorBoard events, orbax checkpoints, resume, eval, export) on a URL workdir.

The URL goes through the real `etils.epath` gs:// path class and its fsspec backend; only the
storage underneath is faked:

* fsspec's `gcs` protocol is registered to `FakeGCS`, a local filesystem rooted in a temp dir
  (`gs://bucket/x` -> `<root>/bucket/x`; like GCS it needs no parent directories);
* orbax's two GCS-only calls are pointed at the same files: the TensorStore kvstore spec
  (`gcs` driver -> `file` driver) and the hierarchical-namespace bucket query (-> False).
"""
import json
import os

import fsspec
import pytest
from fsspec.implementations.local import LocalFileSystem

from rljax import cli, tokenizers
from rljax.train.core import metrics as metrics_lib
from rljax.train.core import paths, workdir as workdir_lib

from tiny_config import tiny_config_source


class FakeGCS(LocalFileSystem):
    protocol = ("gs", "gcs")
    root_marker = ""
    ROOT = "/nonexistent"  # set per test

    def __init__(self, *args, **kwargs):
        kwargs.pop("finalize_on_close", None)  # a gcsfs option etils passes
        super().__init__(*args, auto_mkdir=True, **kwargs)

    @classmethod
    def _strip_protocol(cls, path):
        path = os.fspath(path) if not isinstance(path, str) else path
        for prefix in ("gs://", "gcs://"):
            if path.startswith(prefix):
                return os.path.join(cls.ROOT, path[len(prefix):]).rstrip("/")
        return super()._strip_protocol(path)

    def glob(self, path, **kwargs):  # like gcsfs: "bucket/..." without the protocol
        return [p[len(self.ROOT) + 1:] for p in super().glob(path, **kwargs)]


@pytest.fixture
def fake_gcs(tmp_path, monkeypatch):
    from orbax.checkpoint._src.path import gcs_utils

    root = tmp_path / "gcs"
    root.mkdir()
    monkeypatch.setattr(FakeGCS, "ROOT", str(root))
    fsspec.register_implementation("gcs", FakeGCS, clobber=True)
    fsspec.register_implementation("gs", FakeGCS, clobber=True)
    monkeypatch.setattr(gcs_utils, "get_kvstore_for_gcs",
                        lambda p: {"driver": "file", "path": FakeGCS._strip_protocol(p)})
    monkeypatch.setattr(gcs_utils, "is_hierarchical_namespace_enabled", lambda p: False)
    fsspec.AbstractFileSystem.clear_instance_cache()
    yield root
    fsspec.AbstractFileSystem.clear_instance_cache()


TINY = tiny_config_source(
    eval_every=0, checkpoint_every=1, rollout=dict(batch_size=16), memory=dict(check="auto"),
    sft=dict(steps=2, batch_size=8, max_length=16), logging=dict(tensorboard=True))


def test_paths_local_unchanged(tmp_path):
    local = str(tmp_path / "run")
    assert not paths.is_url(local) and paths.is_url("gs://b/run") and paths.is_url("s3://b/r")
    assert workdir_lib.config_path(local) == os.path.join(local, "config.json")
    assert workdir_lib.checkpoint_dir("gs://b/run/") == "gs://b/run/checkpoints"
    assert paths.absolute("gs://b/run") == "gs://b/run"
    assert paths.absolute("rel") == os.path.abspath("rel")


def test_char_tokenizer_and_metrics_on_url(fake_gcs):
    tok = tokenizers.CharTokenizer()
    assert tok.save("gs://bucket/t") == "gs://bucket/t/char_tokenizer.json"
    assert (fake_gcs / "bucket/t/char_tokenizer.json").is_file()
    assert tokenizers.CharTokenizer.load("gs://bucket/t").alphabet == tok.alphabet

    with metrics_lib.MetricsWriter("gs://bucket/m", tensorboard=False, enabled=True,
                                   stream=open(os.devnull, "w"), sync_every_s=1e9) as w:
        w.write(1, {"a": 1.0})
        w.write(2, {"a": 2.0})
    assert [r["step"] for r in metrics_lib.read_metrics("gs://bucket/m")] == [1, 2]
    # Resuming at step 1 drops step 2 and appends after it (the file is re-uploaded whole).
    with metrics_lib.MetricsWriter("gs://bucket/m", tensorboard=False, enabled=True,
                                   stream=open(os.devnull, "w"), resume_step=1) as w:
        w.write(2, {"a": 3.0})
    assert [r["a"] for r in metrics_lib.read_metrics("gs://bucket/m/metrics.jsonl")] == [1.0, 3.0]


def test_train_resume_eval_export_on_gs_workdir(fake_gcs, tmp_path, capsys):
    config = tmp_path / "tiny.py"
    config.write_text(TINY)
    wd = "gs://bucket/runs/tiny"
    assert cli.main(["train", "--config", str(config), "--workdir", wd]) == 0
    run = fake_gcs / "bucket/runs/tiny"
    assert not os.path.exists("gs:")  # nothing went to a local "gs:" directory
    assert {"config.json", "char_tokenizer.json", "metrics.jsonl"} <= set(os.listdir(run))
    assert any(n.startswith("events.out.tfevents") for n in os.listdir(run))
    steps_kept = sorted(n for n in os.listdir(run / "checkpoints") if n.isdigit())
    assert steps_kept == ["2", "3", "4"]  # max_to_keep=3
    assert [r["step"] for r in metrics_lib.read_metrics(wd) if "loss" in r] == [3, 4]

    # Resume by the workdir alone (its config.json), with 2 more iterations.
    assert cli.main(["train", "--workdir", wd, "--config.steps=4"]) == 0
    assert "resumed at step 4" in capsys.readouterr().err
    records = metrics_lib.read_metrics(wd)
    assert [r["step"] for r in records if "loss" in r] == [3, 4, 5, 6]
    assert json.loads((run / "config.json").read_text())["steps"] == 4
    assert "6" in os.listdir(run / "checkpoints")

    assert cli.main(["eval", "--workdir", wd]) == 0
    out = tmp_path / "hf"
    assert cli.main(["export", "--workdir", wd, "--out", str(out)]) == 0
    assert (out / "char_tokenizer.json").is_file()
