"""How far a base quantized at load (``model.quantize``) moves a real model's logits.

For each model (SmolLM2-135M-Instruct, Gemma 3 270M base; both from their pip packages,
loaded in float32) and each type (``keep``: the file's own blocks; int8, int4, nf4 quantized
from the float32 weights, one scale per ``--block`` inputs), on a batch of plain-text prompts,
over every real position:

* ``vs_dequantized_max``: max |logit difference| between the quantized forward and the forward
  of its dequantized float32 copy (the quantized matmuls are exact up to float32 rounding);
* ``max_abs`` / ``mean_abs``: |logit difference| against the float32 model (the file's own
  dequantized weights), largest and mean, with the largest |logit| for scale;
* ``top1_agree``: fraction of positions whose argmax token is unchanged;
* ``kl_mean``: mean KL(float32 || quantized) of the next-token distributions, in nats;
* ``base_mib`` / ``float_mib``: the base tree's bytes quantized vs float32.

    python bench/qlora_parity.py                 # both models, ~2 min on a 2-core CPU

Writes ``bench/results/qlora_parity.json`` and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PROMPTS = [
    "The capital of France is",
    "Question: What is 57+8?\nAnswer:",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "In 1969, the first humans to walk on the Moon were",
    "Water boils at a temperature of 100 degrees",
    "A list of prime numbers: 2, 3, 5, 7, 11,",
]


def tree_mib(tree) -> float:
    import jax
    from rljax.models import quant
    return sum(quant.nbytes(x.shape, x.dtype) for x in jax.tree.leaves(tree)) / 2**20


def measure(name: str, path: str, types, block: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from rljax import models, sampling, tokenizers
    from rljax.models import quant

    cfg, params = models.load_hf(path)
    tok = tokenizers.load(path)
    ids = [tok.encode(p) for p in PROMPTS]
    tokens, mask = sampling.pad_to_bucket(ids, pad_id=tok.pad_id or 0)
    fwd = jax.jit(lambda p: models.forward(cfg, p, tokens, attention_mask=mask))
    want = np.asarray(fwd(params))
    real = np.asarray(mask).astype(bool)
    rows = []
    for qtype in types:
        t0 = time.perf_counter()
        if qtype == "keep":   # the file's own blocks
            from rljax.models import gguf_keep
            q = dict(params, layers=dict(params["layers"]))
            for tree_path, kept in gguf_keep.keep_plan(path, cfg).items():
                node = q if len(tree_path) == 1 else q["layers"]
                node[tree_path[-1]] = gguf_keep.kept_weight(path, cfg, tree_path, kept)
        else:
            q = jax.jit(lambda p: quant.quantize_params(p, qtype, block))(params)
        jax.block_until_ready(q)
        quantize_s = time.perf_counter() - t0
        got = np.asarray(fwd(q))
        deq = np.asarray(fwd(quant.dequantize_params(q)))
        d = np.abs(got - want)[real]
        lp_w = jax.nn.log_softmax(jnp.asarray(want[real]), -1)
        lp_g = jax.nn.log_softmax(jnp.asarray(got[real]), -1)
        kl = float(jnp.mean(jnp.sum(jnp.exp(lp_w) * (lp_w - lp_g), -1)))
        rows.append({
            "model": name, "type": qtype, "block": block, "positions": int(real.sum()),
            "vs_dequantized_max": float(np.abs(got - deq)[real].max()),
            "max_abs": float(d.max()), "mean_abs": float(d.mean()),
            "logit_absmax": float(np.abs(want[real]).max()),
            "top1_agree": float((got[real].argmax(-1) == want[real].argmax(-1)).mean()),
            "kl_mean": kl, "base_mib": tree_mib(q), "float_mib": tree_mib(params),
            "quantize_s": quantize_s})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2,gemma3-270m")
    ap.add_argument("--types", default="keep,int8,int4,nf4")
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results",
                                                  "qlora_parity.json"))
    args = ap.parse_args()
    from rljax import models
    paths = {"smollm2": models.smollm2_path, "gemma3-270m": models.gemma3_270m_path}
    rows = []
    for name in args.models.split(","):
        rows += measure(name, paths[name](), args.types.split(","), args.block)
    meta = {"platform": platform.platform(), "loadavg": os.getloadavg(), "args": vars(args)}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    print("| model | type | vs dequantized copy | max / mean abs diff (max abs logit) | "
          "top-1 same | KL (nats) | base MiB (float32) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['type']} | {r['vs_dequantized_max']:.1e} | "
              f"{r['max_abs']:.3f} / {r['mean_abs']:.3f} ({r['logit_absmax']:.1f}) | "
              f"{r['top1_agree']:.3f} | {r['kl_mean']:.4f} | {r['base_mib']:.0f} "
              f"({r['float_mib']:.0f}) |")


if __name__ == "__main__":
    main()
