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
                    cannot fill the parent's memory), ``RLIMIT_CORE`` 0,
* ``RLIMIT_NPROC``  processes and threads (``max_procs``; namespace backend only, where it
                    counts the sandbox's own processes).

The parent kills the process group after ``wall_s`` seconds of wall-clock time (a ``sleep``
does not use CPU), and after every run. It reads stdout/stderr back through its own file
descriptors, never by reopening a path the code could replace (a FIFO there cannot block it).

Two backends (``sandbox=`` of ``run_python`` / the python tool):

``"namespace"`` (Linux; the default where it works, see ``namespace_available()``): util-linux
``unshare`` puts the code in new mount, PID, network, IPC and UTS namespaces (plus a user
namespace when the trainer is not root). A small launcher (``_LAUNCHER``) builds a minimal root
file system on a tmpfs -- read-only binds of ``/usr`` (and ``/lib*``, ``/bin``, ``/sbin`` where
they are not links into it), the Python prefixes, ``/etc/ld.so.cache`` and a few ``/dev``
nodes, a fresh ``/proc``, and the working directory (the only writable path) -- pivots into
it, drops every capability (bounding set cleared, ``no_new_privs``; as root it also switches to
an unused uid, so ``RLIMIT_NPROC`` applies), then runs the code as PID 2 under its own PID 1.
So the code sees no home directory, no host ``/tmp``, ``/run`` or sockets, no run workdir or
checkpoints, no rljax source tree, and can write nothing outside its working directory; it
has no network (no interfaces) and cannot reach host abstract Unix sockets; it can signal no
process outside; and when PID 1 exits (the code finished, or the parent killed ``unshare``,
whose death kills PID 1) the kernel kills every process left in the namespace, ``setsid``
daemons included. This is a namespace sandbox, not a VM: the kernel is shared, so for
untrusted code at scale run the whole rollout in a container or VM as well (docs/agents.md).

``"process"`` (the fallback elsewhere, e.g. macOS): the limits above without ``RLIMIT_NPROC``,
and, where ``unshare -rn`` works, a new network namespace (``network_isolated()``). It does
NOT isolate the file system (the code reads what the user can read and writes where the user
can write), other processes of the user, or ``setsid`` children (they outlive the kill).
"""
from __future__ import annotations

import functools
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

from rljax.envs.base import ToolError, ToolTimeout

__all__ = ["run_python", "network_isolated", "namespace_available", "resolve_backend",
           "SandboxLimits", "BACKENDS"]

BACKENDS = ("auto", "namespace", "process")

# The child's bootstrap: limit itself, then run the code file as __main__. Passed with -c so no
# file of ours must exist in the working directory before the code starts.
_BOOTSTRAP = """\
import resource, runpy, sys
for name, soft, hard in (("RLIMIT_CPU", {cpu_s}, {cpu_s} + 1),
                         ("RLIMIT_AS", {memory_bytes}, {memory_bytes}),
                         ("RLIMIT_FSIZE", {file_bytes}, {file_bytes}), ("RLIMIT_CORE", 0, 0),
                         ("RLIMIT_NPROC", {nproc}, {nproc})):
    if soft is None:
        continue
    try:
        resource.setrlimit(getattr(resource, name), (soft, hard))
    except (ValueError, OSError, AttributeError):
        pass  # e.g. RLIMIT_AS on macOS; the wall-clock limit still holds
sys.argv = ["main.py"]
runpy.run_path("main.py", run_name="__main__")
"""

# PID 1 of the namespace backend, run by the trainer's Python (``-I -S``) inside the new
# namespaces, before any model code: builds the minimal root, pivots into it, starts the code
# as its child without capabilities, reaps, and reports the child's status on a pipe.
_LAUNCHER = r"""
import ctypes, json, os, platform, sys
spec = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
KEEP = {1: 1, 2: 2, 4: 4, 8: 8, 1024: 1024, 2048: 2048, 4096: 1 << 21}  # statvfs -> mount flags

def check(rc, what):
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, "%s: %s" % (what, os.strerror(e)))

def mount(src, dst, fstype, flags, data=None):
    enc = lambda x: None if x is None else x.encode()
    check(libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)),
          "mount %s on %s" % (src, dst))

def locked_flags(path):
    f = os.statvfs(path).f_flag
    return sum(v for k, v in KEEP.items() if f & k)

