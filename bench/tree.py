"""Tree sampling vs independent samples (docs/search.md, "Tree sampling").

Two parts:

``sampler``: one policy (a run's checkpoint, e.g. after the arithmetic demo's SFT warm-up),
the same prompts, the same number of completions per prompt M. Independent sampling
(``sampling.generate``, num_samples=M) against ``sampling.tree.generate`` for several tree
shapes, interleaved over ``--rounds`` rounds with fresh keys. Reported per shape:

- decoded tokens per completion: independent = mean completion length (every token is decoded
  by its own row); tree = ``out.decoded`` (each tree node's segment counted once) / completions;
- completion tokens per completion (what training sees: the same law for both, as every
  leaf is marginally a policy sample);
- mean reward of the completions, distinct completions per prompt (leaves are correlated);
- wall and process-CPU seconds per call (median; first call = compile, reported apart).

``grid``: training runs, ``rljax train`` per seed and arm, each run's final held-out greedy
accuracy, total decoded tokens (sum of ``rollout/decoded_tokens``), completions, mean
``time/step`` and ``time/sample``; ``--summarize`` only reads existing workdirs.

    python bench/tree.py sampler --workdir RUN_WORKDIR [--checkpoint STEP] [--prompts 128] [--rounds 5]
    python bench/tree.py grid --root runs/tree_grid --seeds 0,1,2 \\
        --arm plain=configs/grpo_arithmetic.py:--config.rollout.batch_size=512 \\
        --arm tree=configs/grpo_arithmetic_tree.py:--config.rollout.batch_size=896 \\
        --common=--config.steps=200            # [--summarize]

Results go to ``bench/results/tree_*.json`` with the load average at start and end.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)   # run from a checkout without installing


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ----------------------------------------------------------------------------- sampler

def sampler_bench(args) -> dict:
    import jax
    import numpy as np

    from rljax import config as config_lib
    from rljax import sampling
    from rljax.sampling import tree as tree_sampling
    from rljax.train.inference import load_for_inference
    from rljax.train.core.rollout import encode_prompts
    from rljax.train.core.setup import data_iterator

    cfg = config_lib.load_config_json(os.path.join(args.workdir, "config.json"))
    ctx, state, step = load_for_inference(cfg, args.workdir, args.checkpoint)
    examples = next(data_iterator(ctx, args.prompts, split="eval"))
    prompts = [ex["prompt"] for ex in examples]
    tok, mask = encode_prompts(ctx.tokenizer, prompts, cfg.data.max_prompt_length)
    reward_fn = ctx.reward_fn()
    n, m = cfg.rollout.max_new_tokens, args.leaves
    common = dict(max_new_tokens=n, temperature=cfg.rollout.temperature,
                  eos_id=ctx.tokenizer.eos_id, pad_id=ctx.tokenizer.pad_id)
    shapes = {"independent": None}
    for spec in args.shapes.split(","):   # L:k:roots
        seg, k, roots = (int(x) for x in spec.split(":"))
        depth = tree_sampling.tree_depth(roots, k, m)
        if depth is None or depth * seg >= n:
            raise SystemExit(f"shape {spec} does not give {m} leaves within {n} tokens")
        shapes[f"tree L={seg} k={k} roots={roots} depth={depth}"] = dict(
            segment_tokens=seg, branching=k, roots=roots, depth=depth)

    def call(opts, key):
        if opts is None:
            out = sampling.generate(ctx.model_cfg, state.params, tok, mask, rng=key,
                                    num_samples=m, **common)
            decoded = out.lengths
        else:
            out = tree_sampling.generate(ctx.model_cfg, state.params, tok, mask, rng=key,
                                         **opts, **common)
            decoded = out.decoded
        return jax.block_until_ready((out, decoded))

    stats = {name: dict(wall=[], cpu=[], decoded=[], tokens=[], reward=[], distinct=[])
             for name in shapes}
    first = {}
    for name, opts in shapes.items():   # warm-up: compile
        t0 = time.perf_counter()
        call(opts, jax.random.key(10_000))
        first[name] = time.perf_counter() - t0
    for r in range(args.rounds):
        key = jax.random.key(r)
        for name, opts in shapes.items():   # interleaved: load hits all alike
            w0, c0 = time.perf_counter(), time.process_time()
            out, decoded = call(opts, key)
            w1, c1 = time.perf_counter(), time.process_time()
            s = stats[name]
            s["wall"].append(w1 - w0)
            s["cpu"].append(c1 - c0)
            toks, msk = np.asarray(out.tokens), np.asarray(out.mask)
            s["decoded"].append(int(np.asarray(decoded).sum()))
            s["tokens"].append(int(msk.sum()))
            texts = ctx.tokenizer.batch_decode(toks, msk)
            fields = {k: [ex.get(k) for ex in examples for _ in range(m)]
                      for k in examples[0] if k != "prompt"}
            result = reward_fn([p for p in prompts for _ in range(m)], texts, **fields)
            s["reward"].append(float(np.mean(result.total)))
            s["distinct"].append(float(np.mean([len(set(texts[i * m:(i + 1) * m]))
                                                for i in range(len(prompts))])))
    completions = len(prompts) * m
    rows = {}
    for name, s in stats.items():
        rows[name] = {
            "decoded_per_completion": sum(s["decoded"]) / (completions * args.rounds),
            "tokens_per_completion": sum(s["tokens"]) / (completions * args.rounds),
            "mean_reward": statistics.mean(s["reward"]),
            "distinct_per_prompt": statistics.mean(s["distinct"]),
            "wall_s_median": statistics.median(s["wall"]),
            "cpu_s_median": statistics.median(s["cpu"]),
            "first_call_s": first[name],
        }
    base = rows["independent"]["decoded_per_completion"]
    for row in rows.values():
        row["decoded_ratio_vs_independent"] = base / row["decoded_per_completion"]
    return {"workdir": args.workdir, "checkpoint_step": int(step), "prompts": len(prompts),
            "leaves": m, "max_new_tokens": n, "temperature": cfg.rollout.temperature,
            "rounds": args.rounds, "rows": rows}


def print_sampler(res: dict) -> None:
    print(f"\n{res['prompts']} prompts x {res['leaves']} completions, N={res['max_new_tokens']}, "
          f"T={res['temperature']}, {res['rounds']} rounds; load {res['load_start']} -> "
          f"{res['load_end']}\n")
    print("| sampler | decoded tok / completion | x fewer | completion tok | reward | "
          "distinct / prompt | wall s (median) | CPU s (median) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in res["rows"].items():
        print(f"| {name} | {r['decoded_per_completion']:.3f} | "
              f"{r['decoded_ratio_vs_independent']:.2f} | {r['tokens_per_completion']:.3f} | "
              f"{r['mean_reward']:.3f} | {r['distinct_per_prompt']:.2f} | "
              f"{r['wall_s_median']:.3f} | {r['cpu_s_median']:.3f} |")


# ----------------------------------------------------------------------------- grid

def _summarize_run(workdir: str) -> dict | None:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    records = [json.loads(line) for line in open(path)]
    rl = [r for r in records if "rollout/decoded_tokens" in r]
    evals = [r for r in records if "eval/accuracy" in r]
    if not rl or not evals:
        return None
    return {
        "final_step": evals[-1]["step"],
        "eval_accuracy": evals[-1]["eval/accuracy"],
        "eval_accuracy_after_sft": evals[0]["eval/accuracy"],
        "rl_steps": len(rl),
        "decoded_tokens": int(sum(r["rollout/decoded_tokens"] for r in rl)),
        "completion_tokens": int(sum(r["rollout/tokens"] for r in rl)),
        "time_step_mean_s": statistics.mean(r["time/step"] for r in rl),
        "time_sample_mean_s": statistics.mean(r["time/sample"] for r in rl),
        "reward_last10": statistics.mean(r["reward/mean"] for r in rl[-10:]),
        "informative_groups_frac_mean": _mean_of(rl, "rollout/informative_groups_frac"),
        "time_update_mean_s": _mean_of(rl, "time/update"),
        "effective_samples_mean": _mean_of(rl, "rollout/effective_samples"),
        "group_size_max_mean": _mean_of(rl, "rollout/group_size_max"),
        "fork_tokens": int(sum(r.get("vine/fork_tokens", 0) for r in rl)),
    }


def _mean_of(records: list[dict], key: str) -> float | None:
    """Mean of ``key`` over the records that log it (None if none does: older runs)."""
    values = [r[key] for r in records if key in r]
    return statistics.mean(values) if values else None


def grid(args) -> dict:
    arms = dict(a.split("=", 1) for a in args.arm)
    runs = {}
    for seed in [int(s) for s in args.seeds.split(",")]:   # seed-major: arms finish together
        for name, spec in arms.items():
            config, *extra = spec.split(":")
            workdir = os.path.join(args.root, f"{name}_seed{seed}")
            if not args.summarize and not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
                cmd = [sys.executable, "-m", "rljax.cli", "train", "--config", config,
                       "--workdir", workdir, f"--config.seed={seed}", *args.common, *extra]
                print(" ".join(cmd), flush=True)
                t0 = time.perf_counter()
                with open(workdir + ".log", "w") as log:
                    subprocess.run(["/usr/bin/time", "-v", *cmd], stdout=log,
                                   stderr=subprocess.STDOUT, check=True, cwd=ROOT,
                                   env=dict(os.environ, PYTHONPATH=ROOT))
                print(f"  {time.perf_counter() - t0:.0f} s, load {_load()}", flush=True)
            runs[f"{name}_seed{seed}"] = dict(_summarize_run(workdir) or {},
                                             arm=name, seed=seed, cpu_s=_cpu_seconds(workdir))
    return {"arms": arms, "common": args.common, "runs": runs}


def _cpu_seconds(workdir: str) -> float | None:
    """User + system seconds from the run's ``/usr/bin/time -v`` log."""
    try:
        text = open(workdir + ".log").read()
    except OSError:
        return None
    total = 0.0
    for line in text.splitlines():
        line = line.strip()
        if line.startswith(("User time (seconds):", "System time (seconds):")):
            total += float(line.rsplit(":", 1)[1])
    return total or None


