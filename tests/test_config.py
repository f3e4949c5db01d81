"""rljax.config: schema defaults, file loading, typed overrides, validation messages."""
import json
import os
import subprocess
import sys

import pytest

from rljax import config as config_lib
from rljax.config import ConfigError, default_config, load_config, load_config_json, validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_config(tmp_path, body: str, name="exp.py"):
    path = tmp_path / name
    path.write_text("from rljax.config import default_config\n" + body)
    return str(path)


def test_defaults_are_valid_and_complete():
    cfg = validate(default_config())
    for key in ("seed", "steps", "eval_every", "checkpoint_every"):
        assert key in cfg
    for section in ("model", "tokenizer", "data", "rollout", "algo", "optimizer", "reward",
                    "mesh", "logging", "sft", "checkpoint", "eval"):
        assert section in cfg
    for knob in ("num_generations", "beta", "epsilon", "epsilon_high", "loss_agg_mode",
                 "adv_estimator", "kl_estimator", "scale_rewards", "num_iterations"):
        assert knob in cfg.algo


def test_partial_file_is_laid_over_defaults(tmp_path):
    path = write_config(tmp_path, "def get_config():\n    return {'steps': 7, 'algo': {'beta': 0.0}}\n")
    cfg = load_config(path)
    assert cfg.steps == 7 and cfg.algo.beta == 0.0
    assert cfg.algo.lam == default_config().algo.lam  # untouched keys keep defaults


def test_file_arg_is_passed_to_get_config(tmp_path):
    path = write_config(tmp_path, "def get_config(arg='1'):\n    c = default_config()\n"
                        "    c.seed = int(arg)\n    return c\n")
    assert load_config(f"{path}:42").seed == 42


def test_overrides_nested_values_and_types():
    cfg = load_config(None, [
        "--config.algo.beta=0",              # int widens to float
        "--config.algo.kl_in_reward=true",
        "--config.optimizer.learning_rate=3e-5",
        "--config.algo.epsilon_high=0.28",   # placeholder(float): None -> float
        "--config.reward.names=gsm8k,format",
        "--config.reward.weights=(1.0, 0.5)",
        "--config.model.overrides.num_layers=2",  # open section: any key
        "--config.data.path=/tmp/x.jsonl",
    ])
    assert cfg.algo.beta == 0.0 and isinstance(cfg.algo.beta, float)
    assert cfg.algo.kl_in_reward is True
    assert cfg.optimizer.learning_rate == pytest.approx(3e-5)
    assert cfg.algo.epsilon_high == pytest.approx(0.28)
    assert cfg.reward.names == ("gsm8k", "format")
    assert cfg.reward.weights == (1.0, 0.5)
    assert cfg.model.overrides.num_layers == 2
    assert cfg.data.path == "/tmp/x.jsonl"


@pytest.mark.parametrize("override, needle", [
    ("algo.bta=1", "'algo.bta' (did you mean 'algo.beta'?)"),
    ("beta=1", "'beta' (did you mean 'algo.beta'?)"),
    ("optimizer.nested.deep=1", "'optimizer.nested'"),
])
def test_unknown_override_key_is_named(override, needle):
    with pytest.raises(ConfigError, match="unknown config key") as e:
        load_config(None, [override])
    assert needle in str(e.value)


