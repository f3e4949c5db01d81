"""What to train on, measured: plain GRPO against prompt-selection methods (and any other
config variant) at the same number of sampled tokens, several seeds each.

    python bench/curricula.py                                    # the default grid
    python bench/curricula.py --methods plain,online_filter --seeds 0
    python bench/curricula.py --method 'hint=algo.hint.name=seele;algo.hint.target=0.5' \\
        --methods plain,hint                                     # a new row from overrides
    python bench/curricula.py --method 'lite=@configs/grpo_arithmetic_lite_ppo.py' ...

Every run is ``rljax train`` in its own subprocess (``nice -n 10``) on the built-in arithmetic
task at the setting in ``SETTING`` (``--set KEY=VALUE`` to change it), from the same SFT
warm-up per seed. The harness follows the run's ``metrics.jsonl``: the cumulative sampled
tokens after each RL step are the sum of its ``rollout/tokens`` (every sampled completion
token, of re-sampling rounds too), and each held-out evaluation (``eval/accuracy``, greedy, on
problems training never draws) becomes a point (tokens, accuracy). Once an evaluation at or
beyond ``--budget`` sampled tokens is written, the run is stopped (SIGTERM: it saves and exits).
Accuracy "at T tokens" is the linear interpolation between the evaluations around T.
Raising ``--budget`` later continues finished runs from their checkpoints (exact resume).

Method specs: ``NAME=ITEM;ITEM;...`` where an item is ``key=value`` (a ``--config.`` override)
or ``@path/to/config.py`` (the config file, default ``--config``). Results merge into the JSON
by (method, seed); a (method, seed) already there with the same command is not run again
(``--rerun`` to force). Prints a markdown table; writes a plot of accuracy vs sampled tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DEFAULT_CONFIG = "configs/grpo_arithmetic.py"
# The setting (on top of the config file): see docs/curricula.md for why this one.
SETTING = [
    "data.kwargs.digits=2", "data.kwargs.operands=2", "data.kwargs.ops=+-",
    "data.kwargs.num_examples=2000", "sft.steps=50", "rollout.batch_size=256",
    "eval.num_examples=500", "checkpoint_every=0", "logging.tensorboard=false",
]
METHODS = {
    "plain": [],
    "online_filter": ["data.selection.name=online_filter", "data.selection.low=0.1",
                      "data.selection.high=0.9", "algo.max_sampling_rounds=3"],
    "predicted": ["data.selection.name=predicted", "data.selection.target=0.5",
                  "data.selection.pool_factor=4", "data.selection.decay=0.9"],
    "curriculum": ["data.selection.name=curriculum", "data.selection.knob=digits",
                   "data.selection.min_level=1", "data.selection.low=0.2",
                   "data.selection.high=0.5", "data.selection.window=10"],
    "dynamic_sampling": ["algo.dynamic_sampling=true", "algo.max_sampling_rounds=3"],
    "lite_ppo": ["@configs/grpo_arithmetic_lite_ppo.py"],
}


# ----------------------------------------------------------------------------- pure pieces

def parse_method(spec: str) -> tuple[str, list[str]]:
    """``NAME=ITEM;ITEM`` -> (name, items)."""
    name, sep, rest = spec.partition("=")
    if not sep or not name:
        raise SystemExit(f"--method {spec!r}: expected NAME=key=value;key=value;@config.py")
    return name.strip(), [item.strip() for item in rest.split(";") if item.strip()]


def command(method_items: list[str], seed: int, workdir: str, common: list[str],
            config: str, max_steps: int, eval_every: int) -> list[str]:
    """The ``rljax train`` command line of one run (method items override the setting)."""
    files = [i[1:] for i in method_items if i.startswith("@")]
    overrides = [i for i in method_items if not i.startswith("@")]
    cmd = ["nice", "-n", "10", sys.executable, "-m", "rljax.cli", "train", "--config",
           files[-1] if files else config, "--workdir", workdir]
    sets = common + [f"seed={seed}", f"steps={max_steps}", f"eval_every={eval_every}"]
    return cmd + [f"--config.{kv}" for kv in sets + overrides]


def curve(records: list[dict]) -> list[dict]:
    """Held-out accuracy vs cumulative sampled tokens: one point per evaluation
    ``{step, tokens, accuracy}``, tokens = sum of ``rollout/tokens`` of the RL steps up to it
    (0 for the evaluation after the SFT warm-up; earlier ones are dropped)."""
    tokens_at, total = {}, 0
    for r in sorted((r for r in records if "rollout/tokens" in r), key=lambda r: r["step"]):
        total += int(r["rollout/tokens"])
        tokens_at[r["step"]] = total
    points = []
    for r in records:
        if "eval/accuracy" not in r:
            continue
        done = [t for s, t in tokens_at.items() if s <= r["step"]]
        points.append({"step": r["step"], "tokens": max(done, default=0),
                       "accuracy": float(r["eval/accuracy"])})
    points.sort(key=lambda p: p["step"])
    # Evaluations during the SFT warm-up all sit at 0 tokens: the last one (after the
    # warm-up, the RL start) stands for them.
    return [p for i, p in enumerate(points)
            if i + 1 == len(points) or points[i + 1]["tokens"] != p["tokens"]]


def accuracy_at(points: list[dict], tokens: float) -> float | None:
    """Linear interpolation of accuracy at ``tokens`` between the evaluations around it;
    None beyond the last evaluation (the run did not sample that many tokens)."""
    if not points or tokens > points[-1]["tokens"]:
        return None
    prev = points[0]
    for p in points:
        if p["tokens"] >= tokens:
            if p["tokens"] == prev["tokens"]:
                return p["accuracy"]
            w = (tokens - prev["tokens"]) / (p["tokens"] - prev["tokens"])
            return prev["accuracy"] + w * (p["accuracy"] - prev["accuracy"])
        prev = p
    return None


def mean_accuracy(points: list[dict], lo: float, hi: float, n: int = 21) -> float | None:
    """Accuracy averaged over ``n`` evenly spaced token counts in ``[lo, hi]`` (interpolated as
    in ``accuracy_at``): less sensitive than one point to evaluation-to-evaluation noise.
    None when the run did not reach ``hi``."""
    values = [accuracy_at(points, lo + (hi - lo) * i / (n - 1)) for i in range(n)]
    return None if any(v is None for v in values) else statistics.fmean(values)


def with_included(runs: list[dict], included: list[dict]) -> list[dict]:
    """``runs`` plus the runs of other result files (``--include``) whose (method, seed) is
    not in ``runs`` (nor earlier in ``included``: the first file wins), each marked with
    ``included_from``: shown in the table and plot, never run again and never written to
    ``--out``."""
    have, out = {(r["method"], r["seed"]) for r in runs}, list(runs)
    for r in included:
        if (r["method"], r["seed"]) not in have:
            have.add((r["method"], r["seed"]))
            out.append(r)
    return out


def mean_std(values: list[float]) -> tuple[float, float]:
    return (statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0)


def summary(runs: list[dict], methods: list[str], budget: int,
            fractions=(0.25, 0.5, 1.0)) -> list[dict]:
    """Per method: accuracy at each fraction of the budget (mean, std over seeds), runs
    that reached the budget, RL steps and CPU seconds."""
    rows = []
    for m in methods:
        mine = [r for r in runs if r["method"] == m]
        row = {"method": m, "seeds": [r["seed"] for r in mine]}
        for f in fractions:
            acc = [a for a in (accuracy_at(r["points"], f * budget) for r in mine)
                   if a is not None]
            row[f"acc@{f:g}"] = mean_std(acc) if len(acc) == len(mine) and mine else None
        half = [a for a in (mean_accuracy(r["points"], budget / 2, budget) for r in mine)
                if a is not None]
        row["mean@half"] = mean_std(half) if len(half) == len(mine) and mine else None
        if mine:
            row["rl_steps"] = statistics.fmean(r["rl_steps"] for r in mine)
            row["cpu_s"] = statistics.fmean(r["cpu_s"] for r in mine)
            row["sft_acc"] = mean_std([r["points"][0]["accuracy"] for r in mine])
        rows.append(row)
    return rows


def table(rows: list[dict], budget: int, fractions=(0.25, 0.5, 1.0)) -> str:
    """Markdown: accuracy (%) at the token fractions, mean ± std, the change vs plain at the
    budget, and the change vs plain of the accuracy averaged over the budget's second half."""
    plain = next((r for r in rows if r["method"] == "plain"), {})
    base, base_half = plain.get("acc@1"), plain.get("mean@half")
    head = (["method", "seeds", "after SFT"] +
            [f"acc @ {f * budget / 1e3:,.0f}k tok" for f in fractions] +
            ["vs plain", "vs plain, 2nd-half mean", "RL steps", "CPU s/run"])
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    pct = lambda ms: "n/a" if ms is None else f"{100 * ms[0]:.1f} ± {100 * ms[1]:.1f}"  # noqa
    for r in rows:
        final = r.get("acc@1")
        delta = ("" if base is None or final is None or r["method"] == "plain"
                 else f"{100 * (final[0] - base[0]):+.1f}")
        half = r.get("mean@half")
        delta_half = ("" if base_half is None or half is None or r["method"] == "plain"
                      else f"{100 * (half[0] - base_half[0]):+.1f}")
        out.append("| " + " | ".join(
            [r["method"], str(len(r["seeds"])), pct(r.get("sft_acc"))] +
            [pct(r.get(f"acc@{f:g}")) for f in fractions] +
            [delta, delta_half, f"{r.get('rl_steps', 0):.0f}", f"{r.get('cpu_s', 0):.0f}"]) + " |")
    return "\n".join(out)


