"""The roofline prediction of ``bench/gpu.py``'s decode step, made on a CPU by ``rljax plan
--cost``, beside what a GPU measured.

    python bench/predict_decode.py [--measured bench/results/gpu_h200_session12.json]
                                   [--chip h200] [--out results.json]

For each measured decode row (preset, batch B, prompt and new tokens), plans a run with the
slot engine at B slots (one device, bf16, its pages sized for prompt + new tokens) and reads
the ``sample/decode`` program's roofline time on ``--chip``: XLA counts the engine's
stop-when-done loop once, so it is one decode step of every slot, the quantity
``bench/gpu.py`` measured as (time of N new tokens - time of 1) / (N - 1) with the static
sampler. Prints predicted and measured step times and their ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VOCAB = {"qwen2.5-0.5b": 151936}


def predict(preset: str, batch: int, prompt: int, new: int, chip: str) -> dict:
    import jax
    from rljax import config as config_lib, plan as plan_lib
    cfg = config_lib.load_config(os.path.join(ROOT, "configs", "grpo_arithmetic.py"), [
        "--config.sft.steps=0", f"--config.model.preset={preset}",
        f"--config.model.overrides={{'vocab_size': {VOCAB[preset]}}}",
        "--config.model.dtype=bfloat16",
        f"--config.rollout.batch_size={batch}", "--config.algo.num_generations=8",
        f"--config.data.max_prompt_length={prompt}", f"--config.rollout.max_new_tokens={new}",
        "--config.rollout.engine=slots", f"--config.rollout.slots={batch}",
        "--config.mesh.data=1"])
    p = plan_lib.plan(cfg, jax.devices()[:1], chip=chip,
                      programs=lambda name: name == "sample/decode")
    row = next(ph for ph in p.to_dict()["phases"] if ph["name"] == "sample/decode")
    return {"predicted_s": row["roofline_s"], "bound": row["bound"], "cost": row["cost"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measured", default="bench/results/gpu_h200_session12.json")
    ap.add_argument("--chip", default="h200")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    out = []
    for row in json.load(open(os.path.join(ROOT, args.measured)))["decode"]:
        if "decode_step_seconds" not in row:
            continue
        pred = predict(row["preset"], row["batch"], row["prompt"], row["new"], args.chip)
        r = {"preset": row["preset"], "batch": row["batch"], "prompt": row["prompt"],
             "new": row["new"], "chip": args.chip, **pred,
             "measured_s": row["decode_step_seconds"],
             "measured_over_predicted": row["decode_step_seconds"] / pred["predicted_s"]}
        out.append(r)
        print(f"{r['preset']} B={r['batch']} ({r['prompt']}+{r['new']} tokens): predicted "
              f"{r['predicted_s'] * 1e3:.2f} ms a step ({r['bound']}-bound) | measured "
              f"{r['measured_s'] * 1e3:.2f} ms on {args.chip} | measured / predicted "
              f"{r['measured_over_predicted']:.2f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"measured": args.measured, "rows": out}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
