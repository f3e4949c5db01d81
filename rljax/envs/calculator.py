"""Arithmetic by parsing (``ast``), never ``eval``: the ``calculator`` tool's engine.

Accepted: int and float literals, ``+ - * / // % **``, unary ``+ -``, parentheses. Everything
else (names, calls, attributes, strings, comparisons, ...) is refused before anything is
computed. Sizes are bounded so no input can take long or use much memory: the expression's
length, exponents, and every intermediate integer's number of digits.
"""
from __future__ import annotations

import ast
import math
import operator
import warnings

from rljax.envs.base import ToolError

__all__ = ["evaluate", "format_number", "MAX_EXPRESSION_CHARS", "MAX_DIGITS", "MAX_EXPONENT"]

MAX_EXPRESSION_CHARS = 200
MAX_DIGITS = 100          # largest integer (intermediate or result): 10**MAX_DIGITS
MAX_EXPONENT = 1000       # |b| in a ** b
_LIMIT = 10 ** MAX_DIGITS

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic ``expression``; raises ToolError for anything else."""
    if not isinstance(expression, str):
        raise ToolError(f"expression must be a string, got {type(expression).__name__}")
    text = expression.strip().replace("^", "**").replace("×", "*").replace("÷", "/")
    if not text:
        raise ToolError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        with warnings.catch_warnings():   # model text like "12a" warns before it fails
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ToolError(f"not an arithmetic expression: {expression!r}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float):  # bool is an int subclass: refused too
            raise ToolError(f"only numbers are allowed, got {node.value!r}")
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_value(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("result too large") from None
    raise ToolError(f"not allowed in arithmetic: {type(node).__name__}")


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuses a power whose result would exceed MAX_DIGITS before computing it."""
    if abs(exponent) > MAX_EXPONENT:
        raise ToolError(f"exponent larger than {MAX_EXPONENT}")
    if base < 0 and not float(exponent).is_integer():
        raise ToolError("fractional power of a negative number")
    if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) > MAX_DIGITS:
        raise ToolError(f"result larger than 10**{MAX_DIGITS}")
    if base == 0 and exponent < 0:
        raise ToolError("division by zero")


def _checked(value: int | float) -> int | float:
    if isinstance(value, complex):
        raise ToolError("complex result")
    if isinstance(value, int) and abs(value) >= _LIMIT:
        raise ToolError(f"result larger than 10**{MAX_DIGITS}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("result too large")
    return value


def format_number(value: int | float) -> str:
    """Integers as digits; floats with an integer value without ".0" (so ``84/2`` reads
    ``42`` like ``84//2``), others with up to 12 significant digits."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.12g}"
    return str(value)
