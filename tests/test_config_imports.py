"""``imports``: user files and modules imported before the config is validated, so the
advantage estimators, policy losses and algorithms they register can be chosen from the
command line like built-in names."""
import json
import os

import pytest

from rljax import cli
from rljax import config as config_lib
from rljax import rewards
from rljax.config import imports
from rljax.errors import ConfigError
from rljax.train.core import workdir as workdir_lib
from tiny_config import tiny_config_source

# Registers one estimator (the group-mean baseline without std scaling), one policy loss (PPO's
# clip at 0.1) and one algorithm (GRPO under another name). The functions leave a file beside
# this one when the trainer traces them, to show they are the ones that ran.
USER_FILE = '''
import os

from rljax import algorithms
from rljax.train import phases


def _ran(name):
    open(os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".ran"), "w").close()


def centered(rewards, group_size, **_):
    _ran("centered")
    groups = rewards.reshape(-1, group_size)
    return (groups - groups.mean(axis=1, keepdims=True)).reshape(-1)


def narrow_clip(logps, old_logps, advantages, mask, **options):
    _ran("narrow_clip")
    return algorithms.ppo_loss(logps, old_logps, advantages, mask, epsilon=0.1, **options)


algorithms.register_advantage_estimator("centered", centered)
algorithms.register_policy_loss("narrow_clip", narrow_clip)
phases.register_algorithm("grpo_again", phases.ALGORITHMS["grpo"])
'''


@pytest.fixture
def registries(monkeypatch):
    """Registrations made by a test's user file end with the test."""
    from rljax.algorithms import advantages, policy_losses
    from rljax.rewards import registry as reward_registry
    from rljax.train import phases

    monkeypatch.setattr(advantages, "_ADVANTAGE_ESTIMATORS",
                        dict(advantages._ADVANTAGE_ESTIMATORS))
    monkeypatch.setattr(advantages, "_TOKEN_LEVEL", set(advantages._TOKEN_LEVEL))
    monkeypatch.setattr(advantages, "_TREE", set(advantages._TREE))
    monkeypatch.setattr(policy_losses, "_POLICY_LOSSES", dict(policy_losses._POLICY_LOSSES))
    monkeypatch.setattr(phases, "ALGORITHMS", dict(phases.ALGORITHMS))
    monkeypatch.setattr(phases, "PROGRAMS", dict(phases.PROGRAMS))
    monkeypatch.setattr(reward_registry, "_REGISTRY", dict(reward_registry._REGISTRY))
    monkeypatch.setattr(imports, "_IMPORTED", [])


def _write(tmp_path, name="my_ext.py", text=USER_FILE):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rljax: error: "), err
    return err[0]


def test_names_registered_by_imported_code_train_from_the_command_line(
        tmp_path, capsys, registries):
    ext = _write(tmp_path)
    config = tmp_path / "tiny.py"
    config.write_text(tiny_config_source(checkpoint=dict(async_save=False)))
    workdir = tmp_path / "run"
    assert cli.main(["train", "--config", str(config), "--workdir", str(workdir),
                     f"--config.imports={ext}", "--config.algo.adv_estimator=centered",
                     "--config.algo.policy_loss=narrow_clip"]) == 0
    saved = json.loads((workdir / "config.json").read_text())
    assert saved["imports"] == [ext]
    assert (saved["algo"]["adv_estimator"], saved["algo"]["policy_loss"]) == (
        "centered", "narrow_clip")
    # A user loss has no per-loss defaults in the config: its own signature's apply.
    assert saved["algo"]["epsilon"] is None and saved["algo"]["epsilon_high"] is None
    steps = [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").open()
             if '"step"' in line]
    assert max(steps) == 2
    assert (tmp_path / "centered.ran").exists() and (tmp_path / "narrow_clip.ran").exists()
    # Resuming imports the file again: the resume line names it with the other code files.
    assert workdir_lib.code_files_line(config_lib.load_config_json(
        str(workdir / "config.json"))) == f"; its config runs code from {ext} (imports)"


@pytest.mark.parametrize("key, typo, registered, builtin", [
    ("algo.adv_estimator", "centred", "centered", "grpo"),
    ("algo.policy_loss", "narrow_clips", "narrow_clip", "gspo"),
])
def test_a_misspelled_name_lists_the_registered_names_with_the_users(
        tmp_path, capsys, registries, key, typo, registered, builtin):
    ext = _write(tmp_path)
    config = tmp_path / "tiny.py"
    config.write_text(tiny_config_source())
    assert cli.main(["train", "--config", str(config), "--workdir", str(tmp_path / "run"),
                     f"--config.imports={ext}", f"--config.{key}={typo}"]) == 2
    line = _one_error_line(capsys)
    assert f"{key}='{typo}' is not one of: " in line
    names = line.split("is not one of: ")[1]
    assert registered in names and builtin in names
    assert line.endswith(f"(did you mean '{registered}'?)")
    assert not os.path.exists(tmp_path / "run")  # refused before anything was written


