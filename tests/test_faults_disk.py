"""Workdirs and files that cannot be written: one line naming the problem, never a traceback or
a hang, and the last good checkpoint stays as it was."""
import errno
import os
import subprocess
import sys

import pytest

from rljax.errors import UserError
from rljax.train.core import workdir as workdir_lib
from tiny_config import tiny_config_source

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rljax(*args, cwd=ROOT):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
               XLA_FLAGS=os.environ.get("RLJAX_TEST_COMPILER_FLAGS", ""))
    return subprocess.run([sys.executable, "-m", "rljax.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def _mount(*args) -> bool:
    """Runs mount (root only); False when this machine does not allow it."""
    try:
        return subprocess.run(["mount", *args], capture_output=True).returncode == 0
    except OSError:
        return False


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory on a read-only bind mount (skips where mounting is not allowed)."""
    d = tmp_path / "ro"
    d.mkdir()
    if not (_mount("--bind", str(d), str(d)) and _mount("-o", "remount,ro,bind", str(d))):
        subprocess.run(["umount", str(d)], capture_output=True)
        pytest.skip("cannot make a read-only mount here (needs root)")
    yield d
    subprocess.run(["umount", str(d)], capture_output=True)


def test_a_lock_in_an_unwritable_workdir_is_one_user_error(tmp_path, monkeypatch):
    real_open = os.open

    def read_only(path, *args, **kw):
        if str(path).endswith(workdir_lib.LOCK_FILE):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, *args, **kw)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(UserError, match="cannot write in the workdir .*Read-only file system"):
        workdir_lib.lock(str(tmp_path / "run"))


def test_train_in_a_read_only_workdir_is_one_line(tmp_path, read_only_dir):
    config = tmp_path / "tiny.py"
    config.write_text(tiny_config_source())
    out = rljax("train", "--config", str(config), "--workdir", str(read_only_dir / "run"))
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip().splitlines() == [out.stderr.strip()], out.stderr[-3000:]
    assert "cannot write in the workdir" in out.stderr and "Read-only" in out.stderr


# ---- a full disk: metrics, TensorBoard, W&B, checkpoints ------------------------------------

def _no_space(*args, **kw):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _in_thread(fn, limit_s=60):
    """``fn()``'s exception (None if it returned); fails if it is still running (a hang)."""
    import threading
    box = {}

    def target():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(limit_s)
    assert not t.is_alive(), f"still blocked after {limit_s} s"
    return box.get("error")


def test_a_tensorboard_write_on_a_full_disk_fails_in_one_line_instead_of_blocking(tmp_path):
    from rljax.train.core.metrics import MetricsWriteError, MetricsWriter
    writer = MetricsWriter(str(tmp_path), tensorboard=True, enabled=True, stream=open(os.devnull, "w"))
    writer._tb.file_writer.event_writer._ev_writer.write_event = _no_space
    # tensorboardX's writer thread died on its first event; its 10-slot queue then filled
    error = _in_thread(lambda: [writer.write(s, {f"k{i}": 1.0 for i in range(30)})
                                for s in range(1, 4)])
    assert isinstance(error, MetricsWriteError), error
    assert "No space left on device" in str(error) and "\n" not in str(error)
    assert _in_thread(writer.close) is None   # reported once, closing stays quiet


def test_metrics_jsonl_on_a_full_disk_is_one_line(tmp_path):
    from rljax.train.core.metrics import MetricsWriteError, MetricsWriter

    class Full:
        def write(self, *text):
            _no_space()

        flush = close = write

    writer = MetricsWriter(str(tmp_path), tensorboard=False, enabled=True,
                           stream=open(os.devnull, "w"))
    writer._file.close()
    writer._file = Full()
    with pytest.raises(MetricsWriteError, match=r"cannot write metrics in .*No space left"):
        writer.write(1, {"loss": 1.0})
    writer.close()


def test_a_failing_wandb_is_one_warning_and_logging_goes_on(tmp_path, capsys):
    from rljax.train.core.metrics import MetricsWriter

    class Run:
        def log(self, *a, **kw):
            _no_space()

        def finish(self):
            pass

    writer = MetricsWriter(str(tmp_path), tensorboard=False, enabled=True,
                           stream=open(os.devnull, "w"))
    writer._wandb = Run()
    writer.write(1, {"loss": 1.0})
    writer.write(2, {"loss": 0.5})
    writer.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "W&B logging failed at step 1" in err[0]
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 2


@pytest.fixture
def small_disk(tmp_path):
    """A 600 KiB tmpfs (skips where mounting is not allowed)."""
    d = tmp_path / "small"
    d.mkdir()
    if not _mount("-t", "tmpfs", "-o", "size=600k", "tmpfs", str(d)):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield d
    subprocess.run(["umount", str(d)], capture_output=True)


def test_training_onto_a_full_disk_stops_in_one_line_and_keeps_good_checkpoints(
        tmp_path, small_disk):
    from rljax.train.core.checkpoint import CheckpointManager
    config = tmp_path / "tiny.py"
    config.write_text(tiny_config_source(steps=40, checkpoint_every=2,
                                         logging=dict(tensorboard=True)))
    workdir = small_disk / "run"
    out = rljax("train", "--config", str(config), "--workdir", str(workdir))
    assert out.returncode == 1, out.stderr[-3000:]
    # No traceback at all: not rljax's, and not TensorStore's late completions of an async
    # save that failed (they used to print "Event loop is closed" around the error line).
    assert "Traceback" not in out.stderr and "Event loop is closed" not in out.stderr, \
        out.stderr[-3000:]
    assert out.stderr.count("rljax: error:") == 1, out.stderr[-3000:]
    error = out.stderr[out.stderr.index("rljax: error:"):].splitlines()[0]
    assert "No space left on device" in error, out.stderr[-3000:]
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], capture_output=True)
    with CheckpointManager(str(workdir / "checkpoints")) as ckpt:
        assert ckpt.all_steps(), "no checkpoint was committed before the disk filled"
        assert all(ckpt.verify(s) is None for s in ckpt.all_steps())