def _fmt(value: float | None, spec: str = ".3f") -> str:
    """A table cell: the number, or "-" where an older run did not record it."""
    return "-" if value is None else format(value, spec)


def print_grid(res: dict) -> None:
    print("\n| arm | seed | eval acc (after SFT -> end) | decoded tokens | completion tokens | "
          "informative groups | time/step s | time/sample s | time/update s | CPU s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    by_arm: dict = {}
    for r in res["runs"].values():
        if "eval_accuracy" not in r:
            continue
        by_arm.setdefault(r["arm"], []).append(r)
        print(f"| {r['arm']} | {r['seed']} | {r['eval_accuracy_after_sft']:.3f} -> "
              f"{r['eval_accuracy']:.3f} | {r['decoded_tokens']} | {r['completion_tokens']} | "
              f"{_fmt(r.get('informative_groups_frac_mean'))} | {r['time_step_mean_s']:.3f} | "
              f"{r['time_sample_mean_s']:.3f} | {_fmt(r.get('time_update_mean_s'))} | "
              f"{_fmt(r['cpu_s'], '.0f')} |")
    for arm, rs in by_arm.items():
        acc = [r["eval_accuracy"] for r in rs]
        sd = statistics.stdev(acc) if len(acc) > 1 else 0.0
        print(f"\n{arm}: accuracy {statistics.mean(acc):.3f} +- {sd:.3f} over {len(acc)} seeds; "
              f"decoded tokens {statistics.mean(r['decoded_tokens'] for r in rs):.0f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sampler")
    s.add_argument("--workdir", required=True)
    s.add_argument("--checkpoint", default=None, help="checkpoint step (default: the latest)")
    s.add_argument("--prompts", type=int, default=128)
    s.add_argument("--leaves", type=int, default=8)
    s.add_argument("--shapes", default="1:2:2,1:2:1,2:2:2", help="L:k:roots,...")
    s.add_argument("--rounds", type=int, default=5)
    s.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "tree_sampler.json"))
    g = sub.add_parser("grid")
    g.add_argument("--root", required=True)
    g.add_argument("--seeds", default="0,1,2")
    g.add_argument("--arm", action="append", required=True, help="NAME=CONFIG[:--override...]")
    g.add_argument("--common", action="append", default=[], help="override for every run")
    g.add_argument("--summarize", action="store_true")
    g.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "tree_grid.json"))
    args = parser.parse_args(argv)
    load_start = _load()
    res = sampler_bench(args) if args.cmd == "sampler" else grid(args)
    res.update(load_start=load_start, load_end=_load(), cpus=os.cpu_count())
    (print_sampler if args.cmd == "sampler" else print_grid)(res)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
