"""Attacks on the python tool's sandbox by model-written code. Each attack worked against the
limits-only child process (the "process" backend); the namespace backend (the default where it
runs) must stop every one. The last tests cover choosing the backend."""
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import uuid

import pytest

import rljax
from rljax.envs import ToolError, make_tool
from rljax.envs import sandbox as sb
from rljax.envs.sandbox import SandboxLimits, run_python

LIMITS = SandboxLimits(wall_s=20, cpu_s=5, memory_mb=512)

needs_namespace = pytest.mark.skipif(
    not sb.namespace_available(),
    reason=f"namespace sandbox unavailable here: {sb._namespace_problem()}")

# Prints, for each path, READ/WROTE <path> when the code managed, or "blocked <path>".
_TRY = """
import os


def attempt(verb, path, action):
    try:
        action(path)
        print(verb, path)
    except OSError as e:
        print("blocked", path, type(e).__name__)
"""


@needs_namespace
def test_the_runs_workdir_config_and_checkpoints_are_not_readable(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_10").mkdir(parents=True)
    (run / "config.json").write_text('{"api_key": "SECRET-CONFIG-7f3a"}')
    (run / "checkpoints" / "step_10" / "params.bin").write_bytes(b"SECRET-WEIGHTS-91c2")
    paths = [str(run / "config.json"), str(run / "checkpoints" / "step_10" / "params.bin")]
    out = run_python(_TRY + f"for p in {paths!r}:\n"
                     "    attempt('READ', p, lambda p: print(open(p, 'rb').read()))\n"
                     f"attempt('LISTED', {str(run)!r}, os.listdir)\n", LIMITS)
    assert "SECRET" not in out and "READ" not in out and "LISTED" not in out, out
    assert out.count("blocked") == 3


@needs_namespace
def test_nothing_outside_the_working_directory_is_writable(tmp_path):
    rewards = tmp_path / "my_rewards.py"
    rewards.write_text("def reward(text):\n    return 1.0\n")
    probe = f"rljax_probe_{uuid.uuid4().hex}.py"
    new_files = [os.path.join(os.path.dirname(rljax.__file__), probe),       # the rljax package
                 os.path.join(sysconfig.get_paths()["purelib"], probe),      # site-packages
                 os.path.join(os.path.expanduser("~"), probe),               # the user's home
                 os.path.join(tempfile.gettempdir(), probe)]                 # the host's /tmp
    targets = new_files + [str(rewards)]                                     # a reward file
    code = _TRY + (f"for p in {targets!r}:\n"
                   "    attempt('WROTE', p, lambda p: open(p, 'a').write('import os\\n'))\n")
    try:
        out = run_python(code, LIMITS)
        assert "WROTE" not in out, out
        assert out.count("blocked") == len(targets)
        assert not any(os.path.exists(p) for p in new_files)
        assert rewards.read_text() == "def reward(text):\n    return 1.0\n"
    finally:
        for p in new_files:
            if os.path.exists(p):
                os.remove(p)


@needs_namespace
def test_the_view_is_minimal_read_only_and_holds_no_secrets():
    out = run_python("import os\n"
                     "print(sorted(os.listdir('/')))\nprint(sorted(os.listdir('/etc')))\n"
                     "for p in ('/etc/shadow', '/etc/passwd', '/usr/SANDBOX_PROBE'):\n"
                     "    try:\n"
                     "        open(p, 'a' if p.startswith('/usr') else 'r').close()\n"
                     "        print('OPENED', p)\n"
                     "    except OSError as e:\n"
                     "        print('blocked', p)\n", LIMITS)
    root, etc, *rest = out.splitlines()
    prefixes = {p.strip("/").split("/")[0] for p in (sys.prefix, sys.base_prefix,
                                                    os.path.realpath(sys.executable))}
    allowed = {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "dev", "proc",
               "tmp"} | prefixes
    assert set(eval(root)) <= allowed, root
    assert set(eval(etc)) <= {"ld.so.cache", "localtime"}, etc
    assert not any(line.startswith("OPENED") for line in rest), out


@needs_namespace
def test_host_unix_sockets_are_unreachable():
    folder = tempfile.mkdtemp(prefix="rljax-sock-", dir="/tmp")  # short: AF_UNIX paths are
    path = os.path.join(folder, "s")                             # limited to 108 bytes
    abstract = f"\0rljax-test-{uuid.uuid4().hex[:12]}"
    servers = []
    try:
        for address in (path, abstract):
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.bind(address)
            server.listen(4)
            servers.append(server)
        code = ("import socket\n"
                f"for address in ({path!r}, {abstract!r}):\n"
                "    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
                "    try:\n"
                "        s.connect(address)\n"
                "        print('CONNECTED', repr(address))\n"
                "    except OSError as e:\n"
                "        print('blocked', e.errno)\n")
        out = run_python(code, LIMITS)
        assert "CONNECTED" not in out and out.count("blocked") == 2, out
    finally:
        for server in servers:
            server.close()
        if os.path.exists(path):
            os.remove(path)
        os.rmdir(folder)


@needs_namespace
def test_the_trainer_cannot_be_signalled():
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: received.append(1))
    try:
        code = ("import os, signal\n"
                f"for pid in ({os.getpid()}, os.getppid()):\n"
                "    try:\n"
                "        os.kill(pid, signal.SIGUSR1)\n"
                "        print('SIGNALLED', pid)\n"
                "    except OSError as e:\n"
                "        print('blocked', pid, type(e).__name__)\n")
        run_python(code, LIMITS)
        time.sleep(0.3)
        assert not received
    finally:
        signal.signal(signal.SIGUSR1, previous)


