"""Stepwise supervision data for process reward models (TRL's stepwise format).

A row is ``{"prompt": str, "completions": [step, ...], "labels": [label, ...]}``: one label
per step, a bool (good step) or a number in [0, 1] (a soft label). The sequence a PRM reads is
laid out as TRL's PRMTrainer tokenizes it: the prompt, then each step tokenized on its own
followed by the step separator's tokens; the label sits on the last token of each
step + separator, every other token is unlabelled (TRL's -100).

Batches are static arrays: ``prompt_tokens/prompt_mask [B, P]`` (left-padded, the layout of
rljax's preference batches), ``completion_tokens/completion_mask [B, C]`` (right-padded),
``labels float32 [B, C]`` and ``label_mask bool [B, C]`` (step-end tokens), ``row_mask [B]``.
Pure numpy and the tokenizer; no jax.
"""
from __future__ import annotations

import json
import re
import numbers
from typing import Sequence

import numpy as np

STEPWISE_FIELDS = ("prompt", "completions", "labels")


def check_row(row, where: str) -> None:
    """ValueError (one line naming ``where``, e.g. "file.jsonl line 3") unless ``row`` is a
    stepwise row: prompt text, a non-empty list of step texts, as many labels in [0, 1]."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object with {', '.join(STEPWISE_FIELDS)}")
    missing = [k for k in STEPWISE_FIELDS if k not in row]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)} (stepwise rows have "
                         f"{', '.join(STEPWISE_FIELDS)})")
    steps, labels = row["completions"], row["labels"]
    if not isinstance(row["prompt"], str):
        raise ValueError(f"{where}: prompt must be text, got {type(row['prompt']).__name__}")
    if not isinstance(steps, list) or not steps or not all(isinstance(s, str) for s in steps):
        raise ValueError(f"{where}: completions must be a non-empty list of step texts")
    if not isinstance(labels, list) or len(labels) != len(steps):
        n = len(labels) if isinstance(labels, list) else type(labels).__name__
        raise ValueError(f"{where}: {n} labels for {len(steps)} completions (steps); stepwise "
                         "rows need one label per step")
    for j, y in enumerate(labels):
        ok = isinstance(y, (bool, numbers.Real)) and 0.0 <= float(y) <= 1.0
        if not ok:
            raise ValueError(f"{where}: labels[{j}]={y!r} is not a bool or a number in [0, 1]")


def read_jsonl(path: str) -> list[dict]:
    """Every row of a stepwise JSONL file, checked (``check_row``); ValueError on the first
    bad line, naming it, and on an empty file."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {n}: not JSON ({e.msg})") from None
            check_row(row, f"{path} line {n}")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def encode_row(tokenizer, prompt: str, steps: Sequence[str], labels: Sequence,
               separator: str, add_bos: bool = False) -> tuple[list[int], list[int], list[int],
                                                              list[float]]:
    """TRL's label placement for one row: ``(prompt ids, completion ids, label positions in
    the completion, labels)``. Each step is tokenized alone, then the separator's tokens are
    appended; the step's label goes on the last of those tokens. ``add_bos``: a BOS before
    the prompt (TRL adds one when the tokenizer has it; rljax prompts have none)."""
    prompt_ids = tokenizer.encode(prompt, add_bos=add_bos)
    sep = tokenizer.encode(separator) if separator else []
    ids: list[int] = []
    positions: list[int] = []
    for j, step in enumerate(steps):
        piece = tokenizer.encode(step) + sep
        if not piece:
            raise ValueError(f"step {j} {step!r} and the separator {separator!r} have no tokens")
        ids += piece
        positions.append(len(ids) - 1)
    return prompt_ids, ids, positions, [float(y) for y in labels]


