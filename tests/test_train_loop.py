"""The controller loop on a tiny config: phases and metrics, exact resume, determinism,
non-finite skipping."""
import json
import os

import jax
import numpy as np
import pytest

from rljax import config as config_lib
from rljax.errors import TrainingDiverged
from rljax.train import run
from rljax.train.core import checkpoint
from rljax.train.core.faults import StopSignal
from rljax.train.core.metrics import read_metrics
from rljax.train.phases.grpo import GRPOPhase
from rljax.train.core.rollout import Rollout

DEVICES = jax.devices()[:1]   # the loop itself; sharding is covered by test_train_steps
SFT_STEPS, RL_STEPS = 2, 4


def tiny_cfg(**overrides):
    cfg = config_lib.default_config()
    cfg.update_from_flattened_dict({
        "steps": RL_STEPS, "eval_every": 0, "checkpoint_every": 0,
        "model.preset": "tiny", "tokenizer.kind": "char", "data.source": "arithmetic",
        "data.max_prompt_length": 8, "rollout.batch_size": 16, "rollout.max_new_tokens": 4,
        "algo.num_generations": 4, "algo.beta": 0.04, "algo.mini_batch_size": 8,
        "optimizer.learning_rate": 1e-3, "sft.steps": SFT_STEPS, "sft.learning_rate": 1e-3,
        "sft.batch_size": 8, "sft.max_length": 12, "eval.num_examples": 8,
        "eval.batch_size": 8, "logging.tensorboard": False, "checkpoint.async_save": False,
    })
    cfg.model.overrides = {"num_layers": 1, "hidden_size": 32, "intermediate_size": 64,
                           "num_heads": 2, "num_kv_heads": 1}
    cfg.data.kwargs = {"digits": 1, "eval_examples": 8}
    cfg.update_from_flattened_dict(overrides)
    return config_lib.validate(cfg)


def comparable(records):
    """Metrics without wall-clock values."""
    return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "tokens_per_s"}
            for r in records]


def final_params(workdir):
    with checkpoint.CheckpointManager(checkpoint.checkpoint_dir(workdir)) as ckpt:
        state = ckpt.restore().state
    return jax.tree.map(np.asarray, state["params"])


class StopAfter(StopSignal):
    """Requests a stop after ``n`` loop iterations (as a SIGTERM would)."""

    def __init__(self, n):
        super().__init__(quiet=True)
        self.n = n

    def should_stop(self, sync=False):
        self.n -= 1
        if self.n <= 0:
            self.request_stop()
        return super().should_stop(sync)


def resumes_exactly(make_cfg, tmp_path, stop_after: int, devices=None) -> tuple[str, str]:
    """Trains ``make_cfg()`` straight and again stopped after ``stop_after`` iterations then
    resumed, and asserts the two runs' metrics (wall-clock values aside) and final parameters
    are equal. Returns the two workdirs (straight, resumed)."""
    devices = DEVICES if devices is None else devices
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    assert run.train(make_cfg(), straight, devices=devices) == 0
    assert run.train(make_cfg(), split, devices=devices, stop=StopAfter(stop_after)) == 0
    assert run.train(make_cfg(), split, devices=devices) == 0
    assert comparable(read_metrics(split)) == comparable(read_metrics(straight))
    jax.tree.map(np.testing.assert_array_equal, final_params(split), final_params(straight))
    return straight, split


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("straight"))
    assert run.train(tiny_cfg(), workdir, devices=DEVICES) == 0
    return workdir


def test_phases_metrics_and_workdir(straight):
    records = read_metrics(straight)
    steps = [r["step"] for r in records]
    assert steps == sorted(steps) and steps[-1] == SFT_STEPS + RL_STEPS
    evals = [r for r in records if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [SFT_STEPS, SFT_STEPS + RL_STEPS]
    rl = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in rl] == list(range(SFT_STEPS + 1, SFT_STEPS + RL_STEPS + 1))
    for key in ("loss", "pg_loss", "clipfrac_low", "clipfrac_high", "approx_kl", "kl_ref",
                "entropy", "grad_norm", "reward/std", "reward/arithmetic/mean", "adv/std",
                "completion/length_mean", "completion/length_max", "completion/truncated_frac",
                "rollout/logp_diff_mean", "time/rollout", "time/reward", "time/update",
                "tokens_per_s"):
        assert key in rl[0], key
    # The trainer's recomputed log-probs agree with the sampler's (same params, same math).
    assert rl[0]["rollout/logp_diff_max"] < 1e-4
    sft = [r for r in records if "sft/loss" in r]
    assert [r["step"] for r in sft] == list(range(1, SFT_STEPS + 1))
    assert json.load(open(os.path.join(straight, "config.json")))["steps"] == RL_STEPS
    assert os.path.isfile(os.path.join(straight, "char_tokenizer.json"))
    with checkpoint.CheckpointManager(checkpoint.checkpoint_dir(straight)) as ckpt:
        assert ckpt.latest_step() == SFT_STEPS + RL_STEPS


def test_eval_at_start_evaluates_the_starting_policy_once(tmp_path):
    """``eval_at_start``: step 0 is the untrained policy's held-out accuracy; a resumed run
    does not evaluate at its start again."""
    workdir = str(tmp_path / "run")
    cfg = tiny_cfg(**{"sft.steps": 0, "steps": 1, "eval_at_start": True})
    assert run.train(cfg, workdir, devices=DEVICES) == 0
    cfg = tiny_cfg(**{"sft.steps": 0, "steps": 2, "eval_at_start": True})
    assert run.train(cfg, workdir, devices=DEVICES) == 0
    assert [r["step"] for r in read_metrics(workdir) if "eval/accuracy" in r] == [0, 1, 2]


