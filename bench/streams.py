"""Concurrent streams (``rljax.streams``): the sampler and the GRPO update at several counts.

    python bench/streams.py [--part sampler,update] [--shape toy|real] [--streams 1,2,4]
                            [--runs 7]

sampler: ``sampling.generate(streams=k)``, temperature 1, exactly N new tokens; toy: issue
13's 4L-128 llama, 32 prompts x G=1 (bucket 32, N=64), and 8 prompts x G=8; real:
SmolLM2-135M's shape (random weights), 8 prompts x G=4, bucket 160, N=64. update: one GRPO
update of ``bench/update_step.py``'s batch (shared prompt; real: grouped by length too) with
``algo.update_streams=k``. Medians of ``--runs`` interleaved calls after two warm-ups; wall
and process-CPU seconds; the load average before and after.
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
from rljax.train import length_groups, steps  # noqa: E402
from rljax.train.state import create_train_state  # noqa: E402

SAMPLER_SHAPES = {"toy": [(32, 1, 32, 64), (8, 8, 32, 64)], "real": [(8, 4, 160, 64)]}


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
    overrides = update_step.SHAPES[shape][0]
    cfg = models.get_preset("tiny", **overrides)
    params = models.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    for b, g, p, n in SAMPLER_SHAPES[shape]:
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


def bench_update(shape: str, counts: list[int], runs: int) -> None:
    overrides, b, g, p, n, lengths, micro = update_step.SHAPES[shape]
    cfg = models.get_preset("tiny", **overrides)
    batch = update_step.rollout_batch(cfg, b, g, p, n, lengths)
    opt = optax.adamw(1e-5, weight_decay=0.0)
    carried = {"state": create_train_state(models.init_params(cfg, jax.random.key(0)), opt,
                                           jax.random.key(1))}
    fns = {}
    for k in counts:
        algo = config_lib.default_config().algo
        algo.update(num_generations=g, beta=0.0, shared_prompt=True,
                    group_by_length=shape == "real", update_streams=k)
        step = length_groups.build_grpo_step(cfg, algo, opt, num_micro=b * g // micro)

        def run(step=step):   # the state is donated: each call continues from the last one
            carried["state"], m = step(carried["state"], batch)
            return steps.to_host(m)
        fns[f"{k} (runs {step.update_streams(b * g)})"] = run
    t = interleaved(fns, runs)
    print(f"\nupdate {shape}: {b} prompts x G={g}, bucket {p}, N={n}, micro-batch {micro}")
    print("| update_streams | s per update | CPU s |\n|---|---|---|")
    for k, (w, c) in t.items():
        print(f"| {k} | {w:.3f} | {c:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="sampler,update")
    ap.add_argument("--shape", choices=sorted(update_step.SHAPES), default="toy")
    ap.add_argument("--streams", default="1,2,4")
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    counts = [int(k) for k in args.streams.split(",")]
    load0 = os.getloadavg()[0]
    if "sampler" in args.part:
        bench_sampler(args.shape, counts, args.runs)
    if "update" in args.part:
        bench_update(args.shape, counts, args.runs)
    print(f"\nload average {load0:.1f} -> {os.getloadavg()[0]:.1f}; {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
