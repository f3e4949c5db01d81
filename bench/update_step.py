"""The GRPO update alone at a real shape: how its micro-batches are laid out.

    python bench/update_step.py [--shape real|toy] [--runs 5]

One GRPO update (AdamW, beta 0, token-mean, one epoch: the old log-probs are the update's own)
on a synthetic rollout batch, four ways, interleaved, median wall and process-CPU seconds:

- ``padded``: neither option, every row at the full prompt bucket + N columns;
- ``group_by_length``: rows sorted by length, each micro-batch trimmed to its real columns;
- ``shared_prompt``: micro-batches of whole groups, each group's prompt computed once;
- ``both``: the two together.

real: SmolLM2-135M's shape (random weights, vocab 49,152), 8 prompts of 57-137 tokens
(bucket 160) x G=4, completions of 64 tokens (a few end early), micro-batch 8; toy: issue
13's 4L-128 llama, 8 prompts of 32 tokens x G=8 x 64, one micro-batch. Prints the token
efficiency (real / computed positions) of each layout and the load average.

``--algo dpo``: one DPO step (sigmoid, reference log-probs precomputed) on B pairs with
prompts of P tokens and chosen/rejected completions of C, the pair's prompt computed once
(``dpo.sequence_logps``, now) vs ``token_logps`` over both full rows (before): real shape
4 pairs x P=256 (200-256 real) x C=128, micro-batch 2; toy 16 x 32 x 64.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rljax import config as config_lib, models
from rljax.train.core import steps
from rljax.train.phases import grpo
from rljax.train.core.state import create_train_state

SHAPES = {   # model overrides of preset "tiny"; prompts, G, bucket, N, prompt lengths, micro
    "real": (dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                  num_heads=9, num_kv_heads=3, max_position_embeddings=2048,
                  tie_word_embeddings=True), 8, 4, 160, 64, (57, 138), 8),
    "toy": (dict(vocab_size=259, num_layers=4, hidden_size=128, intermediate_size=384,
                 num_heads=4, num_kv_heads=2), 8, 8, 32, 64, (32, 33), 64),
}
LAYOUTS = {"padded": (False, False), "group_by_length": (True, False),
           "shared_prompt": (False, True),
           "both": (True, True)}


def rollout_batch(cfg, b, g, p, n, lengths, seed=0) -> dict:
    """B prompts (left-padded to P) x G completions (N columns, ~1 in 8 ending early)."""
    rng = np.random.default_rng(seed)
    r = b * g
    prompt_len = np.repeat(rng.integers(*lengths, b), g)
    completion_len = np.where(rng.random(r) < 0.125, rng.integers(1, n, r), n)
    mask = np.zeros((r, p + n), bool)
    for i in range(r):
        mask[i, p - prompt_len[i]:p + completion_len[i]] = True
    prompts = np.repeat(rng.integers(3, cfg.vocab_size, (b, p)), g, axis=0)
    tokens = np.concatenate([prompts, rng.integers(3, cfg.vocab_size, (r, n))], axis=1)
    return {"tokens": np.where(mask, tokens, 0).astype(np.int32), "mask": mask,
            "loss_mask": mask[:, p:].copy(),
            "advantages": rng.normal(size=r).astype(np.float32),
            "sampler_logps": (-rng.uniform(0.5, 4, (r, n)) * mask[:, p:]).astype(np.float32)}


DPO_SHAPES = {"real": (4, 256, (200, 257), 128, 2), "toy": (16, 32, (20, 33), 64, 1)}


def plain_sequence_logps(model_cfg, params, batch, lora_dropout_rng=None):
    """The DPO log-probs as computed before: ``token_logps`` over both full rows of a pair."""
    from rljax.train.phases import dpo
    seq = dpo.pair_sequences(batch)
    logps, _ = models.token_logps(model_cfg, params, seq["tokens"],
                                  attention_mask=seq["attention_mask"],
                                  lora_dropout_rng=lora_dropout_rng)
    m = seq["completion_mask"]
    return jnp.where(m, logps, 0.0).sum(axis=1), m.sum(axis=1).astype(jnp.float32)


def dpo_steps(cfg, shape: str, opt) -> tuple[dict, dict]:
    """{"before", "shared_prompt"}: jitted DPO steps; and their preference batch."""
    from rljax.train.phases import dpo
    b, p, lengths, c, micro = DPO_SHAPES[shape]
    rng = np.random.default_rng(0)
    prompt_len = rng.integers(*lengths, b)
    pmask = np.arange(p)[None] >= (p - prompt_len)[:, None]
    batch = {"prompt_tokens": np.where(pmask, rng.integers(3, cfg.vocab_size, (b, p)), 0),
             "prompt_mask": pmask}
    for side in ("chosen", "rejected"):
        cmask = np.arange(c)[None] < rng.integers(c // 2, c + 1, b)[:, None]
        batch[f"{side}_tokens"] = np.where(cmask, rng.integers(3, cfg.vocab_size, (b, c)), 0)
        batch[f"{side}_mask"] = cmask
    batch = {k: (v.astype(np.int32) if v.dtype.kind == "i" else v) for k, v in batch.items()}
    batch["ref_chosen_logps"] = np.full((b,), -150.0, np.float32)
    batch["ref_rejected_logps"] = np.full((b,), -160.0, np.float32)
    algo = config_lib.default_config().algo
    algo.update(name="dpo", beta=0.1, loss_type="sigmoid")
    plain = dpo.build_dpo_step(cfg, algo, opt, num_micro=b // micro)

    def before(state, batch):   # traced (first call) with the old log-prob function
        original, dpo.sequence_logps = dpo.sequence_logps, plain_sequence_logps
        try:
            return plain(state, batch)
        finally:
            dpo.sequence_logps = original
    return {"before": before,
            "shared_prompt": dpo.build_dpo_step(cfg, algo, opt, num_micro=b // micro)}, batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="real")
    ap.add_argument("--algo", choices=("grpo", "dpo"), default="grpo")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    args = ap.parse_args()
    overrides, b, g, p, n, lengths, micro = SHAPES[args.shape]
    cfg = models.get_preset("tiny", **overrides)
    batch = rollout_batch(cfg, b, g, p, n, lengths)
    num_micro = b * g // micro
    opt = optax.adamw(1e-5, weight_decay=0.0)
    params = models.init_params(cfg, jax.random.key(0))
    carried = {"state": create_train_state(params, opt, jax.random.key(1))}
    steps_by_name, effs = {}, {}
    if args.algo == "dpo":
        args.layouts = ""
        steps_by_name, batch = dpo_steps(cfg, args.shape, opt)
        effs = {k: None for k in steps_by_name}
    for name in filter(None, args.layouts.split(",")):
        algo = config_lib.default_config().algo
        algo.update(num_generations=g, beta=0.0)
        algo.update(group_by_length=LAYOUTS[name][0], shared_prompt=LAYOUTS[name][1])
        steps_by_name[name] = grpo.build_update(cfg, algo, opt, num_micro=num_micro)

    def run(name):
        # The state is donated: each call continues from the last one's (timing only).
        carried["state"], m = steps_by_name[name](carried["state"], batch)
        return m

    load0 = os.getloadavg()[0]
    for name in steps_by_name:   # warm-up: compile
        m = steps.to_host(run(name))
        if args.algo == "grpo":
            effs.setdefault(name, m.get("update/token_efficiency"))
        print(f"  {name}: loss {m['loss']:.6f}, grad_norm {m['grad_norm']:.6f}", flush=True)
    wall, cpu = {k: [] for k in steps_by_name}, {k: [] for k in steps_by_name}
    for _ in range(args.runs):
        for name in steps_by_name:
            t0, c0 = time.perf_counter(), time.process_time()
            steps.to_host(run(name))
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    if args.algo == "dpo":
        b, p, _, n, micro = DPO_SHAPES[args.shape]
        print(f"DPO {args.shape}: {b} pairs, prompt bucket {p}, completions {n}, micro-batch "
              f"{micro}; load {load0:.1f} -> {os.getloadavg()[0]:.1f}; median of {args.runs}")
    else:
        print(f"{args.shape}: {b} prompts x G={g}, bucket {p}, N={n}, micro-batch {micro}; load "
              f"{load0:.1f} -> {os.getloadavg()[0]:.1f}; median of {args.runs}")
    print("| layout | s/update (wall) | CPU s | token efficiency |\n|---|---|---|---|")
    for name in steps_by_name:
        print(f"| {name} | {statistics.median(wall[name]):.3f} | "
              f"{statistics.median(cpu[name]):.2f} | "
              + ("n/a |" if effs[name] is None else f"{effs[name]:.2f} |"))


if __name__ == "__main__":
    main()
