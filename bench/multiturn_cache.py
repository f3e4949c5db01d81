"""Multi-turn sampling: continuing the KV cache (prefill only each turn's new observation) vs
re-prefilling the whole history every turn, on the same episodes.

    python bench/multiturn_cache.py [--rows 32 --prompt 32 --turns 4 --turn 24 --obs 48]

Episodes are scripted so both modes produce exactly the same tokens: greedy decoding, no stop
token (every turn is ``--turn`` tokens), and after each turn a fixed random observation of
``--obs`` tokens. Continuation: ``multiturn.start`` once, then ``multiturn.turn`` per turn
(the observation chunk is prefilled at the row's position). Re-prefill: per turn, a fresh
cache prefilled with prompt ++ the whole trajectory so far (``start`` with that as the
prompt), then the same decode (``turn`` of a one-turn layout). The script checks that both
give identical tokens, then reports medians of ``--runs`` timed episodes (after a warm-up
that compiles every program): wall seconds, process CPU seconds, and the prefilled token
count of each mode (load-independent). Writes JSON to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from rljax import models  # noqa: E402
from rljax.sampling import multiturn  # noqa: E402


def continued(cfg, params, prompt, a) -> tuple[np.ndarray, int]:
    """All turns through one continued cache; returns (tokens [R, T*N], prefilled tokens)."""
    r, p = prompt.shape
    layout = multiturn.SlotLayout(prompt_len=p, turn_len=a.turn, chunk_len=a.obs + 1,
                                  max_turns=a.turns)
    mask = np.ones_like(prompt, bool)
    cache = multiturn.start(cfg, params, prompt, mask, layout=layout)
    chunk, cmask, slots = multiturn.first_chunk(prompt, mask, layout)
    out, prefilled = [], r * (p - 1)
    for k in range(a.turns):
        cache, o = multiturn.turn(cfg, params, cache, slots, chunk, cmask, turn=k,
                                  active=np.ones(r, bool), budget=np.full(r, a.turn),
                                  rng=jax.random.key(k), layout=layout, temperature=0.0)
        tokens = np.asarray(o.tokens)
        out.append(tokens)
        prefilled += r * int(cmask[0].sum())
        slots |= multiturn.kept_slots(layout, k, np.full(r, a.turn))
        obs = observation(r, a.obs, k, cfg.vocab_size)
        chunk = np.concatenate([tokens[:, -1:], obs], axis=1)
        cmask = np.ones(chunk.shape, bool)
        if k + 1 < a.turns:
            start = layout.chunk_start(k + 1)
            slots[:, start:start + a.obs + 1] = True
            out.append(obs)
    return np.concatenate(out, axis=1), prefilled


def reprefilled(cfg, params, prompt, a) -> tuple[np.ndarray, int]:
    """Each turn from a fresh cache holding prompt ++ everything so far."""
    r = prompt.shape[0]
    history, out, prefilled = prompt, [], 0
    for k in range(a.turns):
        layout = multiturn.SlotLayout(prompt_len=history.shape[1], turn_len=a.turn,
                                      chunk_len=1, max_turns=1)
        mask = np.ones_like(history, bool)
        cache = multiturn.start(cfg, params, history, mask, layout=layout)
        chunk, cmask, slots = multiturn.first_chunk(history, mask, layout)
        prefilled += r * history.shape[1]
        _, o = multiturn.turn(cfg, params, cache, slots, chunk, cmask, turn=0,
                              active=np.ones(r, bool), budget=np.full(r, a.turn),
                              rng=jax.random.key(k), layout=layout, temperature=0.0)
        tokens = np.asarray(o.tokens)
        out.append(tokens)
        history = np.concatenate([history, tokens], axis=1)
        if k + 1 < a.turns:
            obs = observation(r, a.obs, k, cfg.vocab_size)
            out.append(obs)
            history = np.concatenate([history, obs], axis=1)
    return np.concatenate(out, axis=1), prefilled


def observation(rows: int, n: int, turn: int, vocab: int) -> np.ndarray:
    """The scripted observation after ``turn``: fixed random ids (same in both modes)."""
    return np.random.default_rng(1000 + turn).integers(4, vocab, (rows, n)).astype(np.int32)


def timed(fn, *args, runs: int) -> dict:
    fn(*args)  # warm-up: compiles every program this mode uses
    walls, cpus = [], []
    for _ in range(runs):
        w, c = time.perf_counter(), time.process_time()
        fn(*args)
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn", type=int, default=24, help="tokens per model turn")
    ap.add_argument("--obs", type=int, default=48, help="tokens per observation")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    cfg = models.get_preset("tiny", vocab_size=512, hidden_size=a.hidden,
                            intermediate_size=4 * a.hidden, num_layers=a.layers, num_heads=8,
                            num_kv_heads=4, head_dim=a.hidden // 8, init_std=0.05)
    params = models.init_params(cfg, jax.random.key(0))
    prompt = np.random.default_rng(0).integers(4, 512, (a.rows, a.prompt)).astype(np.int32)
    tok_c, pre_c = continued(cfg, params, prompt, a)
    tok_r, pre_r = reprefilled(cfg, params, prompt, a)
    same = bool(np.array_equal(tok_c, tok_r))
    res = {"config": vars(a), "same_tokens": same,
           "tokens_per_episode": int(tok_c.shape[1]),
           "continue": {"prefilled_tokens": pre_c, **timed(continued, cfg, params, prompt, a,
                                                             runs=a.runs)},
           "reprefill": {"prefilled_tokens": pre_r, **timed(reprefilled, cfg, params, prompt,
                                                              a, runs=a.runs)}}
    res["reprefill_over_continue_wall"] = res["reprefill"]["wall_s"] / res["continue"]["wall_s"]
    res["reprefill_over_continue_cpu"] = res["reprefill"]["cpu_s"] / res["continue"]["cpu_s"]
    res["load_average"] = os.getloadavg()
    print(json.dumps(res, indent=2))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
