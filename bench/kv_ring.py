"""The sampler's memory with and without rings for sliding-window layers.

Compiles (does not run) the static sampler for a model shape at long completions and prints
the KV cache bytes (``models.kv_cache_bytes``) and XLA's temporaries for the program, once with
the local layers' rings (``models.kv_ring``) and once with full-length caches everywhere,
each in its own process. Nothing is downloaded: the weights are abstract.

    python bench/kv_ring.py --preset gemma3-1b --rows 16 --prompt 64 --new 4096
"""
import argparse
import json
import subprocess
import sys


def measure(preset: str, rows: int, prompt: int, new: int, ring: bool) -> dict:
    import jax
    import jax.numpy as jnp

    from rljax import models, sampling
    from rljax.models import kv_ring

    cfg = models.get_preset(preset, dtype="bfloat16", param_dtype="bfloat16")
    if not ring:   # every layer at full length, as before rings existed
        kv_ring.ring_size = lambda cfg, slots: None
    params = jax.eval_shape(lambda: models.init_params(cfg, jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct((rows, prompt), jnp.int32)
    mask = jax.ShapeDtypeStruct((rows, prompt), bool)

    def sample(params, tokens, mask, key):
        return sampling.generate(cfg, params, tokens, mask, rng=key, max_new_tokens=new,
                                 temperature=0.0, eos_id=cfg.eos_token_id)

    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    compiled = jax.jit(sample).lower(params, tokens, mask, key).compile()
    mem = compiled.memory_analysis()
    return dict(preset=preset, rows=rows, prompt=prompt, new=new, ring=ring,
                kv_cache_bytes=models.kv_cache_bytes(cfg, rows, prompt + new,
                                                     ring=ring),
                temp_bytes=int(mem.temp_size_in_bytes),
                argument_bytes=int(mem.argument_size_in_bytes))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gemma3-1b")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=4096)
    ap.add_argument("--one", choices=("ring", "full"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(measure(a.preset, a.rows, a.prompt, a.new, a.one == "ring")))
        return
    rows = []
    for one in ("ring", "full"):   # separate processes: the jit caches would mix them
        out = subprocess.run([sys.executable, __file__, "--preset", a.preset, "--rows",
                              str(a.rows), "--prompt", str(a.prompt), "--new", str(a.new),
                              "--one", one], check=True, capture_output=True, text=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    ring, full = rows
    print(json.dumps({"ring": ring, "full": full,
                      "kv_saved_fraction": 1 - ring["kv_cache_bytes"] / full["kv_cache_bytes"],
                      "temp_saved_bytes": full["temp_bytes"] - ring["temp_bytes"]}, indent=1))


if __name__ == "__main__":
    main()
