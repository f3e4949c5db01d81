"""Running model-written Python in a separate, limited process: the ``python`` tool's engine.

Each call gets a fresh temporary directory and a new process (a new session, so the whole
process group can be killed) running ``python -I`` (isolated mode: no user site-packages, no
``PYTHON*`` environment variables) with a minimal environment. Before the code runs, the child
lowers its own resource limits (hard limits, which the code cannot raise again):

* ``RLIMIT_CPU``    CPU seconds (SIGXCPU at ``cpu_s``, SIGKILL a second later if the code
                    ignores SIGXCPU),
* ``RLIMIT_AS``     address space (a large allocation fails with MemoryError; not enforced by
                    macOS, where only the wall-clock limit bounds a runaway allocation),
* ``RLIMIT_FSIZE``  largest file it may write (``file_mb``; stdout/stderr go to files, so a
                    print loop cannot fill the parent's memory), ``RLIMIT_CORE`` 0,
* ``RLIMIT_NPROC``  processes and threads (``max_procs``; namespace backend only, where it
                    counts the sandbox's own processes).

The parent kills the process group after ``wall_s`` seconds of wall-clock time (a ``sleep``
does not use CPU), and after every run. It reads stdout/stderr back through its own file
descriptors, never by reopening a path the code could replace (a FIFO there cannot block it).
Afterwards it deletes its temp dirs without recursion and without following links (any depth,
any path length; ``_remove_tree``), and every failure of the call, clean-up included, is a
ToolError: nothing escapes to the caller, and nothing stays in the temp space.

Two backends (``sandbox=`` of ``run_python`` / the python tool):

``"namespace"`` (Linux x86_64 and aarch64; the default where it works, see
``namespace_available()``): util-linux ``unshare`` puts the code in new mount, PID, network,
IPC and UTS namespaces (plus a user namespace when the trainer is not root). A small launcher
(``sandbox_launcher.LAUNCHER``) builds a minimal root file system on a tmpfs -- read-only binds
of ``/usr`` (and ``/lib*``, ``/bin``, ``/sbin`` where they are not links into it), of Python
only what it runs on (the interpreter's real file, libpython, the standard library and the
site-packages, links resolved: never a home directory or the folder above a link to the
interpreter), ``/etc/ld.so.cache`` and a few ``/dev`` nodes, a fresh ``/proc``, and as the
working directory (the only writable path) a tmpfs of its own capped at ``disk_mb`` bytes and
``max_files`` inodes, holding a copy of ``main.py`` (a write past the cap fails with ENOSPC
inside; nothing the code writes reaches the host's disk, and it is gone with the namespace) --
pivots into it, drops every capability (bounding set cleared, ``no_new_privs``; as root it
also switches to an unused uid, so ``RLIMIT_NPROC`` applies), installs a system-call filter
that refuses new namespaces, mounts, ``ptrace`` and other kernel surface no program needs
(``sandbox_launcher.seccomp_filter``), then runs the code as PID 2 under its own PID 1.
So the code sees no home directory, no host ``/tmp``, ``/run`` or sockets, no run workdir or
checkpoints, no rljax source tree, not even its own output files, and can write nothing outside
its working directory; it cannot make a user namespace (where it would hold capabilities
again) or mount anything; it has no network (no interfaces) and cannot reach host abstract Unix
sockets; it can signal no process outside; and when PID 1 exits (the code finished, or the
parent killed ``unshare``, whose death kills PID 1) the kernel kills every process left in the
namespace, ``setsid`` daemons included. This is a namespace sandbox, not a VM: the kernel is
shared, so for untrusted code at scale run the whole rollout in a container or VM as well
(docs/agents.md).

``"process"`` (the fallback elsewhere, e.g. macOS): the limits above without ``RLIMIT_NPROC``,
``disk_mb`` and ``max_files`` (it writes to the host's temp dir; only ``file_mb`` bounds each
file), and, where ``unshare -rn`` works, a new network namespace (``network_isolated()``). It
does NOT isolate the file system (the code reads what the user can read and writes where the
user can write), other processes of the user, or ``setsid`` children (they outlive the kill).
"""
from __future__ import annotations

import functools
import json
import os
import platform
import random
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time

from rljax.envs.base import ToolError, ToolTimeout
from rljax.envs.sandbox_launcher import LAUNCHER, seccomp_filter

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


