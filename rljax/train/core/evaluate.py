"""Held-out evaluation: greedy (or sampled) accuracy and unbiased pass@k.

``run_eval(ctx, params, rng)`` is what the trainer calls (after the warm-up, every
``eval_every`` steps, at the end) and what ``rljax eval`` (``run.evaluate``) prints.

A completion is correct when the first reward function (``reward.names[0]``, the task's
verifier) gives it a score >= 1. The verifier is called exactly as training calls rewards
(``train.verifier``: ``rewards.combine``, so a function gets only the fields it names, and a
failure or timeout scores ``reward.default_score`` with one warning line, not a traceback). With ``eval.num_samples = n > 1`` (and temperature > 0),
``eval/accuracy`` is the mean over all samples (pass@1) and ``eval/pass@k`` uses the unbiased
estimator for every power of two k <= n.
"""
from __future__ import annotations

import sys
import time

import jax
import numpy as np

from rljax import algorithms
from rljax import data as data_lib
from rljax.errors import UserError
from rljax.train.core import image_inputs
from rljax.train.core.metrics import format_duration
from rljax.train.core.rollout import encode_prompts, expand_fields
from rljax.train.core.sampler import generate
from rljax.train.core.verifier import verify

EVAL_STREAM = 3  # rng stream of evaluation sampling (never advances the training rng)


def eval_examples(ctx) -> list[dict]:
    """The first ``eval.num_examples`` examples of the held-out split (0 = all), in order."""
    config = dict(ctx.data_config(), shuffle=False)
    try:
        it = data_lib.make_iterator(config, batch_size=ctx.cfg.eval.batch_size, split="eval",
                                    tokenizer=ctx.tokenizer, num_epochs=1)
    except (ValueError, KeyError) as e:
        raise UserError(f"eval data: {e}") from None
    limit = ctx.cfg.eval.num_examples or None
    out: list[dict] = []
    for batch in it:
        out.extend(batch)
        if limit and len(out) >= limit:
            return out[:limit]
    if not out:
        raise UserError(f"eval data: none of the {len(it.source)} examples fits "
                        f"data.max_prompt_length={ctx.cfg.data.max_prompt_length}")
    return out


def run_eval(ctx, params, rng, examples: list[dict] | None = None, *, stop=None,
             progress_every_s: float | None = None, episodes=None) -> dict | None:
    """Evaluates ``params``; returns ``eval/*`` metrics (accuracy, pass@k, lengths).

    ``stop`` (a ``StopSignal``) is checked between batches (on every host together): once a stop
    was requested the eval is abandoned and None is returned. ``progress_every_s``: print
    ``eval: done/total examples | ETA`` to stderr at most that often (process 0; None = quiet).
    ``episodes``: ``(ctx, params, rng, examples) -> metrics``, the evaluator of multi-turn
    episodes (``env.name`` set; ``methods.agent.run_agent_eval``), which the caller supplies.
    """
    cfg = ctx.cfg
    e = cfg.eval
    examples = eval_examples(ctx) if examples is None else examples
    n, bs = e.num_samples, e.batch_size
    if cfg.env.name:
        if episodes is None:
            raise ValueError("env.name is set: run_eval needs the episode evaluator "
                             "(episodes=rljax.train.methods.agent.run_agent_eval)")
        return episodes(ctx, params, rng, examples)
    max_new = e.max_new_tokens or cfg.rollout.max_new_tokens
    correct, lengths, truncated = [], [], []
    images = image_inputs.image_inputs(ctx)   # None: a text model
    t0 = time.perf_counter()
    last_print = t0
    for i, start in enumerate(range(0, len(examples), bs)):
        now = time.perf_counter()
        if (progress_every_s is not None and start and now - last_print >= progress_every_s
                and jax.process_index() == 0):
            last_print = now
            eta = (now - t0) / start * (len(examples) - start)
            print(f"eval: {start}/{len(examples)} examples | ETA {format_duration(eta)}",
                  file=sys.stderr, flush=True)
        if stop is not None and stop.poll(sync=True):
            print(f"rljax: eval stopped after {start}/{len(examples)} examples (not logged)",
                  file=sys.stderr, flush=True)
            return None
        chunk = examples[start:start + bs]
        padded = chunk + [chunk[-1]] * (bs - len(chunk))  # static shapes: one compile
        p_tok, p_mask = encode_prompts(ctx.tokenizer, [ex["prompt"] for ex in padded],
                                       cfg.data.max_prompt_length)
        out = generate(ctx, params, p_tok, p_mask, jax.random.fold_in(rng, i), num_samples=n,
                       max_new_tokens=max_new, temperature=e.temperature,
                       top_k=cfg.rollout.top_k if e.temperature else 0,
                       top_p=cfg.rollout.top_p if e.temperature else 1.0,
                       pixels=None if images is None else images.pixels(padded),
                       images=images)
        keep = len(chunk) * n
        texts = ctx.tokenizer.batch_decode(out["tokens"][:keep], out["mask"][:keep])
        prompts = [ex["prompt"] for ex in chunk for _ in range(n)]
        scores = verify(ctx, prompts, texts, expand_fields(chunk, n), out["lengths"][:keep])
        correct.append(scores >= 1.0)
        lengths.append(out["lengths"][:keep])
        truncated.append(out["truncated"][:keep])
    ok = np.concatenate(correct).reshape(-1, n)
    m = {"eval/accuracy": float(ok.mean()), "eval/num_examples": int(ok.shape[0]),
         "eval/length_mean": float(np.concatenate(lengths).mean()),
         "eval/truncated_frac": float(np.concatenate(truncated).mean()),
         "time/eval": time.perf_counter() - t0}
    m.update(pass_at_k_metrics(ok))
    return m


def pass_at_k_metrics(ok: np.ndarray) -> dict:
    """``eval/pass@k`` for every power of two k <= n from correctness bool [E, n]."""
    n, m, k = ok.shape[1], {}, 2
    while k <= n:
        m[f"eval/pass@{k}"] = float(np.mean(algorithms.pass_at_k(n, ok.sum(axis=1), k)))
        k *= 2
    return m
