"""Prompt-length buckets and the prompt ++ completion layout, shared by the rollout (sampling
and training layout), guidance (its SFT batches) and the length-grouped update
(``length_groups``)."""
from __future__ import annotations

import numpy as np

from rljax import sampling


def prompt_buckets(max_prompt_length: int) -> tuple[int, ...]:
    """Allowed prompt lengths below the maximum, and the maximum: 16, 32, 64, then quarter
    steps between powers of two (80, 96, 112, 128, 160, 192, 224, 256, 320, ...).

    Prompts are left-padded to the bucket for sampling and training alike, so the bucket is
    computed work: with powers of two only, GSM8K chat prompts of 150-200 tokens padded to 256
    (a 256 + 64 training sequence held ~75% real tokens); quarter steps bound the padding to
    < 25% of the bucket (here 192 or 224) at the cost of up to 4 programs per octave, each
    compiled once (and cached on disk)."""
    fine = [b for b in sampling.DEFAULT_BUCKETS if b < 64] + [
        b + i * b // 4 for b in sampling.DEFAULT_BUCKETS if b >= 64 for i in range(4)]
    return tuple(b for b in fine if b < max_prompt_length) + (int(max_prompt_length),)


def pair_prompt_len(cfg) -> int:
    """Prompt columns of a preference batch (DPO, reward models): the longest prompt bucket.
    DPO's step-level pairs (``data.pairs='step_mc'|'mcts'``) put what came before the two
    steps there too: the steps so far, at most ``rollout.max_new_tokens``, or over an
    environment's turns the episode before the turn, at most ``env.max_total_tokens``."""
    p = int(cfg.data.max_prompt_length)
    if cfg.algo.name != "dpo" or cfg.data.pairs not in ("step_mc", "mcts"):
        return max(prompt_buckets(p))
    return p + int(cfg.env.max_total_tokens if cfg.env.name else cfg.rollout.max_new_tokens)


def encode_prompts(tokenizer, prompts: list[str], max_prompt_length: int):
    """Left-padded, bucketed prompts: (int32 [B, P], bool [B, P]) numpy arrays."""
    ids = [tokenizer.encode(p) for p in prompts]
    return sampling.pad_to_bucket(ids, pad_id=tokenizer.pad_id,
                                  buckets=prompt_buckets(max_prompt_length))


def build_sequences(prompt_tokens, prompt_mask, completion_tokens, completion_mask):
    """Prompt ++ completion: (tokens int32 [B, P+N], mask bool [B, P+N])."""
    tokens = np.concatenate([np.asarray(prompt_tokens), np.asarray(completion_tokens)], axis=1)
    mask = np.concatenate([np.asarray(prompt_mask, bool), np.asarray(completion_mask, bool)], 1)
    return tokens.astype(np.int32), mask
