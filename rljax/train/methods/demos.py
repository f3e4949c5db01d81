"""Mixed-policy demonstrations (``algo.mixed_policy``, LUFFY / RL-PLUS style): the reference
solution takes the place of a failed group's last sample, trained with mu = 1. The rollout's
``guidance.Guide`` stage picks the failed groups (of G rows, or of the sizes knapsack
allocation gave them); this module writes the demonstrations into the round.
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from rljax import algorithms


def insert_demos(rollout, rnd: dict, examples: Sequence[dict], rows: Sequence[int],
                 solution: Callable[[dict], str]) -> dict:
    """Mixed-policy groups (LUFFY / RL-PLUS style, ``algo.mixed_policy``): in each failed
    group (of ``examples``), the last sample (its row of ``rows``) is replaced by the reference
    solution (+ EOS, cut to the completion slot), scored by the reward functions.
    ``rnd["demo"]`` bool [R] marks these rows; the rollout sets their ``old_logps`` to 0 (the
    demonstrator's probabilities are unknown; it is taken to be certain, mu = 1), so their
    importance ratio is pi_theta(token) <= 1: bounded, and never clipped for a positive
    advantage (the PPO clip only binds above 1 + epsilon). Their ``sampler_logps`` are 0 as
    well. ``rollout/tokens`` counts the replaced (sampled) completions, not the
    demonstrations."""
    tok, rows = rollout.ctx.tokenizer, [int(r) for r in rows]
    n = rnd["tokens"].shape[1]
    rnd["demo"] = np.zeros(len(rnd["rewards"]), bool)
    rnd.setdefault("extra_tokens", 0)
    if not rows:
        return rnd
    texts, lengths = [], []
    for row, ex in zip(rows, examples):
        text = solution(ex)
        ids = (tok.encode(text) + [tok.eos_id])[:n]
        # rollout/tokens counts sampled tokens: the replaced sample's, not the demo's.
        rnd["extra_tokens"] += int(rnd["lengths"][row]) - len(ids)
        rnd["tokens"][row] = tok.pad_id
        rnd["tokens"][row, :len(ids)] = ids
        rnd["mask"][row] = np.arange(n) < len(ids)
        rnd["lengths"][row], rnd["truncated"][row] = len(ids), ids[-1] != tok.eos_id
        rnd["logps"][row] = 0.0
        rnd["demo"][row] = True
        texts.append(tok.decode(ids))
        lengths.append(len(ids))
    keys = [k for k in examples[0] if k != "prompt"]
    result = rollout.reward_fn([ex["prompt"] for ex in examples], texts,
                               completion_lengths=lengths,
                               **{k: [ex.get(k) for ex in examples] for k in keys})
    total = np.asarray(result.total, np.float32)
    for name, values in result.per_function.items():
        rnd["scores"][name][rows] = np.asarray(values, np.float32)
    cfg = rollout.cfg
    if cfg.algo.overlong_buffer:  # the same DAPO length penalty as sampled completions get
        pen = np.asarray(algorithms.overlong_penalty(
            np.asarray(lengths), cfg.rollout.max_new_tokens, int(cfg.algo.overlong_buffer),
            cfg.algo.overlong_penalty_factor), np.float32)
        rnd["scores"]["overlong"][rows] = pen
        total = total + pen
    rnd["rewards"][rows] = total
    return rnd


def demo_old_logps(old_logps, demo: np.ndarray):
    """``old_logps`` [R, N] with the demonstration rows (``demo`` bool [R]) set to 0."""
    return jnp.where(jnp.asarray(demo)[:, None], 0.0, old_logps)
