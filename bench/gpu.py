"""GPU numbers for one accelerator: update-step MFU and decode against the HBM bound.

    python bench/gpu.py [--preset qwen2.5-0.5b] [--out results.json]

Measured in this one process, on whatever ``jax.devices()[0]`` is:

* **Ceilings.** A jitted bf16 8192^3 matmul (FLOP/s) and a device-to-device copy of 2 GiB
  (bytes read + written per second). MFU and the decode bound use these measured ceilings, not
  datasheet numbers (the datasheet peak is printed beside them).
* **Update step.** rljax's GRPO loss as one jitted step (``steps.update`` of
  ``grpo_loss``: forward, backward, AdamW) on a random batch of ``--batch`` sequences of ``--seq`` positions (half prompt, half
  completion), params float32, compute bfloat16, random weights of ``--preset``. FLOPs are
  counted with the model of ``bench/grpo_step.py``: ``3 x (2 S W + 2 n D V + 4 L S^2 H Dh)``
  per sequence (W = the layers' matmul weights; the LM head on the n = S/2 scored positions
  only, as the loss needs and rljax computes; causal attention computed densely), i.e. no
  credit for the recomputation of remat. XLA's own cost analysis is reported beside it.
  ``--update-variants`` compares ModelConfig overrides (e.g. ``remat_policy``) and LM-head
  chunk budgets (``logits_chunk_elements``) in one process.
* **Decode.** ``sampling.generate`` (prefill once, then the ``while_loop`` over the KV cache)
  with bf16 params for ``--decode-batch`` prompts of ``--prompt`` tokens, ``--new`` new tokens,
  temperature 1 and no stop token (exactly N steps). The bound per decode step is the bytes it
  must read -- every parameter once, plus the KV cache -- over the measured copy bandwidth.
  Two cache figures are given: the slots the step attends to today (the whole bucket, P + N)
  and the filled part only (the mean over the steps), which is the floor.

Medians of ``--runs`` timed calls after a warm-up call. Prints a table; writes JSON to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.grpo_step import forward_flops  # noqa: E402
from rljax import config as config_lib  # noqa: E402
from rljax import models, sampling  # noqa: E402
from rljax.train.core import optim, steps  # noqa: E402
from rljax.train.phases import grpo  # noqa: E402
from rljax.train.core.state import create_train_state  # noqa: E402

DEFAULT_CHUNK = dict(models.head.LOGITS_CHUNK_ELEMENTS)
DATASHEET = {"H100": {"bf16_flops": 989e12, "hbm_bytes_per_s": 3.35e12},
             "H200": {"bf16_flops": 989e12, "hbm_bytes_per_s": 4.8e12}}


def timed(fn, runs: int) -> tuple[float, list[float]]:
    """Median seconds of ``runs`` calls of ``fn()`` (which must block) after one warm-up."""
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def ceilings(runs: int, n: int = 8192, copy_gib: float = 2.0) -> dict:
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda a, b: a @ b)
    t_mm, _ = timed(lambda: mm(a, b).block_until_ready(), runs)
    x = jax.random.normal(jax.random.PRNGKey(2), (int(copy_gib * 2 ** 29),), jnp.bfloat16)
    cp = jax.jit(lambda x: x + 1)
    t_cp, _ = timed(lambda: cp(x).block_until_ready(), runs)
    return {"bf16_matmul_flops_per_s": 2 * n ** 3 / t_mm,
            "copy_bytes_per_s": 2 * x.size * x.dtype.itemsize / t_cp}


def model_config(preset: str, **overrides) -> models.ModelConfig:
    return models.get_preset(preset, **overrides)


def update_step(preset: str, batch: int, seq: int, num_micro: int, runs: int, remat: bool,
                extra: dict) -> dict:
    extra = dict(extra)
    chunk = extra.pop("logits_chunk_elements", None)
    if chunk:  # the LM head's chunk budget (module constant, not a ModelConfig field)
        models.head.LOGITS_CHUNK_ELEMENTS = {None: int(chunk)}
    try:
        return _update_step(preset, batch, seq, num_micro, runs, remat, extra)
    finally:
        models.head.LOGITS_CHUNK_ELEMENTS = DEFAULT_CHUNK


def update_setup(cfg, batch: int, seq: int, num_micro: int = 1):
    """``(step, state, batch)``: the jitted GRPO step of ``cfg`` (AdamW, beta 0), a train state
    of random weights, and a random batch of ``batch`` x ``seq`` tokens, the second half scored."""
    params = models.init_params(cfg, jax.random.PRNGKey(0))
    c = config_lib.default_config()
    c.algo.beta = 0.0
    optimizer = optim.make_optimizer(c.optimizer, total_steps=100, learning_rate=1e-6)
    state = jax.jit(lambda p: create_train_state(p, optimizer, jax.random.PRNGKey(1)))(params)
    del params
    n = seq // 2
    rng = np.random.default_rng(0)
    b = {"tokens": jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, seq)), jnp.int32),
         "mask": jnp.ones((batch, seq), bool),
         "loss_mask": jnp.ones((batch, n), bool),
         "advantages": jnp.asarray(rng.normal(size=(batch,)), jnp.float32),
         "sampler_logps": jnp.full((batch, n), -2.0, jnp.float32)}
    loss_fn = grpo.grpo_loss_fn(cfg, c.algo)
    step = steps.jit_step(lambda s, x: steps.update(optimizer, loss_fn, s, x, num_micro))
    return step, state, b


def _update_step(preset, batch, seq, num_micro, runs, remat, extra) -> dict:
    cfg = model_config(preset, dtype="bfloat16", param_dtype="float32", remat=remat, **extra)
    n_params = cfg.num_params()
    n = seq // 2
    step, state, b = update_setup(cfg, batch, seq, num_micro)
    compiled = step.lower(state, b).compile()
    xla_flops = None
    try:
        ca = compiled.cost_analysis()
        ca = ca[0] if isinstance(ca, (list, tuple)) else ca
        xla_flops = float(ca.get("flops")) if ca and ca.get("flops") else None
    except Exception:  # cost analysis is optional information
        pass
    holder = {"state": state}

    def one():
        holder["state"], m = step(holder["state"], b)
        jax.block_until_ready(m)
    med, times = timed(one, runs)
    flops = 3 * forward_flops(cfg, batch, seq, scored=n)   # the head runs on the completion
    mem = jax.devices()[0].memory_stats() or {}
    return {"preset": preset, "params": n_params, "batch": batch, "seq": seq,
            "num_micro": num_micro, "remat": remat, "extra": extra,
            "logits_chunk_elements": models.head.LOGITS_CHUNK_ELEMENTS.get(
                jax.default_backend(), models.head.LOGITS_CHUNK_ELEMENTS[None]),
            "seconds": med,
            "times": times, "model_flops": flops, "xla_flops": xla_flops,
            "model_flops_per_s": flops / med, "tokens_per_s": batch * seq / med,
            "peak_bytes_in_use": mem.get("peak_bytes_in_use")}


def decode(preset: str, batch: int, prompt: int, new: int, runs: int, extra: dict) -> dict:
    cfg = model_config(preset, dtype="bfloat16", param_dtype="bfloat16", **extra)
    params = models.init_params(cfg, jax.random.PRNGKey(0))
    param_bytes = sum(p.size * p.dtype.itemsize for p in jax.tree.leaves(params))
    rng = np.random.default_rng(0)
    toks = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, prompt)), jnp.int32)
    mask = jnp.ones((batch, prompt), bool)

    def gen(max_new):
        out = sampling.generate(cfg, params, toks, mask, rng=jax.random.PRNGKey(3),
                                max_new_tokens=max_new, temperature=1.0, eos_id=None)
        jax.block_until_ready(out.tokens)
    t_full, times = timed(lambda: gen(new), runs)
    t_one, _ = timed(lambda: gen(1), runs)  # prefill + one token: the decode-free part
    per_step = (t_full - t_one) / (new - 1)
    kv_per_slot = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # k+v, bf16
    slots = prompt + new  # the bucket every step attends over today
    filled = prompt + new / 2  # mean filled length over the decode
    return {"preset": preset, "batch": batch, "prompt": prompt, "new": new, "extra": extra,
            "seconds": t_full, "prefill_plus_one_seconds": t_one, "times": times,
            "decode_step_seconds": per_step, "tokens_per_s": batch * new / t_full,
            "decode_tokens_per_s": batch / per_step, "param_bytes": param_bytes,
            "step_bytes_bucket": param_bytes + batch * slots * kv_per_slot,
            "step_bytes_filled": param_bytes + batch * filled * kv_per_slot}


def attention_parity(preset: str = "small") -> dict:
    """cudnn vs xla attention on a left-padded bf16 batch: logits and gradient differences at
    real positions, relative to the float32 xla reference's scale."""
    rng = np.random.default_rng(0)
    b, t = 4, 128
    lengths = np.array([128, 100, 64, 7])
    mask = jnp.asarray(np.arange(t)[None, :] >= (t - lengths)[:, None])  # left padding
    out = {}
    cfg32 = model_config(preset, dtype="float32", param_dtype="float32")
    params = models.init_params(cfg32, jax.random.PRNGKey(0))
    toks = jnp.asarray(rng.integers(0, cfg32.vocab_size, (b, t)), jnp.int32)

    def loss(cfg, p):
        lg = models.forward(cfg, p, toks, attention_mask=mask).astype(jnp.float32)
        return jnp.where(mask[..., None], lg, 0.0).sum() / 1e3, lg
    ref, ref_logits = jax.jit(lambda p: loss(cfg32, p))(params)
    ref_grad = jax.jit(jax.grad(lambda p: loss(cfg32, p)[0]))(params)
    for impl in ("xla", "cudnn"):
        cfg = model_config(preset, dtype="bfloat16", param_dtype="float32", attention_impl=impl)
        _, logits = jax.jit(lambda p: loss(cfg, p))(params)
        grad = jax.jit(jax.grad(lambda p: loss(cfg, p)[0]))(params)
        real = np.asarray(mask)
        d = np.abs(np.asarray(logits) - np.asarray(ref_logits))[real]
        g = [float(jnp.linalg.norm(a - r) / jnp.linalg.norm(r))
             for a, r in zip(jax.tree.leaves(grad), jax.tree.leaves(ref_grad))]
        out[impl] = {"max_abs_logit_diff": float(d.max()),
                     "logit_scale": float(np.abs(np.asarray(ref_logits)[real]).max()),
                     "max_rel_grad_diff": max(g), "finite": bool(np.isfinite(d).all())}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--num-micro", type=int, nargs="+", default=[1])
    ap.add_argument("--remat", action="store_true")
    ap.add_argument("--attention-impl", nargs="+", default=[None],
                    help="model.attention_impl values to compare (when the model has the knob)")
    ap.add_argument("--update-variants", nargs="+", metavar="JSON",
                    help="update-step variants, each a JSON dict of ModelConfig overrides "
                         "(and optionally logits_chunk_elements, the LM head's chunk budget); "
                         "default: one per --attention-impl")
    ap.add_argument("--decode-batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--skip", nargs="*", default=[], choices=["update", "decode"])
    ap.add_argument("--matmul-n", type=int, default=8192)
    ap.add_argument("--copy-gib", type=float, default=2.0)
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}", flush=True)
    ceil = ceilings(args.runs, args.matmul_n, args.copy_gib)
    sheet = next((v for k, v in DATASHEET.items() if k in dev.device_kind), None)
    print(f"measured: bf16 matmul {ceil['bf16_matmul_flops_per_s'] / 1e12:.0f} TFLOP/s, copy "
          f"{ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s (datasheet: {sheet})", flush=True)
    results = {"device": dev.device_kind, "jax": jax.__version__, "ceilings": ceil,
               "datasheet": sheet, "update": [], "decode": []}
    if has_impl := "attention_impl" in getattr(models.ModelConfig, "__dataclass_fields__", {}):
        if dev.platform == "gpu":
            results["attention_parity"] = attention_parity()
            print(f"attention parity (bf16 vs f32 xla, real positions): "
                  f"{results['attention_parity']}", flush=True)
    has_impl = "attention_impl" in getattr(models.ModelConfig, "__dataclass_fields__", {})
    impls = [i for i in args.attention_impl if i is not None] if has_impl else []
    variants = [{"attention_impl": i} for i in impls] or [{}]
    update_variants = ([json.loads(v) for v in args.update_variants] if args.update_variants
                       else variants)
    if "update" not in args.skip:
        for extra in update_variants:
            for nm in args.num_micro:
                try:
                    r = update_step(args.preset, args.batch, args.seq, nm, args.runs,
                                    args.remat, extra)
                except Exception as e:  # e.g. out of memory at num_micro=1: record, go on
                    print(f"update {extra} num_micro={nm}: {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200]}", flush=True)
                    results["update"].append({"extra": extra, "num_micro": nm,
                                              "error": str(e)[:500]})
                    continue
                r["mfu"] = r["model_flops_per_s"] / ceil["bf16_matmul_flops_per_s"]
                if sheet:
                    r["mfu_datasheet"] = r["model_flops_per_s"] / sheet["bf16_flops"]
                results["update"].append(r)
                print(f"update {args.preset} {extra} B={args.batch} S={args.seq} "
                      f"micro={nm}: {r['seconds'] * 1e3:.1f} ms, "
                      f"{r['model_flops_per_s'] / 1e12:.0f} TFLOP/s = {100 * r['mfu']:.1f}% "
                      f"of measured peak, {r['tokens_per_s']:.0f} tok/s, xla_flops/model_flops="
                      f"{(r['xla_flops'] or 0) / r['model_flops']:.2f}", flush=True)
    if "decode" not in args.skip:
        for extra in variants:
            for bsz in args.decode_batch:
                try:
                    r = decode(args.preset, bsz, args.prompt, args.new, args.runs, extra)
                except Exception as e:
                    print(f"decode {extra} B={bsz}: {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200]}", flush=True)
                    results["decode"].append({"extra": extra, "batch": bsz, "error": str(e)[:500]})
                    continue
                bw = ceil["copy_bytes_per_s"]
                r["bound_fraction_bucket"] = r["step_bytes_bucket"] / bw / r["decode_step_seconds"]
                r["bound_fraction_filled"] = r["step_bytes_filled"] / bw / r["decode_step_seconds"]
                results["decode"].append(r)
                print(f"decode {args.preset} {extra} B={bsz} P={args.prompt} N={args.new}: "
                      f"{r['decode_step_seconds'] * 1e3:.2f} ms/step, "
                      f"{r['decode_tokens_per_s']:.0f} decode tok/s, "
                      f"{100 * r['bound_fraction_bucket']:.0f}% of the HBM bound (bucket cache), "
                      f"{100 * r['bound_fraction_filled']:.0f}% (filled cache)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