def _processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


@needs_namespace
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_a_setsid_daemon_dies_with_the_episode():
    marker = f"rljax-daemon-{uuid.uuid4().hex}"
    code = ("import os, sys, time\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    if os.fork() == 0:\n"
            "        os.execv(sys.executable, [sys.executable, '-c', 'import time; "
            f"time.sleep(60)', {marker!r}])\n"
            "    os._exit(0)\n"
            "time.sleep(1.0)\n"
            "print('started')\n")
    try:
        assert run_python(code, LIMITS).strip() == "started"
        deadline = time.monotonic() + 5
        while _processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _processes_with(marker)
    finally:
        for pid in _processes_with(marker):
            os.kill(pid, signal.SIGKILL)


@needs_namespace
def test_a_fork_bomb_hits_a_process_limit():
    code = ("import os, time\n"
            "n = 0\n"
            "try:\n"
            "    for _ in range(300):\n"
            "        if os.fork() == 0:\n"
            "            time.sleep(5)\n"
            "            os._exit(0)\n"
            "        n += 1\n"
            "except OSError as e:\n"
            "    print('stopped', n)\n"
            "else:\n"
            "    print('unbounded', n)\n")
    out = run_python(code, LIMITS).split()
    assert out[0] == "stopped" and int(out[1]) < LIMITS.max_procs, out


@pytest.mark.parametrize("backend", [
    pytest.param("namespace", marks=needs_namespace), "process"])
def test_a_fifo_in_place_of_the_output_files_neither_blocks_nor_leaves_the_temp_dir(
        tmp_path, monkeypatch, backend):
    # The process backend's code sees its output files; the namespace backend's does not (its
    # working directory is a tmpfs of its own), so there the FIFOs are made at the same names.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    code = ("import os\n"
            "for name in ('.stdout', '.stderr'):\n"
            "    if os.path.exists(name):\n"
            "        os.remove(name)\n"
            "    os.mkfifo(name)\n"
            "print('done')\n")
    result = []
    worker = threading.Thread(target=lambda: result.append(run_python(code, LIMITS, backend)),
                              daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "the trainer's thread is blocked on a FIFO"
    assert result == ["done\n"]
    assert os.listdir(tmp_path) == []  # the temp dirs are gone


@needs_namespace
def test_the_namespace_sandbox_still_runs_ordinary_programs():
    code = ("import json, subprocess, sys, tempfile, threading\n"
            "import numpy as np\n"
            "t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()\n"
            "r = subprocess.run([sys.executable, '-c', 'print(2 + 2)'], capture_output=True,"
            " text=True)\n"
            "with open(tempfile.mkstemp()[1], 'w') as f:\n"
            "    f.write('ok')\n"
            "print(int(np.arange(10).sum()), r.stdout.strip(), json.dumps([1]))\n")
    assert run_python(code, LIMITS, sandbox="namespace").splitlines() == ["thread", "45 4 [1]"]


# ------------------------------------------------------------------ disk: caps and cleanup

def _snapshot(folder) -> dict:
    """Every path under ``folder`` with its size: the tool's temp space, before and after."""
    out = {}
    for dirpath, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, folder)] = os.lstat(path).st_size
    return out