def stepwise_batch(encoded: list[tuple], batch_size: int, max_prompt: int,
                   max_completion: int, pad_id: int) -> dict:
    """Encoded rows (``encode_row``'s tuples) -> the static batch arrays of this module's
    docstring, ``batch_size`` rows (padding rows repeat the last real one, ``row_mask``
    False and no labels). ValueError when a row does not fit."""
    n = len(encoded)
    if not 0 < n <= batch_size:
        raise ValueError(f"{n} rows for a batch of {batch_size}")
    p_tok = np.full((batch_size, max_prompt), pad_id, np.int32)
    p_mask = np.zeros((batch_size, max_prompt), bool)
    c_tok = np.full((batch_size, max_completion), pad_id, np.int32)
    c_mask = np.zeros((batch_size, max_completion), bool)
    labels = np.zeros((batch_size, max_completion), np.float32)
    l_mask = np.zeros((batch_size, max_completion), bool)
    for i in range(batch_size):
        prompt, comp, pos, ys = encoded[min(i, n - 1)]
        if len(prompt) > max_prompt or len(comp) > max_completion:
            raise ValueError(f"row of {len(prompt)} prompt and {len(comp)} completion tokens "
                             f"does not fit {max_prompt} and {max_completion}")
        if prompt:
            p_tok[i, max_prompt - len(prompt):], p_mask[i, max_prompt - len(prompt):] = prompt, True
        c_tok[i, :len(comp)], c_mask[i, :len(comp)] = comp, True
        if i < n:
            labels[i, pos], l_mask[i, pos] = ys, True
    return {"prompt_tokens": p_tok, "prompt_mask": p_mask, "completion_tokens": c_tok,
            "completion_mask": c_mask, "labels": labels, "label_mask": l_mask,
            "row_mask": np.arange(batch_size) < n}


def check_lengths(rows: list[dict], tokenizer, separator: str, max_prompt: int,
                  max_completion: int, what: str) -> None:
    """ValueError (one line: how many rows, the first one's sizes, the keys to raise) when any
    row's prompt or steps + separators exceed ``max_prompt`` / ``max_completion`` tokens."""
    bad = []
    for i, r in enumerate(rows):
        p, c, _, _ = encode_row(tokenizer, r["prompt"], r["completions"], r["labels"], separator)
        if len(p) > max_prompt or len(c) > max_completion:
            bad.append((i, len(p), len(c)))
    if bad:
        i, p, c = bad[0]
        raise ValueError(f"{what}: {len(bad)} of {len(rows)} rows do not fit (row {i + 1}: {p} "
                         f"prompt tokens, {c} step tokens with separators; data.max_prompt_length="
                         f"{max_prompt}, rollout.max_new_tokens={max_completion})")


def encode_solution(tokenizer, prompt: str, steps: Sequence[str], labels: Sequence,
                    delimiter: str) -> tuple[list[int], list[int], list[int], list[float]]:
    """A solution as the policy samples it: steps joined by ``delimiter``, then EOS; the label
    of each step on its delimiter's last token, the last step's on EOS. Same tuple as
    ``encode_row`` (prompt ids, completion ids, label positions, labels)."""
    ids: list[int] = []
    positions: list[int] = []
    sep = tokenizer.encode(delimiter)
    for j, step in enumerate(steps):
        ids += tokenizer.encode(step) + (sep if j + 1 < len(steps) else [tokenizer.eos_id])
        positions.append(len(ids) - 1)
    return tokenizer.encode(prompt), ids, positions, [float(y) for y in labels]


_LINE = re.compile(r"^(-?\d+)([+-])(\d+)=(-?\d+)$")


def corrupted_solutions(prompt: str, solution: str, rng: np.random.Generator,
                        delimiter: str = "\n") -> list[dict]:
    """Two stepwise rows from a left-to-right arithmetic solution (``a+b=c`` per line): the
    solution itself (every label True) and a copy with one wrong result at a random step j,
    later steps carrying the wrong value on correctly (labels True before j, False from j:
    no continuation of a wrong prefix reaches the answer). [] for other solution texts."""
    lines = solution.split(delimiter)
    parsed = [_LINE.match(line) for line in lines]
    if not all(parsed):
        return []
    j = int(rng.integers(len(lines)))
    bad, value = [], None
    for k, m in enumerate(parsed):
        a, op, b = int(m.group(1)) if value is None else value, m.group(2), int(m.group(3))
        value = a + b if op == "+" else a - b
        if k == j:
            value += int(rng.choice([-1, 1])) * int(rng.integers(1, 10))
        bad.append(f"{a}{op}{b}={value}")
    n = len(lines)
    return [{"prompt": prompt, "completions": lines, "labels": [True] * n},
            {"prompt": prompt, "completions": bad, "labels": [k < j for k in range(n)]}]