class SandboxLimits:
    """Limits of one run. ``memory_mb`` bounds the address space (the interpreter itself takes
    ~30 MB of it; numpy ~300 MB more on import). ``file_mb`` bounds each file, ``disk_mb`` and
    ``max_files`` everything the code writes together (bytes; files plus directories), and
    ``max_procs`` processes plus threads (these three: namespace backend)."""

    def __init__(self, wall_s: float = 10.0, cpu_s: int = 10, memory_mb: int = 1024,
                 file_mb: int = 16, max_output_chars: int = 2000, max_procs: int = 64,
                 disk_mb: int = 64, max_files: int = 4096):
        if min(wall_s, cpu_s, memory_mb, file_mb, max_procs, disk_mb, max_files) <= 0:
            raise ValueError("sandbox limits must be positive")
        self.wall_s, self.cpu_s, self.memory_mb = float(wall_s), int(cpu_s), int(memory_mb)
        self.file_mb, self.max_output_chars = int(file_mb), int(max_output_chars)
        self.max_procs, self.disk_mb, self.max_files = int(max_procs), int(disk_mb), int(max_files)


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
    if seccomp_filter(platform.machine()) is None:
        return f"no system-call filter for {platform.machine()} (x86_64 and aarch64 only)"
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


def _link_chain(path: str) -> tuple[list[list[str]], str]:
    """The symbolic links from ``path`` to the file it names, each with an absolute target,
    and that file."""
    links = []
    for _ in range(40):  # the kernel's own limit
        if not os.path.islink(path):
            break
        target = os.path.normpath(os.path.join(os.path.realpath(os.path.dirname(path)),
                                               os.readlink(path)))
        links.append([path, target])
        path = target
    return links, path


