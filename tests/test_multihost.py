"""Multi-host (SPMD): 2 local processes x 4 CPU devices give the same GRPO run as 1 x 8.

The two runs are subprocesses (each needs its own XLA_FLAGS / jax.distributed state) started
side by side; the 2-process one goes through ``launch/local.py``, exactly as a user would.
"""
import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from rljax import distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A tiny GRPO run: 2 RL steps, 8 prompts x G=4, a 1-layer model; the length reward makes the
# rewards (and so advantages, losses and gradients) non-zero from the first step; beta > 0
# exercises the reference log-probs.
OVERRIDES = [
    "--config.steps=2", "--config.sft.steps=0", "--config.eval_every=0",
    "--config.checkpoint_every=0", "--config.rollout.batch_size=32",
    "--config.algo.num_generations=4", "--config.rollout.max_new_tokens=5",
    "--config.eval.num_examples=8", "--config.eval.batch_size=8",
    "--config.logging.tensorboard=false", "--config.model.overrides.num_layers=1",
    "--config.model.overrides.hidden_size=32", "--config.model.overrides.intermediate_size=64",
    "--config.reward.names=('arithmetic','length')",
    "--config.reward.kwargs={'length':{'max_length':5,'buffer':4}}",
    "--config.algo.beta=0.04", "--config.optimizer.learning_rate=0.01",
]
# Wall-clock and throughput differ between runs; everything else must match.
VOLATILE = ("time/", "tokens_per_s", "steps_per_s")


def _env(devices: int) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={devices} "
                        + env.get("RLJAX_TEST_COMPILER_FLAGS", "")).strip()
    for name in ("RLJAX_COORDINATOR_ADDRESS", "RLJAX_NUM_PROCESSES", "RLJAX_PROCESS_ID",
                 "RLJAX_DISTRIBUTED"):
        env.pop(name, None)
    return env


def _read(workdir) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _launch(tmp_path, devices: int, *command) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "launch", "local.py"), "-n", "2",
                             "-d", str(devices), "--log_dir", str(tmp_path / "logs"),
                             "--timeout", "900", "--", *command],
                            env=_env(devices), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _one_and_two(tmp_path, overrides) -> tuple[list, str]:
    """``rljax train`` of grpo_arithmetic.py with ``overrides`` as 1 process of 8 devices
    (workdir ``one``) and, side by side, 2 processes of 4 (``two``). Returns (the train
    command, the 2-process run's output)."""
    train = [sys.executable, "-m", "rljax.cli", "train", "--config",
             os.path.join(ROOT, "configs", "grpo_arithmetic.py"), *overrides]
    one = subprocess.Popen(train + ["--workdir", str(tmp_path / "one")], env=_env(8),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    two = _launch(tmp_path, 4, *train, "--workdir", str(tmp_path / "two"))
    # Three jax processes compile side by side: a busy machine took more than the earlier
    # 300 s. The bounds only stop a hang (a collective waiting for a dead peer).
    out_two, _ = two.communicate(timeout=1000)
    out_one, _ = one.communicate(timeout=1000)
    assert one.returncode == 0, out_one[-3000:]
    assert two.returncode == 0, out_two[-3000:]
    return train, out_two


def _compare(a: list[dict], b: list[dict]) -> None:
    """Two runs' metrics rows: the same steps and keys, the same values (floats to 1e-5)."""
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        keys = {k for k in ra if not any(v in k for v in VOLATILE)}
        assert keys == {k for k in rb if not any(v in k for v in VOLATILE)}
        for k in sorted(keys):
            x, y = ra[k], rb[k]
            if isinstance(x, float) or isinstance(y, float):
                assert math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-6), (ra["step"], k, x, y)
            else:
                assert x == y, (ra["step"], k, x, y)


def test_transfer_between_meshes_across_processes(tmp_path):
    """The sampler's copy of the policy on 2 processes: bit for bit, on the rollout devices."""
    p = _launch(tmp_path, 4, sys.executable, os.path.join(ROOT, "tests", "transfer_worker.py"))
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0 and "transfer ok" in out, out[-3000:]


# Asynchronous GRPO on 8 devices split 4/4 (data x fsdp on both meshes), checkpoint every step.
ASYNC = ["--config.steps=3", "--config.checkpoint_every=1", "--config.algo.asynchronous=true",
         "--config.algo.entropy_coef=0.01", "--config.mesh.rollout_devices=4",
         "--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.rollout.data=2",
         "--config.mesh.rollout.fsdp=2"]


