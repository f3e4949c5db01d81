"""Bounds on what a chat template may render: a template is code from a model's files.

    check_chat_template(template, special_tokens)   # once per template: UserError or None
    check_rendered(text)                            # every render: UserError when too long

Hugging Face tokenizers render their chat template with ``transformers`` (a jinja2 sandbox),
which bounds ``range`` but not string or list repetition: ``{{ 'a' * 10**8 }}`` renders 100
million characters (451 MB here) before anything looks at them. :func:`check_chat_template`
trial-renders the template once, on a small conversation, in a sandbox that refuses any
``*`` or ``**`` whose result would exceed :data:`MAX_OUTPUT_CHARS` and stops the output at
that size; :func:`check_rendered` bounds every real render's text before it is tokenized.
Both fail with one line. Errors the template raises on purpose (``raise_exception``, an
undefined name) are not this module's business: the real render reports them as before.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from rljax.errors import UserError

# A rendered prompt beyond this is not a prompt (the longest real chat prompts are ~100k
# tokens, a few hundred thousand characters).
MAX_OUTPUT_CHARS = 4_000_000

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


def _bounded_environment():
    """An immutable jinja2 sandbox (as transformers') whose ``*`` and ``**`` refuse results
    over the limit, with transformers' template helpers."""
    import json

    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**"])

        def call_binop(self, context, operator, left, right):
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

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
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


def check_rendered(text: str) -> str:
    """``text`` (a rendered chat prompt) unless longer than :data:`MAX_OUTPUT_CHARS`."""
    if len(text) > MAX_OUTPUT_CHARS:
        raise _too_large(f"rendered {len(text):,} characters")
    return text