@functools.lru_cache(maxsize=1)
def _interpreter_view() -> tuple[str, tuple, tuple]:
    """``(python, links, read_only)``: the interpreter the sandbox runs, the links to recreate
    and the paths to bind read-only. The system's programs and libraries, and of Python only
    what it runs on: the interpreter file, libpython, the standard library and the
    site-packages, each with links resolved (and as named). Never a whole prefix, a home
    directory, or the folder above the interpreter's name: started as ``~/bin/python3`` (a
    link), the interpreter's real file is run and ``~`` stays out of sight. A venv's
    ``bin/python`` is run as named (its ``pyvenv.cfg`` next to it makes it the venv), with the
    links it goes through recreated."""
    system = ["/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", "/etc/ld.so.cache",
              "/etc/localtime"]
    exe = os.path.abspath(sys.executable)
    venv_cfg = os.path.join(sys.prefix, "pyvenv.cfg")
    in_venv = (sys.prefix != sys.base_prefix and os.path.isfile(venv_cfg)
               and exe.startswith(os.path.join(sys.prefix, "")))
    python = exe if in_venv else os.path.realpath(exe)
    chain, final = _link_chain(python)
    needed = [final, os.path.realpath(final)] + ([venv_cfg] if in_venv else [])
    for prefix, platbase in ((sys.prefix, sys.exec_prefix),
                             (sys.base_prefix, sys.base_exec_prefix)):
        paths = sysconfig.get_paths(vars={"base": prefix, "platbase": platbase,
                                          "installed_base": prefix, "installed_platbase": platbase})
        needed += [paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")]
        needed.append(os.path.join(prefix, "lib"))  # libpython, and a conda prefix's libraries
    needed += [p for p in sys.path if os.path.basename(p) == "lib-dynload"]
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    if sysconfig.get_config_var("Py_ENABLE_SHARED") and libdir and soname:
        needed.append(os.path.join(libdir, soname))
    homes = {os.path.expanduser("~"), os.environ.get("HOME") or "/"}
    try:
        import pwd
        homes |= {entry.pw_dir for entry in pwd.getpwall()}
    except (ImportError, KeyError, OSError):
        pass
    homes = {os.path.realpath(h) for h in homes if h}
    entries = [(p, target) for p, target in chain]
    for path in system:
        if os.path.islink(path):
            entries.append((path, os.readlink(path)))
        elif os.path.exists(path):
            entries.append((path, None))
    for path in needed:
        for path in (os.path.abspath(path), os.path.realpath(path)):
            if os.path.isdir(path) and any(h == path or h.startswith(path.rstrip("/") + "/")
                                           for h in homes):
                continue  # a home directory, or one holding homes: never as a whole
            if os.path.exists(path) and path != "/":
                entries.append((path, None))
    links, read_only, kept = [], [], []
    for path, target in sorted(set(entries), key=lambda e: len(e[0])):
        if any(path == k or path.startswith(k.rstrip("/") + "/") for k in kept):
            continue  # already seen through an entry above it
        kept.append(path)
        if target is None:
            read_only.append(path)
        else:
            links.append([path, target])
    return python, tuple(map(tuple, links)), tuple(read_only)


def _namespace_command(limits: SandboxLimits, workdir: str, rootdir: str, status_fd: int,
                       uid: int | None) -> list[str]:
    bootstrap = _BOOTSTRAP.format(cpu_s=limits.cpu_s, memory_bytes=limits.memory_mb << 20,
                                  file_bytes=limits.file_mb << 20, nproc=limits.max_procs)
    python, links, read_only = _interpreter_view()
    spec = {"root": rootdir, "workdir": workdir, "links": links, "ro": read_only, "uid": uid,
            "status_fd": status_fd, "python": python, "argv": [python, "-I", "-c", bootstrap],
            "disk_bytes": limits.disk_mb << 20, "max_files": limits.max_files,
            "seccomp": seccomp_filter(platform.machine())}
    unshare = [shutil.which("unshare") or "unshare", "--mount", "--pid", "--fork",
               "--kill-child", "--net", "--ipc", "--uts", "--propagation", "private"]
    if os.geteuid() != 0:
        unshare[1:1] = ["--user", "--map-root-user"]
    return unshare + ["--", python, "-I", "-S", "-c", LAUNCHER, json.dumps(spec)]


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


def _open_dir(name: str, dir_fd: int | None) -> int:
    """Opens a directory to empty it, never through a link; gives back the permissions the
    code took away from it where it must."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except PermissionError:
        if not stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            raise
        os.chmod(name, stat.S_IRWXU, dir_fd=dir_fd)
        fd = os.open(name, flags, dir_fd=dir_fd)
    os.fchmod(fd, stat.S_IRWXU)
    return fd


def _remove_tree(path: str) -> None:
    """Removes a directory the code wrote into: without recursion (any depth) and with two
    descriptors open at a time (any path length). Each directory's files are removed and its
    subdirectories moved up to the top one, which is emptied the same way; links are removed,
    never followed."""
    if not os.path.lexists(path):
        return
    if os.path.islink(path) or not os.path.isdir(path):
        os.unlink(path)
        return
    top, pending, moved = _open_dir(path, None), [None], 0
    try:
        while pending:
            name = pending.pop()
            fd = top if name is None else _open_dir(name, top)
            try:
                with os.scandir(fd) as entries:
                    children = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
                for child, is_dir in children:
                    if not is_dir:
                        os.unlink(child, dir_fd=fd)
                    elif name is None:
                        pending.append(child)
                    else:  # moved up: the tree gets flatter, never deeper
                        while True:
                            moved += 1
                            flat = f".rljax-rm-{moved}"
                            try:
                                os.stat(flat, dir_fd=top, follow_symlinks=False)
                            except FileNotFoundError:
                                break
                        os.rename(child, flat, src_dir_fd=fd, dst_dir_fd=top)
                        pending.append(flat)
            finally:
                if fd != top:
                    os.close(fd)
            if name is not None:
                os.rmdir(name, dir_fd=top)
    finally:
        os.close(top)
    os.rmdir(path)


def run_python(code: str, limits: SandboxLimits | None = None, sandbox: str = "auto") -> str:
    """Runs ``code`` in a child process under ``limits``; returns its stdout. ``sandbox``:
    ``"namespace"``, ``"process"`` or ``"auto"`` (see the module's docstring).

    Raises ToolError (with stdout so far and the last line of the traceback) when the code
    fails, ToolTimeout when it is killed for time (wall clock or CPU), and ToolError for any
    failure of the call itself, its clean-up included (the temp dirs are removed either way).
    """
    if not isinstance(code, str):
        raise ToolError(f"code must be a string, got {type(code).__name__}")
    limits = limits or SandboxLimits()
    backend = sandbox if sandbox in ("namespace", "process") else resolve_backend(sandbox)
    made: list[str] = []
    try:
        try:
            return _run(code, limits, backend, made)
        finally:
            failed = []
            for path in made:
                try:
                    _remove_tree(path)
                except Exception as e:  # noqa: BLE001 - reported below, after trying all
                    failed.append(f"{path}: {type(e).__name__}: {e}")
            if failed:
                raise ToolError("python: could not remove its temporary directory "
                                + "; ".join(failed))
    except ToolError:
        raise
    except Exception as e:  # noqa: BLE001 - a failure of the sandbox, not of the code
        raise ToolError(f"python: the sandbox failed: {type(e).__name__}: {e}") from e


def _run(code: str, limits: SandboxLimits, backend: str, made: list[str]) -> str:
    """One call of ``run_python``; every temp dir it makes is listed in ``made`` at once."""
    workdir = tempfile.mkdtemp(prefix="rljax-python-")
    made.append(workdir)
    rootdir = None
    if backend == "namespace":
        rootdir = tempfile.mkdtemp(prefix="rljax-root-")
        made.append(rootdir)
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
        # The outputs are opened here, and read back through these descriptors. In the
        # namespace backend they stay outside what the code sees (its working directory there
        # is a tmpfs of its own, with a copy of main.py).
        with open(os.path.join(workdir, ".stdout"), "w+b") as out, \
                open(os.path.join(workdir, ".stderr"), "w+b") as err:
            pass_fds: tuple = ()
            if backend == "namespace":
                # As root, the code runs as an otherwise unused uid, so that RLIMIT_NPROC
                # (which never applies to uid 0) counts only its own processes.
                uid = random.SystemRandom().randrange(1 << 30, (1 << 31) - 2) \
                    if os.geteuid() == 0 else None
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
