"""Full fine-tuning vs LoRA (rank 8 / 32) vs QLoRA in one run: memory per device and seconds
per GRPO iteration, plus LoRA sampling with unmerged adapters vs merged once per rollout.

    python bench/lora.py                              # small preset (8L-256), ~5 min on CPU
    python bench/lora.py --shapes small,qwen0.5b      # + a larger random-weight preset
    python bench/lora.py --model-path DIR             # a real HF checkpoint (e.g. SmolLM2)
    python bench/lora.py --variants 16,16-nf4,16-int4,16-int8   # LoRA vs QLoRA, rank 16

A variant is ``full``, a LoRA rank (``16``), or a rank and a ``model.quantize`` type for
QLoRA (``16-nf4``: rank 16 over an nf4 base; sampled unmerged only).

Each variant runs in its own ``--worker`` subprocess (clean memory accounting) that drives the
trainer's own GRPO phase (``build_context -> make_phases -> start_phase -> phase.iteration``)
on the built-in arithmetic task with the char tokenizer (random weights for presets; the vocab
is the tokenizer's). Reported per variant:

* plan: ``rljax plan``'s per-device resident train state (params + optimizer + reference) and
  its estimated peak over the compiled phases (sample / logps / update);
* measured: bytes of live jax arrays on device 0 after the phase's state is built (the
  resident state as allocated), and the process's peak RSS (CPU: everything, compile included);
* seconds per GRPO iteration: median over ``--iters`` iterations after a warm-up one.

Sampling (LoRA variants): ``sampling.generate`` on the adapters as they are (two small extra
matmuls per projection) vs ``lora.merge`` once (W + scale A B) and then ``generate`` on the
merged weights; both jitted, median of 3 after a warm-up, merge time included.

Writes ``bench/results/lora.json`` and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SHAPES = {
    "small": ("small", {}),                                   # 8L-256, ~6M with a char vocab
    "qwen0.5b": ("qwen2.5-0.5b", {"max_position_embeddings": 2048}),  # 24L-896, random weights
}


def overrides(args, variant: str) -> list[str]:
    out = [f"steps={args.iters + 1}", "sft.steps=0", "eval_every=0", "checkpoint_every=0",
           "tokenizer.kind=char", "data.source=arithmetic", "data.max_prompt_length=16",
           f"rollout.batch_size={args.prompts * args.generations}",
           f"rollout.max_new_tokens={args.new_tokens}",
           f"algo.num_generations={args.generations}", f"algo.beta={args.beta}",
           "algo.mini_batch_size=0", "memory.check=off", "logging.tensorboard=false",
           "mesh.data=1", f"model.dtype={args.dtype}"]
    if args.model_path:
        out += [f"model.path={args.model_path}"]
    if variant != "full":
        rank, _, qtype = variant.partition("-")
        out += [f"model.lora.rank={int(rank)}", f"model.lora.alpha={2 * int(rank)}"]
        if qtype:   # QLoRA: "16-nf4" is rank 16 over an nf4 base
            out += [f"model.quantize={qtype}"]
    return out


def worker(args) -> dict:
    import jax
    import numpy as np

    from rljax import config as config_lib
    from rljax import models, plan as plan_lib, sampling
    from rljax.train.inference import initial_state, start_phase
    from rljax.train.phases import make_phases
    from rljax.train.core.setup import build_context, check_inputs

    cfg = config_lib.load_config(None, overrides(args, args.variant))
    if not args.model_path:
        preset, extra = SHAPES[args.shape]
        cfg.model.preset = preset
        cfg.model.overrides = dict(extra)
    devices = jax.devices()[:1]
    check_inputs(cfg, 1)
    p = plan_lib.plan(cfg, devices)
    ctx = build_context(cfg, "", devices)
    (phase,) = make_phases(ctx)
    state = start_phase(ctx, phase, initial_state(ctx))
    jax.block_until_ready(state)
    ctx.params = None  # the context's initial copy (start_phase's outputs are new buffers)
    import gc
    gc.collect()
    live = plan_lib.measure_live_bytes()
    times = []
    for step in range(args.iters + 1):
        t0 = time.perf_counter()
        state, metrics = phase.iteration(state, step)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t0)
    out = {"variant": args.variant, "shape": args.model_path or args.shape,
           "params_m": ctx.model_cfg.num_params() / 1e6,
           "trainable_m": sum(x.size for x in jax.tree.leaves(models.lora.trainable(
               state.params))) / 1e6,
           "plan_resident_mib": p.resident / 2**20, "plan_parts_mib": {
               k: v / 2**20 for k, v in p.resident_parts.items()},
           "plan_peak_mib": p.peak / 2**20, "plan_peak_phase": p.peak_phase,
           "measured_live_mib": live / 2**20,
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "first_iter_s": times[0], "iter_s": statistics.median(times[1:]),
           "reward_mean": metrics.get("reward/mean"), "platform": devices[0].platform}
    stats = devices[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:  # GPU/TPU: the allocator's peak, the true per-device peak
        out["device_peak_mib"] = stats["peak_bytes_in_use"] / 2**20
    if models.lora.has_lora(state.params):
        tok = ctx.tokenizer
        prompts = [tok.encode(f"{i}+{i + 1}=") for i in range(args.prompts)]
        p_tok, p_mask = sampling.pad_to_bucket(prompts, pad_id=tok.pad_id)
        mcfg, n = ctx.model_cfg, args.new_tokens

        def gen(params, key):
            return sampling.generate(mcfg, params, p_tok, p_mask, rng=key, max_new_tokens=n,
                                     temperature=1.0, eos_id=-1, pad_id=tok.pad_id,
                                     num_samples=args.generations).tokens

        unmerged = jax.jit(gen)
        merged = jax.jit(lambda params, key: gen(models.lora.merge(mcfg, params), key))
        res = {"merged": None}
        # A quantized base is never merged for sampling (a float copy of the base).
        quantized = cfg.model.quantize
        for name, fn in (("unmerged", unmerged),) + ((("merged", merged),) if not quantized
                                                     else ()):
            jax.block_until_ready(fn(state.params, jax.random.key(0)))
            ts = []
            for i in range(3):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(state.params, jax.random.key(i + 1)))
                ts.append(time.perf_counter() - t0)
            res[name] = statistics.median(ts)
        out["sample_unmerged_s"], out["sample_merged_s"] = res["unmerged"], res["merged"]
        if not quantized:
            a = np.asarray(unmerged(state.params, jax.random.key(9)))
            b = np.asarray(merged(state.params, jax.random.key(9)))
            out["sample_same_tokens_frac"] = float((a == b).mean())
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="small")
    ap.add_argument("--variants", default="full,8,32")
    ap.add_argument("--model-path", default="")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "lora.json"))
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--shape", default="small")
    ap.add_argument("--variant", default="full")
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return
    rows = []
    shapes = [args.model_path] if args.model_path else args.shapes.split(",")
    for shape in shapes:
        for variant in args.variants.split(","):
            cmd = [sys.executable, __file__, "--worker", "--shape", shape, "--variant", variant,
                   "--iters", str(args.iters), "--prompts", str(args.prompts),
                   "--generations", str(args.generations), "--new-tokens", str(args.new_tokens),
                   "--beta", str(args.beta), "--dtype", args.dtype,
                   "--model-path", args.model_path]
            env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS=os.environ.get(
                "JAX_PLATFORMS", ""))
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not line:
                rows.append({"shape": shape, "variant": variant,
                             "error": proc.stderr.strip().splitlines()[-1:]})
            else:
                rows.append(json.loads(line[0][len("RESULT "):]))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    meta = {"platform": platform.platform(), "loadavg": os.getloadavg(), "args": vars(args)}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    print(table(rows))


def table(rows) -> str:
    head = ("| model | variant | trainable | plan resident | plan peak | measured live | "
            "measured peak | s / GRPO iter | sample unmerged / merged (s) |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['variant']} | error: {r['error']} |")
            continue
        rank, _, qtype = r["variant"].partition("-")
        v = ("full FT" if r["variant"] == "full" else
             f"QLoRA r={rank}, {qtype} base" if qtype else f"LoRA r={rank}")
        samp = ("-" if "sample_unmerged_s" not in r else
                f"{r['sample_unmerged_s']:.3f} / -" if r.get("sample_merged_s") is None else
                f"{r['sample_unmerged_s']:.3f} / {r['sample_merged_s']:.3f}")
        lines.append(
            f"| {r['shape']} ({r['params_m']:.1f}M) | {v} | {r['trainable_m']:.3g}M | "
            f"{r['plan_resident_mib']:.1f} MiB | {r['plan_peak_mib']:.1f} MiB | "
            f"{r['measured_live_mib']:.1f} MiB | "
            + (f"{r['device_peak_mib']:.0f} MiB (device) | " if "device_peak_mib" in r
               else f"{r['peak_rss_mib']:.0f} MiB (RSS) | ") +
            f"{r['iter_s']:.2f} | {samp} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
