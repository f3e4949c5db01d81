"""launch/: the local multi-process launcher and the TPU pod script.

The pod script cannot run here (no TPU, no Google Cloud credentials), so it is checked with
``bash -n``, shellcheck (when installed), its DRY_RUN output, and a fake ``gcloud`` on PATH that
records every call and syntax-checks each command sent to the workers with ``bash -n``.
"""
import os
import shlex
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POD = os.path.join(ROOT, "launch", "tpu_pod.sh")
LOCAL = os.path.join(ROOT, "launch", "local.py")

sys.path.insert(0, os.path.join(ROOT, "launch"))
import local as local_launch  # noqa: E402


def _pod(*args, env=None, path=None):
    full = {**os.environ, "TPU_NAME": "t1", "ZONE": "z1", "ACCELERATOR_TYPE": "v5litepod-16",
            "RUNTIME_VERSION": "v2-alpha-tpuv5-lite", "FOLLOW": "1", **(env or {})}
    if path:
        full["PATH"] = path + os.pathsep + full["PATH"]
    return subprocess.run(["bash", POD, *args], env=full, capture_output=True, text=True,
                          timeout=60)


def test_pod_script_syntax():
    subprocess.run(["bash", "-n", POD], check=True)
    if shutil.which("shellcheck"):
        r = subprocess.run(["shellcheck", POD], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout


def test_pod_dry_run_commands():
    r = _pod("up", env={"DRY_RUN": "1", "SPOT": "1", "PROJECT": "p1"})
    assert r.returncode == 0, r.stderr
    lines = [shlex.split(line[2:]) for line in r.stdout.splitlines() if line.startswith("+ ")]
    create = lines[0]
    assert create[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "create"]
    assert {"t1", "--zone=z1", "--project=p1", "--accelerator-type=v5litepod-16",
            "--version=v2-alpha-tpuv5-lite", "--spot"} <= set(create)
    assert lines[1][:2] == ["git", "-C"] and "archive" in lines[1]
    assert lines[2][4] == "scp" and "--worker=all" in lines[2]
    install = next(a for a in lines[3] if a.startswith("--command="))
    assert "rljax[tpu]" in install and "--worker=all" in lines[3]

    r = _pod("train", "--config", "configs/x.py", "--workdir", "gs://b/run",
             "--config.steps=5", "--config.reward.names=('gsm8k',)", env={"DRY_RUN": "1"})
    assert r.returncode == 0, r.stderr
    lines = [shlex.split(line[2:]) for line in r.stdout.splitlines() if line.startswith("+ ")]
    start = next(line for line in lines if any("setsid" in a for a in line))
    assert "--worker=all" in start
    remote = next(a for a in start if a.startswith("--command="))[len("--command="):]
    assert "RLJAX_DISTRIBUTED=1" in remote
    # The overrides survive two levels of quoting intact.
    words = shlex.split(remote.split("setsid nohup ", 1)[1].split(" > ")[0])
    assert words == ["python3", "-m", "rljax.cli", "train", "--config", "rljax-run/config.py",
                     "--workdir", "gs://b/run", "--config.steps=5",
                     "--config.reward.names=('gsm8k',)"]
    assert "--worker=0" in lines[-1] and "tail" in lines[-1][-1]   # then follows worker 0

    r = _pod("train", "--config", "c.py", "--workdir", "/tmp/local", env={"DRY_RUN": "1"})
    assert "not gs://" in r.stderr
    assert _pod("train", "--workdir", "gs://b").returncode == 2
    assert _pod("frobnicate").returncode == 2


def test_pod_remote_commands_parse(tmp_path):
    """A fake gcloud: logs calls, and every worker command must be valid shell (bash -n)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "calls.log"
    fake = bindir / "gcloud"
    fake.write_text(f"""#!/usr/bin/env bash
echo "$*" >> {log}
for a in "$@"; do
  case "$a" in --command=*) bash -n -c "${{a#--command=}}" || exit 9 ;; esac
done
""")
    fake.chmod(0o755)
    for command in (["up"], ["train", "--config", "c.py", "--workdir", "gs://b/r",
                             "--config.algo.beta=0.1"], ["logs"], ["status"], ["stop"],
                    ["run", "nvidia-smi || true"], ["delete"]):
        r = _pod(*command, path=str(bindir))
        assert r.returncode == 0, (command, r.stdout, r.stderr)
    calls = log.read_text().splitlines()
    assert sum("tpu-vm ssh" in c for c in calls) >= 7
    assert calls[-1].startswith("compute tpus tpu-vm delete t1")


def test_local_process_env():
    env = local_launch.process_env(
        {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_foo=1",
         "RLJAX_DISTRIBUTED": "1"},
        process_id=1, num_processes=2, devices=4, coordinator="127.0.0.1:1234")
    assert env["XLA_FLAGS"] == "--xla_foo=1 --xla_force_host_platform_device_count=4"
    assert env["JAX_PLATFORMS"] == "cpu"
    assert (env["RLJAX_COORDINATOR_ADDRESS"], env["RLJAX_NUM_PROCESSES"],
            env["RLJAX_PROCESS_ID"]) == ("127.0.0.1:1234", "2", "1")
    assert "RLJAX_DISTRIBUTED" not in env


@pytest.mark.parametrize("failing,expected", [(None, 0), ("1", 3)])
def test_local_launcher_exit_codes(tmp_path, failing, expected):
    """Exit codes propagate; a failing process stops the others (which would wait forever)."""
    ready = tmp_path / "ready"
    ready.mkdir()
    # The failing process exits only once process 0 has printed: otherwise, on a busy machine,
    # it can fail (and the launcher stop process 0) before process 0's first line. Process 0
    # then sleeps longer than the test waits (300 s), so only the launcher can end it in time.
    script = ("import os, sys, time\n"
              "pid = os.environ['RLJAX_PROCESS_ID']\n"
              "print('proc', pid, os.environ['RLJAX_NUM_PROCESSES'], flush=True)\n"
              f"open(os.path.join({str(ready)!r}, pid), 'w').close()\n"
              f"if pid == {failing!r}:\n"
              "    deadline = time.monotonic() + 120\n"
              f"    while not os.path.exists(os.path.join({str(ready)!r}, '0')):\n"
              "        if time.monotonic() > deadline: sys.exit(4)\n"
              "        time.sleep(0.01)\n"
              "    sys.exit(3)\n"
              f"if {failing!r} is not None: time.sleep(600)\n")
    r = subprocess.run([sys.executable, LOCAL, "-n", "2", "-d", "2", "--log_dir", str(tmp_path),
                        "--", sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == expected, r.stderr
    assert "proc 0 2" in r.stdout
    assert "proc 1 2" in (tmp_path / "process_1.log").read_text()
