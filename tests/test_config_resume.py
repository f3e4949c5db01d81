"""A workdir written by rljax 0.1.0 resumes: its ``config.json`` (``tests/data/config_0.1.0.json``,
the default config as 0.1.0 validated and wrote it) loads to the same config, and a config
this version cannot read is refused with one line naming the key."""
import json
import os
import shutil

from rljax import cli
from rljax import config as config_lib
from rljax.train.core import workdir as workdir_lib

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "config_0.1.0.json")


def test_a_0_1_0_config_json_loads_to_the_same_config():
    with open(FIXTURE) as f:
        saved = json.load(f)
    now = json.loads(config_lib.to_json(config_lib.load_config_json(FIXTURE)))
    # The keys added since, at the values that keep a 0.1.0 run what it was: no user code to
    # import, the static sampler, no partial rollouts, no distillation, no quantized base,
    # synchronous RL on one mesh, no role baselines, no self-play.
    assert now.pop("imports") == []
    added = ("engine", "slots", "chunk_steps", "partial", "max_staleness", "stop_strings")
    assert {k: now["rollout"].pop(k) for k in added} == {
        "engine": "static", "slots": 0, "chunk_steps": 32, "partial": False, "max_staleness": 2,
        "stop_strings": []}
    assert now["algo"].pop("distill") == {   # read by algo.name='distill' only
        "teacher": "", "teacher_step": 0, "teacher_quantize": "", "kl_weight": 1.0,
        "teacher_temperature": 1.0,   # the rollout's, as the teacher was scored then
        "reward_weight": 0.0, "jsd_weight": 0.0, "jsd_beta": 0.5, "top_k": 16}
    assert {k: now["model"].pop(k) for k in ("quantize", "quantize_block")} == {
        "quantize": "", "quantize_block": 64}   # the base as loaded
    assert {k: now["algo"].pop(k) for k in ("asynchronous", "async_lag")} == {
        "asynchronous": False, "async_lag": 1}   # synchronous RL
    assert {k: now["mesh"].pop(k) for k in ("rollout_devices", "rollout")} == {
        "rollout_devices": 0, "rollout": {"data": -1, "fsdp": 1, "expert": 1, "tensor": 1}}
    assert now["mesh"].pop("expert") == 1   # expert parallelism (mixtures of experts)
    assert now["algo"].pop("moe_aux_loss_coef") == 0.0   # mixtures of experts only
    assert now["algo"].pop("routing_replay") is False
    assert now["algo"].pop("rae_alpha") == 0.95   # read by algo.adv_estimator='rae' only
    assert now["env"].pop("selfplay") == {   # mode 'off': the environment's own opponent
        "mode": "off", "workdir": "", "step": 0, "temperature": 0.0, "forfeit_reward": 0.0}
    image_keys = ("images_field", "max_images", "max_image_pixels")
    assert {k: now["data"].pop(k) for k in image_keys} == {
        "images_field": "images", "max_images": 1,   # read only where rows carry images
        "max_image_pixels": 50_000_000}
    assert now["model"].pop("vision") == {   # a text model: no vision tower loaded
        "image_token": "<image_soft_token>", "load": False, "train": False}
    assert {k: now["rollout"].pop(k) for k in ("allocation", "knapsack")} == {
        "allocation": "uniform",   # the same G for every prompt
        "knapsack": {"budget": 0, "max_samples": 0, "min_samples": 2}}
    assert now["algo"].pop("vine") == {   # read by algo.adv_estimator='vineppo' only
        "forks": 4, "max_steps": 4, "regex": "", "splitter": "newline"}
    assert now["algo"].pop("inflight_updates") is False   # weights swap between iterations only
    # read by algo.name='prm' / the tree search only; SFT on the data's solutions
    assert now["algo"].pop("prm") == {"correct_reward": 1.0, "soft_labels": False,
                                      "step_score": "min"}
    assert now["algo"].pop("mcts") == {
        "c_puct": 1.0, "children": 4, "correct_reward": 1.0, "max_nodes": 64, "prm": "",
        "rollouts": 4, "simulations": 8, "unvisited_value": 0.0, "value": "mc",
        "refit_prm": False, "refit_updates": 1, "refit_learning_rate": 0.0}
    # read by algo.adv_estimator='grpo_process' only
    assert now["algo"].pop("process_reward") == {"prm": "", "weight": 1.0}
    assert now["sft"].pop("traces") == ""
    assert now == saved


def test_a_0_1_0_workdir_resumes_without_a_config_change(tmp_path):
    workdir = tmp_path / "run"
    os.makedirs(workdir / "checkpoints" / "2")  # as if step 2 had been saved
    shutil.copy(FIXTURE, workdir / "config.json")
    cfg, resuming, changes = workdir_lib.resolve_train_config(None, str(workdir))
    assert resuming and changes == [] and cfg.imports == ()
    # The same experiment from a config file today is the same run, not a changed one.
    path = tmp_path / "exp.py"
    path.write_text("from rljax.config import default_config\n"
                    "def get_config():\n    return default_config()\n")
    assert workdir_lib.resolve_train_config(str(path), str(workdir))[2] == []


def test_a_config_json_with_a_key_this_version_lacks_is_one_line(tmp_path, capsys):
    with open(FIXTURE) as f:
        data = json.load(f)
    data["algo"]["clip_mode"] = "token"
    (tmp_path / "config.json").write_text(json.dumps(data))
    os.makedirs(tmp_path / "checkpoints" / "2")
    assert cli.main(["eval", "--workdir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "rljax: error: unknown config key 'algo.clip_mode'"), err


def test_a_distillation_config_json_from_before_teacher_temperature_keeps_its_scoring(tmp_path):
    """A distillation run's config.json written before ``algo.distill.teacher_temperature``
    existed scored its teacher at the rollout's temperature: it loads with that temperature
    (resuming it changes nothing); a config.json that has the key keeps its value."""
    cfg = config_lib.default_config()
    cfg.update_from_flattened_dict({"algo.name": "distill", "algo.beta": 0.0,
                                    "algo.distill.teacher": "runs/demo",
                                    "rollout.temperature": 0.7})
    data = json.loads(config_lib.to_json(config_lib.validate(cfg)))
    assert data["algo"]["distill"].pop("teacher_temperature") == 1.0
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    assert config_lib.load_config_json(str(old)).algo.distill.teacher_temperature == 0.7
    data["algo"]["distill"]["teacher_temperature"] = 1.0
    new = tmp_path / "new.json"
    new.write_text(json.dumps(data))
    assert config_lib.load_config_json(str(new)).algo.distill.teacher_temperature == 1.0
