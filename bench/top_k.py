"""Top-k threshold: ``lax.top_k`` vs the bisection ``sampling`` uses (``_top_k_threshold``).

    python bench/top_k.py [--batch 32] [--vocab 49152] [--k 50] [--runs 20]

Both jitted on the same float32 [batch, vocab] normal logits; checks they give the same k-th
value and prints the median wall time of each (after a warm-up) and the load average.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np

from rljax import sampling


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--k", type=int, default=50)
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    x = jax.random.normal(jax.random.key(0), (args.batch, args.vocab))
    fns = {"lax.top_k": jax.jit(lambda x: jax.lax.top_k(x, args.k)[0][:, -1:]),
           "bisection": jax.jit(lambda x: sampling.draw._top_k_threshold(x, args.k))}
    outs = {name: np.asarray(fn(x)) for name, fn in fns.items()}
    assert np.array_equal(*outs.values()), "thresholds differ"
    load = os.getloadavg()[0]
    for name, fn in fns.items():
        times = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            fn(x).block_until_ready()
            times.append(time.perf_counter() - t0)
        print(f"{name}: {1e3 * statistics.median(times):.2f} ms "
              f"([{args.batch}, {args.vocab}], k={args.k})")
    print(f"same threshold; load average {load:.1f}")


if __name__ == "__main__":
    main()
