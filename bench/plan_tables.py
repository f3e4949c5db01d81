"""``rljax plan --cost`` for Qwen2.5 0.5B/1.5B/7B and Qwen3-30B-A3B on three targets, on paper:
whether a GRPO run fits, its per-device memory, and the roofline's update and decode rates.

    python bench/plan_tables.py [--only NAME ...] [--out bench/results/plan_tables]

Each (model, target) is planned in its own process with that many fake CPU devices
(``rljax.plan.plan`` with ``chip``: every program compiled for the target mesh, XLA's cost
analysis of each). The workload is the same everywhere: 512 completions a rollout (64 prompts
x 8), prompts of 512 tokens, completions of 1,024, bf16 model, remat, 64-row micro-batches,
the slot engine with 128 slots. Printed: a markdown table; written: each plan's text and JSON.

Rates from the per-device roofline times (the largest of compute, memory and communication;
``rljax.cost``):
  update tokens/s = rows x (prompt + completion) / (the update programs one step runs x their
                    time + the optimizer step's time);
  update MFU at the bound = the update's FLOPs at the compute peak / its roofline time;
  decode tokens/s = slots / the decode program's time: XLA counts the engine's decode loop
                    (a while loop that stops when its rows do) once, so that program's cost is
                    one step of every slot. The engine runs its slots whole on every device (it
                    does not split them over the mesh), so this is the rate of the target, not
                    of one device.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = {   # name -> (chip, devices, GiB per device)
    "8xH100": ("h100", 8, 74.5),   # 80 GB
    "v5e-16": ("v5e", 16, 16),
    "v5p-64": ("v5p", 32, 95),     # v5p slices are named by TensorCores: 64 = 32 chips
}
MODELS = {   # preset -> vocabulary (the char tokenizer's is replaced by the model's)
    "qwen2.5-0.5b": 151936, "qwen2.5-1.5b": 151936, "qwen2.5-7b": 152064,
    "qwen3-30b-a3b": 151936,
}
ROWS, PROMPT, NEW, MICRO, SLOTS = 512, 512, 1024, 64, 128


def overrides(preset: str, target: str) -> list[str]:
    chip, devices, gib = TARGETS[target]
    moe = preset == "qwen3-30b-a3b"
    mesh = (["--config.mesh.expert=8", f"--config.mesh.fsdp={devices // 8}"] if moe else
            [f"--config.mesh.fsdp={devices}"])
    return ["--config.sft.steps=0", f"--config.model.preset={preset}",
            f"--config.model.overrides={{'vocab_size': {MODELS[preset]}}}",
            "--config.model.dtype=bfloat16", "--config.model.remat=true",
            f"--config.rollout.batch_size={ROWS}", "--config.algo.num_generations=8",
            f"--config.data.max_prompt_length={PROMPT}",
            f"--config.rollout.max_new_tokens={NEW}", f"--config.algo.micro_batch_size={MICRO}",
            "--config.rollout.engine=slots", f"--config.rollout.slots={SLOTS}",
            "--config.eval.batch_size=64", f"--config.memory.device_memory_gb={gib}",
            "--config.mesh.data=1", *mesh]


def one(preset: str, target: str) -> dict:
    """Plans one (model, target) in this process (its device count already set)."""
    from rljax import config as config_lib, cost as cost_lib, plan as plan_lib
    cfg = config_lib.load_config(os.path.join(ROOT, "configs", "grpo_arithmetic.py"),
                                 overrides(preset, target))
    chip = TARGETS[target][0]
    p = plan_lib.plan(cfg, chip=chip)
    out = p.to_dict()
    out["text"] = p.format()
    phases = {ph["name"]: ph for ph in out["phases"]}
    upd, apply = phases["update"], phases["apply"]
    programs = ROWS * upd["copies"] / MICRO   # each runs MICRO / copies rows
    step_s = programs * upd["roofline_s"] + apply["roofline_s"]
    decode = phases["sample/decode"]
    compute = lambda ph: ph["cost"]["flops"] / cost_lib.CHIPS[chip]["flops"]
    compute_s = programs * compute(upd) + compute(apply)
    out["derived"] = {"update_tokens_per_s": ROWS * (PROMPT + NEW) / step_s,
                      "update_step_s": step_s, "update_bound": upd["bound"],
                      "update_tokens_per_s_compute": ROWS * (PROMPT + NEW) / compute_s,
                      "update_mfu_at_bound": compute_s / step_s,
                      "decode_tokens_per_s": SLOTS / decode["roofline_s"],
                      "decode_bound": decode["bound"],
                      "decode_tokens_per_s_compute": SLOTS / compute(decode)}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", nargs=2, metavar=("PRESET", "TARGET"))
    ap.add_argument("--only", nargs="*", default=None, help="PRESET@TARGET names to run")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "plan_tables"))
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(*args.one)))
        return
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for target, (chip, devices, gib) in TARGETS.items():
        for preset in MODELS:
            name = f"{preset}@{target}"
            if args.only and name not in args.only:
                continue
            env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
                       XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
            try:
                run = subprocess.run([sys.executable, __file__, "--one", preset, target], env=env,
                                     capture_output=True, text=True, timeout=900)
            except subprocess.TimeoutExpired:
                print(f"{name}: no plan within 15 minutes", file=sys.stderr)
                continue
            if run.returncode:
                print(f"{name}: failed\n{run.stderr[-2000:]}", file=sys.stderr)
                continue
            res = json.loads(run.stdout.strip().splitlines()[-1])
            with open(os.path.join(args.out, f"{name}.json"), "w") as f:
                json.dump(res, f, indent=1)
            print(res["text"], "\n", file=sys.stderr)
            d = res["derived"]
            rows.append(f"| {preset} | {target} | {'yes' if res['fits'] else 'no'} | "
                        f"{res['peak_bytes'] / 2**30:.1f} ({res['peak_phase']}) | "
                        f"{d['update_tokens_per_s']:,.0f} ({d['update_bound']}) | "
                        f"{d['update_tokens_per_s_compute']:,.0f} | "
                        f"{d['update_mfu_at_bound']:.1%} | "
                        f"{d['decode_tokens_per_s']:,.0f} ({d['decode_bound']}) | "
                        f"{d['decode_tokens_per_s_compute']:,.0f} |")
            print(rows[-1], flush=True)
    print("| model | target | fits | peak GiB per device (phase) | update tokens/s (bound) "
          "| at compute peak | update MFU at the bound | decode tokens/s (bound) "
          "| at compute peak |\n|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
