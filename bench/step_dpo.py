"""Search in the rollout, measured on the built-in multi-step arithmetic task (CPU, tiny llama).

Two comparisons, each over seeds, each variant a plain ``rljax train`` run (same SFT warm-up
recipe, same seed per column, so each pair of runs starts from the same warmed-up policy):

* ``dpo``: step-level DPO from Monte-Carlo step values (``data.pairs=step_mc``) vs outcome-level
  online DPO (best vs worst of G samples, ``data.pairs=auto``), at (nearly) equal sampled
  tokens: both run the same number of rounds and outcome DPO gets ``--outcome-prompts`` prompts
  per round so that its sampled tokens match step_mc's (step_mc also samples continuations of
  step prefixes; the table reports the tokens each actually sampled).
* ``anneal``: GRPO with the exploratory annealed temperature schedule vs a constant
  temperature 1.0, same prompts and samples per step (sampled tokens differ only by the
  completions' lengths; reported).

Reported per run: held-out greedy accuracy after the warm-up and at the end (256 problems),
sampled tokens of the RL phase, CPU seconds of the run (load-independent, unlike wall time),
and, with ``--pass-at-k``, pass@1/2/4 of the final policy at temperature 1 (``rljax eval``).

    nice -n 10 python bench/step_dpo.py --experiment dpo --seeds 0,1,2
    nice -n 10 python bench/step_dpo.py --experiment anneal --seeds 0,1,2
    python bench/step_dpo.py --report bench/results/step_dpo_dpo*.json   # tables of saved runs

Writes ``bench/results/step_dpo_<experiment>.json`` and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

EXPERIMENTS = {
    "dpo": ("configs/dpo_arithmetic_step_mc.py", {
        "step_mc": ["data.pairs=step_mc"],
        "outcome": ["data.pairs=auto"],   # + rollout.batch_size from --outcome-prompts
    }),
    "anneal": ("configs/grpo_arithmetic_annealed.py", {
        "annealed": [],                    # the config's exp schedule, 1.2 -> 0.6
        "constant": ["rollout.temperature_schedule.name=constant"],
    }),
}


def run_variant(config: str, overrides: list[str], workdir: str) -> dict:
    """One ``rljax train`` run; its metrics and the CPU seconds it used (children's rusage)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    cmd = [sys.executable, "-m", "rljax.cli", "train", "--config", config, "--workdir", workdir,
           *[f"--config.{o}" for o in overrides]]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    evals = [r for r in records if "eval/accuracy" in r]
    rl = [r for r in records if "dpo/pairs" in r or "pg_loss" in r]
    return {
        "overrides": overrides,
        "acc_start": evals[0]["eval/accuracy"], "acc_end": evals[-1]["eval/accuracy"],
        "rl_steps": len(rl),
        "sampled_tokens": int(sum(r["rollout/tokens"] for r in rl)),
        "padding_tokens": int(sum(r.get("rollout/tokens_padding", 0) for r in rl)),
        "train_reward_last5": statistics.mean(r["reward/mean"] for r in rl[-5:]),
        "pairs_per_step": (statistics.mean(r["dpo/pairs"] for r in rl)
                           if "dpo/pairs" in rl[0] else None),
        "cpu_s": round((after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime), 1),
        "wall_s": round(time.time() - t0, 1),
    }