@pytest.mark.slow
def test_async_split_across_two_processes_matches_one_and_resumes(tmp_path):
    """Each process gives two of its four devices to the sampler; the run equals the one on
    8 devices of one process (the sampler's and the trainer's meshes both span the two
    processes, so this is also the synchronous update's cross-process check), its checkpoints
    hold both processes' shards, and resuming from step 2 redoes step 3 exactly."""
    train, out_two = _one_and_two(tmp_path, [*OVERRIDES, *ASYNC])
    first = _read(tmp_path / "two")
    assert [r.get("rollout/sample_version") for r in first] == [0, 0, 1, None]   # + eval row
    assert first[0]["reward/std"] > 0 and first[0]["loss"] != 0   # a run that could differ
    _compare(_read(tmp_path / "one"), first)
    # Only process 0 logs; both processes wrote their shards of the collective checkpoint.
    assert "step 3/3" in out_two
    assert "step 3/3" not in (tmp_path / "logs" / "process_1.log").read_text()
    ckpt = tmp_path / "two" / "checkpoints" / "3"
    assert (ckpt / "state" / "ocdbt.process_0").exists()
    assert (ckpt / "state" / "ocdbt.process_1").exists()
    # Process 0 hashed every host's files after the commit barrier; they verify.
    files = json.loads((ckpt / "rljax_manifest.json").read_text())["files"]
    assert any(name.startswith("state/ocdbt.process_1/") for name in files)
    from rljax.train.core.manifest import verify_step_dir
    assert verify_step_dir(ckpt) is None
    meta = json.loads((ckpt / "meta" / "metadata").read_text())
    assert meta["host"]["process_count"] == 2 and meta["host"]["device_count"] == 8

    shutil.rmtree(tmp_path / "two" / "checkpoints" / "3")   # as if killed before saving it
    again = _launch(tmp_path, 4, *train, "--workdir", str(tmp_path / "two"))
    out, _ = again.communicate(timeout=1000)
    assert again.returncode == 0 and "resumed at step 2" in out, out[-3000:]
    resumed = _read(tmp_path / "two")
    assert [{k: v for k, v in r.items() if not any(s in k for s in VOLATILE)} for r in resumed] \
        == [{k: v for k, v in r.items() if not any(s in k for s in VOLATILE)} for r in first]


# The slot engine on 4 devices, its parameters on data x fsdp (both spanning the processes).
ENGINE = ["--config.rollout.engine=slots", "--config.rollout.slots=8",
          "--config.mesh.data=2", "--config.mesh.fsdp=2"]


