"""Search and process rewards against plain GRPO on multi-step arithmetic (CPU, tiny llama).

For one seed, ``rljax train`` runs from the same SFT warm-up (same model config, seed and
warm-up keys, so the same 200-step warm-up):

* ``prm``: ``configs/prm_arithmetic_steps.py``, the process reward model the ``grpo_prm`` arm
  reads (Math-Shepherd labels sampled from the warmed-up policy; its sampled tokens are
  reported, not counted against the RL budget);
* ``grpo``: ``configs/grpo_arithmetic_steps.py`` for ``--iterations`` iterations;
* ``grpo_prm``: ``configs/grpo_prm_arithmetic_steps.py`` (``algo.adv_estimator='grpo_process'``
  on the ``prm`` run), the same iterations, so the same sampled tokens as ``grpo``;
* ``rest_mcts``: ``configs/sft_mcts_arithmetic_steps.py`` (MCTS over steps, SFT on the best
  verified trace per prompt) for ``--mcts-rounds`` rounds: set so that the tokens its searches
  decode match ``grpo``'s (from a probe of its tokens per round).

Each run evaluates greedy accuracy on the task's 500 held-out problems after the warm-up and at
the end. Writes and prints per-run summaries: accuracies, decoded tokens, CPU seconds.

    python bench/search_vs_grpo.py --seed 0 --out bench/results/search_vs_grpo_s0.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train(workdir: str, config: str, overrides: list[str]) -> dict:
    """One ``rljax train`` run (skipped when ``workdir`` already has metrics); its summary."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    if not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
        cmd = [sys.executable, "-m", "rljax.cli", "train", "--config", config, "--workdir",
               workdir, *[f"--config.{o}" for o in overrides]]
        print(" ".join(cmd), flush=True)
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    evals = [r for r in records if "eval/accuracy" in r]
    trained = [r for r in records if "rollout/tokens" in r]
    out = {"config": config, "overrides": overrides, "wall_s": round(time.time() - t0, 1),
           "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1),
           "iterations": len(trained),
           "decoded_tokens": int(sum(r.get("rollout/decoded_tokens", r["rollout/tokens"])
                                     for r in trained))}
    if len(evals) >= 2:
        out["accuracy_after_warmup"] = evals[0]["eval/accuracy"]
        out["accuracy"] = evals[-1]["eval/accuracy"]
    for key in ("process/step_score_mean", "mcts/solved_frac", "reward/mean"):
        seen = [r[key] for r in trained if key in r]
        if seen:
            out[key + "_last10"] = round(sum(seen[-10:]) / len(seen[-10:]), 4)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iterations", type=int, default=60, help="GRPO iterations per arm")
    p.add_argument("--mcts-rounds", type=int, required=True,
                   help="rest_mcts rounds (matched to GRPO's decoded tokens by a probe)")
    p.add_argument("--arms", default="grpo,grpo_prm,rest_mcts")
    p.add_argument("--workdir", default="/tmp/search_vs_grpo")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    s, root = args.seed, args.workdir
    seed = [f"seed={s}"]
    prm_dir = os.path.join(root, f"prm_s{s}")
    runs = {}
    if "grpo_prm" in args.arms:
        runs["prm"] = train(prm_dir, "configs/prm_arithmetic_steps.py", seed)
    steps = [f"steps={args.iterations}"]
    specs = {"grpo": ("configs/grpo_arithmetic_steps.py", steps),
             "grpo_prm": ("configs/grpo_prm_arithmetic_steps.py",
                          steps + [f"algo.process_reward.prm={prm_dir}"]),
             "rest_mcts": ("configs/sft_mcts_arithmetic_steps.py",
                           [f"steps={args.mcts_rounds}", "checkpoint_every=0"])}
    for arm in args.arms.split(","):
        config, extra = specs[arm]
        runs[arm] = train(os.path.join(root, f"{arm}_s{s}"), config, seed + extra)
    result = {"seed": s, "machine": f"{platform.processor() or platform.machine()}, "
                                    f"{os.cpu_count()} CPUs",
              "date": time.strftime("%Y-%m-%d"), "load_avg": os.getloadavg(), "runs": runs}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