_NEST = ("import os\n"
         "for _ in range(3000):\n"
         "    os.mkdir('d')\n"
         "    os.chdir('d')\n"
         "with open('leaf', 'wb') as f:\n"
         "    f.write(b'x' * 4096)\n"
         "print('nested')\n")


@pytest.mark.parametrize("backend", [
    pytest.param("namespace", marks=needs_namespace), "process"])
def test_deeply_nested_directories_leave_nothing_behind(tmp_path, monkeypatch, backend):
    # Recursive deletion hit RecursionError at this depth, and the temp dirs stayed for good.
    (tmp_path / "someone-elses.txt").write_text("kept")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = _snapshot(tmp_path)
    assert run_python(_NEST, LIMITS, sandbox=backend) == "nested\n"
    assert _snapshot(tmp_path) == before


def test_the_cleanup_follows_no_link_and_undoes_removed_permissions(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("kept")
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "link").symlink_to(outside / "keep.txt")
    fd = os.open(tree, os.O_RDONLY)
    for depth in range(300):  # 6,000 characters deep: longer than any path may be
        os.mkdir("d" * 20, dir_fd=fd)
        os.chmod("d" * 20, 0o500 if depth == 0 else 0o700, dir_fd=fd)
        fd, parent = os.open("d" * 20, os.O_RDONLY, dir_fd=fd), fd
        os.close(parent)
    with open(os.open("f", os.O_WRONLY | os.O_CREAT, dir_fd=fd), "w") as f:
        f.write("x")
    os.symlink(str(outside), "link", dir_fd=fd)
    os.fchmod(fd, 0)
    os.close(fd)
    sb._remove_tree(str(tree))
    assert not os.path.lexists(tree)
    assert (outside / "keep.txt").read_text() == "kept"


