"""Bounds on what a chat template may render: a template is code from a model's files.

    check_chat_template(template, special_tokens)   # once per template: UserError or None
    check_rendered(text)                            # every render: UserError when too long

Hugging Face tokenizers render their chat template with ``transformers`` (a jinja2 sandbox),
which bounds ``range`` but not string or list repetition: ``{{ 'a' * 10**8 }}`` renders 100
million characters (451 MB here) before anything looks at them. :func:`check_chat_template`
trial-renders the template once, on a small conversation, in a sandbox that refuses any
``*``, ``**``, ``%``, string filter (``center``, ``format``, ``join``, ``indent``,
``replace``) or string method whose result would exceed :data:`MAX_OUTPUT_CHARS` (computed
from its arguments, before it runs), stops when any of the template's variables or namespace
attributes grows past it (a string doubled in a loop, by any operator) or the render runs
past :data:`MAX_RENDER_SECONDS` (nested loops), and stops the output at that size; :func:`check_rendered` bounds every real render's text before it is tokenized.
Both fail with one line. Errors the template raises on purpose (``raise_exception``, an
undefined name) are not this module's business: the real render reports them as before.
"""
from __future__ import annotations

import math
import re
import sys
import time
from typing import Any, Mapping

from rljax.errors import UserError

# A rendered prompt beyond this is not a prompt (the longest real chat prompts are ~100k
# tokens, a few hundred thousand characters).
MAX_OUTPUT_CHARS = 4_000_000
# The trial render of a two-turn conversation takes milliseconds; nested loops do not end.
MAX_RENDER_SECONDS = 5.0

_SAMPLE = [{"role": "system", "content": "You are helpful."},
           {"role": "user", "content": "What is 2 + 3?"},
           {"role": "assistant", "content": "5"},
           {"role": "user", "content": "And 3 + 4?"}]


class TemplateTooLarge(UserError):
    """A chat template renders (or would render) more than ``MAX_OUTPUT_CHARS``."""


def _too_large(what: str) -> TemplateTooLarge:
    return TemplateTooLarge(f"the chat template {what}, more than {MAX_OUTPUT_CHARS:,} "
                            "characters: it is not a usable prompt template (a corrupt or "
                            "hostile tokenizer_config.json / GGUF chat template?)")


def _size(value: Any) -> int | None:
    """Length of a str/list/tuple operand, None for anything else."""
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else None


def _wide_spec(fmt: Any) -> bool:
    """Whether printf / str.format text ``fmt`` holds a number (a width, a precision) over
    the limit: ``'%100000000s'`` renders 100 million characters from one."""
    if not isinstance(fmt, str):
        return False
    digits = len(str(MAX_OUTPUT_CHARS))
    return any(len(n) > digits or int(n) > MAX_OUTPUT_CHARS
               for n in re.findall(r"\d+", fmt) if len(n) >= digits)


def _check_width(what: str, *args: Any, **kwargs: Any) -> None:
    """Refuses an int argument (a width) over the limit before the call pads to it."""
    for n in (*args, *kwargs.values()):
        if isinstance(n, int) and not isinstance(n, bool) and n > MAX_OUTPUT_CHARS:
            raise _too_large(f"pads with {what}({n:,})")


def _joined_size(sep: Any, items: Any) -> int:
    """Length of ``sep.join(items)`` for a list or tuple (0 for anything else)."""
    if not isinstance(items, (list, tuple)):
        return 0
    return (sum(len(x) if isinstance(x, str) else len(str(x)) for x in items)
            + len(str(sep)) * max(len(items) - 1, 0))


def _check_call(obj: Any, args: tuple, kwargs: dict) -> None:
    """Refuses a string method call whose result would exceed the limit (computed from its
    arguments, before it runs): ``center``/``ljust``/``rjust``/``zfill``/``expandtabs``
    widths, ``format`` specs, ``join`` and ``replace`` sizes."""
    owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    if not isinstance(owner, str):
        return
    if name in ("center", "ljust", "rjust", "zfill"):
        _check_width(f"str.{name}", *args[:1])
    elif name == "expandtabs":
        n = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(n, int) and owner.count("\t") * n + len(owner) > MAX_OUTPUT_CHARS:
            raise _too_large(f"expands tabs to {n:,} columns")
    elif name in ("format", "format_map") and _wide_spec(owner):
        raise _too_large(f"formats with a width in {owner[:40]!r}")
    elif name == "join" and args and _joined_size(owner, args[0]) > MAX_OUTPUT_CHARS:
        raise _too_large("joins values into a string")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and args[0] and \
            isinstance(args[1], str) and \
            len(owner) + owner.count(args[0]) * len(args[1]) > MAX_OUTPUT_CHARS:
        raise _too_large("replaces text into a string")


