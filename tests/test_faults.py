"""Graceful stop: SIGTERM/SIGINT set a flag; the loop checkpoints and exits (0 / 130)."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from rljax.train.faults import EXIT_INTERRUPTED, EXIT_PREEMPTED, StopSignal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A tiny training loop using the fault handler and the checkpoint manager, as run.py will.
LOOP = textwrap.dedent(f"""
    import sys, time
    sys.path.insert(0, {ROOT!r})
    import jax.numpy as jnp
    from rljax.train.checkpoint import CheckpointManager
    from rljax.train.faults import StopSignal

    directory, step_time, last_step_time = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    with StopSignal() as stop, CheckpointManager(directory) as ckpt:
        state = {{"w": jnp.zeros((4,)), "step": jnp.int32(0)}}
        for step in range(1, 10_000):
            state = {{"w": state["w"] + 1.0, "step": jnp.int32(step)}}
            print(f"step {{step}}", flush=True)
            time.sleep(step_time if step < 3 else last_step_time)
            if stop.should_stop(sync=True):
                ckpt.save(step, state, {{"reason": stop.reason}})
                break
    sys.exit(stop.exit_code)
""")


def start_loop(directory, step_time, last_step_time=None):
    """Starts LOOP; steps from the 3rd on take ``last_step_time`` (default ``step_time``)."""
    last_step_time = step_time if last_step_time is None else last_step_time
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.Popen([sys.executable, "-c", LOOP, str(directory), str(step_time),
                             str(last_step_time)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    seen = []
    for _ in range(3):  # let it get through a few steps, so the handler is installed
        seen.append(proc.stdout.readline())
        assert seen[-1].startswith("step"), proc.stderr.read()
    return proc, seen


def restore(directory):
    from rljax.train.checkpoint import CheckpointManager

    with CheckpointManager(directory) as ckpt:
        return ckpt.restore()


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, EXIT_PREEMPTED),
                                       (signal.SIGINT, EXIT_INTERRUPTED)])
def test_signal_saves_checkpoint_and_exits(tmp_path, sig, code):
    proc, seen = start_loop(tmp_path, step_time=0.05)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err[-2000:]
    lines = [l for l in "".join(seen).splitlines() + out.splitlines() if l.startswith("step")]
    last_step = int(lines[-1].split()[1])
    restored = restore(tmp_path)
    assert restored.step == last_step == int(restored.state["step"])
    assert float(restored.state["w"][0]) == last_step
    assert restored.meta["reason"] == signal.Signals(sig).name
    assert "stopping after this step" in err


def test_second_ctrl_c_exits_immediately(tmp_path):
    proc, _ = start_loop(tmp_path, step_time=0.05, last_step_time=60.0)  # a 1-minute step
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == EXIT_INTERRUPTED, err[-2000:]
    assert time.monotonic() - start < 20
    assert "exiting now" in err
    assert not any(name.isdigit() for name in os.listdir(tmp_path))  # nothing half-saved


def test_in_process_flag_and_restore_previous_handler():
    previous = signal.getsignal(signal.SIGTERM)
    with StopSignal(quiet=True) as stop:
        assert not stop.should_stop() and stop.reason is None
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # the handler runs at the next bytecode boundary
        assert stop.should_stop() and stop.should_stop(sync=True)
        assert stop.reason == "SIGTERM" and stop.exit_code == 0
    assert signal.getsignal(signal.SIGTERM) is previous
    manual = StopSignal()
    manual.request_stop()
    assert manual.should_stop() and manual.exit_code == 0
