"""Where a decode step's time goes: ``sampling.generate`` per-step cost and its parts.

    python bench/decode_step.py [--shape real|toy] [--runs 5]

real: SmolLM2-135M's shape (random weights, vocab 49,152), 8 prompts (57-137 tokens, bucket
160) x G=4, 64 new tokens; toy: the GRPO benchmark's 4L-128 llama, 32 prompts x 32, 64 new. Temperature
1, no stop id. Per step = (generate at N - generate at N=1) / (N - 1), medians of ``--runs``
interleaved calls, wall and process CPU seconds. Parts: one decode step jitted alone on the
per-layer (unstacked) weights and cache at B*G rows and S = bucket + N slots: the layers, the
LM head and ``sample_logits``. Prints the load average: on a shared machine CPU seconds are
the steadier figure.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from rljax import models, sampling

SHAPES = {   # model overrides of preset "tiny"; prompts, G, bucket, N, prompt length range
    "real": (dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                  num_heads=9, num_kv_heads=3, max_position_embeddings=2048,
                  tie_word_embeddings=True), 8, 4, 160, 64, (57, 138)),
    "toy": (dict(vocab_size=259, num_layers=4, hidden_size=128, intermediate_size=384,
                 num_heads=4, num_kv_heads=2), 32, 1, 32, 64, (16, 33)),
}


def timed(fns: dict, runs: int) -> dict:
    """{name: (median wall s, median CPU s)} over ``runs`` interleaved rounds after a warm-up."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    wall, cpu = {k: [] for k in fns}, {k: [] for k in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn())
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return {k: (statistics.median(wall[k]), statistics.median(cpu[k])) for k in fns}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="real")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    overrides, b, g, p, n, lengths = SHAPES[args.shape]
    cfg = models.get_preset("tiny", **overrides)
    params = models.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    ids = [list(rng.integers(3, cfg.vocab_size, int(rng.integers(*lengths)))) for _ in range(b)]
    tok, mask = sampling.pad_to_bucket(ids, pad_id=0, buckets=(p,))
    keys = iter(jax.random.split(jax.random.key(0), 4 * args.runs + 8))

    def gen(new):
        return lambda: sampling.generate(cfg, params, tok, mask, rng=next(keys), max_new_tokens=new,
                                         temperature=1.0, pad_id=0, num_samples=g).tokens

    load0 = os.getloadavg()[0]
    t = timed({"generate": gen(n), "generate N=1": gen(1)}, args.runs)
    step_wall = (t["generate"][0] - t["generate N=1"][0]) / (n - 1)
    step_cpu = (t["generate"][1] - t["generate N=1"][1]) / (n - 1)

    # One decode step alone, on the decode loop's per-layer weights and cache.
    rows, s = b * g, p + n
    dparams = models.unstack_layers(params)
    cache = models.unstack_cache(models.init_cache(cfg, rows, s))
    prev, pos = jnp.ones((rows, 1), jnp.int32), jnp.full((rows, 1), p + n // 2)
    slots = jnp.ones((rows, s), bool)
    hidden = jax.random.normal(jax.random.key(1), (rows, cfg.hidden_size))
    logits = jax.random.normal(jax.random.key(2), (rows, cfg.vocab_size))
    # The cache is donated and carried from call to call, as in the loop (written in place).
    layers = jax.jit(lambda c: models.trunk(cfg, dparams, prev, attention_mask=slots,
                                            positions=pos, cache=c, cache_index=p + n // 2),
                     donate_argnums=0)
    carried = {"cache": cache}

    def run_layers():
        hidden_out, carried["cache"] = layers(carried["cache"])
        return hidden_out

    head = jax.jit(lambda h: models.logits_from_hidden(cfg, dparams, h))
    draw = jax.jit(lambda k, x: sampling.sample_logits(k, x, temperature=1.0))
    parts = timed({"layers": run_layers, "LM head": lambda: head(hidden),
                   "sample_logits": lambda: draw(jax.random.key(3), logits)}, args.runs)

    print(f"{args.shape}: {b} prompts x G={g}, bucket {p}, {n} new; load {load0:.1f} -> "
          f"{os.getloadavg()[0]:.1f}")
    print(f"generate {t['generate'][0]:.3f} s wall / {t['generate'][1]:.3f} s CPU "
          f"({rows * n / t['generate'][0]:.0f} tok/s); per decode step {step_wall * 1e3:.1f} ms "
          f"wall / {step_cpu * 1e3:.1f} ms CPU")
    for name, (w, c) in parts.items():
        print(f"  {name}: {w * 1e3:.2f} ms wall / {c * 1e3:.2f} ms CPU")


if __name__ == "__main__":
    main()