def test_unknown_nested_key_in_file_is_named(tmp_path):
    path = write_config(tmp_path, "def get_config():\n    c = default_config()\n"
                        "    c.rollout.max_new_token = 64\n    return c\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "'rollout.max_new_token'" in str(e.value)
    assert "'rollout.max_new_tokens'" in str(e.value)


def test_validate_catches_unknown_key_added_in_code():
    cfg = default_config()
    cfg.algo.epsilon_hgh = 0.3
    with pytest.raises(ConfigError, match=r"'algo.epsilon_hgh' \(did you mean 'algo.epsilon_high'"):
        validate(cfg)


@pytest.mark.parametrize("override, needle", [
    ("algo.beta=abc", "algo.beta: expected float, got str"),
    ("algo.num_generations=2.5", "algo.num_generations: expected int, got float"),
    ("algo.kl_in_reward=maybe", "algo.kl_in_reward: expected true/false"),
    ("algo=3", "algo is a section"),
    ("steps=None", "steps: expected int, got None"),
])
def test_wrong_type_override(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert needle in str(e.value)


def test_none_only_where_the_default_is_none():
    cfg = load_config(None, ["algo.epsilon_high=0.3", "algo.epsilon_high=None"])
    assert cfg.algo.epsilon_high is None


def test_wrong_type_in_file(tmp_path):
    path = write_config(tmp_path, "def get_config():\n    return {'rollout': {'batch_size': '16'}}\n")
    with pytest.raises(ConfigError, match="rollout.batch_size: expected int, got str"):
        load_config(path)


@pytest.mark.parametrize("overrides, needle", [
    (["rollout.batch_size=10"], "rollout.batch_size=10 is not divisible by algo.num_generations=4"),
    (["algo.epsilon_high=0.1"], "algo.epsilon_high=0.1 must be >= algo.epsilon=0.2"),
    (["algo.name=reinforce"], "algo.name='reinforce' is not one of"),
    (["algo.kl_estimator=k9"], "algo.kl_estimator='k9' is not one of"),
    (["algo.loss_agg_mode=mean"], "algo.loss_agg_mode='mean' is not one of"),
    (["algo.num_generations=1", "rollout.batch_size=4"], "algo.num_generations=1 must be >= 2"),
    (["algo.adv_estimator=gae"], "needs a critic"),
    (["algo.mini_batch_size=8", "algo.micro_batch_size=3"], "algo.mini_batch_size=8 is not divisible"),
    (["mesh.data=-1", "mesh.fsdp=-1"], "at most one axis may be -1"),
    (["reward.weights=1,2"], "reward.weights has 2 entries but reward.names has 1"),
    (["optimizer.min_lr_ratio=2"], "optimizer.min_lr_ratio=2.0 must be in [0.0, 1.0]"),
    (["algo.clip_ratio_c=0.5"], "algo.clip_ratio_c=0.5 must be > 1"),
    (["algo.epsilon=-0.1"], "algo.epsilon=-0.1 must be >= 0"),
    (["algo.beta=-1"], "algo.beta=-1.0 must be >= 0.0"),
    (["rollout.streams=-1"], "rollout.streams=-1 must be >= 0"),
    (["algo.update_streams=-2"], "algo.update_streams=-2 must be >= 0"),
    (["algo.policy_loss=gspo", "algo.epsilon=1e-3"],
     "algo.epsilon_high=0.0004 must be >= algo.epsilon=0.001 (algo.epsilon_high not set"),
    (["data.source=jsonl"], "data.path is required"),
    (["sft.trace_noise=0.3"], "sft.trace_noise=0.3 applies to env.name='guess_number'"),
    (["sft.trace_noise=2"], "sft.trace_noise=2.0 must be in [0.0, 1.0]"),
])
def test_impossible_combinations(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert needle in str(e.value)


def test_batch_divisibility_problems_are_reported_all_at_once():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["rollout.batch_size=24", "algo.mini_batch_size=16",
                           "algo.micro_batch_size=5", "rollout.micro_batch_size=7"])
    text = str(e.value)
    assert "\n" not in text
    assert text.split("; ") == [
        "rollout.batch_size=24 is not divisible by algo.mini_batch_size=16",
        "algo.mini_batch_size=16 is not divisible by algo.micro_batch_size=5",
        "rollout.batch_size=24 is not divisible by rollout.micro_batch_size=7"]


def test_choices_can_be_extended_by_a_registry():
    with pytest.raises(ConfigError):
        load_config(None, ["algo.adv_estimator=my_adv"])
    cfg = load_config(None, ["algo.adv_estimator=my_adv"],
                      choices={"algo.adv_estimator": ("grpo", "my_adv")})
    assert cfg.algo.adv_estimator == "my_adv"


def test_missing_file_and_missing_get_config(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(str(tmp_path / "nope.py"))
    path = tmp_path / "bad.py"
    path.write_text("x = 1\n")
    with pytest.raises(ConfigError, match="no get_config"):
        load_config(str(path))


def test_json_round_trip(tmp_path):
    cfg = load_config(None, ["algo.epsilon_high=0.3", "reward.names=gsm8k,format", "steps=9"])
    path = tmp_path / "config.json"
    path.write_text(config_lib.to_json(cfg))
    assert json.loads(path.read_text())["algo"]["epsilon_high"] == 0.3
    again = load_config_json(str(path), ["seed=5"])
    assert again.steps == 9 and again.reward.names == ("gsm8k", "format") and again.seed == 5
    assert again.eval.max_new_tokens is None  # placeholder survives as null
    assert config_lib.to_json(again) == config_lib.to_json(load_config(
        None, ["algo.epsilon_high=0.3", "reward.names=gsm8k,format", "steps=9", "seed=5"]))


def test_choices_match_algorithm_registries():
    algorithms = pytest.importorskip("rljax.algorithms")
    for name in config_lib.CHOICES["algo.adv_estimator"]:
        if name != "gae":  # GAE needs values: it is not an outcome estimator
            algorithms.get_advantage_estimator(name)
    for name in config_lib.CHOICES["algo.kl_estimator"]:
        algorithms.get_kl_estimator(name)
    for name in config_lib.CHOICES["algo.policy_loss"]:
        algorithms.get_policy_loss(name)
    assert set(config_lib.CHOICES["algo.loss_agg_mode"]) == set(algorithms.AGGREGATION_MODES)
    assert set(config_lib.CHOICES["algo.loss_type"]) == set(algorithms.DPO_LOSS_TYPES)


# The built-in names of the registry-backed keys, as 0.1.0 listed them: all still accepted.
BUILTIN_NAMES = {
    "algo.name": ("grpo", "ppo", "dpo", "sft", "rm"),
    "algo.adv_estimator": ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline",
                           "reinforce_pp_seq", "reinforce_pp_baseline_seq", "gae", "treepo",
                           "rover"),
    "algo.kl_estimator": ("k1", "kl", "k2", "mse", "k3", "low_var_kl", "k3+", "k3_st", "abs"),
    "algo.loss_agg_mode": ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                           "seq-mean-token-sum-norm"),
    "algo.policy_loss": ("ppo", "vanilla", "gspo", "cispo"),
    "algo.loss_type": ("sigmoid", "ipo", "hinge", "robust", "simpo"),
    "data.selection.name": ("uniform", "online_filter", "predicted", "curriculum"),
}


@pytest.mark.parametrize("key", sorted(BUILTIN_NAMES))
def test_registries_hold_every_builtin_name(key):
    assert set(BUILTIN_NAMES[key]) <= set(config_lib.CHOICES[key])


def test_the_temperature_schedules_are_the_samplers():
    sampling = pytest.importorskip("rljax.sampling")
    assert config_lib.CHOICES["rollout.temperature_schedule.name"] == \
        sampling.TEMPERATURE_SCHEDULES


@pytest.mark.parametrize("overrides, want", [
    # (algo.beta, algo.epsilon, algo.epsilon_high) after validation
    ([], (0.04, 0.2, None)),                                   # GRPO + PPO clip
    (["algo.name=ppo", "algo.adv_estimator=gae", "algo.num_generations=1"], (0.04, 0.2, None)),
    (["algo.name=dpo"], (0.1, 0.2, None)),                     # DPO's temperature
    (["algo.policy_loss=gspo"], (0.04, 3e-4, 4e-4)),           # the GSPO paper's clip range
    (["algo.policy_loss=cispo"], (0.04, None, 0.28)),          # one-sided, as MiniMax-M1
    (["algo.name=dpo", "algo.beta=0.5"], (0.5, 0.2, None)),    # set keys are kept
    (["algo.policy_loss=gspo", "algo.epsilon=1e-3", "algo.epsilon_high=2e-3"],
     (0.04, 1e-3, 2e-3)),
    (["algo.policy_loss=gspo", "algo.epsilon_high=1e-3"], (0.04, 3e-4, 1e-3)),
    (["algo.policy_loss=cispo", "algo.epsilon=0.1"], (0.04, 0.1, 0.28)),
    (["algo.beta=0"], (0.0, 0.2, None)),
])
def test_algorithm_dependent_defaults(tmp_path, overrides, want):
    assert default_config().algo.beta is None and default_config().algo.epsilon is None
    cfg = load_config(None, overrides)
    assert (cfg.algo.beta, cfg.algo.epsilon, cfg.algo.epsilon_high) == want
    # The config a run writes (config.json) shows the values used, and reads back the same.
    saved = json.loads(config_lib.to_json(cfg))["algo"]
    assert (saved["beta"], saved["epsilon"], saved["epsilon_high"]) == want
    path = tmp_path / "config.json"
    path.write_text(config_lib.to_json(cfg))
    assert config_lib.to_json(load_config_json(str(path))) == config_lib.to_json(cfg)
    assert config_lib.resolve_defaults(cfg) == {}  # idempotent


def test_policy_loss_defaults_match_the_loss_signatures():
    import inspect
    algorithms = pytest.importorskip("rljax.algorithms")
    assert set(config_lib.POLICY_LOSS_DEFAULTS) == set(config_lib.CHOICES["algo.policy_loss"])
    for name, defaults in config_lib.POLICY_LOSS_DEFAULTS.items():
        params = inspect.signature(algorithms.get_policy_loss(name)).parameters
        for key, value in defaults.items():
            assert params[key].default == value, (name, key)


def test_check_changes_nothing_and_validate_fills_the_algorithm_defaults():
    cfg = default_config()
    config_lib.check(cfg)
    assert cfg.algo.beta is None and cfg.algo.epsilon is None
    assert validate(cfg) is cfg and (cfg.algo.beta, cfg.algo.epsilon) == (0.04, 0.2)
    bad = default_config()
    bad.algo.num_generations = 3
    with pytest.raises(ConfigError, match="not divisible by algo.num_generations=3"):
        config_lib.check(bad)
    assert bad.algo.beta is None


def test_importing_the_config_needs_neither_jax_nor_the_sampler():
    code = ("import sys, rljax.config as c; c.default_config(); "
            "print(sorted(m for m in ('jax', 'rljax.tree_sampling', 'rljax.sampling') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.stdout.strip() == "[]"


def test_registry_backed_names_are_read_when_validating(monkeypatch):
    from rljax.data import selection

    assert {"algo.name", "algo.adv_estimator", "algo.policy_loss", "algo.kl_estimator",
            "algo.loss_agg_mode", "algo.loss_type", "data.selection.name"} <= set(
        config_lib.CHOICES.registry_backed())
    with pytest.raises(ConfigError, match="data.selection.name='mine' is not one of: uniform"):
        load_config(None, ["data.selection.name=mine"])
    monkeypatch.setitem(selection.SELECTORS, "mine", selection.Selector)
    assert load_config(None, ["data.selection.name=mine"]).data.selection.name == "mine"
    assert config_lib.CHOICES["compile_for"] == ("throughput", "startup")  # a closed set


@pytest.mark.parametrize("override, want", [
    ("algo.adv_estimator=rlooo", "algo.adv_estimator='rlooo' is not one of: grpo, dr_grpo"),
    ("algo.adv_estimator=rlooo", "(did you mean 'rloo'?)"),
    ("reward.names=gsm9k", "reward.names: unknown reward 'gsm9k'; known: "),
    ("reward.names=gsm9k", "(did you mean 'gsm8k'?)"),
])
def test_unknown_registry_names_suggest_the_closest(override, want):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert want in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("overrides, message", [
    (["reward.names=overlong"],
     "reward 'overlong' needs reward.kwargs.overlong.max_length (e.g. "
     "--config.reward.kwargs.overlong.max_length=...)"),
    (["reward.names=('arithmetic', 'length')"], "reward 'length' needs "
                                                "reward.kwargs.length.max_length"),
    (["reward.names=overlong", "reward.kwargs.overlong.max_len=9"],
     "reward.kwargs.overlong.max_len is not an option of reward 'overlong' (its options: "
     "max_length, buffer, tokenizer)"),
    (["rollout.partial=true"],
     "rollout.partial=true needs rollout.engine='slots' (got 'static'): add "
     "--config.rollout.engine=slots"),
])
def test_refusals_name_the_config_key_to_set(overrides, message):
    """A reward factory's missing or unknown option and a partial rollout without its engine:
    one line naming the key, when the config is validated (before anything is built)."""
    import re
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        load_config(None, overrides)
    assert "\n" not in str(e.value)
    load_config(None, ["reward.names=overlong", "reward.kwargs.overlong.max_length=9"])


def test_the_gemma3_recipes_default_to_a_registered_seed():
    """The Gemma 3 270M recipes were measured on seeds 6, 7 and 8 (registered before the runs):
    their default seed is one of those (8), so the shipped command reproduces a listed run."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in ("grpo_gemma3_270m", "grpo_gemma3_270m_lora"):
        cfg = load_config(os.path.join(root, "configs", name + ".py"))
        assert cfg.seed == 8, name
