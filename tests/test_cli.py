"""`rljax` CLI: one-line user errors (exit 2), dispatch to rljax.train.run, resume, plot."""
import json
import os
import subprocess
import sys
import types

import pytest

from rljax import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_config(tmp_path):
    path = tmp_path / "exp.py"
    path.write_text("from rljax.config import default_config\n"
                    "def get_config():\n    c = default_config()\n    c.steps = 3\n    return c\n")
    return str(path)


@pytest.fixture
def fake_run(monkeypatch):
    """A stand-in rljax.train.run that records its calls."""
    module = types.ModuleType("fake_rljax_run")
    module.calls = []

    def train(cfg, workdir, allow_config_change=False):
        module.calls.append(("train", cfg, workdir))
        return 0

    def evaluate(cfg, workdir, checkpoint=None):
        module.calls.append(("evaluate", cfg, workdir))

    module.train, module.evaluate = train, evaluate
    monkeypatch.setitem(sys.modules, "fake_rljax_run", module)
    monkeypatch.setattr(cli, "RUN_MODULE", "fake_rljax_run")
    return module


def test_user_error_is_one_line_exit_2_in_a_subprocess(tmp_path):
    cfg = write_config(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "rljax.cli", "train", "--config", cfg,
         "--config.algo.bta=0.1", "--workdir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=300, cwd=ROOT,  # importing jax can be slow
        env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "rljax: error: unknown config key 'algo.bta' (did you mean 'algo.beta'?)"]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv, needle", [
    (["train", "--config", "missing.py", "--workdir", "w"], "config file not found: missing.py"),
    (["train", "--workdir", "{tmp}/fresh"], "--config is required"),
    (["eval", "--workdir", "{tmp}"], "has no config.json"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["train", "--config.rollout.batch_size"], "needs a value"),
    (["plot", "{tmp}"], "no metrics.jsonl found"),
])
def test_user_errors_exit_2(tmp_path, capsys, argv, needle):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rljax: error: ") and needle in err[0]


def test_missing_run_module_is_not_available_yet(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "RUN_MODULE", "rljax.train._no_such_run_module")
    code = cli.main(["train", "--config", write_config(tmp_path), "--workdir", str(tmp_path)])
    assert code == 2
    assert "`rljax train` is not available yet" in capsys.readouterr().err


def test_train_dispatch_writes_config_and_resumes(tmp_path, capsys, fake_run):
    workdir = tmp_path / "run"
    cfg_file = write_config(tmp_path)
    assert cli.main(["train", "--config", cfg_file, "--config.algo.beta", "0",
                     "--workdir", str(workdir)]) == 0
    (_, cfg, seen_workdir), = fake_run.calls
    assert cfg.steps == 3 and cfg.algo.beta == 0.0 and seen_workdir == str(workdir)
    saved = json.loads((workdir / "config.json").read_text())
    assert saved["steps"] == 3 and saved["algo"]["beta"] == 0.0

    os.makedirs(workdir / "checkpoints" / "2")  # as if step 2 had been saved
    # Resume by workdir alone: the saved config (plus a new override) is used.
    assert cli.main(["train", "--workdir", str(workdir), "--config.steps=5"]) == 0
    assert fake_run.calls[-1][1].steps == 5 and fake_run.calls[-1][1].algo.beta == 0.0
    assert "resuming from" in capsys.readouterr().err
    # A resumed run's config.json is rewritten by train() after its checkpoint restored, not
    # here; a config file that differs from it is refused (one line naming the keys) ...
    assert json.loads((workdir / "config.json").read_text())["steps"] == 3
    calls = len(fake_run.calls)
    assert cli.main(["train", "--config", cfg_file, "--workdir", str(workdir)]) == 2
    err = capsys.readouterr().err
    assert "algo.beta (0.0 -> 0.04)" in err and "--allow-config-change" in err
    assert len(fake_run.calls) == calls
    # ... unless allowed; the changes are then reported.
    assert cli.main(["train", "--config", cfg_file, "--workdir", str(workdir),
                     "--allow-config-change"]) == 0
    err = capsys.readouterr().err
    assert "config changed since the last run: algo.beta: 0.0 -> 0.04" in err


def test_eval_uses_workdir_config_and_overrides(tmp_path, fake_run):
    assert cli.main(["train", "--config", write_config(tmp_path),
                     "--workdir", str(tmp_path)]) == 0
    assert cli.main(["eval", "--workdir", str(tmp_path), "--config.eval.num_examples=8"]) == 0
    name, cfg, _ = fake_run.calls[-1]
    assert name == "evaluate" and cfg.steps == 3 and cfg.eval.num_examples == 8


def test_plot_command_writes_png(tmp_path, capsys):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in range(1, 6):
            f.write(json.dumps({"step": step, "reward/mean": step / 5, "loss": 1 / step}) + "\n")
    out = tmp_path / "curves.png"
    assert cli.main(["plot", str(tmp_path), "-o", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert capsys.readouterr().out.strip() == str(out)


def test_split_overrides():
    rest, overrides = cli.split_overrides(
        ["train", "--config", "a.py", "--config.x.y=1", "--config.z", "2", "--workdir", "w"])
    assert rest == ["train", "--config", "a.py", "--workdir", "w"]
    assert overrides == ["--config.x.y=1", "--config.z=2"]


@pytest.mark.parametrize("verb", ["train", "eval", "sample", "export", "plan"])
def test_verb_help_mentions_config_overrides(verb, capsys):
    with pytest.raises(SystemExit):
        cli.main([verb, "--help"])
    assert "--config.KEY=VALUE" in capsys.readouterr().out
