"""A workdir's config.json is code-bearing (``file.py:name`` specs are imported and run on
resume): the resume line names every such file, resolved."""
import os

from rljax import cli
from rljax import config as config_lib
from rljax.train.core import workdir as workdir_lib
from tiny_config import tiny_config_source

REWARD = "def score(prompts, completions, **kw):\n    return [0.0] * len(completions)\n"


def test_code_files_finds_every_python_file_spec_resolved():
    cfg = config_lib.default_config()
    cfg.reward.names = ("arithmetic", "rewards/mine.py:score")
    cfg.data.source = "loaders.py:load"
    assert workdir_lib.code_files(cfg) == [
        ("data.source", os.path.abspath("loaders.py")),
        ("reward.names", os.path.abspath("rewards/mine.py"))]
    assert workdir_lib.code_files_line(config_lib.default_config()) == ""


def test_the_resume_line_names_the_reward_files_it_will_run(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_reward.py").write_text(REWARD)
    config = tmp_path / "tiny.py"
    config.write_text(tiny_config_source(steps=1, reward=dict(names=("my_reward.py:score",)),
                                         checkpoint=dict(async_save=False)))
    workdir = str(tmp_path / "run")
    assert cli.main(["train", "--config", str(config), "--workdir", workdir]) == 0
    capsys.readouterr()
    assert cli.main(["train", "--workdir", workdir, "--config.steps=2"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "resuming from" in line]
    assert len(lines) == 1, lines
    assert lines[0].endswith(f"; its config runs code from {tmp_path / 'my_reward.py'} "
                             "(reward.names)")
