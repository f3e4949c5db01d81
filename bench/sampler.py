"""Decode throughput: ``rljax.sampling.generate`` vs ``transformers`` ``generate`` (PyTorch CPU).

Both sides run the *same* random llama model (created with transformers, ``save_pretrained`` to a
temp dir, loaded with ``models.load_hf``), the same left-padded prompts, batch size B, G samples
per prompt, prompt length and N new tokens. Both are forced to produce exactly N tokens (rljax:
no stop id; transformers: ``min_new_tokens = max_new_tokens = N``), so tokens/s compare like for
like. Sampling: temperature 1, no top-k/top-p, on both sides.

Also measured: the effect of prefill sharing (rljax with ``num_samples=G`` vs the same prompts
repeated G times with ``num_samples=1``).

    taskset -c 0 python bench/sampler.py [--presets tiny,small] [--runs 7] [--out PATH]

(``taskset`` pins both contenders to the same single core; without it JAX may use every core
while torch runs ``--threads`` threads.)

Throughput = B*G*N generated tokens / wall time of one generate call, median over ``--runs``
rounds after one warm-up call (which compiles the JAX program; first-call time reported
separately). Within a round the contenders run interleaved, so background load on a shared
machine affects them alike.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import sys
import time

# Run from a checkout without installing: the repository root holds the `rljax` package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from rljax import models, sampling


def _interleaved_times(fns: dict, runs: int) -> tuple[dict, dict]:
    """Times each callable once to warm up (compile), then `runs` rounds in which every callable
    runs once, interleaved, so load from other processes hits all contenders alike.

    Returns ({name: first-call seconds}, {name: list of seconds, one per round}).
    """
    first, times = {}, {k: [] for k in fns}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        first[name] = time.perf_counter() - t0
    for _ in range(runs):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return first, times


def _prompts(rng: np.random.Generator, batch: int, max_len: int, vocab: int):
    """Left-padded prompts of varied lengths in [max_len/2, max_len]; pad id 0."""
    lengths = rng.integers(max_len // 2, max_len + 1, size=batch)
    rows = [list(rng.integers(1, vocab, size=int(n))) for n in lengths]
    return sampling.pad_to_bucket(rows, pad_id=0, buckets=(max_len,))


# Shapes beyond the model presets: "base" is bench/grpo_step.py's 4L-128 llama (the toy
# sampler row: --presets base --batch 32 --num-samples 1 --prompt-len 32 --threads 2).
EXTRA_SHAPES = {"base": ("tiny", dict(num_layers=4, hidden_size=128, intermediate_size=384,
                                      num_heads=4, num_kv_heads=2))}


def preset_config(name: str):
    preset, overrides = EXTRA_SHAPES.get(name, (name, {}))
    return models.get_preset(preset, **overrides)


def bench_preset(preset: str, batch: int, num_samples: int, prompt_len: int, new_tokens: int,
                 runs: int, seed: int = 0, streams: int = 0) -> dict:
    import torch
    import transformers

    cfg0 = preset_config(preset)
    hf_cfg = transformers.LlamaConfig(**models.config_to_hf(cfg0))
    torch.manual_seed(seed)
    hf_model = transformers.LlamaForCausalLM(hf_cfg).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf_model.save_pretrained(tmp)
        cfg, params = models.load_hf(tmp, dtype=jnp.float32)

    tokens, mask = _prompts(np.random.default_rng(seed), batch, prompt_len, cfg.vocab_size)
    n_tokens = batch * num_samples * new_tokens

    # Sanity: the two implementations are the same model (greedy tokens agree).
    greedy = sampling.generate(cfg, params, tokens, mask, rng=jax.random.key(0),
                               max_new_tokens=8, temperature=0.0, pad_id=0)
    with torch.no_grad():
        hf_greedy = hf_model.generate(
            input_ids=torch.from_numpy(tokens.astype(np.int64)),
            attention_mask=torch.from_numpy(mask.astype(np.int64)), do_sample=False,
            max_new_tokens=8, min_new_tokens=8, pad_token_id=0)
    greedy_match = bool(np.array_equal(np.asarray(greedy.tokens),
                                       hf_greedy[:, tokens.shape[1]:].numpy()))

    # rljax: G fan-out (prefill once per prompt).
    keys = iter(jax.random.split(jax.random.key(seed), 10 * runs + 10))

    def run_jax(t=tokens, m=mask, g=num_samples, n=new_tokens):
        out = sampling.generate(cfg, params, t, m, rng=next(keys), max_new_tokens=n,
                                temperature=1.0, eos_id=None, pad_id=0, num_samples=g,
                                streams=streams)
        jax.block_until_ready(out.tokens)
        assert out.tokens.shape == (batch * num_samples, n)

    rep_t, rep_m = np.repeat(tokens, num_samples, 0), np.repeat(mask, num_samples, 0)

    # transformers: num_return_sequences=G repeats each prompt G times (its own prefill each).
    ids = torch.from_numpy(tokens.astype(np.int64))
    am = torch.from_numpy(mask.astype(np.int64))

    def run_hf():
        with torch.no_grad():
            out = hf_model.generate(input_ids=ids, attention_mask=am, do_sample=True,
                                    temperature=1.0, top_k=0, top_p=1.0,
                                    num_return_sequences=num_samples,
                                    max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                    pad_token_id=0)
        assert out.shape == (batch * num_samples, tokens.shape[1] + new_tokens)

    first, times = _interleaved_times(
        {"fan_out": run_jax, "repeated": lambda: run_jax(rep_t, rep_m, 1), "hf": run_hf,
         # One new token: (almost) only the prefill, where sharing it matters most.
         "prefill_fan_out": lambda: run_jax(n=1),
         "prefill_repeated": lambda: run_jax(rep_t, rep_m, 1, n=1)}, runs)
    med = {k: statistics.median(v) for k, v in times.items()}
    jax_first, jax_t, jax_rep_t, hf_t = first["fan_out"], med["fan_out"], med["repeated"], med["hf"]
    return {
        "preset": preset, "params": cfg.num_params(), "batch": batch, "num_samples": num_samples,
        "prompt_len": prompt_len, "new_tokens": new_tokens, "runs": runs,
        "greedy_tokens_match_transformers": greedy_match,
        "rljax_streams": sampling.stream_count(streams, batch, new_tokens, cfg.vocab_size,
                                               greedy=False, num_samples=num_samples),
        "rljax_tok_s": n_tokens / jax_t, "rljax_first_call_s": jax_first,
        "rljax_repeated_prompts_tok_s": n_tokens / jax_rep_t,
        "transformers_tok_s": n_tokens / hf_t,
        "speedup_vs_transformers": hf_t / jax_t,
        "fan_out_gain": jax_rep_t / jax_t,
        "prefill_only_ms_fan_out": 1e3 * med["prefill_fan_out"],
        "prefill_only_ms_repeated": 1e3 * med["prefill_repeated"],
        "fan_out_gain_prefill_only": med["prefill_repeated"] / med["prefill_fan_out"],
        # Best-of-runs: on a shared machine the least-disturbed run of each contender.
        "speedup_vs_transformers_best_of_runs": min(times["hf"]) / min(times["fan_out"]),
        "times_s": times,
    }


def markdown(results: list[dict]) -> str:
    head = ("| preset | params | B x G | P | N | rljax tok/s | transformers tok/s | speedup "
            "| rljax repeated prompts tok/s | fan-out gain | fan-out gain, prefill only "
            "| greedy match | speedup, best of runs |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = [f"| {r['preset']} | {r['params'] / 1e6:.2f}M | {r['batch']} x {r['num_samples']} "
            f"| {r['prompt_len']} | {r['new_tokens']} | {r['rljax_tok_s']:.0f} "
            f"| {r['transformers_tok_s']:.0f} | {r['speedup_vs_transformers']:.2f}x "
            f"| {r['rljax_repeated_prompts_tok_s']:.0f} | {r['fan_out_gain']:.2f}x "
            f"| {r['fan_out_gain_prefill_only']:.2f}x ({r['prefill_only_ms_repeated']:.1f} -> "
            f"{r['prefill_only_ms_fan_out']:.1f} ms) "
            f"| {r['greedy_tokens_match_transformers']} "
            f"| {r['speedup_vs_transformers_best_of_runs']:.2f}x |" for r in results]
    return "\n".join([head] + rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--num-samples", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=7)
    # torch's OpenMP threads spin: on a loaded machine 2 threads on 2 shared cores ran 10-60x
    # slower than 1 thread. Default 1; for an equal core budget run the whole script pinned,
    # e.g. `taskset -c 0 python bench/sampler.py`, so JAX gets the same single core.
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--streams", type=int, default=0,
                    help="rljax concurrent decode streams (0 = auto, as rollout.streams)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "sampler.json"))
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    results = [bench_preset(p, args.batch, args.num_samples, args.prompt_len, args.new_tokens,
                            args.runs, streams=args.streams) for p in args.presets.split(",")]
    meta = {"jax": jax.__version__, "backend": jax.default_backend(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "cpus": os.cpu_count(), "cpus_allowed": len(os.sched_getaffinity(0)),
            "machine": platform.machine()}
    import transformers
    meta["transformers"] = transformers.__version__
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    print(markdown(results))
    print(f"\n{meta}\nwritten to {args.out}")


if __name__ == "__main__":
    main()