def pass_at_k(workdir: str, samples: int) -> dict:
    """pass@k of the workdir's final policy at temperature 1 (``rljax eval``)."""
    cmd = [sys.executable, "-m", "rljax.cli", "eval", "--workdir", workdir,
           f"--config.eval.num_samples={samples}", "--config.eval.temperature=1.0"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    record = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    return {("sampled_" + k.split("/")[1] if k == "eval/accuracy" else k.split("/")[1]): v
            for k, v in record.items() if k == "eval/accuracy" or k.startswith("eval/pass@")}


def report(paths: list[str]) -> None:
    """Markdown summary of saved result files: per variant, mean over seeds of the held-out
    accuracy (end, gain over the warm-up), sampled tokens and pass@k; and the paired
    difference of gains (first variant minus second, same seed = same warm-up)."""
    runs = [r for path in paths for r in json.load(open(path))["runs"]]
    variants = list(dict.fromkeys(r["variant"] for r in runs))
    mean = statistics.mean
    sd = lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0  # noqa: E731
    print("| variant | seeds | acc after warm-up | acc end | gain | sampled tokens / run | "
          "pass@1 (T=1) | pass@4 (T=1) |")
    print("|---|---|---|---|---|---|---|---|")
    for v in variants:
        rs = [r for r in runs if r["variant"] == v]
        gains = [r["acc_end"] - r["acc_start"] for r in rs]
        passk = (f"{mean(r['sampled_accuracy'] for r in rs):.3f} | "
                 f"{mean(r['pass@4'] for r in rs):.3f}" if "pass@4" in rs[0] else "- | -")
        print(f"| {v} | {len(rs)} | {mean(r['acc_start'] for r in rs):.3f} | "
              f"{mean(r['acc_end'] for r in rs):.3f} | {mean(gains):+.3f} ± {sd(gains):.3f} | "
              f"{mean(r['sampled_tokens'] for r in rs):,.0f} | {passk} |")
    a, b = variants[:2]
    by_seed = {(r["variant"], r["seed"]): r for r in runs}
    diffs = [(by_seed[(a, s)]["acc_end"] - by_seed[(b, s)]["acc_end"])
             for s in sorted({r["seed"] for r in runs}) if (a, s) in by_seed and (b, s) in by_seed]
    print(f"\npaired end-accuracy difference {a} - {b}: {mean(diffs):+.3f} ± {sd(diffs):.3f} "
          f"(sd over {len(diffs)} seeds; per seed {', '.join(f'{d:+.3f}' for d in diffs)})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experiment", choices=sorted(EXPERIMENTS))
    p.add_argument("--report", nargs="+", default=None, help="summarize saved result files")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=0, help="RL rounds (0 = the config's)")
    p.add_argument("--outcome-prompts", type=int, default=48,
                   help="dpo: prompts per round of outcome DPO (step_mc: 32); chosen so both "
                        "sample about the same number of tokens")
    p.add_argument("--pass-at-k", type=int, default=0, help="samples for pass@k (0 = off)")
    p.add_argument("--workdir", default="/tmp/rljax_bench_step_dpo")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    if args.report:
        report(args.report)
        return 0
    if not args.experiment:
        p.error("--experiment is required (or --report FILES)")
    config, variants = EXPERIMENTS[args.experiment]
    results = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for name, extra in variants.items():
            over = [f"seed={seed}", "checkpoint_every=0", "logging.tensorboard=false", *extra]
            if args.steps:
                over.append(f"steps={args.steps}")
            if name == "outcome":
                over.append(f"rollout.batch_size={args.outcome_prompts * 4}")
            workdir = os.path.join(args.workdir, f"{args.experiment}_{name}_s{seed}")
            subprocess.run(["rm", "-rf", workdir])
            res = dict(variant=name, seed=seed, **run_variant(config, over, workdir))
            if args.pass_at_k:
                res.update(pass_at_k(workdir, args.pass_at_k))
            print(json.dumps(res), flush=True)
            results.append(res)
    load = os.getloadavg()
    out = args.out or os.path.join(ROOT, "bench", "results", f"step_dpo_{args.experiment}.json")
    with open(out, "w") as f:
        json.dump({"experiment": args.experiment, "config": config, "loadavg_end": load,
                   "runs": results}, f, indent=1)
    print("\n| variant | seed | acc after warm-up | acc end | sampled tokens | cpu s | "
          "pass@1 / pass@k (T=1) |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        k = max((key for key in r if key.startswith("pass@")), default=None,
                key=lambda key: int(key[5:]))
        passk = f"{r['sampled_accuracy']:.3f} / {k} {r[k]:.3f}" if k else "-"
        print(f"| {r['variant']} | {r['seed']} | {r['acc_start']:.3f} | {r['acc_end']:.3f} | "
              f"{r['sampled_tokens']} | {r['cpu_s']} | {passk} |")
    for name in variants:
        rs = [r for r in results if r["variant"] == name]
        gains = [r["acc_end"] - r["acc_start"] for r in rs]
        print(f"{name}: mean acc end {statistics.mean(r['acc_end'] for r in rs):.3f}, mean gain "
              f"{statistics.mean(gains):+.3f} over {len(rs)} seeds; load avg at end {load}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