# ----------------------------------------------------------------------------- running

def read_records(workdir: str) -> list[dict]:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line being written
    return records


def run_one(cmd: list[str], workdir: str, budget: int, log_path: str) -> dict:
    """Runs one training until an evaluation at >= ``budget`` tokens (then SIGTERM) or the
    end; returns wall/CPU seconds (the child's own rusage), load and exit code."""
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    with open(log_path, "a") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        stopped, status, usage = False, None, None
        while status is None:
            pid, code, rusage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                status, usage = code, rusage
                break
            if not stopped:
                points = curve(read_records(workdir))
                if points and points[-1]["tokens"] >= budget:
                    proc.send_signal(signal.SIGTERM)  # saves, exits after this iteration
                    stopped = True
            time.sleep(0.5)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"returncode": proc.returncode, "stopped_at_budget": stopped,
            "wall_s": time.perf_counter() - t0, "cpu_s": usage.ru_utime + usage.ru_stime,
            "load_start": load0, "load_end": os.getloadavg()[0]}


def plot(runs: list[dict], methods: list[str], budget: int, path: str) -> bool:
    """Mean held-out accuracy vs sampled tokens per method (band: ± std over seeds)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    grid = [budget * i / 40 for i in range(41)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in methods:
        mine = [r for r in runs if r["method"] == m]
        xs, mu, sd = [], [], []
        for t in grid:
            acc = [accuracy_at(r["points"], t) for r in mine]
            if mine and all(a is not None for a in acc):
                xs.append(t / 1e3)
                mu.append(100 * statistics.fmean(acc))
                sd.append(100 * (statistics.stdev(acc) if len(acc) > 1 else 0.0))
        if xs:
            line, = ax.plot(xs, mu, label=f"{m} ({len(mine)} seeds)")
            ax.fill_between(xs, [a - b for a, b in zip(mu, sd)], [a + b for a, b in zip(mu, sd)],
                            color=line.get_color(), alpha=0.15)
    ax.set_xlabel("sampled tokens (thousands)")
    ax.set_ylabel("held-out greedy accuracy (%)")
    ax.set_title("arithmetic: accuracy vs sampled tokens (mean ± std over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="plain,online_filter,predicted,curriculum,lite_ppo")
    p.add_argument("--method", action="append", default=[], metavar="NAME=SPEC",
                   help="define or redefine a method (see the module docstring)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--budget", type=int, default=150_000, help="sampled tokens per run")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--max-steps", type=int, default=2000, help="RL steps cap per run")
    p.add_argument("--config", default=DEFAULT_CONFIG)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override the setting for every method")
    p.add_argument("--workdirs", default="/tmp/rljax_curricula")
    p.add_argument("--out", default=os.path.join(ROOT, "bench/results/curricula.json"))
    p.add_argument("--plot", default=os.path.join(ROOT, "docs/curricula.png"))
    p.add_argument("--rerun", action="store_true")
    p.add_argument("--include", action="append", default=[], metavar="RESULTS.json",
                   help="also show these files' runs (e.g. a baseline measured before) in "
                        "the table and plot; they are not run and not copied into --out")
    args = p.parse_args(argv)

    methods_def = {k: list(v) for k, v in METHODS.items()}
    for spec in args.method:
        name, items = parse_method(spec)
        methods_def[name] = items
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in methods_def]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; known: {sorted(methods_def)} "
                         "(define one with --method NAME=SPEC)")
    seeds = [int(s) for s in args.seeds.split(",")]
    common = SETTING + args.set

    results = {"runs": []}
    if os.path.exists(args.out):
        with open(args.out) as f:
            results = json.load(f)
    runs = results["runs"]
    for m in methods:
        for seed in seeds:
            workdir = os.path.join(args.workdirs, f"{m}_s{seed}")
            cmd = command(methods_def[m], seed, workdir, common, args.config, args.max_steps,
                          args.eval_every)
            old = next((r for r in runs if r["method"] == m and r["seed"] == seed), None)
            same = old is not None and old["command"][4:] == cmd[4:] and not args.rerun
            if same and old["budget"] >= args.budget:
                print(f"[{m} seed {seed}] done before, kept", flush=True)
                continue
            # A larger budget continues the run from the checkpoint its stop saved (resume
            # is exact), so only the extra tokens are sampled.
            extend = same and os.path.isdir(os.path.join(workdir, "checkpoints"))
            if not extend:
                subprocess.run(["rm", "-rf", workdir], check=True)
            os.makedirs(args.workdirs, exist_ok=True)
            print(f"[{m} seed {seed}] {'extended: ' if extend else ''}{' '.join(cmd[4:])}",
                  flush=True)
            info = run_one(cmd, workdir, args.budget, workdir + ".log")
            if extend:  # the costs of both parts
                info.update(wall_s=info["wall_s"] + old["wall_s"],
                            cpu_s=info["cpu_s"] + old["cpu_s"], load_start=old["load_start"])
            records = read_records(workdir)
            points = curve(records)
            rl = [r for r in records if "rollout/tokens" in r]
            row = {"method": m, "seed": seed, "command": cmd, "budget": args.budget,
                   "points": points, "rl_steps": len(rl),
                   "tokens": sum(int(r["rollout/tokens"]) for r in rl),
                   # ReLIFT's SFT steps: supervised tokens the sampled-token budget omits.
                   "supervised_tokens": sum(int(r.get("relift/sft_tokens", 0)) for r in records),
                   **info}
            print(f"[{m} seed {seed}] rc {info['returncode']}, {len(rl)} RL steps, "
                  f"{row['tokens']} tokens, final acc "
                  f"{points[-1]['accuracy'] if points else float('nan'):.3f}, "
                  f"{info['wall_s']:.0f} s wall, {info['cpu_s']:.0f} CPU s, load "
                  f"{info['load_start']:.1f}->{info['load_end']:.1f}", flush=True)
            if info["returncode"] != 0:
                print(open(workdir + ".log").read()[-3000:], file=sys.stderr)
            runs[:] = [r for r in runs if not (r["method"] == m and r["seed"] == seed)] + [row]
            os.makedirs(os.path.dirname(args.out), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    included = []
    for path in args.include:
        with open(path) as f:
            included += [dict(r, included_from=os.path.relpath(path, ROOT))
                         for r in json.load(f)["runs"]]
    runs = with_included(runs, included)
    shown = [m for m in dict.fromkeys([r["method"] for r in runs])]
    shown = [m for m in methods] + [m for m in shown if m not in methods]
    budget = args.budget
    rows = summary(runs, shown, budget)
    results["summary"] = {"budget": budget, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(table(rows, budget))
    if args.plot and plot(runs, shown, budget, args.plot):
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
