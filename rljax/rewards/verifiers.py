"""Exact-answer verifiers: gsm8k, arithmetic, countdown and math.

Each is a reward function ``fn(prompts, completions, **dataset_fields) -> list[float]`` scoring
1.0 for a correct final answer and 0.0 otherwise. Malformed completions score 0.0, they do not
raise: raising is reserved for a broken setup (e.g. the dataset lacks the field a verifier needs).
"""
from __future__ import annotations

import ast
import re
import threading
from collections import Counter
from fractions import Fraction
from typing import Sequence

from rljax.rewards import parsing

__all__ = ["gsm8k", "arithmetic", "countdown", "math_equivalence", "countdown_value",
           "countdown_expression"]


def _need(field, name: str, verifier: str, n: int) -> Sequence:
    """The dataset field ``name`` as a list of n items, or a clear error naming it."""
    if field is None:
        raise KeyError(f"reward {verifier!r} needs the dataset field {name!r}")
    if isinstance(field, str) or not hasattr(field, "__len__"):
        field = [field] * n  # one reference for the whole batch
    if len(field) != n:
        raise ValueError(f"reward {verifier!r}: field {name!r} has {len(field)} items for {n} completions")
    return field


def _numeric_match(completions: Sequence[str], references: Sequence, name: str) -> list[float]:
    scores = []
    for completion, reference in zip(completions, references):
        ref = parsing.reference_number(reference)
        if ref is None:
            raise ValueError(f"reward {name!r}: reference answer {reference!r} has no number")
        got = parsing.extract_number(completion)
        scores.append(1.0 if got is not None and got == ref else 0.0)
    return scores


def gsm8k(prompts, completions, answer=None, **_) -> list[float]:
    """GSM8K: the completion's final number equals the reference ("... #### 18" or "18")."""
    return _numeric_match(completions, _need(answer, "answer", "gsm8k", len(completions)), "gsm8k")


def arithmetic(prompts, completions, answer=None, **_) -> list[float]:
    """Built-in arithmetic task: the completion's final number equals ``answer``."""
    return _numeric_match(completions, _need(answer, "answer", "arithmetic", len(completions)),
                          "arithmetic")


gsm8k.rljax_fields = arithmetic.rljax_fields = ("answer",)  # rows must have them (checked up front)


# ---- countdown -----------------------------------------------------------------------------

_EXPR_CHARS = re.compile(r"^[\d\s+\-*/()]+$")
_MAX_EXPR_LEN = 200  # a countdown expression over a handful of numbers is short


def countdown_expression(completion: str) -> str | None:
    """The arithmetic expression a countdown completion proposes, without a trailing "= target"."""
    text = parsing.final_answer_text(completion)
    if text is None:  # no marker: the last non-empty line
        lines = [ln for ln in parsing.normalize_text(completion).splitlines() if ln.strip()]
        text = lines[-1] if lines else ""
    text = text.replace("×", "*").replace("÷", "/").replace("\\times", "*").replace("\\div", "/")
    text = text.split("=")[0].strip().rstrip(".")
    if not text or len(text) > _MAX_EXPR_LEN or not _EXPR_CHARS.match(text):
        return None
    return text


def _eval_node(node, used: list[int]) -> Fraction:
    """Evaluates +, -, *, / over integer literals exactly; anything else is rejected."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp):
        left, right = _eval_node(node.left, used), _eval_node(node.right, used)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if isinstance(node.op, ast.Div):
            if right == 0:
                raise ZeroDivisionError
            return left / right
    raise ValueError("not a countdown expression")


def countdown_value(expression: str) -> tuple[Fraction, list[int]] | None:
    """(value, numbers used) of an expression, or None if it is not valid countdown arithmetic."""
    try:
        tree = ast.parse(expression, mode="eval")
        used: list[int] = []
        return _eval_node(tree.body, used), used
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return None


def _countdown_ok(completion: str, numbers: Sequence[int], target: int, use_all: bool) -> bool:
    expression = countdown_expression(completion)
    result = countdown_value(expression) if expression else None
    if result is None:
        return False
    value, used = result
    available, needed = Counter(int(n) for n in numbers), Counter(used)
    if any(needed[k] > available[k] for k in needed):
        return False  # a number used more often than given, or not given at all
    if use_all and needed != available:
        return False
    return value == int(target)


def countdown(prompts, completions, numbers=None, target=None, use_all=None, **_) -> list[float]:
    """Countdown: an expression over the given numbers (each at most once; all of them when the
    example's ``use_all`` is true) with + - * / and parentheses that equals ``target``."""
    n = len(completions)
    if numbers is not None and len(numbers) and not hasattr(numbers[0], "__len__"):
        numbers = [numbers] * n  # one shared list of numbers for the whole batch
    numbers = _need(numbers, "numbers", "countdown", n)
    targets = _need(target, "target", "countdown", n)
    flags = [False] * n if use_all is None else _need(use_all, "use_all", "countdown", n)
    return [1.0 if _countdown_ok(c, nums, t, bool(u)) else 0.0
            for c, nums, t, u in zip(completions, numbers, targets, flags)]


countdown.rljax_fields = ("numbers", "target")


# ---- math (LaTeX / sympy equivalence via math-verify) ----------------------------------------

def _as_gold(reference) -> str:
    """math-verify finds LaTeX inside $...$ or \\boxed{}; wrap a bare reference so it parses."""
    text = str(reference).strip()
    if "$" in text or "\\boxed" in text or "\\(" in text or "\\[" in text:
        return text
    return f"${text}$"


# math-verify's per-call parse/verify limit (seconds, wall clock) on the main thread.
MATH_TIMEOUT_S: float | None = 5


def math_equivalence(prompts, completions, answer=None, **_) -> list[float]:
    """MATH-style answers: the completion's final answer is mathematically equivalent to ``answer``
    (fractions, decimals, \\frac, \\boxed{}, simple expressions), judged by math-verify."""
    from math_verify import parse, verify

    references = _need(answer, "answer", "math", len(completions))
    # math-verify's own timeouts use SIGALRM, which only works on the main thread; in a worker
    # thread (see combine) we switch them off and rely on combine's deadline instead.
    main = threading.current_thread() is threading.main_thread()
    limit = MATH_TIMEOUT_S if main else None
    scores = []
    for completion, reference in zip(completions, references):
        gold = parse(_as_gold(reference), parsing_timeout=limit)
        pred = parse(parsing.normalize_text(completion), parsing_timeout=limit)
        ok = bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=limit)
        scores.append(1.0 if ok else 0.0)
    return scores


# combine's thread isolation runs it on the calling (main) thread, where its per-sample limits
# work, instead of in a worker thread where they would be off.
math_equivalence.rljax_main_thread = True
math_equivalence.rljax_fields = ("answer",)
