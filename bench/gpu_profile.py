"""Where a GPU's time goes in decode and in the update step: one profiled call of each.

    python bench/gpu_profile.py [--preset qwen2.5-0.5b] [--out DIR]

Runs ``bench/gpu.py``'s decode (``sampling.generate``, bf16, ``--decode-batch`` prompts of
``--prompt`` tokens, ``--new`` new tokens) and update step (GRPO, float32 params, bf16 compute,
cuDNN attention where it applies) once to compile, then once under ``jax.profiler.trace``.
From the trace's device events it prints, per call: wall time, device-busy time (the union of
kernel intervals), the number of kernels, and the kernels that take the most time (summed over
the call). Busy time well under wall time with many short kernels means the call is bound by
launches and gaps, not by the GPU's bandwidth or arithmetic. The Perfetto traces are copied to
``--out``.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.gpu import update_setup  # noqa: E402
from rljax import models, sampling  # noqa: E402


def profile(fn, name: str, out: str | None) -> dict:
    """Runs ``fn()`` (blocking) once under the profiler; a summary of its device events."""
    d = tempfile.mkdtemp(prefix=f"rljax_prof_{name}_")
    t0 = time.perf_counter()
    with jax.profiler.trace(d, create_perfetto_trace=True):
        fn()
    wall = time.perf_counter() - t0
    path = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)[0]
    if out:
        shutil.copy(path, os.path.join(out, f"{name}.perfetto_trace.json.gz"))
    with gzip.open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device_pids = {pid for pid, n in names.items() if "device" in n.lower() and "cpu" not in
                   n.lower()} or set(names)
    kernels = [e for e in events if e.get("ph") == "X" and e["pid"] in device_pids
               and e.get("dur") is not None]
    # Busy time: the union of the kernel intervals (streams may overlap).
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels)
    busy, end = 0.0, -1e30
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    by_name = collections.defaultdict(lambda: [0.0, 0])
    for e in kernels:
        by_name[e["name"]][0] += e["dur"]
        by_name[e["name"]][1] += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]
    return {"name": name, "wall_ms": wall * 1e3, "device_busy_ms": busy / 1e3,
            "kernels": len(kernels), "device_processes": sorted(names[p] for p in device_pids),
            "top": [{"kernel": k[:120], "total_ms": v[0] / 1e3, "count": v[1]} for k, v in top]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--decode-batch", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--skip", nargs="*", default=[], choices=["update", "decode"])
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    impl = "auto"
    results = []

    if "decode" not in args.skip:
        cfg = models.get_preset(args.preset, dtype="bfloat16", param_dtype="bfloat16",
                                attention_impl=impl)
        params = models.init_params(cfg, jax.random.PRNGKey(0))
        rng = np.random.default_rng(0)
        toks = jnp.asarray(rng.integers(0, cfg.vocab_size, (args.decode_batch, args.prompt)),
                           jnp.int32)
        mask = jnp.ones(toks.shape, bool)

        def gen():
            out = sampling.generate(cfg, params, toks, mask, rng=jax.random.PRNGKey(3),
                                    max_new_tokens=args.new, temperature=1.0, eos_id=None)
            jax.block_until_ready(out.tokens)
        gen()
        results.append(profile(gen, "decode", args.out))
        del params

    if "update" not in args.skip:
        cfg = models.get_preset(args.preset, dtype="bfloat16", param_dtype="float32",
                                attention_impl=impl)
        step, state, b = update_setup(cfg, args.batch, args.seq)
        holder = {"state": state}

        def one():
            holder["state"], m = step(holder["state"], b)
            jax.block_until_ready(m)
        one()
        results.append(profile(one, "update", args.out))

    for r in results:
        print(f"\n## {r['name']}: wall {r['wall_ms']:.1f} ms, device busy {r['device_busy_ms']:.1f}"
              f" ms, {r['kernels']} kernels ({r['device_processes']})")
        for t in r["top"]:
            print(f"  {t['total_ms']:9.3f} ms  x{t['count']:<6d} {t['kernel']}")
    if args.out:
        with open(os.path.join(args.out, "profile_summary.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
