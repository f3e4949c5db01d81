"""Distillation vs GRPO on SmolLM2-135M (docs/algorithms.md, "Pre-registered comparison
(SmolLM2-135M)"): per run, the sampled tokens to reach 90 % of the teacher's final held-out
accuracy, the accuracy at step 0 and at the end, the first/last distillation metrics, and the
run's wall and CPU seconds and load averages, as a markdown table and as JSON lines.

    python bench/distill_smollm2.py --teacher RUNS/grpo_full_s0 [--log RUNS/runs.log] \\
        [--json OUT.jsonl] RUNS/grpo_full_s0 RUNS/distill_full_s0 ...

Tokens are summed as in bench/distill_toy.py (``rollout/tokens``; the teacher's scoring pass
is not sampling). Times come from ``/usr/bin/time -v`` output in ``WORKDIR.time`` and loads
from ``START``/``END`` lines of the log (both optional).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from distill_toy import cells, summarise  # noqa: E402


def final_accuracy(workdir: str) -> float:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        accs = [r["eval/accuracy"] for r in map(json.loads, filter(str.strip, f))
                if "eval/accuracy" in r]
    return accs[-1]


def read_time(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    text = open(path).read()

    def num(pattern):
        m = re.search(pattern, text)
        return m.group(1) if m else None
    wall = num(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)")
    secs = None
    if wall:
        parts = [float(x) for x in wall.split(":")]
        secs = sum(p * 60 ** i for i, p in enumerate(reversed(parts)))
    user, system = num(r"User time \(seconds\): (\S+)"), num(r"System time \(seconds\): (\S+)")
    rss = num(r"Maximum resident set size \(kbytes\): (\d+)")
    return {"wall_s": secs, "cpu_s": (float(user) + float(system)) if user else None,
            "peak_rss_gb": int(rss) / 1e6 if rss else None}


def read_loads(log: str) -> dict:
    loads = {}
    if log and os.path.isfile(log):
        for line in open(log):
            m = re.match(r"(START|END) (\S+) (\S+) load (\S+)", line)
            if m:
                loads.setdefault(m.group(2), {})[m.group(1).lower()] = (m.group(3),
                                                                        float(m.group(4)))
    return loads


def _fmt_time(s):
    return "-" if s is None else f"{int(s // 60)} m {int(round(s % 60)):02d} s"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--teacher", required=True, help="the teacher's workdir")
    p.add_argument("--log", default="")
    p.add_argument("--json", default="")
    p.add_argument("workdirs", nargs="+")
    args = p.parse_args(argv)
    teacher_acc = final_accuracy(args.teacher)
    target = 0.9 * teacher_acc
    loads = read_loads(args.log)
    print(f"teacher final accuracy {teacher_acc:.3f}; target {target:.4f}")
    print("| run | accuracy at step 0 | at the end (best) | sampled tokens | tokens to target "
          "| reverse KL first -> last | teacher agreement first -> last | wall | CPU s "
          "| load start -> end |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for w in args.workdirs:
        s = summarise(w, target)
        name = os.path.basename(w.rstrip("/"))
        s.update(read_time(w.rstrip("/") + ".time"), teacher_accuracy=teacher_acc,
                 target=target, load=loads.get(name, {}))
        rows.append(s)
        kl, ag, reached = cells(s)
        ld = s["load"]
        load = (f"{ld['start'][1]:.2f} -> {ld['end'][1]:.2f}" if "start" in ld and "end" in ld
                else "-")
        cpu = "-" if s.get("cpu_s") is None else f"{s['cpu_s']:.0f}"
        print(f"| {name} | {s['start_accuracy']:.3f} | {s['final_accuracy']:.3f} "
              f"({s['best_accuracy']:.3f}) | {s['sampled_tokens']:,} | {reached} | {kl} | {ag} "
              f"| {_fmt_time(s.get('wall_s'))} | {cpu} | {load} |")
    if args.json:
        with open(args.json, "w") as f:
            for s in rows:
                f.write(json.dumps(s) + "\n")


if __name__ == "__main__":
    main()