def test_any_command_that_hits_a_full_disk_ends_in_one_line():
    # e.g. export writing safetensors, or a tokenizer file, with no message of its own
    code = ("import errno, os, sys\nfrom rljax import cli\n"
            "def full(args, overrides):\n"
            "    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), '/out/model.safetensors')\n"
            "cli.COMMANDS['plot'] = full\nsys.exit(cli.main(['plot', 'x']))\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip() == ("rljax: error: cannot write /out/model.safetensors: "
                                  "No space left on device")


def test_a_closed_save_loop_drops_late_completions_quietly():
    import asyncio

    from rljax.train.core import checkpoint
    checkpoint._quiet_orbax_errors()   # as every CheckpointManager does
    loop = asyncio.new_event_loop()
    ran = []
    loop.call_soon_threadsafe(ran.append, 1)
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()
    assert loop.call_soon_threadsafe(ran.append, 2) is None   # no RuntimeError
    assert ran == [1]


def test_a_failed_async_save_is_named_by_its_own_step_not_the_next(tmp_path):
    """Step 3's background write fails (disk full); the error surfaces when step 4 starts:
    the line names checkpoint 3, the one left uncommitted."""
    import jax.numpy as jnp

    from rljax.train.core.checkpoint import CheckpointManager, CheckpointWriteError
    ckpt = CheckpointManager(str(tmp_path / "checkpoints"), async_save=True)
    ckpt.save(3, {"w": jnp.arange(8.0)}, {"phase": 0})
    real_wait = ckpt._manager.wait_until_finished

    def full_disk():
        real_wait()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "checkpoints"))
    ckpt._manager.wait_until_finished = full_disk
    with pytest.raises(CheckpointWriteError) as e:
        ckpt.save(4, {"w": jnp.arange(8.0)}, {"phase": 0})
    assert "(step 3)" in str(e.value) and "No space left on device" in str(e.value)
    ckpt._manager.wait_until_finished = real_wait
    ckpt.close()
