"""Graceful stop: SIGTERM/SIGINT set a flag; the loop checkpoints and exits (0 / 130)."""
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from rljax.train.core.faults import EXIT_INTERRUPTED, EXIT_PREEMPTED, StopSignal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A tiny training loop using the fault handler and the checkpoint manager, as run.py will.
LOOP = textwrap.dedent(f"""
    import sys, time
    sys.path.insert(0, {ROOT!r})
    import jax.numpy as jnp
    from rljax.train.core.checkpoint import CheckpointManager
    from rljax.train.core.faults import StopSignal

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


def read_until(proc, stream, needle, limit_s=300):
    """Lines of ``stream`` up to the first one containing ``needle``.

    Waits for the child to say where it is instead of sleeping for a guessed time. The limit
    only catches a hang: the watchdog kills the child, readline() returns "" and this fails.
    """
    watchdog = threading.Timer(limit_s, proc.kill)
    watchdog.start()
    lines = []
    try:
        while not lines or needle not in lines[-1]:
            lines.append(stream.readline())
            if not lines[-1]:
                proc.kill()
                raise AssertionError(f"the child ended before printing {needle!r}:\n"
                                     + "".join(lines) + proc.stderr.read()[-3000:])
    finally:
        watchdog.cancel()
    return lines


def start_loop(directory, step_time, last_step_time=None):
    """Starts LOOP; steps from the 3rd on take ``last_step_time`` (default ``step_time``)."""
    last_step_time = step_time if last_step_time is None else last_step_time
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=os.environ.get("RLJAX_TEST_COMPILER_FLAGS", ""))
    proc = subprocess.Popen([sys.executable, "-c", LOOP, str(directory), str(step_time),
                             str(last_step_time)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    # Let it get through a few steps, so the handler is installed.
    seen = read_until(proc, proc.stdout, "step 3")
    assert all(line.startswith("step") for line in seen), seen
    return proc, seen


def restore(directory):
    from rljax.train.core.checkpoint import CheckpointManager

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
    # Step 3 lasts an hour, so exiting at all shows the second Ctrl-C did not wait for it.
    proc, _ = start_loop(tmp_path, step_time=0.05, last_step_time=3600.0)
    try:
        proc.send_signal(signal.SIGINT)
        # Two signals sent before the child handles the first arrive as one; wait until it has.
        read_until(proc, proc.stderr, "stopping after this step")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_INTERRUPTED, err[-2000:]
    assert "exiting now" in err
    assert not any(name.isdigit() for name in os.listdir(tmp_path))  # nothing half-saved


def test_in_process_flag_and_restore_previous_handler():
    previous = signal.getsignal(signal.SIGTERM)
    with StopSignal(quiet=True) as stop:
        assert not stop.should_stop() and stop.reason is None
        # raise_signal runs the Python handler before it returns; os.kill could deliver the
        # signal to another thread and run the handler after a check made right after it.
        signal.raise_signal(signal.SIGTERM)
        assert stop.should_stop() and stop.should_stop(sync=True)
        assert stop.reason == "SIGTERM" and stop.exit_code == 0
    assert signal.getsignal(signal.SIGTERM) is previous
    manual = StopSignal()
    manual.request_stop()
    assert manual.should_stop() and manual.exit_code == 0