@pytest.mark.slow
def test_slot_engine_and_partial_across_two_processes_match_one_and_resume(tmp_path):
    """GRPO on the slot engine, on its episodes (straight, and partial with asynchronous GRPO),
    on its trees (straight, and carried), on self-play (static turns, and carried on the
    engine), with in-flight weight updates, then with partial rollouts
    (``tests/engine_worker.py``), as 2 processes of 2 devices and as 1 of 4: every process
    drives the engine's host loop from the same global values (which slot refills, when a row,
    a turn or a tree's level stops), so the runs are the same (the partial episodes'
    evaluation runs the static turn batches: checked too); the partial run resumed from step 1 redoes
    step 2 exactly (the pool's groups in flight come back on both processes)."""
    worker = [sys.executable, os.path.join(ROOT, "tests", "engine_worker.py")]
    config = [os.path.join(ROOT, "configs", "grpo_arithmetic.py"), *OVERRIDES, *ENGINE]
    one = subprocess.Popen([*worker, str(tmp_path / "one"), "straight", *config], env=_env(4),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    two = _launch(tmp_path, 2, *worker, str(tmp_path / "two"), "resume", *config)
    out_two, _ = two.communicate(timeout=1000)
    out_one, _ = one.communicate(timeout=1000)
    assert one.returncode == 0, out_one[-3000:]
    assert two.returncode == 0 and "resumed at step 1" in out_two, out_two[-3000:]
    slots = _read(tmp_path / "two" / "slots")
    assert 0 < slots[0]["rollout/slot_utilisation"] < 1 and slots[0]["reward/std"] > 0
    _compare(_read(tmp_path / "one" / "slots"), slots)
    episodes = _read(tmp_path / "two" / "episodes")
    assert 0 < episodes[0]["rollout/slot_utilisation"] < 1 and episodes[0]["reward/std"] > 0
    assert 1 < episodes[1]["env/turns_mean"] < 3   # turns that end at different steps
    _compare(_read(tmp_path / "one" / "episodes"), episodes)
    carried = _read(tmp_path / "two" / "episodes_partial")
    assert carried[0]["rollout/carried_groups"] > 0 and carried[1]["rollout/staleness_max"] >= 1
    assert carried[1]["time/weight_transfer"] > 0   # asynchronous: the sampler's own devices
    _compare(_read(tmp_path / "one" / "episodes_partial"), carried)
    trees = _read(tmp_path / "two" / "tree")   # shared segments decoded once
    assert trees[0]["rollout/decoded_tokens"] < trees[0]["rollout/tokens"]
    assert trees[0]["reward/std"] > 0
    _compare(_read(tmp_path / "one" / "tree"), trees)
    carried_trees = _read(tmp_path / "two" / "tree_partial")
    assert carried_trees[0]["rollout/carried_groups"] > 0
    _compare(_read(tmp_path / "one" / "tree_partial"), carried_trees)
    for name in ("selfplay", "selfplay_partial"):   # one policy in both seats of each match
        games = _read(tmp_path / "two" / name)
        assert games[0]["env/games_X_mean"] == games[0]["env/games_O_mean"] == 0.5
        assert games[0]["reward/std"] > 0
        _compare(_read(tmp_path / "one" / name), games)
    assert _read(tmp_path / "two" / "selfplay_partial")[0]["rollout/carried_groups"] > 0
    # In-flight updates: process 1 saw update 0 finish at poll 2, process 0 at poll 3; both
    # swapped at poll 3, as one process did, and batch 1 mixes versions 0 and 1.
    swaps = [json.loads((tmp_path / run / "inflight" / f"swaps_{p}.json").read_text())
             for run, p in (("one", 0), ("two", 0), ("two", 1))]
    assert swaps == [[[1, 3]]] * 3
    inflight = _read(tmp_path / "two" / "inflight")
    assert inflight[1]["rollout/weight_swaps"] == 1
    assert 0 < inflight[1]["rollout/staleness_mean"] < 1
    _compare(_read(tmp_path / "one" / "inflight"), inflight)
    first = [json.loads(line) for line in (tmp_path / "two" / "first.jsonl").open()]
    assert first[0]["rollout/carried_groups"] > 0 and first[1]["rollout/staleness_max"] >= 1
    _compare(_read(tmp_path / "one" / "partial"), first)
    _compare(first, _read(tmp_path / "two" / "partial"))


# ----------------------------------------------------------------------------- detection

def test_detect_explicit_and_off():
    env = {"RLJAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "RLJAX_NUM_PROCESSES": "4",
           "RLJAX_PROCESS_ID": "3", "RLJAX_LOCAL_DEVICE_IDS": "0,1"}
    assert distributed.detect(env, query_metadata=False) == dict(
        coordinator_address="10.0.0.1:1234", num_processes=4, process_id=3,
        local_device_ids=[0, 1])
    assert distributed.detect({**env, "RLJAX_DISTRIBUTED": "0"}, query_metadata=False) is None
    single = {**env, "RLJAX_NUM_PROCESSES": "1", "RLJAX_PROCESS_ID": "0"}
    assert distributed.detect(single, query_metadata=False) is None
    with pytest.raises(ValueError, match="RLJAX_PROCESS_ID"):
        distributed.detect({"RLJAX_COORDINATOR_ADDRESS": "h:1", "RLJAX_NUM_PROCESSES": "2"},
                           query_metadata=False)
    with pytest.raises(ValueError, match=r"\[0, RLJAX_NUM_PROCESSES=2\)"):
        distributed.detect({**env, "RLJAX_NUM_PROCESSES": "2", "RLJAX_PROCESS_ID": "2"},
                           query_metadata=False)


@pytest.mark.parametrize("env,expected", [
    ({}, None),
    ({"RLJAX_DISTRIBUTED": "1"}, {}),
    ({"TPU_WORKER_HOSTNAMES": "w0,w1,w2,w3"}, {}),
    ({"TPU_WORKER_HOSTNAMES": "w0"}, None),
    ({"MEGASCALE_COORDINATOR_ADDRESS": "w0"}, {}),
    ({"SLURM_NTASKS": "2"}, {}),
    ({"SLURM_NTASKS": "1"}, None),
    ({"OMPI_COMM_WORLD_SIZE": "8"}, {}),
])
def test_detect_cluster_signals(env, expected):
    assert distributed.detect(env, query_metadata=False) == expected


def test_single_process_helpers():
    """Outside a multi-host run every helper is the identity / whole batch."""
    import numpy as np

    from rljax import sharding as shd

    mesh = shd.make_mesh({"data": -1})
    assert distributed.local_rows(mesh, 16) == slice(0, 16)
    x = np.arange(6.0)
    assert distributed.device_batch({"x": x}, mesh)["x"] is x
    assert distributed.rows_to_global(x, mesh, 6) is x
    np.testing.assert_array_equal(distributed.gather(x), x)
    np.testing.assert_array_equal(distributed.to_host(distributed.global_batch(x, mesh)), x)
    assert distributed.any_process(True) and not distributed.any_process(False)
    assert distributed.every_process(True) and not distributed.every_process(False)
    assert distributed.row_replication(mesh, 16) == 1
    assert distributed.initialize({}) is False
