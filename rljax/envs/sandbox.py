"""Running model-written Python in a separate, limited process: the ``python`` tool's engine.

Each call gets a fresh temporary working directory (removed afterwards) and a new process (a
new session, so the whole process group can be killed) running ``python -I`` (isolated mode: no
user site-packages, no ``PYTHON*`` environment variables) with a minimal environment. Before the
code runs, the child lowers its own resource limits (hard limits, which the code cannot raise
again):

* ``RLIMIT_CPU``    CPU seconds (SIGXCPU at ``cpu_s``, SIGKILL a second later if the code
                    ignores SIGXCPU),
* ``RLIMIT_AS``     address space (a large allocation fails with MemoryError; not enforced by
                    macOS, where only the wall-clock limit bounds a runaway allocation),
* ``RLIMIT_FSIZE``  largest file it may write (stdout/stderr go to files, so a print loop
                    cannot fill the parent's memory), ``RLIMIT_CORE`` 0.

The parent kills the process group after ``wall_s`` seconds of wall-clock time (a ``sleep``
does not use CPU), and after every run, so background processes the code started in its group
end with it. Where the OS allows unprivileged user namespaces (Linux, ``unshare -rn``
works) the child runs in a new network namespace with no interfaces: no network at all.
Elsewhere it runs with the network of the user (``network_isolated()`` says which).

What is NOT isolated (this is not a security boundary against a hostile model): the file system
(the code can read what the user can read and write where the user can write; only its working
directory is fresh), other processes of the user, and children that leave the process group
(``setsid``) can outlive the wall-clock kill; a fork bomb is bounded only by the user's process
limit. For untrusted code at scale, run the whole rollout in a container or VM.
"""
from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from rljax.envs.base import ToolError, ToolTimeout

__all__ = ["run_python", "network_isolated", "SandboxLimits"]

# The child's bootstrap: limit itself, then run the code file as __main__. Passed with -c so no
# file of ours must exist in the working directory before the code starts.
_BOOTSTRAP = """\
import resource, runpy, sys
for name, soft, hard in (("RLIMIT_CPU", {cpu_s}, {cpu_s} + 1),
                         ("RLIMIT_AS", {memory_bytes}, {memory_bytes}),
                         ("RLIMIT_FSIZE", {file_bytes}, {file_bytes}), ("RLIMIT_CORE", 0, 0)):
    try:
        resource.setrlimit(getattr(resource, name), (soft, hard))
    except (ValueError, OSError, AttributeError):
        pass  # e.g. RLIMIT_AS on macOS; the wall-clock limit still holds
sys.argv = ["main.py"]
runpy.run_path("main.py", run_name="__main__")
"""


class SandboxLimits:
    """Limits of one run. ``memory_mb`` bounds the address space (the interpreter itself takes
    ~30 MB of it; numpy ~300 MB more on import)."""

    def __init__(self, wall_s: float = 10.0, cpu_s: int = 10, memory_mb: int = 1024,
                 file_mb: int = 16, max_output_chars: int = 2000):
        if wall_s <= 0 or cpu_s <= 0 or memory_mb <= 0 or file_mb <= 0:
            raise ValueError("sandbox limits must be positive")
        self.wall_s, self.cpu_s, self.memory_mb = float(wall_s), int(cpu_s), int(memory_mb)
        self.file_mb, self.max_output_chars = int(file_mb), int(max_output_chars)


@functools.lru_cache(maxsize=1)
def network_isolated() -> bool:
    """Whether ``unshare -rn`` (a new user + network namespace) works here; checked once."""
    exe = shutil.which("unshare")
    if exe is None or not sys.platform.startswith("linux"):
        return False
    try:
        return subprocess.run([exe, "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _command(limits: SandboxLimits) -> list[str]:
    bootstrap = _BOOTSTRAP.format(cpu_s=limits.cpu_s, memory_bytes=limits.memory_mb << 20,
                                  file_bytes=limits.file_mb << 20)
    command = [sys.executable, "-I", "-c", bootstrap]
    return (["unshare", "-rn"] + command) if network_isolated() else command


def _read_tail(path: str, limit: int) -> str:
    """The first ``limit`` characters of a file the child wrote (it may be huge)."""
    with open(path, "rb") as f:
        data = f.read(limit * 4 + 1)
    text = data.decode("utf-8", errors="replace")
    return text if len(text) <= limit else text[:limit] + "... [output cut]"


def _wait_unreaped(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Waits up to ``timeout_s`` for the child to exit WITHOUT reaping it (``WNOWAIT``): while
    it is a zombie its process group id cannot be reused, so killing the group afterwards is
    safe. Returns whether it exited. Falls back to ``Popen.wait`` where ``waitid`` is missing."""
    if not hasattr(os, "waitid"):
        try:
            proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    deadline, pause = time.monotonic() + timeout_s, 0.001
    while True:
        if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(pause, max(deadline - time.monotonic(), 0)))
        pause = min(pause * 2, 0.02)


def _kill_group(proc: subprocess.Popen) -> None:
    """Kills every process left in the child's group (its own children too), then reaps it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def run_python(code: str, limits: SandboxLimits | None = None) -> str:
    """Runs ``code`` in a child process under ``limits``; returns its stdout.

    Raises ToolError (with stdout so far and the last line of the traceback) when the code
    fails, ToolTimeout when it is killed for time (wall clock or CPU).
    """
    if not isinstance(code, str):
        raise ToolError(f"code must be a string, got {type(code).__name__}")
    limits = limits or SandboxLimits()
    workdir = tempfile.mkdtemp(prefix="rljax-python-")
    try:
        with open(os.path.join(workdir, "main.py"), "w") as f:
            f.write(code)
        out_path, err_path = os.path.join(workdir, ".stdout"), os.path.join(workdir, ".stderr")
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": workdir,
               "TMPDIR": workdir, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
               # One BLAS/OpenMP thread: the CPU limit counts every thread, and the rollout
               # runs many programs at once.
               "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(_command(limits), cwd=workdir, env=env,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True)
            try:
                finished = _wait_unreaped(proc, limits.wall_s)
            finally:
                _kill_group(proc)  # also after a normal exit: no background process outlives a call
            if not finished:
                raise ToolTimeout(f"python: killed after {limits.wall_s:g}s wall-clock")
        stdout = _read_tail(out_path, limits.max_output_chars)
        if proc.returncode == 0:
            return stdout if stdout else "(no output)"
        if proc.returncode == -signal.SIGXCPU:
            raise ToolTimeout(f"python: killed after {limits.cpu_s}s of CPU time")
        if proc.returncode == -signal.SIGKILL:  # the CPU hard limit (SIGXCPU ignored) or OOM
            raise ToolError("python: killed by SIGKILL (CPU or memory limit)")
        stderr = _read_tail(err_path, 100_000).rstrip().splitlines()
        reason = stderr[-1] if stderr else f"exit status {proc.returncode}"
        prefix = f"{stdout.rstrip()}\n" if stdout.strip() else ""
        raise ToolError(f"{prefix}{reason}"[-limits.max_output_chars:])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