def test_an_algorithm_registered_by_imported_code_is_a_valid_algo_name(tmp_path, registries):
    ext = _write(tmp_path)
    cfg = config_lib.load_config(None, [f"imports={ext}", "algo.name=grpo_again"])
    assert cfg.algo.name == "grpo_again" and "grpo_again" in config_lib.CHOICES["algo.name"]
    with pytest.raises(ConfigError, match="algo.name='grpo_agian' is not one of: .*grpo_again"):
        config_lib.load_config(None, [f"imports={ext}", "algo.name=grpo_agian"])


def test_a_module_name_is_imported_too(tmp_path, monkeypatch, registries):
    _write(tmp_path, "my_losses_pkg_mod.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = config_lib.load_config(None, ["imports=my_losses_pkg_mod",
                                        "algo.policy_loss=narrow_clip"])
    assert cfg.imports == ("my_losses_pkg_mod",)


@pytest.mark.parametrize("entry, needle", [
    ("missing_ext.py", "imports: file not found: missing_ext.py"),
    ("no_such_package.module", "imports: no module named 'no_such_package.module'"),
    ("broken.py", "imports: importing broken.py failed: ZeroDivisionError"),
    ("not a module", "imports: 'not a module' is neither a Python file"),
    # os._exit(0) ended the run with rc 0 and no line; a KeyboardInterrupt the file raises
    # read as the user's Ctrl-C
    ("exits.py", "imports: importing exits.py failed: it called os._exit(0) (exits.py:2)"),
    ("interrupts.py", "imports: importing interrupts.py failed: it raised KeyboardInterrupt "
                      "(not Ctrl-C) (interrupts.py:1)"),
])
def test_a_bad_import_is_one_line_naming_it(tmp_path, capsys, monkeypatch, entry, needle):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken.py").write_text("x = 1 / 0\n")
    (tmp_path / "exits.py").write_text("import os\nos._exit(0)\n")
    (tmp_path / "interrupts.py").write_text("raise KeyboardInterrupt\n")
    config = tmp_path / "tiny.py"
    config.write_text(tiny_config_source())
    assert cli.main(["train", "--config", str(config), "--workdir", str(tmp_path / "run"),
                     f"--config.imports={entry}"]) == 2
    assert needle in _one_error_line(capsys)


REWARD_FILE = '''
from rljax import rewards


def _always_one(prompts, completions, **_):
    return [1.0] * len(completions)


rewards.register("always_one", lambda: _always_one)
'''


def test_a_reward_registered_by_imported_code_resolves_in_reward_worker_processes(
        tmp_path, registries):
    ext = _write(tmp_path, "my_rewards.py", REWARD_FILE)
    cfg = config_lib.load_config(None, [f"imports={ext}", "reward.names=always_one",
                                        "reward.isolation=process"])
    reward = rewards.combine([(name, 1.0) for name in cfg.reward.names],
                             isolation=cfg.reward.isolation, timeout_s=60.0)
    try:
        result = reward(["1+1="], ["2"])
    finally:
        reward.close()
    assert list(result.total) == [1.0], result


USER_PHASE = """
from rljax.train import phases


def my_grpo(ctx, steps):
    open(__file__ + ".built", "a").write("x")   # the trainer built this phase
    return phases.ALGORITHMS["grpo"](ctx, steps)


phases.register_algorithm("my_grpo", my_grpo, programs=phases.PROGRAMS["grpo"])
"""


def test_a_phase_registered_by_imported_code_trains_from_the_cli(tmp_path, registries):
    from rljax import cli
    from tiny_config import tiny_config_source
    ext = _write(tmp_path, "my_phase.py", USER_PHASE)
    path = tmp_path / "tiny.py"
    path.write_text(tiny_config_source())
    assert cli.main(["train", "--config", str(path), "--workdir", str(tmp_path / "w"),
                     f"--config.imports={ext}", "--config.algo.name=my_grpo"]) == 0
    assert (tmp_path / "my_phase.py.built").read_text() == "x"
    assert '"reward/mean"' in (tmp_path / "w" / "metrics.jsonl").read_text()
