"""Projected GRPO throughput of a 7B model on a 64-chip pod: synchronous vs asynchronous vs
asynchronous with partial rollouts. On paper: a model of step times, checked against what
this machine measured.

    python bench/async_sim.py [--set KEY=VALUE ...] [--iterations 200]

The model (every number in ``PARAMS``, printed as one table; docs/scaling.md keeps it):

* **Decode** is memory-bound: one decode step of a sampler replica (``tp`` chips) reads its
  weight shard and the live rows' KV cache, ``(weights + kv_live) / (tp * hbm * hbm_eff)``.
  Rows of a batch are split evenly over the replicas. Completion lengths are geometric (each
  token stops with probability ``1 / (mean_frac * max_new)``), cut at ``max_new``: the shape of
  the toy workload that ``bench/partial.py`` measured (mean/max ~0.3).
* **Static** sampling (sync, async): each replica decodes until its longest row stops.
  **Partial** rollouts (async+partial): a pool of two batches; every unfinished row decodes
  each step; the iteration ends when ``prompts`` groups are complete, whose rows leave; the
  rest carry over (``sampling.partial``). Simulated step by step over ``--iterations``.
* **Training**: ``6 * params`` FLOPs per trained token (prompt and completion) plus
  ``2 * params`` per token for each log-prob pass (reference: one), at ``mfu`` of peak.
* **sync**: every chip samples, then every chip trains: ``gen(64) + train(64)``;
  **sync_partial** the same with the pool (rljax's ``rollout.partial`` today).
  **async** (lag 1): ``max(gen(r), train(64 - r)) + publish``, publish = the weights over the
  slower side's interconnect, ``weights / (min(r, 64 - r) * ici)``; the best split r in steps
  of ``tp`` is reported.

Calibration (printed by every run): the partial-rollout pool's sampling time against the
static sampler's on the toy workload (64 prompts x 8, 128 tokens, measured 2.07x faster on
this machine, ``bench/results/partial_toy.json``) is re-derived from the same step model; and
the measured synchronous sample/update split of the demo (``bench/results/async_step.json``)
gives the asynchronous speed-up two independent devices would have, against the 1.0x that
two fake devices sharing two cores measured. Writes ``bench/results/async_sim.json``.
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PARAMS = {   # name: (value, what)
    "params": (7e9, "model parameters (7B, dense)"),
    "bytes_per_param": (2, "bf16 weights"),
    "kv_bytes_per_token": (131072, "KV cache per token: 32 layers x 8 KV heads x 128 x 2 x bf16"),
    "chips": (64, "chips in the pod"),
    "peak_flops": (459e12, "bf16 peak FLOP/s per chip (TPU v5p class)"),
    "hbm": (2.76e12, "HBM bytes/s per chip"),
    "hbm_bytes": (95e9, "HBM bytes per chip (weights + KV must fit a replica, else waves)"),
    "hbm_eff": (0.6, "share of HBM bandwidth a decode step reaches"),
    "ici": (100e9, "weight-publish bytes/s per chip pair (one ICI link each way)"),
    "mfu": (0.4, "training model-FLOPs utilisation"),
    "tp": (4, "chips per sampler replica (tensor parallel)"),
    "prompts": (256, "prompts per batch"),
    "group": (16, "samples per prompt (G)"),
    "prompt_len": (512, "prompt tokens"),
    "max_new": (8192, "max completion tokens"),
    "mean_frac": (0.3, "mean completion length / max (the measured toy workload: 0.30)"),
    "logp_passes": (1, "extra forward passes per trained token (reference log-probs)"),
}


LOOPS = ("sync", "sync_partial", "async", "async_partial")


def lengths(rng, rows: int, p: dict) -> np.ndarray:
    """int [rows]: completion lengths, geometric with mean ~``mean_frac * max_new``, cut."""
    stop = 1.0 / (p["mean_frac"] * p["max_new"])
    return np.minimum(rng.geometric(stop, rows), p["max_new"])


def step_s(p: dict, rows_live: float, ctx_tokens: float) -> float:
    """Seconds of one decode step of one replica holding ``rows_live`` rows of mean context
    ``ctx_tokens``; rows beyond what its memory holds decode in further waves."""
    weights = p["params"] * p["bytes_per_param"]
    cap = max(1.0, (p["tp"] * p["hbm_bytes"] * 0.9 - weights)
              / ((p["prompt_len"] + p["max_new"]) * p["kv_bytes_per_token"]))
    waves = np.ceil(rows_live / cap) if rows_live > cap else 1.0
    kv = rows_live * ctx_tokens * p["kv_bytes_per_token"]
    return (waves * weights + kv) / (p["tp"] * p["hbm"] * p["hbm_eff"])


def static_gen_s(rng, p: dict, chips: int) -> tuple[float, int]:
    """(seconds, decode steps) of one static batch on ``chips`` sampler chips: every row of a
    replica's share decodes (finished ones as padding) until its longest row stops."""
    replicas = max(1, chips // p["tp"])
    rows = p["prompts"] * p["group"]
    per = int(np.ceil(rows / replicas))
    steps = int(lengths(rng, per * replicas, p).max())
    return steps * step_s(p, per, p["prompt_len"] + steps / 2), steps


def partial_gen_s(rng, p: dict, chips: int, iterations: int) -> tuple[float, float]:
    """(mean seconds, mean decode steps) per iteration of the partial-rollout pool (two
    batches in flight) on ``chips`` sampler chips, in steady state."""
    replicas = max(1, chips // p["tp"])
    b, g = p["prompts"], p["group"]
    left = lengths(rng, 2 * b * g, p).reshape(2 * b, g).astype(np.int64)
    done = np.zeros((2 * b, g), np.int64)   # tokens already decoded
    times, steps_all = [], []
    for it in range(iterations):
        finish = left.max(1)                  # steps until each group completes
        k = int(np.sort(finish)[b - 1])       # the b-th group to complete
        live_rows = np.minimum(left, k)       # steps each row decodes this iteration
        # live rows per step, per replica, at mean context
        live = np.array([(live_rows > s).sum() for s in range(0, max(k, 1), 64)]) / replicas
        ctx = p["prompt_len"] + done.mean() + k / 2
        times.append(sum(min(64, k - 64 * i) * step_s(p, n, ctx) for i, n in enumerate(live)))
        steps_all.append(k)
        left -= live_rows
        done += live_rows
        out = np.argsort(finish, kind="stable")[:b]
        left[out] = lengths(rng, b * g, p).reshape(b, g)
        done[out] = 0
    warm = iterations // 5
    return float(np.mean(times[warm:])), float(np.mean(steps_all[warm:]))


def train_s(p: dict, chips: int, trained_tokens: float) -> float:
    flops = (6 + 2 * p["logp_passes"]) * p["params"] * trained_tokens
    return flops / (chips * p["peak_flops"] * p["mfu"])


def publish_s(p: dict, r: int) -> float:
    return p["params"] * p["bytes_per_param"] / (min(r, p["chips"] - r) * p["ici"])


def project(p: dict, iterations: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    c, tp = p["chips"], p["tp"]
    rows = p["prompts"] * p["group"]
    tokens = rows * (p["prompt_len"] + p["mean_frac"] * p["max_new"])
    gen_all = np.mean([static_gen_s(rng, p, c)[0] for _ in range(5)])
    sync = gen_all + train_s(p, c, tokens)
    part_all = partial_gen_s(rng, p, c, iterations)[0]
    out = {"trained_tokens_per_iteration": tokens,
           "sync": {"s_per_iteration": sync, "gen_s": gen_all, "train_s": train_s(p, c, tokens)},
           "sync_partial": {"s_per_iteration": part_all + train_s(p, c, tokens),
                            "gen_s": part_all, "train_s": train_s(p, c, tokens)}}
    for name, gen in (("async", lambda r: np.mean([static_gen_s(rng, p, r)[0]
                                                   for _ in range(5)])),
                      ("async_partial", lambda r: partial_gen_s(rng, p, r, iterations)[0])):
        best = None
        for r in range(tp, c, tp):
            g_s, t_s = gen(r), train_s(p, c - r, tokens)
            total = max(g_s, t_s) + publish_s(p, r)
            if best is None or total < best["s_per_iteration"]:
                best = {"s_per_iteration": total, "rollout_chips": r, "gen_s": g_s,
                        "train_s": t_s, "publish_s": publish_s(p, r)}
        out[name] = best
    for name in LOOPS:
        out[name]["tokens_per_s"] = tokens / out[name]["s_per_iteration"]
        out[name]["speedup_vs_sync"] = sync / out[name]["s_per_iteration"]
    return out


def check() -> dict:
    """What this machine measured, against the model (see the module docstring)."""
    toy = dict({k: v for k, (v, _) in PARAMS.items()}, prompts=64, group=8, max_new=128,
               prompt_len=16, tp=1, chips=1, mean_frac=0.31)
    rng = np.random.default_rng(1)
    static = np.mean([static_gen_s(rng, toy, 1)[0] for _ in range(20)])
    partial = partial_gen_s(rng, toy, 1, 100)[0]
    out = {"toy_partial_speedup_model": static / partial}
    path = os.path.join(ROOT, "bench", "results", "partial_toy.json")
    if os.path.isfile(path):
        with open(path) as f:
            out["toy_partial_speedup_measured"] = json.load(f)["speedup_vs_static"]["partial"]
    path = os.path.join(ROOT, "bench", "results", "async_step.json")
    if os.path.isfile(path):
        with open(path) as f:
            s = json.load(f)["summary"]
        sync = s["sync_1"]
        sample, step = sync["time/sample"], sync["time/step"]
        out["demo_async_speedup_model"] = step / max(sample, step - sample)
        out["demo_async_speedup_measured"] = s["sync"]["time/step"] / s["async"]["time/step"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--set", nargs="*", default=[], help="PARAM=VALUE overrides")
    ap.add_argument("--iterations", type=int, default=100)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "async_sim.json"))
    args = ap.parse_args()
    p = {k: v for k, (v, _) in PARAMS.items()}
    for item in args.set:
        k, v = item.split("=", 1)
        if k not in p:
            raise SystemExit(f"unknown parameter {k!r}; known: {', '.join(p)}")
        p[k] = type(p[k])(float(v)) if isinstance(p[k], int) else float(v)
    print("| parameter | value | what |\n|---|---|---|")
    for k, (_, what) in PARAMS.items():
        print(f"| `{k}` | {p[k]:g} | {what} |")
    result = project(p, args.iterations)
    print("\n| loop | s / iteration | sampling s | training s | publish s | trained tokens / s "
          "| vs sync | rollout chips |\n|---|---|---|---|---|---|---|---|")
    for name in LOOPS:
        r = result[name]
        print(f"| {name} | {r['s_per_iteration']:.1f} | {r['gen_s']:.1f} | {r['train_s']:.1f} "
              f"| {r.get('publish_s', 0.0):.2f} | {r['tokens_per_s']:.0f} | "
              f"{r['speedup_vs_sync']:.2f}x | {r.get('rollout_chips', p['chips'])} of "
              f"{p['chips']} |")
    calib = check()
    print("\ncalibration: " + json.dumps({k: (round(v, 2) if isinstance(v, float) else v)
                                          for k, v in calib.items()}))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"params": p, "result": result, "calibration": calib}, f, indent=1)


if __name__ == "__main__":
    main()
