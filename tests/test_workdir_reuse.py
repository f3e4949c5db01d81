"""Training again in a used workdir: a changed or incompatible config is refused with one line
naming the keys, before anything is written, so the workdir stays usable; a larger `steps`
extends the run; `--allow-config-change` resumes with changed hyper-parameters."""
import json

import pytest

from rljax import cli

from tiny_config import tiny_config_source

TINY = tiny_config_source()


def _one_error_line(capsys) -> str:
    text = capsys.readouterr().err
    err = [line for line in text.splitlines() if line.startswith("rljax: error: ")]
    assert len(err) == 1 and "Traceback" not in text, text
    return err[0]


def _last_step(workdir) -> int:
    return [json.loads(line) for line in open(workdir / "metrics.jsonl")][-1]["step"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("reuse")
    cfg_file = root / "tiny.py"
    cfg_file.write_text(TINY)
    workdir = root / "run"
    assert cli.main(["train", "--config", str(cfg_file), "--workdir", str(workdir)]) == 0
    return str(cfg_file), workdir


@pytest.mark.parametrize("override, key, hint, allow", [
    ("--config.algo.epsilon=0.3", "algo.epsilon (0.2 -> 0.3)", "--allow-config-change", False),
    ("--config.model.overrides.num_layers=2", "model.overrides.num_layers (1 -> 2)",
     "use a new --workdir", False),
    # Incompatible keys are refused even with the flag: the checkpoint could not restore.
    ("--config.model.overrides.num_layers=2", "model.overrides.num_layers (1 -> 2)",
     "use a new --workdir", True),
])
def test_changed_config_is_refused_and_the_workdir_stays_usable(trained, capsys, override, key,
                                                                 hint, allow):
    cfg_file, workdir = trained
    before = (workdir / "config.json").read_bytes()
    argv = ["train", "--config", cfg_file, "--workdir", str(workdir), override]
    assert cli.main(argv + (["--allow-config-change"] if allow else [])) == 2
    line = _one_error_line(capsys)
    assert key in line and hint in line
    assert (workdir / "config.json").read_bytes() == before  # nothing rewritten
    # Still a working run directory.
    assert cli.main(["eval", "--workdir", str(workdir)]) == 0
    assert json.loads(capsys.readouterr().out)["step"] >= 2


def test_extend_steps_then_allowed_change(trained, capsys):
    cfg_file, workdir = trained
    # A larger `steps` extends the run without a flag.
    assert cli.main(["train", "--workdir", str(workdir), "--config.steps=3"]) == 0
    assert "resumed at step 2" in capsys.readouterr().err
    assert _last_step(workdir) == 3
    assert json.loads((workdir / "config.json").read_text())["steps"] == 3
    # A hyper-parameter change needs the flag; then the run resumes with it.
    argv = ["train", "--config", cfg_file, "--workdir", str(workdir), "--config.steps=4",
            "--config.optimizer.learning_rate=0.0005"]
    assert cli.main(argv) == 2
    assert "optimizer.learning_rate (0.001 -> 0.0005)" in _one_error_line(capsys)
    assert cli.main(argv + ["--allow-config-change"]) == 0
    assert "optimizer.learning_rate: 0.001 -> 0.0005" in capsys.readouterr().err
    assert _last_step(workdir) == 4
    saved = json.loads((workdir / "config.json").read_text())
    assert saved["optimizer"]["learning_rate"] == 0.0005 and saved["steps"] == 4


def test_allowed_change_that_does_not_restore_leaves_config_json(trained, capsys):
    """beta > 0 adds a reference model to the state: the checkpoint cannot restore into it."""
    _, workdir = trained
    before = (workdir / "config.json").read_bytes()
    assert cli.main(["train", "--workdir", str(workdir), "--config.algo.beta=0.04",
                     "--allow-config-change"]) == 2
    assert "does not fit this config" in _one_error_line(capsys)
    assert (workdir / "config.json").read_bytes() == before


def test_check_reuse_key_classes(tmp_path):
    """Without training: which differences are free, need the flag, or are never accepted."""
    from rljax import config as config_lib
    from rljax.errors import UserError
    from rljax.train.core import workdir as wd

    cfg = config_lib.default_config()
    wd.write_config(str(tmp_path), cfg)
    assert wd.check_reuse(str(tmp_path), cfg) == []  # no checkpoint yet: anything goes
    (tmp_path / "checkpoints" / "5").mkdir(parents=True)

    def changed(**kv):
        new = config_lib.default_config()
        config_lib.merge_into(new, kv)
        return new

    free = changed(steps=500, logging=dict(console_every_s=1.0), checkpoint_every=7,
                   model=dict(remat=True, overrides=dict(attention_impl="auto",
                                                         remat_policy="everything")))
    assert len(wd.check_reuse(str(tmp_path), free)) == 6
    with pytest.raises(UserError, match=r"algo.beta \(0.04 -> 0.0\).*--allow-config-change"):
        wd.check_reuse(str(tmp_path), changed(algo=dict(beta=0.0)))
    assert wd.check_reuse(str(tmp_path), changed(algo=dict(beta=0.0)), True)
    for kv in (dict(model=dict(dtype="bfloat16")), dict(sft=dict(steps=3)),
               dict(optimizer=dict(name="sgd")), dict(tokenizer=dict(kind="char"))):
        with pytest.raises(UserError, match="use a new --workdir"):
            wd.check_reuse(str(tmp_path), changed(**kv), True)
    (tmp_path / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"]}')
    with pytest.raises(UserError, match="is not an rljax config"):
        wd.check_reuse(str(tmp_path), cfg)
