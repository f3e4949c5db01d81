"""Sampling seconds per training iteration: static sampler vs slot engine vs partial rollouts.

    python bench/partial.py [--workload toy|smollm2] [--prompts 64] [--generations 8]
                            [--new-tokens 128] [--slots 32] [--iterations 5]

Workloads as in bench/engine.py: ``toy``, its long-tailed toy model (geometric completion
lengths, mean/max ~0.3); ``smollm2``, SmolLM2-135M-Instruct on GSM8K test questions in its
chat template (each iteration B new questions).
Every iteration needs B groups of G completions (one GRPO batch) under fixed weights:

* static: ``sampling.generate`` on the iteration's B new prompts, until the longest row stops;
* engine: ``engine.generate`` on them (S refilled slots), until the last row stops;
* partial: a ``sampling.partial.Pool`` of 2B groups admits the B new prompts and decodes until
  B groups (any of the pool's) are complete; the others carry over.

Contenders are interleaved per iteration (static k, engine k, partial k, then k + 1), each
with one warm-up iteration first (compiles; the partial pool's first iteration also admits the
extra batch). Reported: median seconds per iteration, decoded tokens per iteration, the
partial batches' staleness. Writes ``bench/results/partial_<workload>.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import engine as bench_engine  # noqa: E402  (bench/engine.py: the workloads' models)
from rljax import sampling  # noqa: E402
from rljax.sampling import engine, partial  # noqa: E402


def toy_batches(count: int, b: int):
    """(model config, params, ``count`` batches of ``b`` prompt id lists, prompt bucket,
    eos id, pad id) of the toy workload."""
    cfg, params = bench_engine.toy_model()
    rng = np.random.default_rng(0)
    batches = [[list(rng.integers(1, 40, size=int(rng.integers(16, 33)))) for _ in range(b)]
               for _ in range(count)]
    return cfg, params, batches, 32, 0, 0


def smollm2_batches(count: int, b: int, model_dir: str):
    """The same for SmolLM2 on GSM8K: ``count * b`` questions in the chat template."""
    import real_model   # bench/real_model.py
    from rljax.train.core.rollout import prompt_buckets
    model_dir, tok, cfg, params = bench_engine.smollm2_model(model_dir)
    ids = [tok.encode(p) for p in real_model.chat_prompts(model_dir, count * b)]
    bucket = min(x for x in prompt_buckets(512) if x >= max(map(len, ids)))
    pad = tok.pad_id if tok.pad_id is not None else 0
    return cfg, params, [ids[i * b:(i + 1) * b] for i in range(count)], bucket, tok.eos_id, pad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=("toy", "smollm2"), default="toy")
    ap.add_argument("--model-dir", default=os.path.expanduser(
        "~/.cache/rljax/bench/smollm2-135m-instruct"))
    ap.add_argument("--prompts", type=int, default=64, help="B")
    ap.add_argument("--generations", type=int, default=8, help="G")
    ap.add_argument("--new-tokens", type=int, default=128, help="N")
    ap.add_argument("--slots", type=int, default=32, help="S")
    ap.add_argument("--chunk-steps", type=int, default=32)
    ap.add_argument("--iterations", type=int, default=5, help="timed iterations")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    b, g, n, s = args.prompts, args.generations, args.new_tokens, args.slots
    count = args.iterations + 2   # + the warm-up and the pool's extra one
    cfg, params, batches, bucket, eos, pad = (
        toy_batches(count, b) if args.workload == "toy"
        else smollm2_batches(count, b, args.model_dir))
    kw = dict(max_new_tokens=n, temperature=1.0, eos_id=eos, pad_id=pad, num_samples=g)
    pool = partial.Pool(cfg, num_samples=g, max_new_tokens=n, groups=2 * b, prompt_len=bucket,
                        slots=s, chunk_steps=args.chunk_steps, temperature=1.0, eos_id=eos,
                        pad_id=pad)
    pool_key, fed = jax.random.key(7), [0]
    times = {"static": [], "engine": [], "partial": []}
    decoded = {k: [] for k in times}
    staleness = []

    def static(k):
        p, m = sampling.pad_to_bucket(batches[k], pad_id=pad, buckets=(bucket,))
        out = sampling.generate(cfg, params, p, m, rng=jax.random.key(k), **kw)
        return int(np.asarray(out.lengths).sum())

    def slots(k):
        p, m = sampling.pad_to_bucket(batches[k], pad_id=pad, buckets=(bucket,))
        out, _ = engine.generate(cfg, params, p, m, rng=jax.random.key(k), slots=s,
                                 chunk_steps=args.chunk_steps, **kw)
        return int(np.asarray(out.lengths).sum())

    def carried(k):
        while pool.free >= b:
            pool.admit(batches[fed[0]], list(range(b)))
            fed[0] += 1
        taken = pool.run(params, pool_key, version=k, want=b, max_staleness=None)
        v = taken.rows["versions"][taken.rows["mask"]]
        staleness.append((float((k - v).mean()), int((k - v).max())))
        return taken.drawn

    fns = {"static": static, "engine": slots, "partial": carried}
    load = os.getloadavg()[0]
    first = {}
    for name, fn in fns.items():   # warm-up: compiles
        t0 = time.perf_counter()
        fn(0)
        first[name] = time.perf_counter() - t0
    for k in range(1, args.iterations + 1):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            decoded[name].append(fn(k))
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "backend": jax.default_backend(), "workload": args.workload,
        "prompt_bucket": bucket, "prompts": b,
        "generations": g, "new_tokens": n, "slots": s, "chunk_steps": args.chunk_steps,
        "iterations": args.iterations, "median_s_per_iteration": med, "times_s": times,
        "first_call_s": first, "decoded_tokens_per_iteration": decoded,
        "speedup_vs_static": {k: med["static"] / v for k, v in med.items()},
        "partial_staleness_mean_max": staleness[1:],
        "load_average_before": load, "load_average_after": os.getloadavg()[0],
    }
    out = args.out or os.path.join(ROOT, "bench", "results", f"partial_{args.workload}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print("| contender | median s / iteration | x static | decoded tokens / iteration |")
    print("|---|---|---|---|")
    for k in med:
        print(f"| {k} | {med[k]:.2f} | {result['speedup_vs_static'][k]:.2f} | "
              f"{statistics.median(decoded[k]):.0f} |")
    print(f"load {load:.1f} -> {result['load_average_after']:.1f}; {out}")


if __name__ == "__main__":
    main()
