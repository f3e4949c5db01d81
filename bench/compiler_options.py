"""XLA compiler options for the GRPO update: compile time against run time, side by side.

    python bench/compiler_options.py [--shape toy|small|real] [--runs 7]
        [--options '{"xla_cpu_use_fusion_emitters": false}']

Builds the length-grouped GRPO update of ``bench/update_step.py``'s batch (shared prompt,
``algo.update_streams`` auto) twice in one process: A with ``training_compiler_options()``
(what rljax uses), B with ``--options`` added to them. Prints each one's first call (compile +
one run, B after A, so B's tracing is warm: its number is mostly its own compile) and the
medians of ``--runs`` interleaved calls after two warm-ups (wall and process-CPU seconds).
Shapes: ``bench/streams.py``'s (``toy`` and ``real`` as ``update_step.py``, ``small`` an
8L-256 llama).

The default ``--options`` are XLA:CPU's older elementwise-fusion emitters;
``bench/RESULTS.md`` has the numbers and why rljax keeps the default ones.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import optax  # noqa: E402

import update_step  # noqa: E402  (its rollout batch)
from streams import UPDATE_SHAPES as SHAPES, interleaved  # noqa: E402
from rljax import compilation_cache, config as config_lib, models  # noqa: E402
from rljax.train.core import steps  # noqa: E402
from rljax.train.phases import grpo  # noqa: E402
from rljax.train.core.state import create_train_state  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="toy")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--options", default='{"xla_cpu_use_fusion_emitters": false}')
    args = ap.parse_args()
    extra = json.loads(args.options)
    overrides, b, g, p, n, lengths, micro = SHAPES[args.shape]
    cfg = models.get_preset("tiny", **overrides)
    batch = update_step.rollout_batch(cfg, b, g, p, n, lengths)
    opt = optax.adamw(1e-5, weight_decay=0.0)
    carried = {"state": create_train_state(models.init_params(cfg, jax.random.key(0)), opt,
                                           jax.random.key(1))}
    load0 = os.getloadavg()[0]
    base = compilation_cache.training_compiler_options() or {}
    variants = {"A (rljax)": base, "B (+options)": dict(base, **extra)}
    fns, first = {}, {}
    for name, options in variants.items():
        compilation_cache.training_compiler_options = lambda options=options: options
        algo = config_lib.default_config().algo
        algo.update(num_generations=g, beta=0.0, shared_prompt=True,
                    group_by_length=args.shape == "real")
        step = grpo.build_update(cfg, algo, opt, num_micro=b * g // micro)

        def run(step=step):   # the state is donated: each call continues from the last one
            carried["state"], m = step(carried["state"], batch)
            return steps.to_host(m)
        t0 = time.perf_counter()
        run()
        first[name] = time.perf_counter() - t0
        fns[name] = run
    t = interleaved(fns, args.runs)
    print(f"\nGRPO update, {args.shape} ({cfg.num_params() / 1e6:.2f}M params): {b} prompts x "
          f"G={g}, bucket {p}, N={n}, micro-batch {micro}; B adds {extra}")
    print("| options | first call (compile + run) s | s per update | CPU s |\n|---|---|---|---|")
    for name in fns:
        w, c = t[name]
        print(f"| {name} | {first[name]:.2f} | {w:.3f} | {c:.2f} |")
    a, bb = (t[k][0] for k in fns)
    print(f"\nB / A per update: {bb / a:.3f}; load average {load0:.1f} -> "
          f"{os.getloadavg()[0]:.1f}; {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