new = spec["root"]
mount(None, "/", None, REC | PRIVATE)
mount("tmpfs", new, "tmpfs", NOSUID | NODEV, "size=1m,mode=0755")

def inside(path):
    return new + path

def bind(src, writable=False, device=False):
    dst = inside(src)
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()
    mount(src, dst, None, BIND | REC)
    flags = locked_flags(src) | NOSUID | (0 if device else NODEV) | (0 if writable else RDONLY)
    mount(None, dst, None, REMOUNT | BIND | flags)

for path in spec["ro"]:
    if os.path.islink(path):
        os.makedirs(os.path.dirname(inside(path)), exist_ok=True)
        os.symlink(os.readlink(path), inside(path))
    elif os.path.exists(path):
        bind(path)
bind(spec["workdir"], writable=True)
for name in ("null", "zero", "full", "random", "urandom"):
    if os.path.exists("/dev/" + name):
        bind("/dev/" + name, writable=True, device=True)  # writable: the device, not a file
for fd, name in enumerate(("stdin", "stdout", "stderr")):
    os.symlink("/proc/self/fd/%d" % fd, inside("/dev/" + name))
os.symlink("/proc/self/fd", inside("/dev/fd"))
os.makedirs(inside("/proc"))
try:
    mount("proc", inside("/proc"), "proc", NOSUID | NODEV | NOEXEC)
except OSError:
    pass  # e.g. a container that masks parts of /proc: the code runs without /proc

os.chdir(new)
numbers = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
number = numbers.get(platform.machine())
if number is not None:
    check(libc.syscall(number, b".", b"."), "pivot_root")
    check(libc.umount2(b".", 2), "umount old root")  # MNT_DETACH
else:
    mount(new, "/", None, 8192)  # MS_MOVE
    os.chroot(".")
os.chdir("/")
mount(None, "/", None, REMOUNT | BIND | RDONLY | NOSUID | NODEV)

def drop_privileges():
    for cap in range(64):
        libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP (EINVAL past the last capability)
    if spec["uid"] is not None:  # as root: an unused uid (no capabilities left after it)
        os.setgroups([])
        os.setresgid(spec["uid"], spec["uid"], spec["uid"])
        os.setresuid(spec["uid"], spec["uid"], spec["uid"])
    check(libc.prctl(38, 1, 0, 0, 0), "no_new_privs")  # PR_SET_NO_NEW_PRIVS

status_fd = spec["status_fd"]
os.set_inheritable(status_fd, False)
pid = os.fork()
if pid == 0:
    try:
        drop_privileges()
        os.chdir(spec["workdir"])
        os.execve(spec["python"], spec["argv"], dict(os.environ))
    except BaseException as e:
        os.write(2, ("sandbox setup failed: %r\n" % (e,)).encode())
        os._exit(127)
try:
    drop_privileges()  # PID 1 only waits: it needs no privileges either
except OSError:
    pass
libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: the code cannot ptrace or read PID 1
while True:
    done, status = os.waitpid(-1, 0)
    if done == pid:
        break
os.write(status_fd, ("signal %d" % os.WTERMSIG(status) if os.WIFSIGNALED(status)
                     else "exit %d" % os.WEXITSTATUS(status)).encode())