def test_stop_and_resume_equals_straight_run(straight, tmp_path):
    workdir = str(tmp_path)
    # Stop in the middle of the RL phase, then resume to the end.
    stop_at = SFT_STEPS + RL_STEPS // 2
    assert run.train(tiny_cfg(), workdir, devices=DEVICES, stop=StopAfter(stop_at)) == 0
    with checkpoint.CheckpointManager(checkpoint.checkpoint_dir(workdir)) as ckpt:
        assert ckpt.latest_step() == stop_at
    assert max(r["step"] for r in read_metrics(workdir)) == stop_at
    assert run.train(tiny_cfg(), workdir, devices=DEVICES) == 0
    # Same seed, run twice (once in two parts): identical metrics and parameters.
    assert comparable(read_metrics(workdir)) == comparable(read_metrics(straight))
    jax.tree.map(np.testing.assert_array_equal, final_params(workdir), final_params(straight))


def test_prefetching_the_next_prompts_changes_no_result(straight, tmp_path, monkeypatch):
    """GRPO draws the next prompt batch while the update runs: the same run without the
    prefetch has identical metrics and parameters; every RL step reports time/host_frac."""
    monkeypatch.setattr(GRPOPhase, "prefetch", False)
    workdir = str(tmp_path)
    assert run.train(tiny_cfg(), workdir, devices=DEVICES) == 0
    assert comparable(read_metrics(workdir)) == comparable(read_metrics(straight))
    jax.tree.map(np.testing.assert_array_equal, final_params(workdir), final_params(straight))
    rl = [r for r in read_metrics(straight) if "reward/mean" in r]
    assert all(0.0 <= r["time/host_frac"] <= 1.0 and r["time/prefetch"] >= 0 for r in rl)


def test_non_finite_steps_are_skipped_counted_and_stop_the_run(tmp_path, monkeypatch):
    original = Rollout.advantages
    poisoned = {SFT_STEPS + 2}  # RL step 2 (global step 4) gets NaN advantages

    def advantages(self, rewards, **kw):
        adv = original(self, rewards, **kw)
        calls.append(1)
        return adv * np.nan if SFT_STEPS + len(calls) in poisoned else adv

    calls = []
    monkeypatch.setattr(Rollout, "advantages", advantages)
    cfg = tiny_cfg(**{"sft.steps": SFT_STEPS, "algo.mini_batch_size": 0})
    assert run.train(cfg, str(tmp_path / "a"), devices=DEVICES) == 0
    rl = [r for r in read_metrics(str(tmp_path / "a")) if "reward/mean" in r]
    assert [r["skipped"] for r in rl] == [0, 1, 0, 0]
    assert rl[-1]["train/skipped_total"] == 1

    calls.clear()
    poisoned.update(range(SFT_STEPS + 1, SFT_STEPS + RL_STEPS + 1))  # every step
    cfg = tiny_cfg(**{"optimizer.max_consecutive_nonfinite": 2})
    with pytest.raises(TrainingDiverged, match="2 consecutive"):
        run.train(cfg, str(tmp_path / "b"), devices=DEVICES)


def test_reinforce_pp_gets_token_level_advantages_with_a_per_token_kl(tmp_path, monkeypatch):
    # REINFORCE++-baseline with the KL in the reward: the rollout hands the estimator the
    # loss mask and the per-token KL, and the update trains on [R, N] advantages equal to the
    # paper's formula (group-centred score on the last token, -beta * KL_t on every token,
    # return-to-go, whitening over all tokens).
    original, seen = Rollout.advantages, []

    def advantages(self, rewards, **kw):
        adv = original(self, rewards, **kw)
        seen.append((np.asarray(rewards), kw["mask"], kw["token_kl"], adv))
        return adv

    monkeypatch.setattr(Rollout, "advantages", advantages)
    beta, g = 0.5, 4
    cfg = tiny_cfg(**{"sft.steps": 0, "steps": 2, "algo.adv_estimator": "reinforce_pp_baseline",
                      "algo.kl_in_reward": True, "algo.kl_estimator": "k1",
                      "algo.beta": beta, "algo.mini_batch_size": 0,
                      # the untrained model scores 0 everywhere: the entropy bonus moves
                      # the policy in step 1 so that step 2 sees a KL to the reference
                      "algo.entropy_coef": 0.1, "optimizer.learning_rate": 1e-2})
    assert run.train(cfg, str(tmp_path), devices=DEVICES) == 0
    rewards, mask, kl, adv = seen[-1]   # step 2: the policy has moved off the reference
    assert adv.shape == mask.shape == kl.shape and np.abs(kl[mask]).max() > 0
    centred = (rewards.reshape(-1, g) - rewards.reshape(-1, g).mean(1, keepdims=True)).ravel()
    ret = np.zeros(mask.shape)
    for i in range(len(rewards)):
        idx = np.flatnonzero(mask[i])
        running = 0.0
        for t in idx[::-1]:
            running += -beta * float(kl[i, t]) + (centred[i] if t == idx[-1] else 0.0)
            ret[i, t] = running
    vals = ret[mask]
    want = np.where(mask, (ret - vals.mean()) / (vals.std() + 1e-8), 0.0)
    np.testing.assert_allclose(adv, want, rtol=1e-4, atol=1e-5)
    rl = [r for r in read_metrics(str(tmp_path)) if "reward/mean" in r]
    assert len(rl) == 2 and all(np.isfinite(r["loss"]) and r["skipped"] == 0 for r in rl)
    assert rl[-1]["kl_ref_seq"] != 0.0
