"""Decode-step layers at the real shape with S = 224 vs S = 65 cache slots (an ablation).

    python bench/decode_slots.py

How much of the per-step layer time is attention / KV-cache reads: SmolLM2-135M's shape
(random weights), 32 rows (8 prompts x G=4), the per-layer (unstacked) weights and cache as
in the decode loop, cache donated and carried. S = 224 is bucket 160 + 64 new; S = 65 is the
completion part alone. Median of 5 calls after a warm-up, wall and process CPU seconds, twice
interleaved; prints the load average.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp

from bench.decode_step import SHAPES
from rljax import models


def layers_ms(cfg, params, rows: int, slots: int, runs: int = 5) -> tuple[float, float]:
    """(median wall ms, median CPU ms) of one jitted decode step's layers at ``slots`` cache slots."""
    cache = models.unstack_cache(models.init_cache(cfg, rows, slots))
    prev, pos = jnp.ones((rows, 1), jnp.int32), jnp.full((rows, 1), slots - 2)
    mask = jnp.ones((rows, slots), bool)
    step = jax.jit(lambda c: models.trunk(cfg, params, prev, attention_mask=mask, positions=pos,
                                          cache=c, cache_index=slots - 2), donate_argnums=0)
    hidden, cache = step(cache)
    jax.block_until_ready(hidden)
    wall, cpu = [], []
    for _ in range(runs):
        t0, c0 = time.perf_counter(), time.process_time()
        hidden, cache = step(cache)
        jax.block_until_ready(hidden)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3


def main() -> None:
    cfg = models.get_preset("tiny", **SHAPES["real"][0])
    params = models.unstack_layers(models.init_params(cfg, jax.random.key(0)))
    for slots in (224, 65, 224, 65):
        wall, cpu = layers_ms(cfg, params, rows=32, slots=slots)
        print(f"S={slots}: layers {wall:.1f} ms wall / {cpu:.1f} ms CPU; "
              f"load {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
