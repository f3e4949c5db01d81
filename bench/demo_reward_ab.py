"""Paired A/B of the reward wait inside one demo run (load-robust).

Odd GRPO iterations wait for the reward thread the old way (``time.sleep`` polls of 50 ms, as
before 4d391dd), even ones with the fix (the call's completion event). Adjacent iterations of
one process share the machine's load, so the paired difference of ``time/step`` isolates the
wait; results do not depend on how the wait wakes up.

    python bench/demo_reward_ab.py OUTDIR     # 400 SFT steps + 100 GRPO iterations, the demo
"""
import importlib
import json
import os
import statistics
import sys
import time

# Run from a checkout without installing: the repository root holds the `rljax` package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rljax import cli  # noqa: E402
from rljax.train.phases import grpo  # noqa: E402

combine = importlib.import_module("rljax.rewards.combine")  # the module, not the function
EVENT_WAIT = combine._first_pending


def main() -> int:
    out = sys.argv[1]
    iteration, records = grpo.GRPOPhase.iteration, []

    def alternating(self, state, step):
        combine._first_pending = EVENT_WAIT if step % 2 == 0 else (lambda calls: time.sleep)
        state, m = iteration(self, state, step)
        records.append({"step": step, **{k: m[k] for k in
                                         ("time/step", "time/reward", "time/sample",
                                          "time/update")}})
        return state, m

    grpo.GRPOPhase.iteration = alternating
    code = cli.main(["train", "--config", "configs/grpo_arithmetic.py", "--workdir",
                     os.path.join(out, "wd"), "--config.steps=100", "--config.eval_every=100"])
    pairs = [(records[i], records[i + 1]) for i in range(2, len(records) - 1, 2)]  # (event, poll)
    summary = {"load_end": os.getloadavg(), "pairs": len(pairs)}
    for key in ("time/step", "time/reward", "time/sample", "time/update"):
        summary[key] = {
            "event_median": statistics.median(e[key] for e, _ in pairs),
            "poll_median": statistics.median(p[key] for _, p in pairs),
            "paired_diff_median": statistics.median(p[key] - e[key] for e, p in pairs)}
        print(f"{key}: event {summary[key]['event_median'] * 1e3:.1f} ms, poll "
              f"{summary[key]['poll_median'] * 1e3:.1f} ms, paired difference "
              f"{summary[key]['paired_diff_median'] * 1e3:+.1f} ms ({len(pairs)} pairs)")
    with open(os.path.join(out, "ab.json"), "w") as f:
        json.dump({"summary": summary, "records": records}, f, indent=1)
    return code


if __name__ == "__main__":
    sys.exit(main())
