"""Per-token sampling cost at a real vocabulary: Gumbel-max vs inverse-CDF draw, and whole
``sampling.generate`` calls on the SmolLM2-135M shape (random weights) with either draw.

    python bench/sample_step.py [--runs 5] [--new-tokens 32] [--out bench/results/sample_step.json]

Draw alone: jitted ``jax.random.categorical`` (what ``sample_logits`` used at every vocabulary
size) against ``sampling.categorical_inverse_cdf`` (used from ``INVERSE_CDF_MIN_VOCAB``
tokens on) on float32 logits [B, V], plus the whole ``sample_logits`` (temperature 1, and
top-p 0.9) with each draw. Generate: 8 prompts of 12 tokens (bucket 16: decode, not the
prefill, dominates) x G = 4, exactly
``--new-tokens`` tokens (no stop id), temperature 1. Every contender runs once to compile,
then ``--runs`` interleaved rounds; medians reported with the load average.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# Run from a checkout without installing: the repository root holds the `rljax` package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from rljax import models, sampling

# SmolLM2-135M-Instruct's shape (HF config): 30 layers, 576 wide, 9 heads / 3 KV heads.
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                    num_heads=9, num_kv_heads=3, max_position_embeddings=2048,
                    tie_word_embeddings=True)


def interleaved(fns: dict, runs: int) -> tuple[dict, dict]:
    """({name: [wall seconds per round]}, {name: [process CPU seconds per round]}) after one
    warm-up call each; every round runs each fn once. CPU seconds (all threads) are less
    sensitive than wall time to other processes taking the cores."""
    for fn in fns.values():
        jax.block_until_ready(fn(0))
    wall, cpu = {k: [] for k in fns}, {k: [] for k in fns}
    for r in range(1, runs + 1):
        for name, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn(r))
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return wall, cpu


def with_draw(draw: str, fn):
    """``fn`` traced with ``sample_logits`` using ``draw`` at every vocabulary size ("gumbel")
    or the default threshold ("inverse_cdf"): the module constant is read at trace time."""
    def traced(*args, **kwargs):
        saved = sampling.draw.INVERSE_CDF_MIN_VOCAB
        sampling.draw.INVERSE_CDF_MIN_VOCAB = saved if draw == "inverse_cdf" else 1 << 62
        try:
            return fn(*args, **kwargs)
        finally:
            sampling.draw.INVERSE_CDF_MIN_VOCAB = saved
    return traced


def draw_fns(batch: int, vocab: int) -> dict:
    # Logits are an argument, not a closed-over constant (XLA would fold work into compile).
    logits = jax.random.normal(jax.random.key(1), (batch, vocab)) * 3.0
    key = jax.random.key(0)
    cat = jax.jit(lambda k, x: jax.random.categorical(k, x, axis=-1))
    icdf = jax.jit(sampling.categorical_inverse_cdf)
    fns = {"categorical (Gumbel-max) alone": cat, "inverse CDF alone": icdf}
    for draw in ("gumbel", "inverse_cdf"):
        for top_p in (1.0, 0.9):
            f = jax.jit(with_draw(draw, lambda k, x, p=top_p: sampling.sample_logits(
                k, x, temperature=1.0, top_p=p)))
            fns[f"sample_logits top_p={top_p}, {draw}"] = f
    return {name: (lambda r, f=f: f(jax.random.fold_in(key, r), logits))
            for name, f in fns.items()}


def generate_fns(new_tokens: int, prompts: int = 8, g: int = 4, prompt_len: int = 12) -> dict:
    cfg = models.get_preset("tiny", **SMOLLM2_135M)
    params = models.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    ids = [list(rng.integers(3, cfg.vocab_size, prompt_len)) for _ in range(prompts)]
    tok, mask = sampling.pad_to_bucket(ids, pad_id=0)
    raw = sampling.core._generate.__wrapped__   # one jit per draw: separate traces and caches
    jits = {d: jax.jit(with_draw(d, raw), static_argnames=sampling.core._STATIC)
            for d in ("gumbel", "inverse_cdf")}
    kw = dict(max_new_tokens=new_tokens, temperature=1.0, top_k=0, top_p=1.0, stop_ids=(),
              pad_id=0, num_samples=g, min_new_tokens=0, mesh=None, rules=(),
              cache_dtype=None)
    return {f"generate {prompts}x{g}x{new_tokens}, {d}":
            (lambda r, f=f: f(cfg=cfg, params=params, prompt_tokens=jnp.asarray(tok),
                              prompt_mask=jnp.asarray(mask), rng=jax.random.key(r),
                              **kw).tokens)
            for d, f in jits.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--skip-generate", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    load0 = os.getloadavg()
    times, cpu = interleaved(draw_fns(args.batch, args.vocab), args.runs)
    if not args.skip_generate:
        for out, more in zip((times, cpu), interleaved(generate_fns(args.new_tokens), args.runs)):
            out.update(more)
    load1 = os.getloadavg()
    print(f"| B={args.batch}, V={args.vocab} (generate: SmolLM2-135M shape) | median ms | "
          f"min ms | median CPU ms |\n|---|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts) * 1e3:.1f} | {min(ts) * 1e3:.1f} | "
              f"{statistics.median(cpu[name]) * 1e3:.1f} |")
    print(f"load average {load0[0]:.1f} at the start, {load1[0]:.1f} at the end; "
          f"{args.runs} interleaved rounds; jax {jax.__version__}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "load_start": load0, "load_end": load1,
                       "jax": jax.__version__, "seconds": times, "cpu_seconds": cpu}, f,
                      indent=1)


if __name__ == "__main__":
    main()
