"""A process reward model at inference: score sampled solutions step by step, pick the best of N.

Each completion is cut into steps at ``data.step_delimiter`` (``step_mc.step_ends``: a step
ends after its delimiter, or at the stop token); the PRM's logit at each step's last token is
the step's log-odds, ``sigmoid`` its score, and a completion's score combines its step scores
(``algorithms.aggregate_step_scores``: the weakest step, ``min``, by default; ``last``
reads the score after the whole solution, which is how an outcome reward model scores).
Best-of-N samples N completions per prompt and keeps the highest-scoring one.

The scorer is any value head over a trunk (``models.value_forward``): a PRM, or an outcome
reward model read at the same step ends, so the two are compared on the same tokens.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from rljax import algorithms, models
from rljax.data import stepwise
from rljax.data.iterator import encode_prompts
from rljax.train.core.rollout import expand_fields
from rljax.train.core.sampler import generate
from rljax.train.core.verifier import verify
from rljax.train.methods.step_mc import step_ends


def step_logits(model_cfg: models.ModelConfig, value_params: Any, batch: dict,
                lora_dropout_rng=None) -> jax.Array:
    """Value-head logits [B, C] at the completion positions of a stepwise batch (prompt
    [B, P] and completion [B, C] read as one sequence; padding masked out of attention)."""
    p = batch["prompt_tokens"].shape[1]
    tokens = jnp.concatenate([batch["prompt_tokens"], batch["completion_tokens"]], axis=1)
    mask = jnp.concatenate([batch["prompt_mask"], batch["completion_mask"]], axis=1)
    values = models.value_forward(model_cfg, value_params, tokens.astype(jnp.int32),
                                  attention_mask=mask.astype(bool),
                                  lora_dropout_rng=lora_dropout_rng)
    return values[:, p:]


def step_rows(prompt_ids: list[list[int]], completions: list[list[int]], decode: Callable,
              delimiter: str, stop_ids=()) -> list[tuple]:
    """``stepwise.stepwise_batch`` rows (prompt ids, completion ids, step-end positions,
    placeholder labels) of completions; ``prompt_ids[r]`` is completion r's prompt."""
    rows = []
    for prompt, comp in zip(prompt_ids, completions):
        ends = step_ends(comp, decode, delimiter, stop_ids)
        rows.append((prompt, comp, [e - 1 for e in ends], [0.0] * len(ends)))
    return rows


def completion_scores(logits_fn: Callable, rows: list[tuple], batch_rows: int,
                      max_prompt: int, max_completion: int, pad_id: int,
                      mode: str = "min") -> np.ndarray:
    """Scores [R] of R ``step_rows``: ``mode`` over the sigmoid of the logits at each step's
    end (``logits_fn(batch) -> [batch_rows, C]``); batches of ``batch_rows`` (static)."""
    out = []
    for i in range(0, len(rows), batch_rows):
        chunk = rows[i:i + batch_rows]
        b = stepwise.stepwise_batch(chunk, batch_rows, max_prompt, max_completion, pad_id)
        probs = jax.nn.sigmoid(logits_fn(b))
        m = b["label_mask"] & b["row_mask"][:, None]
        out.append(np.asarray(algorithms.aggregate_step_scores(probs, m, mode))[:len(chunk)])
    return np.concatenate(out) if out else np.zeros(0, np.float32)


def pair_accuracy(scores: np.ndarray, correct: np.ndarray) -> float:
    """Over prompts [E, N]: the fraction of (correct, wrong) sample pairs of one prompt that
    the scores order correctly, ties counted half; NaN without such pairs."""
    hits = pairs = 0.0
    for s, ok in zip(scores, correct.astype(bool)):
        d = s[ok][:, None] - s[~ok][None, :]
        hits += (d > 0).sum() + 0.5 * (d == 0).sum()
        pairs += d.size
    return float(hits / pairs) if pairs else float("nan")


def best_of_n(ctx, policy_params, scorers: dict, examples: list[dict], rng, *, n: int,
              temperature: float, prompts_per_batch: int) -> dict:
    """Samples ``n`` completions per example from the policy, verifies them and scores them
    with each scorer; ``scorers = {name: (logits_fn, mode)}``. Returns ``{"accuracy": mean
    correctness of the samples, "pass@n": any correct, name: {"accuracy": of the picked
    (highest-scoring, first of ties) sample, "auroc": scores vs correctness over all
    samples, "pair_accuracy": within prompts}}``."""
    cfg, tok = ctx.cfg, ctx.tokenizer
    p_len, c_len = int(cfg.data.max_prompt_length), int(cfg.rollout.max_new_tokens)
    stop_ids = tuple(i for i in (tok.eos_id,) if i is not None)
    correct, scores = [], {name: [] for name in scorers}
    t0 = time.perf_counter()
    for i, start in enumerate(range(0, len(examples), prompts_per_batch)):
        chunk = examples[start:start + prompts_per_batch]
        padded = chunk + [chunk[-1]] * (prompts_per_batch - len(chunk))   # one compile
        p_tok, p_mask = encode_prompts(tok, padded, p_len)
        out = generate(ctx, policy_params, p_tok, p_mask, jax.random.fold_in(rng, i),
                       num_samples=n, max_new_tokens=c_len, temperature=temperature)
        keep = len(chunk) * n
        comps = [out["tokens"][r][out["mask"][r]].tolist() for r in range(keep)]
        texts = tok.batch_decode(out["tokens"][:keep], out["mask"][:keep])
        prompts = [ex["prompt"] for ex in chunk for _ in range(n)]
        ok = verify(ctx, prompts, texts, expand_fields(chunk, n), out["lengths"][:keep]) >= 1.0
        correct.append(ok.reshape(-1, n))
        rows = step_rows([tok.encode(p) for p in prompts], comps, tok.decode,
                         cfg.data.step_delimiter, stop_ids)
        for name, (fn, mode) in scorers.items():
            s = completion_scores(fn, rows, prompts_per_batch * n, p_len, c_len, tok.pad_id,
                                  mode)
            scores[name].append(s.reshape(-1, n))
    ok = np.concatenate(correct)
    result = {"accuracy": float(ok.mean()), "pass@n": float(ok.any(axis=1).mean()),
              "num_examples": int(ok.shape[0]), "n": int(n),
              "seconds": time.perf_counter() - t0}
    for name in scorers:
        s = np.concatenate(scores[name])
        picked = ok[np.arange(len(ok)), np.argmax(s, axis=1)]
        result[name] = {"accuracy": float(picked.mean()),
                        "auroc": algorithms.auroc(s.reshape(-1), ok.reshape(-1)),
                        "pair_accuracy": pair_accuracy(s, ok)}
    return result


def value_logits_fn(model_cfg, value_params) -> Callable:
    """``batch -> logits [B, C]`` of a value head (jitted, no LoRA dropout)."""
    fn = jax.jit(functools.partial(step_logits, model_cfg.replace(lora_dropout=0.0)))
    return lambda batch: fn(value_params, batch)
