"""Shaping rewards: output format (regex) and length / overlong penalties.

These are factories: ``make_format(pattern=...)`` and ``make_overlong(max_length=..., ...)`` return
reward functions; ``rewards.get("format", pattern=...)`` passes its keyword arguments through.
"""
from __future__ import annotations

import re
from typing import Sequence

__all__ = ["DEFAULT_FORMAT", "make_format", "make_overlong", "overlong_penalty"]

# The R1-style "<think>...</think><answer>...</answer>" layout.
DEFAULT_FORMAT = r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$"


def make_format(pattern: str = DEFAULT_FORMAT, mode: str = "fullmatch", score: float = 1.0):
    """Reward ``score`` when the completion matches ``pattern`` (DOTALL), else 0.

    ``mode`` is "fullmatch" (the whole completion has the layout) or "search" (the pattern
    occurs somewhere, e.g. r"\\\\boxed\\{.+\\}").
    """
    if mode not in ("fullmatch", "search"):
        raise ValueError(f"format reward: mode must be 'fullmatch' or 'search', got {mode!r}")
    compiled = re.compile(pattern, re.DOTALL)
    match = compiled.fullmatch if mode == "fullmatch" else compiled.search

    def format_reward(prompts, completions, **_) -> list[float]:
        return [score if match(c) else 0.0 for c in completions]

    format_reward.__name__ = "format"
    return format_reward


def overlong_penalty(length: int, max_length: int, buffer: int) -> float:
    """DAPO-style soft overlong punishment.

    0 up to ``max_length - buffer``; then falls linearly to -1 at ``max_length``; -1 beyond.
    """
    soft = max_length - buffer
    if length <= soft:
        return 0.0
    if length >= max_length or buffer <= 0:
        return -1.0
    return (soft - length) / buffer


def make_overlong(max_length: int, buffer: int | None = None, tokenizer=None):
    """Length shaping: ``overlong_penalty`` on each completion's length.

    Length is counted, in order of preference, from a ``completion_lengths`` dataset field (token
    counts the trainer passes), with ``tokenizer`` if one is given, else in characters.
    ``buffer`` defaults to a quarter of ``max_length``.
    """
    if max_length <= 0:
        raise ValueError(f"overlong reward: max_length must be positive, got {max_length}")
    buffer = max_length // 4 if buffer is None else int(buffer)
    if not 0 <= buffer <= max_length:
        raise ValueError(f"overlong reward: buffer must be in [0, max_length], got {buffer}")

    def lengths(completions: Sequence[str], given) -> list[int]:
        if given is not None:
            return [int(n) for n in given]
        if tokenizer is not None:
            return [len(tokenizer.encode(c)) for c in completions]
        return [len(c) for c in completions]

    def overlong_reward(prompts, completions, completion_lengths=None, **_) -> list[float]:
        return [overlong_penalty(n, max_length, buffer)
                for n in lengths(completions, completion_lengths)]

    overlong_reward.__name__ = "overlong"
    return overlong_reward
