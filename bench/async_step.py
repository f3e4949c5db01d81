"""Seconds per GRPO iteration: synchronous vs asynchronous (one device per role), interleaved.

    python bench/async_step.py [--config configs/grpo_arithmetic.py] [--steps 6] [--rounds 2]
                               [--devices 2] [--set KEY=VALUE ...]

Runs the config's GRPO phase (no warm-up, no evals but the last, on 16 examples) with XLA's
default options on ``--devices`` fake CPU devices, as contenders interleaved per round:

* ``sync``: ``algo.asynchronous=false`` on one mesh of every device (data parallel);
* ``sync_1``: the same on one device (the trainer's share under the split);
* ``async``: ``algo.asynchronous=true``, ``mesh.rollout_devices = devices / 2``.

Reported per contender: the median over rounds of each run's median ``time/step`` (the first
iteration, which compiles, left out), and of ``time/sample``, ``time/update`` and the async
idle fractions. Writes ``bench/results/async_step.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "grpo_arithmetic.py"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--set", nargs="*", default=[], help="extra --config overrides KEY=VALUE")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "async_step.json"))
    args = ap.parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.devices}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from rljax import config as config_lib
    from rljax.train import run
    from rljax.train.core.metrics import read_metrics

    half = args.devices // 2
    contenders = {
        "sync": ([], jax.devices()),
        "sync_1": (["mesh.data=1"], jax.devices()[:1]),
        "async": (["algo.asynchronous=true", f"mesh.rollout_devices={half}"], jax.devices()),
    }
    keys = ("time/step", "time/sample", "time/update", "time/trainer_idle_frac",
            "time/sampler_idle_frac", "time/weight_transfer")
    runs: dict = {name: [] for name in contenders}
    for r in range(args.rounds):
        for name, (overrides, devices) in contenders.items():
            cfg = config_lib.load_config(args.config, [
                f"--config.steps={args.steps}", "--config.sft.steps=0", "--config.eval_every=0",
                "--config.checkpoint_every=0", "--config.eval.num_examples=16",
                "--config.eval.batch_size=16", "--config.logging.tensorboard=false",
                "--config.memory.check=off", "--config.compilation_cache_dir=",
                *[f"--config.{x}" for x in args.set], *[f"--config.{x}" for x in overrides]])
            workdir = tempfile.mkdtemp(prefix=f"async_step_{name}_")
            assert run.train(cfg, workdir, devices=devices) == 0
            rows = [m for m in read_metrics(workdir) if "time/step" in m][1:]
            got = {k: statistics.median(m[k] for m in rows) for k in keys if k in rows[0]}
            runs[name].append(got)
            print(f"round {r} {name}: " + " ".join(f"{k}={v:.3f}" for k, v in got.items()),
                  flush=True)
    summary = {name: {k: statistics.median(g[k] for g in got) for k in got[0]}
               for name, got in runs.items()}
    ratio = summary["async"]["time/step"] / summary["sync"]["time/step"]
    print(json.dumps(summary, indent=1))
    print(f"async / sync seconds per iteration: {ratio:.2f}; async / sync_1: "
          f"{summary['async']['time/step'] / summary['sync_1']['time/step']:.2f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"config": os.path.relpath(args.config, ROOT), "steps": args.steps,
                   "rounds": args.rounds, "devices": args.devices, "set": args.set,
                   "machine": platform.processor() or platform.machine(),
                   "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "summary": summary,
                   "runs": runs, "async_over_sync": ratio}, f, indent=1)


if __name__ == "__main__":
    main()
