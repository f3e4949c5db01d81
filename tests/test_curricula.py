"""docs/curricula.md's other pieces: the Lite PPO preset (its advantages against the written-out
formula) and the measurement harness's bookkeeping (bench/curricula.py: sampled tokens per
evaluation, accuracy at equal tokens, method specs)."""
import importlib.util
import os

import jax.numpy as jnp
import numpy as np
import pytest

from rljax import algorithms
from rljax import config as config_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench():
    spec = importlib.util.spec_from_file_location(
        "curricula_bench", os.path.join(ROOT, "bench", "curricula.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lite_ppo_preset_is_group_mean_batch_std_token_mean():
    cfg = config_lib.load_config(os.path.join(ROOT, "configs/grpo_arithmetic_lite_ppo.py"))
    a = cfg.algo
    assert (a.adv_estimator, a.scale_rewards, a.loss_agg_mode, a.policy_loss, a.beta,
            a.dynamic_sampling) == ("grpo", "batch", "token-mean", "ppo", 0.0, False)
    g = 4
    rewards = np.array([1, 0, 0, 0, 1, 1, 1, 1, 0, 1, 0.5, 0], np.float32)
    adv = np.asarray(algorithms.get_advantage_estimator(a.adv_estimator)(
        jnp.asarray(rewards), g, scale_rewards=a.scale_rewards))
    # Written out: subtract each group's mean; divide by the (unbiased) std of all 12 rewards.
    groups = rewards.reshape(3, g).astype(np.float64)
    centred = groups - groups.mean(axis=1, keepdims=True)
    expected = centred / (np.std(rewards.astype(np.float64), ddof=1) + 1e-6)
    np.testing.assert_allclose(adv, expected.reshape(-1), rtol=1e-6, atol=1e-6)
    assert np.all(adv[4:8] == 0.0)   # an all-equal group carries no signal


def test_curve_counts_sampled_tokens_up_to_each_evaluation():
    bench = _bench()
    records = [{"step": 10, "eval/accuracy": 0.05}, {"step": 20, "eval/accuracy": 0.1},
               {"step": 21, "rollout/tokens": 100}, {"step": 22, "rollout/tokens": 50},
               {"step": 22, "eval/accuracy": 0.2}, {"step": 23, "rollout/tokens": 70},
               {"step": 24, "rollout/tokens": 30}, {"step": 24, "eval/accuracy": 0.4}]
    points = bench.curve(records)
    # The SFT-time evaluations (0 tokens) collapse to the last one, the RL start.
    assert [(p["step"], p["tokens"], p["accuracy"]) for p in points] == [
        (20, 0, 0.1), (22, 150, 0.2), (24, 250, 0.4)]
    assert bench.accuracy_at(points, 0) == 0.1
    assert bench.accuracy_at(points, 150) == 0.2
    assert bench.accuracy_at(points, 200) == pytest.approx(0.3)   # halfway 150 -> 250
    assert bench.accuracy_at(points, 251) is None                 # never sampled that many


def test_summary_compares_methods_at_the_same_tokens():
    bench = _bench()
    run = lambda m, s, acc: {"method": m, "seed": s, "rl_steps": 10, "cpu_s": 5.0,  # noqa
                             "points": [{"step": 0, "tokens": 0, "accuracy": 0.1},
                                        {"step": 9, "tokens": 1000, "accuracy": acc}]}
    runs = [run("plain", 0, 0.2), run("plain", 1, 0.4), run("x", 0, 0.5), run("x", 1, 0.5)]
    rows = bench.summary(runs, ["plain", "x"], budget=1000)
    assert rows[0]["acc@1"] == pytest.approx((0.3, np.std([0.2, 0.4], ddof=1)))
    assert rows[1]["acc@0.5"] == pytest.approx((0.3, 0.0))
    text = bench.table(rows, 1000)
    assert "| x | 2 |" in text and "+20.0" in text
    # A run that stopped short of the budget has no accuracy there.
    short = [dict(run("x", 0, 0.5), points=[{"step": 0, "tokens": 0, "accuracy": 0.1}])]
    assert bench.summary(short, ["x"], budget=1000)[0]["acc@1"] is None


def test_included_runs_fill_in_only_missing_method_seeds():
    bench = _bench()
    mine = [{"method": "x", "seed": 0, "acc": 1}]
    other = [{"method": "x", "seed": 0, "acc": 2}, {"method": "plain", "seed": 0, "acc": 3},
             {"method": "plain", "seed": 0, "acc": 4}]  # a second file with the same run
    merged = bench.with_included(mine, other)
    assert [(r["method"], r["acc"]) for r in merged] == [("x", 1), ("plain", 3)]
    assert mine == [{"method": "x", "seed": 0, "acc": 1}]  # not modified in place


def test_method_specs_become_overrides_and_config_files():
    bench = _bench()
    name, items = bench.parse_method("hint=algo.beta=0.1;@configs/x.py")
    assert name == "hint" and items == ["algo.beta=0.1", "@configs/x.py"]
    cmd = bench.command(items, 2, "/tmp/w", ["steps=5"], "configs/grpo_arithmetic.py", 100, 10)
    assert cmd[cmd.index("--config") + 1] == "configs/x.py"
    assert cmd[-1] == "--config.algo.beta=0.1" and "--config.seed=2" in cmd
    assert cmd.index("--config.steps=100") > cmd.index("--config.steps=5")  # cap wins


def test_second_half_mean_averages_interpolated_accuracy_and_is_compared_to_plain():
    bench = _bench()
    points = [{"step": 0, "tokens": 0, "accuracy": 0.0},
              {"step": 5, "tokens": 500, "accuracy": 0.2},
              {"step": 9, "tokens": 1000, "accuracy": 0.4}]
    # Linear from 0.2 at 500 to 0.4 at 1000: the mean over [500, 1000] is 0.3.
    assert bench.mean_accuracy(points, 500, 1000) == pytest.approx(0.3)
    assert bench.mean_accuracy(points, 500, 1001) is None   # never sampled that many
    run = lambda m, s, acc: {"method": m, "seed": s, "rl_steps": 10, "cpu_s": 5.0,  # noqa
                             "points": [{"step": 0, "tokens": 0, "accuracy": 0.1},
                                        {"step": 5, "tokens": 500, "accuracy": acc},
                                        {"step": 9, "tokens": 1000, "accuracy": acc}]}
    rows = bench.summary([run("plain", 0, 0.2), run("x", 0, 0.3)], ["plain", "x"], 1000)
    assert rows[1]["mean@half"] == pytest.approx((0.3, 0.0))
    assert "| x | 1 | 10.0 ± 0.0 | 20.0 ± 0.0 | 30.0 ± 0.0 | 30.0 ± 0.0 | +10.0 | +10.0 |" in \
        bench.table(rows, 1000)