def _bounded_filters(filters: dict) -> dict:
    """jinja2's string filters with their result sizes checked before they run."""
    center, fmt, join, indent, replace = (filters[k] for k in ("center", "format", "join",
                                                                "indent", "replace"))

    def bounded_center(value, width=80):
        _check_width("center", width)
        return center(value, width)

    def bounded_format(value, *args, **kwargs):
        if _wide_spec(value):
            raise _too_large(f"formats with a width in {str(value)[:40]!r}")
        return fmt(value, *args, **kwargs)

    def bounded_join(context, value, d="", attribute=None):
        if attribute is None and _joined_size(d, value) > MAX_OUTPUT_CHARS:
            raise _too_large("joins values into a string")
        return join(context, value, d, attribute)

    def bounded_indent(s, width=4, first=False, blank=False):
        n = width if isinstance(width, int) else len(str(width))
        if (str(s).count("\n") + 1) * n + len(str(s)) > MAX_OUTPUT_CHARS:
            raise _too_large(f"indents by {n:,}")
        return indent(s, width, first, blank)

    def bounded_replace(eval_ctx, s, old, new, count=None):
        if isinstance(s, str) and old and len(s) + s.count(str(old)) * len(str(new)) > \
                MAX_OUTPUT_CHARS:
            raise _too_large("replaces text into a string")
        return replace(eval_ctx, s, old, new, count)

    import jinja2
    return {"center": bounded_center, "format": bounded_format,
            "join": jinja2.pass_eval_context(bounded_join), "indent": bounded_indent,
            "replace": jinja2.pass_eval_context(bounded_replace)}


def _bounded_environment():
    """An immutable jinja2 sandbox (as transformers') whose ``*``, ``**``, ``%``, string
    filters and string methods refuse results over the limit, with transformers' template
    helpers and a ``namespace`` whose attributes are bounded too."""
    import json

    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "%"])

        def getattr(self, obj, attribute):
            # the sandbox hands str.format out wrapped (no __self__ left for ``call``)
            if attribute in ("format", "format_map") and _wide_spec(obj):
                raise _too_large(f"formats with a width in {obj[:40]!r}")
            return super().getattr(obj, attribute)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's names
            _check_call(__obj, args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

        def call_binop(self, context, operator, left, right):
            if operator == "%" and _wide_spec(left):
                raise _too_large(f"formats with a width in {left[:40]!r}")
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    size = _size(seq)
                    if size is not None and isinstance(n, int) and size * n > MAX_OUTPUT_CHARS:
                        raise _too_large(f"repeats a {size}-long value {n:,} times")
            elif isinstance(left, int) and isinstance(right, int) and right > 0 and \
                    abs(left) > 1 and right * math.log10(abs(left)) > 1000:
                raise _too_large(f"computes {left} ** {right}")
            return super().call_binop(context, operator, left, right)

    class Generation(Extension):  # transformers' {% generation %} ... {% endgeneration %}
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body
                                          ).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    class BoundedNamespace(Namespace):
        def __setitem__(self, name, value):
            if (_size(value) or 0) > MAX_OUTPUT_CHARS:
                raise _too_large(f"stores a {len(value):,}-long value in a namespace")
            super().__setitem__(name, value)

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters.update(_bounded_filters(env.filters))
    env.globals["namespace"] = BoundedNamespace
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, \
        sort_keys=False: json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                                    separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: "2025-01-01"
    return env


def check_chat_template(template: str | Mapping[str, str] | None,
                        special_tokens: Mapping[str, Any] | None = None) -> None:
    """Trial-renders ``template`` (each one of a name -> template mapping) on a small
    conversation, bounded; raises :class:`TemplateTooLarge` (one line) when it renders or
    computes more than :data:`MAX_OUTPUT_CHARS`. Other template errors are left to the real
    render."""
    if not template:
        return
    if isinstance(template, Mapping):
        for one in template.values():
            check_chat_template(one, special_tokens)
        return
    import jinja2

    env = _bounded_environment()
    try:
        compiled = env.from_string(template)
    except jinja2.TemplateSyntaxError:
        return  # transformers reports it, with its own message
    variables = {**dict(special_tokens or {}), "messages": _SAMPLE,
                 "add_generation_prompt": True, "tools": None, "documents": None}
    total = 0
    previous = sys.gettrace()
    sys.settrace(_watch(time.monotonic() + MAX_RENDER_SECONDS))
    try:
        for chunk in compiled.generate(**variables):
            total += len(chunk)
            if total > MAX_OUTPUT_CHARS:
                raise _too_large("renders a two-turn conversation to")
    except TemplateTooLarge:
        raise
    except (MemoryError, OverflowError, RecursionError) as e:
        raise _too_large(f"fails on a two-turn conversation ({type(e).__name__})") from None
    except Exception:  # noqa: BLE001 - raise_exception, undefined names: the real render's
        return
    finally:
        sys.settrace(previous)


def _watch(deadline: float):
    """A trace function for the trial render: in the template's own code (compiled from
    ``<template>``), at every line, stop past ``deadline`` (nested ``range`` loops) or when a
    variable holds a value over the limit (a string doubled in a loop or a recursive macro:
    stopped at most one doubling past the limit, whatever operator built it)."""
    def line(frame, event, arg):
        if time.monotonic() > deadline:
            raise TemplateTooLarge(
                f"the chat template did not finish rendering a two-turn conversation within "
                f"{MAX_RENDER_SECONDS:g} s: it is not a usable prompt template (a corrupt or "
                "hostile tokenizer_config.json / GGUF chat template?)")
        for value in frame.f_locals.values():
            size = _size(value)
            if size is not None and size > MAX_OUTPUT_CHARS:
                raise _too_large(f"builds a {size:,}-long value")
        return line

    def call(frame, event, arg):
        return line if frame.f_code.co_filename == "<template>" else None
    return call


def check_rendered(text: str) -> str:
    """``text`` (a rendered chat prompt) unless longer than :data:`MAX_OUTPUT_CHARS`."""
    if len(text) > MAX_OUTPUT_CHARS:
        raise _too_large(f"rendered {len(text):,} characters")
    return text
