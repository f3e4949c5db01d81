"""Concurrent streams (``rljax.streams``): the sampler and the GRPO update at several counts.

    python bench/streams.py [--part sampler,update] [--shape toy|small|real] [--streams 1,2,4]
                            [--micro-batches 1] [--runs 7]

sampler: ``sampling.generate(streams=k)``, temperature 1, exactly N new tokens; toy: issue
13's 4L-128 llama, 32 prompts x G=1 (bucket 32, N=64), and 8 prompts x G=8; real:
SmolLM2-135M's shape (random weights), 8 prompts x G=4, bucket 160, N=64; small: none.

update: one GRPO update of ``bench/update_step.py``'s batch (shared prompt; real: grouped by
length too; small: ``UPDATE_SHAPES``) with ``algo.update_streams=k``, for each count of
micro-batches in ``--micro-batches`` (each micro-batch is cut into k parts: more
micro-batches, smaller parts).

Medians of ``--runs`` interleaved calls after two warm-ups; wall and process-CPU seconds; the
load average before and after.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import update_step  # noqa: E402  (its shapes and rollout batch)
from rljax import config as config_lib, models, sampling  # noqa: E402
from rljax.train.core import steps  # noqa: E402
from rljax.train.phases import grpo  # noqa: E402
from rljax.train.core.state import create_train_state  # noqa: E402

SAMPLER_SHAPES = {"toy": [(32, 1, 32, 64), (8, 8, 32, 64)], "real": [(8, 4, 160, 64)]}
# The update's shapes: update_step.py's, and small: an 8L-256 llama (vocab 2,048, ~7M params),
# 8 prompts of 40-64 tokens (bucket 64) x G=8 x 64, one micro-batch.
UPDATE_SHAPES = dict(update_step.SHAPES, small=(
    dict(vocab_size=2048, num_layers=8, hidden_size=256, intermediate_size=768, num_heads=4,
         num_kv_heads=2), 8, 8, 64, 64, (40, 65), 64))


def interleaved(fns: dict, runs: int) -> dict:
    """{name: (median wall s, median CPU s)}, rounds interleaved after two warm-up calls."""
    for fn in fns.values():
        fn(), fn()
    wall, cpu = {k: [] for k in fns}, {k: [] for k in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return {k: (statistics.median(wall[k]), statistics.median(cpu[k])) for k in fns}


def bench_sampler(shape: str, counts: list[int], runs: int) -> None:
    overrides = UPDATE_SHAPES[shape][0]
    cfg = models.get_preset("tiny", **overrides)
    params = models.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    for b, g, p, n in SAMPLER_SHAPES.get(shape, []):
        ids = [list(rng.integers(3, cfg.vocab_size, int(rng.integers(p // 2, p + 1))))
               for _ in range(b)]
        tok, mask = sampling.pad_to_bucket(ids, pad_id=0, buckets=(p,))
        keys = iter(jax.random.split(jax.random.key(1), 8 * runs + 32))

        def call(k):
            return lambda: jax.block_until_ready(sampling.generate(
                cfg, params, tok, mask, rng=next(keys), max_new_tokens=n, temperature=1.0,
                pad_id=0, num_samples=g, streams=k).tokens)
        t = interleaved({k: call(k) for k in counts}, runs)
        print(f"\nsampler {shape}: {b} prompts x G={g}, bucket {p}, N={n}")
        print("| streams | s per generate | CPU s | tok/s |\n|---|---|---|---|")
        for k, (w, c) in t.items():
            print(f"| {k} | {w:.4f} | {c:.4f} | {b * g * n / w:,.0f} |")


def bench_update(shape: str, counts: list[int], runs: int, micro_counts=(None,)) -> None:
    """``micro_counts``: micro-batches per update (None: the shape's micro-batch size)."""
    overrides, b, g, p, n, lengths, micro = UPDATE_SHAPES[shape]
    cfg = models.get_preset("tiny", **overrides)
    batch = update_step.rollout_batch(cfg, b, g, p, n, lengths)
    opt = optax.adamw(1e-5, weight_decay=0.0)
    carried = {"state": create_train_state(models.init_params(cfg, jax.random.key(0)), opt,
                                           jax.random.key(1))}
    fns = {}
    for num_micro in micro_counts:
        num_micro = num_micro or b * g // micro
        for k in counts:
            algo = config_lib.default_config().algo
            algo.update(num_generations=g, beta=0.0, shared_prompt=True,
                        group_by_length=shape == "real", update_streams=k)
            step = grpo.build_update(cfg, algo, opt, num_micro=num_micro)

            def run(step=step):   # the state is donated: each call continues from the last one
                carried["state"], m = step(carried["state"], batch)
                return steps.to_host(m)
            ran = step.update_streams(b * g)
            fns[f"{k} (runs {ran}) | {num_micro} | {b * g // num_micro // ran}"] = run
    t = interleaved(fns, runs)
    print(f"\nupdate {shape}: {b} prompts x G={g}, bucket {p}, N={n}")
    print("| update_streams | micro-batches | rows per part | s per update | CPU s |\n"
          "|---|---|---|---|---|")
    for k, (w, c) in t.items():
        print(f"| {k} | {w:.3f} | {c:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="sampler,update")
    ap.add_argument("--shape", choices=sorted(UPDATE_SHAPES), default="toy")
    ap.add_argument("--streams", default="1,2,4")
    ap.add_argument("--micro-batches", default="",
                    help="micro-batches per update, e.g. 1,4 (default: the shape's)")
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    counts = [int(k) for k in args.streams.split(",")]
    load0 = os.getloadavg()[0]
    if "sampler" in args.part:
        bench_sampler(args.shape, counts, args.runs)
    if "update" in args.part:
        micro = [int(m) for m in args.micro_batches.split(",")] if args.micro_batches else [None]
        bench_update(args.shape, counts, args.runs, micro)
    print(f"\nload average {load0:.1f} -> {os.getloadavg()[0]:.1f}; {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
