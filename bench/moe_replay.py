"""Sampler/trainer log-prob mismatch of a mixture of experts, with and without routing replay.

A random ``tiny-moe`` (qwen3_moe family, 8 experts, 2 per token) samples completions with the
KV-cache decoder, recording each token's experts; the trainer's full-sequence forward then
scores them once routing for itself and once replaying the sampler's routes. Reported per
dtype: ``logp_diff_mean`` / ``_max`` (|sampler logp - trainer logp| over completion tokens,
what GRPO logs as ``rollout/logp_diff_*``) and the share of (token, layer) routes where the
trainer's own top-k differs from the sampler's.

    python bench/moe_replay.py --out bench/results/moe_replay.json
"""
from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from rljax import models, sampling


def measure(dtype: str, seed: int, prompts: int, g: int, new_tokens: int) -> dict:
    """One dtype's mismatch numbers (see the module docstring)."""
    cfg = models.get_preset("tiny-moe", dtype=dtype, param_dtype=dtype)
    params = models.init_params(cfg, jax.random.PRNGKey(seed))
    rng = np.random.default_rng(seed)
    p = 16
    prompt = rng.integers(1, cfg.vocab_size, size=(prompts, p)).astype(np.int32)
    pmask = np.ones((prompts, p), bool)
    out = sampling.generate(cfg, params, jnp.asarray(prompt), jnp.asarray(pmask),
                            rng=jax.random.PRNGKey(seed), max_new_tokens=new_tokens,
                            temperature=1.0, num_samples=g, record_routes=True)
    tokens = jnp.concatenate([jnp.repeat(prompt, g, 0), out.tokens], 1)
    mask = jnp.concatenate([jnp.repeat(pmask, g, 0), out.mask], 1)
    score = jax.jit(models.token_logps, static_argnums=0, static_argnames=("first_scored",))
    own = score(cfg, params, tokens, mask, first_scored=p)[0][:, p:]
    routes = jnp.transpose(out.routes, (2, 0, 1, 3))
    replayed = score(cfg, params, tokens, mask, first_scored=p, routes=routes)[0][:, p:]
    _, _, stats = models.trunk(cfg, params, tokens, mask, with_moe_stats=True)
    comp = np.asarray(out.mask)
    fed = np.asarray(mask).copy()
    fed[np.arange(len(fed)), p + np.asarray(out.lengths) - 1] = False   # never fed back
    sampler_sets = np.sort(np.asarray(out.routes), -1)[fed]              # [n, L, k]
    own_sets = np.sort(np.asarray(stats["ids"]).transpose(1, 2, 0, 3), -1)[fed]
    row = {"dtype": dtype, "tokens_scored": int(comp.sum()),
           "route_mismatch_frac": float(np.mean(np.any(sampler_sets != own_sets, -1)))}
    for name, logps in (("no_replay", own), ("replay", replayed)):
        diff = np.abs(np.asarray(logps) - np.asarray(out.logps))[comp]
        row[f"logp_diff_mean_{name}"] = float(diff.mean())
        row[f"logp_diff_max_{name}"] = float(diff.max())
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--g", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    rows = [measure(d, s, args.prompts, args.g, args.new_tokens)
            for d in ("float32", "bfloat16") for s in range(args.seeds)]
    result = {"backend": jax.default_backend(), "load_average": os.getloadavg(),
              "args": vars(args), "rows": rows}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