@needs_namespace
def test_writes_past_the_total_cap_fail_inside_and_never_reach_the_host(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    limits = SandboxLimits(wall_s=20, cpu_s=5, memory_mb=512, file_mb=2, disk_mb=4)
    code = ("import os\n"
            "s = os.statvfs('.')\n"
            "print('capacity', s.f_blocks * s.f_frsize)\n"
            "for i in range(64):\n"  # 64 files of 1 MB, each under file_mb
            "    with open(f'f{i}', 'wb') as f:\n"
            "        f.write(b'x' * (1 << 20))\n"
            "    print('wrote', i + 1, flush=True)\n")
    with pytest.raises(ToolError, match="No space left on device") as info:
        run_python(code, limits)
    lines = str(info.value).splitlines()
    assert lines[0] == f"capacity {4 << 20}", lines  # its working directory is the capped space
    assert max(int(line.split()[1]) for line in lines if line.startswith("wrote")) <= 4
    assert os.listdir(tmp_path) == []


@needs_namespace
def test_files_past_the_inode_cap_fail_inside():
    tool = make_tool("python", wall_s=20, cpu_s=5, memory_mb=512, max_files=50)
    code = ("import os\n"
            "for i in range(500):\n"
            "    os.mkdir(f'd{i}')\n"
            "print('made all')\n")
    with pytest.raises(ToolError, match="No space left on device"):
        tool.fn(code=code)


def test_a_failing_cleanup_is_a_tool_error_not_a_crash(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    remove = sb._remove_tree

    def broken(path):
        raise OSError(16, "Device or resource busy", path)
    monkeypatch.setattr(sb, "_remove_tree", broken)
    with pytest.raises(ToolError, match="could not remove its temporary directory"):
        run_python("print(1)", LIMITS, sandbox="process")
    for name in os.listdir(tmp_path):
        remove(os.path.join(tmp_path, name))


def test_a_failure_of_the_sandbox_itself_is_a_tool_error(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))  # mkdtemp fails
    with pytest.raises(ToolError, match="the sandbox failed: FileNotFoundError"):
        run_python("print(1)", LIMITS, sandbox="process")


# ------------------------------------------------------------- kernel surface: the syscall filter

@needs_namespace
def test_new_user_namespaces_and_mounts_are_refused():
    # With a new user namespace the code had every capability again, then a mount namespace and
    # mounts of its own: the way into most namespace escapes.
    code = ("import ctypes, os, subprocess, sys, threading\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "def attempt(name, call):\n"
            "    if call() == 0:\n"
            "        print('ALLOWED', name)\n"
            "    else:\n"
            "        print('refused', name, os.strerror(ctypes.get_errno()))\n"
            "attempt('unshare user', lambda: libc.unshare(0x10000000))\n"  # CLONE_NEWUSER
            "attempt('unshare user+mount', lambda: libc.unshare(0x10020000))\n"
            "attempt('unshare mount', lambda: libc.unshare(0x00020000))\n"
            "os.mkdir('m')\n"
            "attempt('mount', lambda: libc.mount(b'none', b'm', b'tmpfs', 0, None))\n"
            "fd = os.open('/proc/self/ns/mnt', os.O_RDONLY)\n"
            "attempt('setns', lambda: libc.setns(fd, 0))\n"
            "print([line.split()[1] for line in open('/proc/self/status')"
            " if line.startswith('Seccomp:')])\n"
            # ordinary programs are untouched: threads, fork, a python subprocess
            "t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    os._exit(7)\n"
            "print('fork', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
            "print(subprocess.run([sys.executable, '-c', 'print(6 * 7)'], capture_output=True,"
            " text=True).stdout.strip())\n")
    lines = run_python(code, LIMITS).splitlines()
    assert not [line for line in lines if line.startswith("ALLOWED")], lines
    assert sum(line.startswith("refused") for line in lines) == 5, lines
    assert lines[5:] == ["['2']", "thread", "fork 7", "42"], lines


def test_the_filter_checks_the_architecture_first():
    from rljax.envs import sandbox_launcher as sl
    for machine, arch in (("x86_64", 0xC000003E), ("aarch64", 0xC00000B7)):
        program = sl.seccomp_filter(machine)
        assert program[0] == (0x20, 0, 0, 4) and program[1][3] == arch  # load arch, compare
        assert all(code != 0x06 or k in (sl.ALLOW, sl.EPERM, sl.ENOSYS)
                   for code, _, _, k in program)
        assert all(i + 1 + max(jt, jf) < len(program)  # every jump lands inside the program
                   for i, (code, jt, jf, _) in enumerate(program) if code & 0x07 == 0x05)
    assert sl.seccomp_filter("riscv64") is None


# ----------------------------------------------------------- what the namespace backend binds

@needs_namespace
def test_an_interpreter_started_through_a_link_in_a_home_directory_does_not_expose_it(tmp_path):
    home = tmp_path / "home" / "someone"
    (home / "bin").mkdir(parents=True)
    (home / ".ssh").mkdir()
    decoy = home / ".ssh" / "id_ed25519"
    decoy.write_text("DECOY-PRIVATE-KEY-5e1d")
    link = home / "bin" / "python3"
    link.symlink_to(os.path.realpath(sys.executable))
    code = (_TRY + f"attempt('READ', {str(decoy)!r}, lambda p: print(open(p).read()))\n"
            f"attempt('LISTED', {str(home)!r}, lambda p: print(os.listdir(p)))\n"
            "print('ran')\n")
    trainer = ("import sys\n"
               "from rljax.envs.sandbox import SandboxLimits, run_python\n"
               "print(sys.executable)\n"
               f"print(run_python({code!r}, SandboxLimits(wall_s=20, cpu_s=5, memory_mb=512),"
               " sandbox='namespace'))\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([str(link), "-c", trainer], cwd=root, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.splitlines()[0] == str(link)  # the trainer really ran as the link
    assert "ran" in out and "DECOY" not in out and "READ" not in out and "LISTED" not in out, out
    assert out.count("blocked") == 2, out


# ----------------------------------------------------------------------------- the backend choice

def test_the_backend_is_a_tool_option_and_bad_names_are_refused():
    assert make_tool("python", wall_s=5, sandbox="process").fn(code="print(1)") == "1\n"
    with pytest.raises(ValueError, match="one of"):
        make_tool("python", sandbox="docker")


def test_an_unavailable_namespace_backend_is_an_error_when_asked_for_and_one_line_on_auto(
        monkeypatch, capsys):
    monkeypatch.setattr(sb, "_namespace_problem", lambda: "util-linux 'unshare' is not on PATH")
    monkeypatch.setattr(sb, "_warned", set())
    with pytest.raises(ValueError, match="'namespace' is not available here: util-linux"):
        sb.resolve_backend("namespace")
    assert sb.resolve_backend("auto") == "process"
    assert sb.resolve_backend("auto") == "process"
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "namespace backend unavailable" in lines[0]
    assert make_tool("python", wall_s=5).fn(code="print(2)") == "2\n"
