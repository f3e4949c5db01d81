"""The namespace sandbox's parts that run inside it: the launcher (PID 1 of the new PID
namespace, ``LAUNCHER``) and the system-call filter it installs before the code starts
(``seccomp_filter``). ``rljax.envs.sandbox`` builds their inputs and starts them.

The filter is classic BPF, written out here and installed with ``prctl(PR_SET_SECCOMP)``
through ctypes: no dependency, and it needs no privilege once ``no_new_privs`` is set. It is
built for x86_64 and aarch64 (their system-call numbers differ; the first instruction checks
the architecture, so a call through another ABI, e.g. 32-bit ``int 0x80`` on x86_64, fails
instead of slipping past the numbers). It refuses, with EPERM:

* new namespaces: ``unshare`` (all of it) and ``clone`` with any ``CLONE_NEW*`` flag. In a new
  user namespace the code would hold every capability again, then could mount, make more
  namespaces and reach the kernel code most namespace escapes go through;
* mounts and root changes: ``mount``, ``umount2``, ``pivot_root``, ``chroot``, ``setns`` and the
  new mount API (``open_tree``, ``move_mount``, ``fsopen``, ``fsconfig``, ``fsmount``,
  ``fspick``, ``mount_setattr``, ``open_tree_attr``);
* debugging other processes: ``ptrace``, ``process_vm_readv``/``writev``;
* kernel surface no Python program needs: ``bpf``, ``perf_event_open``, ``userfaultfd``,
  ``io_uring_*``, the key-ring calls, ``open_by_handle_at``, modules, ``kexec``, ``reboot``,
  ``swapon``/``swapoff``, ``acct``, ``syslog``, ``quotactl`` (and ``iopl``/``ioperm``, x32 calls
  on x86_64).

``clone3`` passes its flags in memory, where a filter cannot read them, so it fails with ENOSYS:
the C library then falls back to ``clone`` (as under Docker's and systemd's filters), whose
flags are checked. Threads, ``fork`` and ``subprocess`` work as before.

Why a filter and not ``user.max_user_namespaces = 0`` inside: that limit lives in a user
namespace, and a root trainer's sandbox has none of its own (setting it there would change the
host); a filter is per process, inherited by every child and kept across ``execve``, and it
also closes the mount calls and the rest of the list above.
"""
from __future__ import annotations

import sys

__all__ = ["LAUNCHER", "seccomp_filter", "ALLOW", "EPERM", "ENOSYS"]

ALLOW, EPERM, ENOSYS = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38  # SECCOMP_RET_*
_LD, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|...|K
_CLONE_NEW = 0x7E020080  # CLONE_NEW{NS,CGROUP,UTS,IPC,USER,PID,NET,TIME}

# name: (x86_64, aarch64) system-call numbers (asm/unistd_64.h, asm-generic/unistd.h)
_DENIED = {
    "unshare": (272, 97), "setns": (308, 268), "mount": (165, 40), "umount2": (166, 39),
    "pivot_root": (155, 41), "chroot": (161, 51), "open_tree": (428, 428),
    "move_mount": (429, 429), "fsopen": (430, 430), "fsconfig": (431, 431),
    "fsmount": (432, 432), "fspick": (433, 433), "mount_setattr": (442, 442),
    "open_tree_attr": (467, 467), "ptrace": (101, 117), "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271), "bpf": (321, 280), "perf_event_open": (298, 241),
    "userfaultfd": (323, 282), "io_uring_setup": (425, 425), "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427), "keyctl": (250, 219), "add_key": (248, 217),
    "request_key": (249, 218), "open_by_handle_at": (304, 265), "init_module": (175, 105),
    "finit_module": (313, 273), "delete_module": (176, 106), "kexec_load": (246, 104),
    "kexec_file_load": (320, 294), "reboot": (169, 142), "swapon": (167, 224),
    "swapoff": (168, 225), "acct": (163, 89), "syslog": (103, 116), "quotactl": (179, 60),
    "iopl": (172, None), "ioperm": (173, None),
}
_ARCHES = {"x86_64": (0, 0xC000003E, 56), "aarch64": (1, 0xC00000B7, 220)}  # AUDIT_ARCH_*, clone
_ARCHES["amd64"], _ARCHES["arm64"] = _ARCHES["x86_64"], _ARCHES["aarch64"]
_CLONE3 = 435


