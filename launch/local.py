#!/usr/bin/env python3
"""Run a command as N local jax processes, the way it would run on N hosts of a pod.

    python launch/local.py -n 2 -d 4 -- rljax train --config configs/grpo_arithmetic.py \\
        --workdir /tmp/run

Each process gets ``JAX_PLATFORMS=cpu``, ``XLA_FLAGS=--xla_force_host_platform_device_count=D``
(D fake CPU devices) and ``RLJAX_COORDINATOR_ADDRESS`` / ``RLJAX_NUM_PROCESSES`` /
``RLJAX_PROCESS_ID`` (read by ``rljax.distributed.initialize``), with the coordinator on
127.0.0.1 at a free port. Process 0 prints to this terminal; the others write
``LOG_DIR/process_<i>.log``. If one process fails, the others are stopped (they would otherwise
wait forever in a collective). Exit code: the first non-zero exit code, else 0.

Only the standard library is used, so this also works without rljax installed.
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(base: dict, *, process_id: int, num_processes: int, devices: int,
                coordinator: str, platform: str = "cpu") -> dict:
    """The environment of local process ``process_id``."""
    env = dict(base)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    if platform == "cpu":
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    env["JAX_PLATFORMS"] = platform
    env["RLJAX_COORDINATOR_ADDRESS"] = coordinator
    env["RLJAX_NUM_PROCESSES"] = str(num_processes)
    env["RLJAX_PROCESS_ID"] = str(process_id)
    env.pop("RLJAX_DISTRIBUTED", None)
    return env


def launch(command: list[str], *, num_processes: int, devices_per_process: int,
           log_dir: str | None = None, port: int | None = None, platform: str = "cpu",
           timeout_s: float | None = None, stream_all: bool = False) -> int:
    """Starts ``command`` ``num_processes`` times, waits, returns the combined exit code."""
    if not command:
        raise SystemExit("launch/local.py: no command given (put it after --)")
    log_dir = log_dir or tempfile.mkdtemp(prefix="rljax-local-")
    os.makedirs(log_dir, exist_ok=True)
    coordinator = f"127.0.0.1:{port or free_port()}"
    procs, files = [], []
    for i in range(num_processes):
        env = process_env(os.environ, process_id=i, num_processes=num_processes,
                          devices=devices_per_process, coordinator=coordinator,
                          platform=platform)
        if i == 0 or stream_all:
            out = None
        else:
            out = open(os.path.join(log_dir, f"process_{i}.log"), "w")
            files.append(out)
        procs.append(subprocess.Popen(command, env=env, stdout=out,
                                      stderr=subprocess.STDOUT if out else None))
    print(f"launch/local.py: {num_processes} processes x {devices_per_process} devices, "
          f"coordinator {coordinator}, logs of processes 1..: {log_dir}", file=sys.stderr)

    def stop_all(sig=signal.SIGTERM):
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)

    def on_signal(signum, _frame):
        stop_all(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    code = 0
    kill_at = None  # after a failure: SIGTERM now, SIGKILL after a grace period
    try:
        while [p.poll() for p in procs].count(None):
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if failed and not code:
                code = failed[0]
                print(f"launch/local.py: a process exited with {code}; stopping the others",
                      file=sys.stderr)
                stop_all()
                kill_at = time.monotonic() + 15
            if kill_at is not None and time.monotonic() > kill_at:
                stop_all(signal.SIGKILL)
            if deadline is not None and time.monotonic() > deadline:
                print(f"launch/local.py: timed out after {timeout_s}s", file=sys.stderr)
                code = code or 124
                stop_all(signal.SIGKILL)
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for f in files:
            f.close()
        for s, handler in old.items():
            signal.signal(s, handler)
    if not code:
        code = next((p.returncode for p in procs if p.returncode), 0)
    if code:
        for i in range(1, num_processes):
            path = os.path.join(log_dir, f"process_{i}.log")
            if procs[i].returncode and os.path.exists(path):
                with open(path) as f:
                    tail = f.read()[-3000:]
                print(f"--- process {i} (exit {procs[i].returncode}), {path}:\n{tail}",
                      file=sys.stderr)
    return code


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        at = argv.index("--")
        argv, command = argv[:at], argv[at + 1:]
    else:
        command = []
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s [-n N] [-d D] [--log_dir DIR] -- COMMAND ...")
    parser.add_argument("-n", "--num_processes", type=int, default=2)
    parser.add_argument("-d", "--devices_per_process", type=int, default=4,
                        help="fake CPU devices per process")
    parser.add_argument("--log_dir", help="where processes 1.. write their logs (default: temp)")
    parser.add_argument("--port", type=int, help="coordinator port (default: a free one)")
    parser.add_argument("--platform", default="cpu", help="JAX_PLATFORMS for every process")
    parser.add_argument("--timeout", type=float, help="kill everything after this many seconds")
    parser.add_argument("--stream_all", action="store_true",
                        help="every process prints to this terminal (interleaved)")
    args = parser.parse_args(argv)
    print("launch/local.py: running " + shlex.join(command), file=sys.stderr)
    return launch(command, num_processes=args.num_processes,
                  devices_per_process=args.devices_per_process, log_dir=args.log_dir,
                  port=args.port, platform=args.platform, timeout_s=args.timeout,
                  stream_all=args.stream_all)


if __name__ == "__main__":
    sys.exit(main())
