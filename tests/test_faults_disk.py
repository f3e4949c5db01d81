"""Workdirs and files that cannot be written: one line naming the problem, never a traceback or
a hang, and the last good checkpoint stays as it was."""
import errno
import os
import subprocess
import sys

import pytest

from rljax.errors import UserError
from rljax.train import workdir as workdir_lib
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
