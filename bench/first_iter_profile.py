"""Where a cold first GRPO iteration goes: every XLA program's trace, lowering and compile.

Runs ``grpo_step.py``'s rljax worker in this process (4L-128 llama, 8 prompts x G=8 x 64
tokens by default, an empty persistent compilation cache) and prints, on one time axis from
the start of the first iteration, each trace / MLIR lowering / XLA compile span longer than
``--min-ms`` with its function and thread, then totals per kind.

    python bench/first_iter_profile.py [--shape base] [--iters 2] [--json out.json] [--cache DIR]
        [--compile-for startup]

Spans come from ``jax.monitoring`` time-span events; a compile span is wall time, so two
compiles that share XLA:CPU's compile threads stretch each other.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import grpo_step  # noqa: E402  (the benchmark's model, prompts and worker)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="base", help="tiny, base or small (grpo_step.py)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--iters", type=int, default=2, help="timed iterations after the first")
    ap.add_argument("--min-ms", type=float, default=20.0, help="shortest span printed")
    ap.add_argument("--json", help="also write the spans and the worker's result here")
    ap.add_argument("--cache", help="persistent compilation cache folder, kept (default: a new "
                    "empty one): run twice to profile a second run's first iteration")
    ap.add_argument("--compile-for", default="throughput", choices=["throughput", "startup"],
                    help="rljax's compile_for")
    args = ap.parse_args()

    from jax._src import monitoring
    from rljax.train.phases import grpo

    spans, marks = [], {}

    def on_span(event, start, end, **kw):
        spans.append((event.rsplit("/", 1)[-1].removesuffix("_duration"), start, end,
                      kw.get("fun_name"), threading.current_thread().name))
    monitoring.register_event_time_span_listener(on_span)
    original = grpo.GRPOPhase.iteration

    def iteration(self, state, step):   # marks the first iteration's start on the same clock
        marks.setdefault("start", time.time())
        return original(self, state, step)
    grpo.GRPOPhase.iteration = iteration

    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, args.shape)
        grpo_step.write_model(args.shape, model, seed=0)
        spec = grpo_step.make_spec(model, args.prompts, args.generations, args.new_tokens,
                                   args.iters, seed=0)
        spec["compilation_cache_dir"] = args.cache or os.path.join(tmp, "jax_cache")
        spec["compile_for"] = args.compile_for
        res = grpo_step.rljax_worker(spec)
    t0 = marks["start"]
    print(f"first iteration {res['first_iter_s']:.2f} s (setup before it {res['setup_s']:.2f} "
          f"s), steady {res['iter_s']:.3f} s/iter, load average {os.getloadavg()[0]:.2f}")
    cores = len(os.sched_getaffinity(0))
    print(f"first iteration process CPU {res['first_iter_cpu_s']:.2f} s (all threads): on "
          f"{cores} cores at least {res['first_iter_cpu_s'] / cores:.2f} s of wall time")
    print(f"{'from s':>7} {'to s':>7} {'secs':>6}  {'kind':28s} program [thread]")
    totals: dict = {}
    for kind, start, end, fun, thread in sorted(spans, key=lambda s: s[1]):
        if start >= t0 and end - start >= args.min_ms / 1e3:
            print(f"{start - t0:7.2f} {end - t0:7.2f} {end - start:6.3f}  {kind:28s} {fun} "
                  f"[{thread}]")
        if start >= t0 and end <= t0 + res["first_iter_s"]:
            totals[kind] = totals.get(kind, 0.0) + end - start
    print("first iteration totals (s): " + ", ".join(f"{k} {v:.2f}" for k, v in totals.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"result": res, "first_iter_start": t0, "spans": spans}, f, indent=1)


if __name__ == "__main__":
    main()
