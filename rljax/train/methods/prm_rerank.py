"""A process reward model at inference: score sampled solutions step by step, pick the best of N.

Each completion is cut into steps at ``data.step_delimiter`` (``step_mc.step_ends``: a step
ends after its delimiter, or at the stop token); the PRM's logit at each step's last token is
the step's log-odds, ``sigmoid`` its score, and a completion's score combines its step scores
(``algorithms.aggregate_step_scores``: the weakest step, ``min``, by default; ``last``
reads the score after the whole solution, which is how an outcome reward model scores).
Best-of-N samples N completions per prompt and keeps the highest-scoring one; step-level beam
search (``beam_search``) grows solutions one step at a time, keeping the best-scoring prefixes.

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

from rljax import algorithms, models, sampling
from rljax.data import stepwise
from rljax.data.iterator import encode_prompts
from rljax.train.core.rollout import expand_fields
from rljax.train.core.sampler import generate
from rljax.train.core.verifier import verify
from rljax.train.methods.step_mc import step_ends, turn_step_ends


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
              delimiter: str, stop_ids=(), turns=None) -> list[tuple]:
    """``stepwise.stepwise_batch`` rows (prompt ids, completion ids, step-end positions,
    placeholder labels) of completions; ``prompt_ids[r]`` is completion r's prompt. With
    ``turns`` (``turns[r]``: completion r's model turn of each token, -1 on observations) the
    completions are multi-turn trajectories cut within their model turns
    (``step_mc.turn_step_ends``)."""
    rows = []
    for r, (prompt, comp) in enumerate(zip(prompt_ids, completions)):
        ends = (step_ends(comp, decode, delimiter, stop_ids) if turns is None else
                turn_step_ends(comp, turns[r], decode, delimiter, stop_ids))
        rows.append((prompt, comp, [e - 1 for e in ends], [0.0] * len(ends)))
    return rows


def step_probabilities(logits_fn: Callable, rows: list[tuple], batch_rows: int,
                       max_prompt: int, max_completion: int,
                       pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """The PRM's step scores of R ``step_rows``: ``(probs f32 [R, C], step_ends bool [R, C])``
    with ``C = max_completion``, the sigmoid of the logit at each step's last completion
    position (``logits_fn(batch) -> [batch_rows, C]``; batches of ``batch_rows``, static)."""
    probs, ends = [], []
    for i in range(0, len(rows), batch_rows):
        chunk = rows[i:i + batch_rows]
        b = stepwise.stepwise_batch(chunk, batch_rows, max_prompt, max_completion, pad_id)
        m = b["label_mask"] & b["row_mask"][:, None]
        p = np.asarray(jax.nn.sigmoid(logits_fn(b)), np.float32)
        probs.append(np.where(m, p, 0.0)[:len(chunk)])
        ends.append(m[:len(chunk)])
    if not probs:
        return np.zeros((0, max_completion), np.float32), np.zeros((0, max_completion), bool)
    return np.concatenate(probs), np.concatenate(ends)


def completion_scores(logits_fn: Callable, rows: list[tuple], batch_rows: int,
                      max_prompt: int, max_completion: int, pad_id: int,
                      mode: str = "min") -> np.ndarray:
    """Scores [R] of R ``step_rows``: ``mode`` over the sigmoid of the logits at each step's
    end (``step_probabilities``)."""
    probs, ends = step_probabilities(logits_fn, rows, batch_rows, max_prompt, max_completion,
                                     pad_id)
    if not len(rows):
        return np.zeros(0, np.float32)
    return np.asarray(algorithms.aggregate_step_scores(probs, ends, mode), np.float32)


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


def _first_step(cont: list[int], decode: Callable, delimiter: str, stop_ids) -> tuple[list, bool]:
    """The first step of a continuation and whether it ends the solution (no delimiter after
    it: the stop token, or the continuation's end)."""
    ends = step_ends(cont, decode, delimiter, stop_ids)
    if not ends:
        return [], True
    return cont[:ends[0]], len(ends) == 1


def beam_search(ctx, policy_params, scorer: tuple, examples: list[dict], rng, *, beams: int,
                expand: int, temperature: float, max_depth: int = 8) -> list[list[int]]:
    """Step-level beam search: each live prefix of each example samples ``expand``
    continuations, their first steps extend it, the PRM scores the candidates (``scorer =
    (logits_fn, mode)``: step scores combined by ``mode``) and the best ``beams`` stay
    (a finished candidate leaves the beam). Returns each example's best finished solution
    (token ids). Shapes are static per depth: every example keeps ``beams`` prefix rows
    (repeats of a live one)."""
    cfg, tok = ctx.cfg, ctx.tokenizer
    p_len, n = int(cfg.data.max_prompt_length), int(cfg.rollout.max_new_tokens)
    stop_ids = tuple(i for i in (tok.eos_id,) if i is not None)
    delim, (logits_fn, mode) = cfg.data.step_delimiter, scorer
    prompts = [tok.encode(ex["prompt"]) for ex in examples]
    live: list[list[tuple]] = [[((), 1.0)] for _ in examples]      # (tokens, score)
    done: list[list[tuple]] = [[] for _ in examples]
    for depth in range(max_depth):
        active = [i for i, beam in enumerate(live) if beam]
        if not active:
            break
        # Static shapes: every example keeps `beams` rows (a finished one, its prompt alone).
        rows = [(i, (live[i][k % len(live[i])][0] if live[i] else ()))
                for i in range(len(examples)) for k in range(beams)]
        p_tok, p_mask = sampling.pad_to_bucket([prompts[i] + list(t) for i, t in rows],
                                               pad_id=tok.pad_id, buckets=(p_len + n,))
        out = generate(ctx, policy_params, p_tok, p_mask, jax.random.fold_in(rng, depth),
                       num_samples=expand, max_new_tokens=n, temperature=temperature)
        cands: dict[int, dict[tuple, bool]] = {i: {} for i in active}
        for r, (i, prefix) in enumerate(rows):
            if i not in cands:
                continue
            for j in range(expand):
                cont = out["tokens"][r * expand + j][out["mask"][r * expand + j]].tolist()
                step, last = _first_step(cont[:n - len(prefix)], tok.decode, delim, stop_ids)
                cand = prefix + tuple(step)
                cands[i][cand] = cands[i].get(cand, False) or last or len(cand) >= n
        flat = [(i, c, fin) for i in active for c, fin in cands[i].items()]
        scores = completion_scores(
            logits_fn, step_rows([prompts[i] for i, _, _ in flat], [list(c) for _, c, _ in flat],
                                 tok.decode, delim, stop_ids),
            len(rows), p_len, n, tok.pad_id, mode)
        for i in active:
            ranked = sorted(((float(s), c, fin) for (k, c, fin), s in zip(flat, scores)
                             if k == i), key=lambda x: -x[0])[:beams]
            done[i] += [(c, s) for s, c, fin in ranked if fin]
            live[i] = [(c, s) for s, c, fin in ranked if not fin]
    for i in range(len(examples)):   # depth exhausted: the live prefixes count as they are
        done[i] += live[i]
    return [list(max(d, key=lambda cs: cs[1])[0]) if d else [] for d in done]


def beam_search_accuracy(ctx, policy_params, scorer: tuple, examples: list[dict], rng, *,
                         beams: int, expand: int, temperature: float,
                         prompts_per_batch: int) -> dict:
    """``beam_search`` over ``examples`` in chunks (the last one padded: one compile per
    depth's shapes); ``{"accuracy": of the chosen solutions, "num_examples"}``."""
    tok, ok = ctx.tokenizer, []
    for c, start in enumerate(range(0, len(examples), prompts_per_batch)):
        chunk = examples[start:start + prompts_per_batch]
        padded = chunk + [chunk[-1]] * (prompts_per_batch - len(chunk))
        sols = beam_search(ctx, policy_params, scorer, padded, jax.random.fold_in(rng, c),
                           beams=beams, expand=expand, temperature=temperature)[:len(chunk)]
        texts = [tok.decode(t) for t in sols]
        ok.append(verify(ctx, [ex["prompt"] for ex in chunk], texts, expand_fields(chunk, 1),
                         [len(t) for t in sols]) >= 1.0)
    ok = np.concatenate(ok)
    return {"accuracy": float(ok.mean()), "num_examples": int(len(ok))}


@functools.cache
def value_logits_program(model_cfg) -> Callable:
    """``(value params, batch) -> logits [B, C]`` of a value head: ``step_logits`` jitted,
    without LoRA dropout (one per model config)."""
    return jax.jit(functools.partial(step_logits, model_cfg.replace(lora_dropout=0.0)))


def value_logits_fn(model_cfg, value_params) -> Callable:
    """``batch -> logits [B, C]`` of a value head (jitted, no LoRA dropout)."""
    fn = value_logits_program(model_cfg)
    return lambda batch: fn(value_params, batch)
