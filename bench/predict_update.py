"""The roofline prediction of ``bench/gpu.py``'s update step, made on a CPU, beside what a
GPU measured.

    python bench/predict_update.py [--measured bench/results/gpu_h200_update_final.json]
                                   [--chip h200] [--out results.json]

Lowers and compiles, on this machine's CPU and with abstract inputs only (nothing is
allocated), exactly the update program ``bench/gpu.py`` timed (the same preset, batch, length,
dtypes and attention option, read from the measured JSON), takes XLA's cost analysis of it
(``rljax.cost.program_cost``: FLOPs and bytes accessed per call) and prints the roofline time
on ``--chip`` next to the measured median, with the ratio. The CPU program counts every
matmul's FLOPs (a GPU build hands them to cuBLAS as custom calls, which its cost analysis does
not count), so the prediction is compared with the GPU's time, not with its cost analysis.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.grpo_step import forward_flops  # noqa: E402
from rljax import config as config_lib  # noqa: E402
from rljax import cost as cost_lib  # noqa: E402
from rljax import models  # noqa: E402
from rljax.train.core import optim, steps  # noqa: E402
from rljax.train.core.state import create_train_state  # noqa: E402
from rljax.train.phases import grpo  # noqa: E402


def abstract_update(preset: str, batch: int, seq: int, extra: dict):
    """``(jitted step, abstract state, abstract batch)`` of bench/gpu.py's update."""
    cfg = models.get_preset(preset, dtype="bfloat16", param_dtype="float32", **extra)
    c = config_lib.default_config()
    c.algo.beta = 0.0
    optimizer = optim.make_optimizer(c.optimizer, total_steps=100, learning_rate=1e-6)
    state = jax.eval_shape(lambda: create_train_state(
        models.init_params(cfg, jax.random.PRNGKey(0)), optimizer, jax.random.PRNGKey(1)))
    n = seq // 2
    s = jax.ShapeDtypeStruct
    b = {"tokens": s((batch, seq), jnp.int32), "mask": s((batch, seq), bool),
         "loss_mask": s((batch, n), bool), "advantages": s((batch,), jnp.float32),
         "sampler_logps": s((batch, n), jnp.float32)}
    loss_fn = grpo.grpo_loss_fn(cfg, c.algo)
    step = steps.jit_step(lambda st, x: steps.update(optimizer, loss_fn, st, x, 1))
    return cfg, step, state, b


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measured", default="bench/results/gpu_h200_update_final.json")
    ap.add_argument("--chip", default="h200", choices=sorted(cost_lib.CHIPS))
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    rows = json.load(open(args.measured))["update"]
    out = []
    for row in rows:
        extra = {k: v for k, v in row.get("extra", {}).items()
                 if k != "attention_impl"}   # cudnn is a GPU kernel; the CPU uses XLA's
        cfg, step, state, b = abstract_update(row["preset"], row["batch"], row["seq"], extra)
        t0 = time.perf_counter()
        compiled = step.lower(state, b).compile()
        cost = cost_lib.program_cost(compiled)
        seconds, bound = cost_lib.roofline(cost, args.chip)
        times = cost_lib.roofline_times(cost, args.chip)
        model = 3 * forward_flops(cfg, row["batch"], row["seq"], scored=row["seq"] // 2)
        out.append({"preset": row["preset"], "batch": row["batch"], "seq": row["seq"],
                    "extra": row.get("extra", {}), "chip": args.chip,
                    "predicted_s": seconds, "bound": bound, "xla_cpu_flops": cost.flops,
                    "compute_s": times["compute"], "memory_s": times["memory"],
                    "measured_over_compute": row["seconds"] / times["compute"],
                    "bytes_accessed": cost.bytes_accessed, "model_flops": model,
                    "measured_s": row["seconds"], "measured_over_predicted":
                    row["seconds"] / seconds, "compile_s": time.perf_counter() - t0})
        r = out[-1]
        print(f"{r['preset']} {r['batch']}x{r['seq']} {r['extra']}: predicted "
              f"{r['predicted_s'] * 1e3:.1f} ms ({bound}-bound; {cost.flops / 1e12:.1f} TFLOP "
              f"by XLA:CPU, {model / 1e12:.1f} by the model formula, "
              f"{cost.bytes_accessed / 1e9:.1f} GB accessed) | measured "
              f"{r['measured_s'] * 1e3:.1f} ms on {args.chip} | measured / predicted "
              f"{r['measured_over_predicted']:.2f} | compute alone "
              f"{times['compute'] * 1e3:.1f} ms (measured / compute "
              f"{r['measured_over_compute']:.2f}), memory alone {times['memory'] * 1e3:.1f} ms",
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": os.uname().machine, "jax": jax.__version__, "rows": out},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