os._exit(0)  # PID 1 exits: the kernel kills whatever the code left running
"""


class SandboxLimits:
    """Limits of one run. ``memory_mb`` bounds the address space (the interpreter itself takes
    ~30 MB of it; numpy ~300 MB more on import). ``max_procs`` bounds processes plus threads
    (namespace backend)."""

    def __init__(self, wall_s: float = 10.0, cpu_s: int = 10, memory_mb: int = 1024,
                 file_mb: int = 16, max_output_chars: int = 2000, max_procs: int = 64):
        if wall_s <= 0 or cpu_s <= 0 or memory_mb <= 0 or file_mb <= 0 or max_procs <= 0:
            raise ValueError("sandbox limits must be positive")
        self.wall_s, self.cpu_s, self.memory_mb = float(wall_s), int(cpu_s), int(memory_mb)
        self.file_mb, self.max_output_chars = int(file_mb), int(max_output_chars)
        self.max_procs = int(max_procs)


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


@functools.lru_cache(maxsize=1)
def _namespace_problem() -> str | None:
    """Why the namespace backend cannot run here (None when it can): tried once, for real."""
    if not sys.platform.startswith("linux"):
        return f"needs Linux (this is {sys.platform})"
    if shutil.which("unshare") is None:
        return "util-linux 'unshare' is not on PATH"
    try:
        out = run_python("print(6 * 7)", SandboxLimits(wall_s=30, cpu_s=10), sandbox="namespace")
    except Exception as e:  # noqa: BLE001 - any failure means: not available
        return f"a test run failed: {str(e).strip().splitlines()[-1] if str(e).strip() else e!r}"
    return None if out.strip() == "42" else f"a test run printed {out!r}"


def namespace_available() -> bool:
    """Whether the namespace backend works here (Linux with util-linux ``unshare`` and
    namespaces allowed: as root, or with unprivileged user namespaces); checked once."""
    return _namespace_problem() is None


_warned: set = set()


def resolve_backend(sandbox: str = "auto") -> str:
    """``"auto"`` -> ``"namespace"`` where it works, else ``"process"`` (with one warning line
    on stderr). ``"namespace"`` where it cannot run raises ValueError saying why."""
    if sandbox not in BACKENDS:
        raise ValueError(f"python sandbox must be one of {BACKENDS}, got {sandbox!r}")
    if sandbox == "process":
        return "process"
    problem = _namespace_problem()
    if problem is None:
        return "namespace"
    if sandbox == "namespace":
        raise ValueError(f"python sandbox 'namespace' is not available here: {problem} "
                         "(use sandbox='process' for the limits-only child process)")
    if "auto" not in _warned:
        _warned.add("auto")
        print(f"rljax: python sandbox: namespace backend unavailable ({problem}); using "
              "'process' (limits only, no file-system or process isolation)", file=sys.stderr)
    return "process"


def _read_only_paths() -> list[str]:
    """What the namespace sandbox sees read-only: the system's programs and libraries, and the
    Python prefixes (a venv and the interpreter it points to), nothing under them twice."""
    paths = ["/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", "/etc/ld.so.cache",
             "/etc/localtime"]
    prefixes = [sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
                os.path.dirname(os.path.dirname(os.path.abspath(sys.executable)))]
    # Each as named (a venv's bin/python is reached through it) and with links resolved.
    for prefix in prefixes + [os.path.realpath(p) for p in prefixes]:
        prefix = os.path.abspath(prefix)
        if prefix != "/" and prefix not in paths:
            paths.append(prefix)
    out: list[str] = []
    for path in sorted(paths, key=len):
        if not any(path.startswith(p.rstrip("/") + "/") for p in out if not os.path.islink(p)):
            out.append(path)
    return out


def _namespace_command(limits: SandboxLimits, workdir: str, rootdir: str, status_fd: int,
                       uid: int | None) -> list[str]:
    bootstrap = _BOOTSTRAP.format(cpu_s=limits.cpu_s, memory_bytes=limits.memory_mb << 20,
                                  file_bytes=limits.file_mb << 20, nproc=limits.max_procs)
    python = os.path.abspath(sys.executable)  # not resolved: a venv's python finds its venv
    spec = {"root": rootdir, "workdir": workdir, "ro": _read_only_paths(), "uid": uid,
            "status_fd": status_fd, "python": python, "argv": [python, "-I", "-c", bootstrap]}
    unshare = [shutil.which("unshare") or "unshare", "--mount", "--pid", "--fork", "--kill-child", "--net", "--ipc",
               "--uts", "--propagation", "private"]
    if os.geteuid() != 0:
        unshare[1:1] = ["--user", "--map-root-user"]
    return unshare + ["--", python, "-I", "-S", "-c", _LAUNCHER, json.dumps(spec)]


def _process_command(limits: SandboxLimits) -> list[str]:
    bootstrap = _BOOTSTRAP.format(cpu_s=limits.cpu_s, memory_bytes=limits.memory_mb << 20,
                                  file_bytes=limits.file_mb << 20, nproc=None)
    command = [sys.executable, "-I", "-c", bootstrap]
    return (["unshare", "-rn"] + command) if network_isolated() else command


def _read_head(fd: int, limit: int) -> str:
    """The first ``limit`` characters of an output file, read through the parent's own
    descriptor (the code may have renamed it or put a FIFO at its path)."""
    data = os.pread(fd, limit * 4 + 1, 0)
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


def _remove_tree(path: str) -> None:
    """Removes a directory the code wrote into, even where it took away its own permissions."""
    def retry(function, failed, _):
        try:
            for path in (os.path.dirname(failed), failed):
                if os.path.isdir(path) and not os.path.islink(path):  # never through a link
                    os.chmod(path, stat.S_IRWXU)
            function(failed)
        except OSError:
            pass
    shutil.rmtree(path, onerror=retry)
    if os.path.lexists(path):
        shutil.rmtree(path, ignore_errors=True)


def run_python(code: str, limits: SandboxLimits | None = None, sandbox: str = "auto") -> str:
    """Runs ``code`` in a child process under ``limits``; returns its stdout. ``sandbox``:
    ``"namespace"``, ``"process"`` or ``"auto"`` (see the module's docstring).

    Raises ToolError (with stdout so far and the last line of the traceback) when the code
    fails, ToolTimeout when it is killed for time (wall clock or CPU).
    """
    if not isinstance(code, str):
        raise ToolError(f"code must be a string, got {type(code).__name__}")
    limits = limits or SandboxLimits()
    backend = sandbox if sandbox in ("namespace", "process") else resolve_backend(sandbox)
    workdir = tempfile.mkdtemp(prefix="rljax-python-")
    rootdir = tempfile.mkdtemp(prefix="rljax-root-") if backend == "namespace" else None
    status_r = status_w = None
    try:
        with open(os.path.join(workdir, "main.py"), "w") as f:
            f.write(code)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin" if backend == "namespace"
               else os.environ.get("PATH", "/usr/bin:/bin"), "HOME": workdir,
               "TMPDIR": workdir, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
               # One BLAS/OpenMP thread: the CPU limit counts every thread, and the rollout
               # runs many programs at once.
               "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        # The outputs are opened here, and read back through these descriptors.
        with open(os.path.join(workdir, ".stdout"), "w+b") as out, \
                open(os.path.join(workdir, ".stderr"), "w+b") as err:
            pass_fds: tuple = ()
            if backend == "namespace":
                # As root, the code runs as an otherwise unused uid, so that RLIMIT_NPROC
                # (which never applies to uid 0) counts only its own processes.
                uid = random.SystemRandom().randrange(1 << 30, (1 << 31) - 2) \
                    if os.geteuid() == 0 else None
                if uid is not None:
                    for path in (workdir, os.path.join(workdir, "main.py")):
                        os.chown(path, uid, uid)
                status_r, status_w = os.pipe()
                os.set_blocking(status_r, False)
                command, pass_fds = _namespace_command(limits, workdir, rootdir, status_w,
                                                       uid), (status_w,)
            else:
                command = _process_command(limits)
            proc = subprocess.Popen(command, cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=err, start_new_session=True,
                                    pass_fds=pass_fds)
            if status_w is not None:
                os.close(status_w)
                status_w = None
            try:
                finished = _wait_unreaped(proc, limits.wall_s)
            finally:
                _kill_group(proc)  # also after a normal exit: no background process outlives a call
            if not finished:
                raise ToolTimeout(f"python: killed after {limits.wall_s:g}s wall-clock")
            returncode = proc.returncode
            if status_r is not None:
                try:
                    kind, _, number = os.read(status_r, 64).decode().partition(" ")
                    returncode = -int(number) if kind == "signal" else int(number)
                except (OSError, ValueError):  # PID 1 never reported: setup failed
                    returncode = returncode or 1
            stdout = _read_head(out.fileno(), limits.max_output_chars)
            stderr_text = _read_head(err.fileno(), 100_000)
        if returncode == 0:
            return stdout if stdout else "(no output)"
        if returncode == -signal.SIGXCPU:
            raise ToolTimeout(f"python: killed after {limits.cpu_s}s of CPU time")
        if returncode == -signal.SIGKILL:  # the CPU hard limit (SIGXCPU ignored) or OOM
            raise ToolError("python: killed by SIGKILL (CPU or memory limit)")
        stderr = stderr_text.rstrip().splitlines()
        reason = stderr[-1] if stderr else f"exit status {returncode}"
        prefix = f"{stdout.rstrip()}\n" if stdout.strip() else ""
        raise ToolError(f"{prefix}{reason}"[-limits.max_output_chars:])
    finally:
        for fd in (status_r, status_w):
            if fd is not None:
                os.close(fd)
        _remove_tree(workdir)
        if rootdir is not None:
            _remove_tree(rootdir)
