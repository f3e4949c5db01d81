"""On-device samplers: one program per call, KV cache kept inside it.

    from rljax import sampling
    out = sampling.generate(cfg, params, prompt_tokens, prompt_mask, rng=key, max_new_tokens=N,
                            num_samples=G, eos_id=tok.eos_id, pad_id=tok.pad_id)
    # out.tokens int32[B*G, N], out.logps float32[B*G, N], out.mask bool[B*G, N], ...
    tree = sampling.tree.generate(...)        # segment trees sharing their prefixes' caches
    cache = sampling.multiturn.start(...)     # multi-turn episodes, one program for every turn

Modules, each importing only those above it:
  draw       one token per row from logits (temperature, top-k / top-p, the random draw)
  core       the static-batch sampler ``generate``, prompt buckets, stop ids, cache constraints
  tree       tree-shaped sampling (``tree.generate``, ``tree_layout``, ``tree_depth``)
  multiturn  multi-turn sampling with a cache that lives across turns
  engine     the slot engine: decode slots refilled as rows stop, prompts in shared pages
  partial    partial rollouts: a pool of groups whose unfinished samples carry over
  tree_engine tree-shaped sampling on the slot engine (each fork a request)
  tree_partial partial rollouts of trees: a pool of trees carried across runs by level

The module constants (``INVERSE_CDF_MIN_VOCAB``, ``NOISE_AHEAD_MAX_ELEMENTS``, ...) are read
from ``rljax.sampling.draw`` when a sampler traces; the copies here are for reading.
"""
from rljax.sampling import (core, draw, engine, multiturn, partial, tree, tree_engine,
                            tree_partial)
from rljax.sampling.core import (CACHE_AXES, DEFAULT_BUCKETS, SampleOutput, bucket_length,
                                 constrain_cache, generate, merge_stop_ids, pad_to_bucket,
                                 stream_count)
from rljax.sampling.draw import (INVERSE_CDF_BLOCK, INVERSE_CDF_MIN_VOCAB,
                                 NOISE_AHEAD_MAX_ELEMENTS, TEMPERATURE_SCHEDULES,
                                 categorical_inverse_cdf, draw_noise, first_argmax, noise_ahead,
                                 noise_ahead_size, sample_logits, temperature_schedule)

__all__ = [
    "core", "draw", "engine", "multiturn", "tree", "tree_engine",
    "CACHE_AXES", "DEFAULT_BUCKETS", "SampleOutput", "bucket_length", "constrain_cache",
    "generate", "merge_stop_ids", "pad_to_bucket", "stream_count",
    "INVERSE_CDF_BLOCK", "INVERSE_CDF_MIN_VOCAB", "NOISE_AHEAD_MAX_ELEMENTS",
    "TEMPERATURE_SCHEDULES", "categorical_inverse_cdf", "draw_noise", "first_argmax",
    "noise_ahead", "noise_ahead_size", "sample_logits", "temperature_schedule",
]
