"""Distillation vs GRPO on the toy student (docs/algorithms.md, "Pre-registered comparison"):
reads the runs' metrics and prints, per run, the sampled tokens to reach a held-out accuracy
target, the accuracy at the end, and the first/last distillation metrics.

    python bench/distill_toy.py --target 0.511 runs/distill_s0 runs/grpo_s0 ...

Sampled tokens are the cumulative ``rollout/tokens`` of the RL phase (the SFT warm-up samples
none; the teacher's scoring pass is not sampling), read at each ``eval/accuracy`` record.
"""
from __future__ import annotations

import argparse
import json
import os


def summarise(workdir: str, target: float) -> dict:
    tokens, reached, curve = 0, None, []
    first_kl = last_kl = first_agree = last_agree = None
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    start = min((r["step"] for r in records if "rollout/tokens" in r), default=None)
    for r in records:
        if "rollout/tokens" in r:
            tokens += int(r["rollout/tokens"])
        if "distill/reverse_kl" in r:
            first_kl = r["distill/reverse_kl"] if first_kl is None else first_kl
            last_kl = r["distill/reverse_kl"]
            agree = r.get("distill/teacher_agreement")
            first_agree = agree if first_agree is None else first_agree
            last_agree = agree
        if "eval/accuracy" in r and start is not None and r["step"] >= start - 1:
            curve.append((r["step"], tokens, r["eval/accuracy"]))
            if reached is None and r["eval/accuracy"] >= target:
                reached = tokens
    return {"run": os.path.basename(workdir.rstrip("/")), "start_accuracy": curve[0][2],
            "final_accuracy": curve[-1][2], "best_accuracy": max(c[2] for c in curve),
            "sampled_tokens": tokens, "tokens_to_target": reached,
            "reverse_kl": (first_kl, last_kl), "teacher_agreement": (first_agree, last_agree)}


def cells(s: dict) -> tuple[str, str, str]:
    """A summary's reverse-KL, teacher-agreement (first -> last) and tokens-to-target cells."""
    def first_last(pair):
        return "-" if pair[0] is None else f"{pair[0]:.2f} -> {pair[1]:.2f}"
    reached = ("not reached" if s["tokens_to_target"] is None
               else f"{s['tokens_to_target']:,}")
    return first_last(s["reverse_kl"]), first_last(s["teacher_agreement"]), reached


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=float, required=True)
    p.add_argument("workdirs", nargs="+")
    args = p.parse_args(argv)
    print("| run | accuracy after SFT | at the end (best) | sampled tokens | tokens to "
          f"{args.target} | reverse KL first -> last | teacher agreement first -> last |")
    print("|---|---|---|---|---|---|---|")
    for w in args.workdirs:
        s = summarise(w, args.target)
        kl, ag, reached = cells(s)
        print(f"| {s['run']} | {s['start_accuracy']:.3f} | {s['final_accuracy']:.3f} "
              f"({s['best_accuracy']:.3f}) | {s['sampled_tokens']:,} | {reached} | {kl} | {ag} |")


if __name__ == "__main__":
    main()