def seccomp_filter(machine: str) -> list[tuple[int, int, int, int]] | None:
    """The filter for ``platform.machine()`` == ``machine`` as ``(code, jt, jf, k)``
    instructions, or None where there is none (other architectures, 32-bit Pythons)."""
    if machine not in _ARCHES or sys.maxsize <= 2 ** 32:
        return None
    column, arch, clone = _ARCHES[machine]
    # Jump targets by name, resolved to the relative offsets classic BPF uses.
    body = [(_LD, None, None, 4), (_JEQ, None, "nosys", arch), (_LD, None, None, 0)]
    if column == 0:
        body.append((_JGE, "nosys", None, 0x40000000))  # __X32_SYSCALL_BIT
    body.append((_JEQ, "nosys", None, _CLONE3))
    body += [(_JEQ, "eperm", None, numbers[column]) for numbers in _DENIED.values()
             if numbers[column] is not None]
    body += [(_JEQ, None, "allow", clone), (_LD, None, None, 16),  # args[0], low 32 bits
             (_JSET, "eperm", "allow", _CLONE_NEW)]
    labels = {"allow": len(body), "eperm": len(body) + 1, "nosys": len(body) + 2}
    out = [(code, 0 if jt is None else labels[jt] - i - 1, 0 if jf is None else labels[jf] - i - 1,
            k) for i, (code, jt, jf, k) in enumerate(body)]
    return out + [(_RET, 0, 0, ALLOW), (_RET, 0, 0, EPERM), (_RET, 0, 0, ENOSYS)]


# PID 1 of the namespace backend, run by the trainer's Python (``-I -S``) inside the new
# namespaces, before any model code: builds the minimal root, pivots into it, starts the code
# as its child without capabilities and under the filter, reaps, and reports the child's status
# on a pipe. ``sys.argv[1]`` is the JSON spec ``sandbox._namespace_command`` writes.
LAUNCHER = r"""
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

for path, target in spec["links"]:
    os.makedirs(os.path.dirname(inside(path)), exist_ok=True)
    os.symlink(target, inside(path))
for path in spec["ro"]:
    if os.path.exists(path):
        bind(path)
# The working directory: a tmpfs of its own, capped in bytes and inodes, holding a copy of
# main.py. What the code writes stays in memory here and goes with the mount namespace.
with open(os.path.join(spec["workdir"], "main.py"), "rb") as f:
    code = f.read()
work = inside(spec["workdir"])
os.makedirs(work)
owner = "" if spec["uid"] is None else ",uid=%d,gid=%d" % (spec["uid"], spec["uid"])
mount("tmpfs", work, "tmpfs", NOSUID | NODEV,
      "size=%d,nr_inodes=%d,mode=0700%s" % (spec["disk_bytes"], spec["max_files"], owner))
with open(os.path.join(work, "main.py"), "wb") as f:
    f.write(code)
if spec["uid"] is not None:
    os.chown(os.path.join(work, "main.py"), spec["uid"], spec["uid"])
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
numbers = {"x86_64": 155, "aarch64": 41}
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

class Instruction(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                ("k", ctypes.c_uint32)]

class Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Instruction))]

def install_filter(instructions):  # after no_new_privs; kept across execve and by children
    array = (Instruction * len(instructions))(*[Instruction(*i) for i in instructions])
    program = Program(len(instructions), array)
    check(libc.prctl(22, ctypes.c_ulong(2), ctypes.byref(program), ctypes.c_ulong(0),
                     ctypes.c_ulong(0)), "seccomp filter")  # PR_SET_SECCOMP, MODE_FILTER

status_fd = spec["status_fd"]
os.set_inheritable(status_fd, False)
pid = os.fork()
if pid == 0:
    try:
        drop_privileges()
        os.chdir(spec["workdir"])
        install_filter(spec["seccomp"])
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
