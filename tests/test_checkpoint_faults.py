"""Checkpoint faults users hit: damaged files (detected, reported, fallback), a checkpoint folder
that cannot be written (one line, no hang), save-then-message ordering, one run per workdir,
stop during eval, and the small items (max_to_keep after a kill, the phase's LR key)."""
import glob
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.errors import TrainingDiverged
from rljax.train import run
from rljax.train.core import checkpoint
from rljax.train.core.checkpoint import CheckpointManager
from rljax.train.core.faults import StopSignal
from rljax.train.core.metrics import read_metrics

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_train_loop import (DEVICES, RL_STEPS, SFT_STEPS, StopAfter, comparable,  # noqa: E402
                             final_params, tiny_cfg)
from test_train_cli import rljax, tiny_config  # noqa: E402,F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOTAL = RL_STEPS   # the damage tests' runs: RL from the start, a checkpoint every step


def biggest_data_file(step_dir):
    files = glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True)
    return max(files, key=os.path.getsize)


def damage(path, how):
    if how == "truncate":
        os.truncate(path, os.path.getsize(path) // 2)
    elif how == "delete":
        os.remove(path)
    elif how == "garble":  # 4 KB of random bytes, size unchanged
        data = bytearray(open(path, "rb").read())
        at = len(data) // 4
        data[at:at + 4096] = os.urandom(min(4096, len(data) - at))
        open(path, "wb").write(bytes(data))
    elif how == "bitflip":
        data = bytearray(open(path, "rb").read())
        data[len(data) // 2] ^= 1
        open(path, "wb").write(bytes(data))


# ----------------------------------------------------------------------------- integrity

@pytest.mark.parametrize("how", ["truncate", "delete", "garble", "bitflip"])
def test_damage_after_commit_is_detected_naming_step_and_file(tmp_path, how):
    state = {"w": jax.random.normal(jax.random.PRNGKey(0), (128, 128)), "b": jnp.arange(5.0)}
    with CheckpointManager(tmp_path, max_to_keep=3) as ckpt:
        ckpt.save(1, state, {"i": 1}, wait=True)
        ckpt.save(2, state, {"i": 2}, wait=True)
        assert ckpt.verify(1) is None and ckpt.verify(2) is None
    target = biggest_data_file(tmp_path / "2")
    damage(target, how)
    with CheckpointManager(tmp_path) as ckpt:
        problem = ckpt.verify(2)
        assert problem is not None and os.path.basename(target) in problem, problem
        assert ckpt.verify(1) is None
        moved = ckpt.move_aside(2)
        assert ckpt.all_steps() == [1] and os.path.isdir(moved)  # moved, not deleted


def test_damaged_latest_falls_back_and_equals_uninterrupted_run(tmp_path, capsys):
    workdir = str(tmp_path / "run")
    cfg = tiny_cfg(**{"sft.steps": 0, "checkpoint_every": 1, "checkpoint.max_to_keep": 10})
    assert run.train(cfg, workdir, devices=DEVICES) == 0
    reference = final_params(workdir), comparable(read_metrics(workdir))
    ckpt_dir = checkpoint.checkpoint_dir(workdir)

    # Garble the latest checkpoint after it was committed: the resumed run must notice it,
    # move it aside, resume from the previous one and redo the last step exactly.
    damage(biggest_data_file(os.path.join(ckpt_dir, str(TOTAL))), "garble")
    capsys.readouterr()
    cfg3 = tiny_cfg(**{"sft.steps": 0, "checkpoint_every": 1, "checkpoint.max_to_keep": 3})
    seen = {}

    class Watch(StopSignal):
        def should_stop(self, sync=False):
            seen.setdefault("steps", sorted(int(n) for n in os.listdir(ckpt_dir) if n.isdigit()))
            return super().should_stop(sync)

    assert run.train(cfg3, workdir, devices=DEVICES, stop=Watch(quiet=True)) == 0
    err = capsys.readouterr().err
    assert f"checkpoint {TOTAL} is damaged: state/" in err
    assert f"WARNING: moved damaged checkpoint {TOTAL} aside" in err
    assert f"resumed at step {TOTAL - 1}" in err
    assert os.path.isdir(os.path.join(ckpt_dir, f"{TOTAL}.damaged"))
    assert seen["steps"] == [TOTAL - 2, TOTAL - 1, TOTAL]  # max_to_keep=3 of the new config
    jax.tree.map(np.testing.assert_array_equal, final_params(workdir), reference[0])
    assert comparable(read_metrics(workdir)) == reference[1]

    # Fallback off: one line naming the step and file; nothing is moved.
    damage(biggest_data_file(os.path.join(ckpt_dir, str(TOTAL))), "truncate")
    off = tiny_cfg(**{"sft.steps": 0, "checkpoint.fallback_on_damage": False})
    with pytest.raises(checkpoint.CheckpointDamaged, match=f"checkpoint {TOTAL} is damaged: state/"):
        run.train(off, workdir, devices=DEVICES)
    assert os.path.isdir(os.path.join(ckpt_dir, str(TOTAL)))

    # --checkpoint STEP: resume from an older step; the later ones are moved aside.
    assert run.train(cfg3, workdir, devices=DEVICES, checkpoint=TOTAL - 2) == 0
    assert os.path.isdir(os.path.join(ckpt_dir, f"{TOTAL}.discarded"))
    jax.tree.map(np.testing.assert_array_equal, final_params(workdir), reference[0])
    assert comparable(read_metrics(workdir)) == reference[1]


# ----------------------------------------------------------------------------- cannot write

# Makes orbax's creation of a step's tmp directory fail, as a read-only folder or a full disk
# does, after the start-up write probe passed (the path that used to hang forever).
FAILING_MKDIR = textwrap.dedent("""
    import errno, os, sys
    from orbax.checkpoint._src.path import async_path
    code = getattr(errno, sys.argv.pop(1))
    original = async_path.mkdir
    async def mkdir(path, *args, **kwargs):
        if "orbax-checkpoint-tmp" in str(path):
            raise OSError(code, os.strerror(code), str(path))
        return await original(path, *args, **kwargs)
    async_path.mkdir = mkdir
    from rljax.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def test_unwritable_checkpoint_is_one_line_and_does_not_hang(tiny_config, tmp_path):
    code, text = "EACCES", "Permission denied"   # a full disk: the test below
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
               XLA_FLAGS=os.environ.get("RLJAX_TEST_COMPILER_FLAGS", ""))
    proc = subprocess.Popen(
        [sys.executable, "-c", FAILING_MKDIR, code, "train", "--config", tiny_config,
         "--workdir", str(tmp_path / "w"), "--config.steps=2"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # A hang is forever; 600 s leaves room for compiling on a busy machine.
        _, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("rljax train hung after a failed checkpoint write")
    assert proc.returncode == 1, err[-3000:]
    errors = [ln for ln in err.splitlines() if ln.startswith("rljax: error:")]
    assert len(errors) == 1 and "cannot write checkpoint" in errors[0] and text in errors[0]
    assert str(tmp_path / "w" / "checkpoints") in errors[0]
    assert "Traceback" not in err, err[-3000:]


def test_a_full_disk_is_named_in_the_write_error(tmp_path, monkeypatch):
    """The same failed write as above, ENOSPC: the error names the disk being full, the step
    and the folder (the run's one line is that error's text; the subprocess test above checks
    the line, the exit and that nothing hangs)."""
    import errno

    from orbax.checkpoint._src.path import async_path

    original = async_path.mkdir

    async def mkdir(path, *args, **kwargs):
        if "orbax-checkpoint-tmp" in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return await original(path, *args, **kwargs)

    monkeypatch.setattr(async_path, "mkdir", mkdir)
    with CheckpointManager(tmp_path / "checkpoints", async_save=False) as ckpt:
        with pytest.raises(checkpoint.CheckpointWriteError) as e:
            ckpt.save(2, {"w": jnp.ones((4,))}, {"phase": 0}, wait=True)
    message = str(e.value)
    assert "cannot write checkpoint (step 2)" in message
    assert "No space left on device" in message and str(tmp_path / "checkpoints") in message


# ----------------------------------------------------------------------------- ordering

def test_save_wait_waits_for_the_same_step_in_flight(tmp_path):
    big = {"w": jnp.ones((2048, 4096))}  # 32 MiB: still being written when save() returns
    with CheckpointManager(tmp_path, async_save=True) as ckpt:
        assert ckpt.save(3, big)
        assert ckpt.save(3, big, wait=True) is False  # already in flight: wait, do not re-save
        assert os.path.isdir(tmp_path / "3")  # committed when save(wait=True) returned
        assert ckpt.verify(3) is None


STOP_THEN_SLOW_CLOSE = textwrap.dedent(f"""
    import sys, time
    sys.path.insert(0, {os.path.join(ROOT, "tests")!r})
    from test_train_loop import DEVICES, StopAfter, tiny_cfg
    from rljax.train import run
    from rljax.train.core import checkpoint
    original = checkpoint.CheckpointManager.close
    def close(self):
        print("closing", file=sys.stderr, flush=True)
        time.sleep(120)
        original(self)
    checkpoint.CheckpointManager.close = close
    sys.exit(run.train(tiny_cfg(**{{"sft.steps": 1}}), sys.argv[1], devices=DEVICES,
                       stop=StopAfter(1)))
""")


def test_second_signal_while_closing_exits_130(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
               XLA_FLAGS=os.environ.get("RLJAX_TEST_COMPILER_FLAGS", ""))
    proc = subprocess.Popen([sys.executable, "-c", STOP_THEN_SLOW_CLOSE, str(tmp_path)],
                            env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines = []
    for line in proc.stderr:  # until close() starts (bounded by the run itself)
        lines.append(line)
        if line.startswith("closing"):
            break
    assert any("stopped by SIGTERM at step 1" in ln for ln in lines), "".join(lines)[-3000:]
    assert os.path.isdir(tmp_path / "checkpoints" / "1")  # saved before the message
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 130


# ----------------------------------------------------------------------------- lock

HOLD_LOCK = textwrap.dedent("""
    import sys, time
    from rljax.train.core import workdir
    workdir.lock(sys.argv[1])
    print("locked", flush=True)
    time.sleep(600)
""")


def test_second_train_on_a_workdir_in_use_refuses_and_kill_frees_it(tiny_config, tmp_path):
    workdir = str(tmp_path / "w")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
               XLA_FLAGS=os.environ.get("RLJAX_TEST_COMPILER_FLAGS", ""))
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, workdir], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        proc = rljax("train", "--config", tiny_config, "--workdir", workdir, "--config.steps=1")
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 75, err[-3000:]
        lines = [ln for ln in err.splitlines() if ln.startswith("rljax: error:")]
        assert len(lines) == 1 and "in use by another `rljax train`" in lines[0]
        assert f"pid {holder.pid}" in lines[0]
        assert not os.path.exists(os.path.join(workdir, "config.json"))  # not overwritten
        assert not os.path.exists(os.path.join(workdir, "checkpoints"))
    finally:
        holder.kill()  # SIGKILL: the kernel drops the flock with the process
        holder.wait(timeout=60)
    from rljax.train.core import workdir as wd

    release = wd.lock(workdir)  # a killed holder never leaves the lock stuck
    release()


# ----------------------------------------------------------------------------- eval

class StopInEval(StopSignal):
    """Ctrl-C arriving while the eval after the warm-up runs (between its batches)."""

    def poll(self, sync=False):
        self.request_stop(signal.SIGINT)
        return super().poll(sync)


def test_checkpoint_before_eval_and_stop_during_eval(tmp_path, capsys):
    workdir = str(tmp_path)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:  # an aborted attempt's rows
        f.writelines(json.dumps({"step": s, "stale": 1}) + "\n" for s in (1, 2, 9))
    cfg = tiny_cfg(**{"eval.batch_size": 4, "logging.console_every_s": 0.0})
    assert run.train(cfg, workdir, devices=DEVICES, stop=StopInEval(quiet=True)) == 130
    err = capsys.readouterr().err
    assert "eval stopped after 0/8 examples" in err and "stopped by SIGINT" in err
    with CheckpointManager(checkpoint.checkpoint_dir(workdir)) as ckpt:
        assert ckpt.all_steps() == [SFT_STEPS]  # the trained steps are saved
        assert ckpt.restore_meta()["eval_pending"] is True
    records = read_metrics(workdir)
    assert not any("stale" in r for r in records)
    assert [r["step"] for r in records] == [1, 2] and not any("eval/accuracy" in r for r in records)

    # The resumed run first does the eval it owes (with progress lines), then goes on.
    assert run.train(cfg, workdir, devices=DEVICES, stop=StopAfter(1)) == 0
    assert "eval: 4/8 examples" in capsys.readouterr().err
    records = read_metrics(workdir)
    assert [(r["step"], "eval/accuracy" in r) for r in records] == [
        (1, False), (2, False), (2, True), (3, False)]


# ----------------------------------------------------------------------------- small items

def test_prune_extra_checkpoints_left_by_a_kill(tmp_path):
    with CheckpointManager(tmp_path, max_to_keep=10) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save(step, {"w": jnp.full((3,), float(step))}, wait=True)
    with CheckpointManager(tmp_path, max_to_keep=3) as ckpt:
        assert ckpt.prune() == [1]
        assert ckpt.all_steps() == [2, 3, 4]


def test_non_finite_stop_names_the_warmup_learning_rate(tmp_path, monkeypatch):
    from rljax.train.phases.sft import SFTPhase

    monkeypatch.setattr(SFTPhase, "iteration", lambda self, state, step: (state, {"skipped": 1}))
    cfg = tiny_cfg(**{"optimizer.max_consecutive_nonfinite": 1})
    with pytest.raises(TrainingDiverged, match=r"Lower sft\.learning_rate"):
        run.train(cfg, str(tmp_path), devices=DEVICES)
