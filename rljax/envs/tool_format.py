"""How tool calls look in a model's text: parsing them out of a turn, writing them, and wrapping
tool results as messages.

Two formats, by name (``get_tool_format``):

``json``   the Qwen/Hermes form that chat templates with tool support use::

               <tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>

           results are ``{"role": "tool", "content": result}`` messages, rendered by the chat
           template.
``plain``  a short form a tiny character-level model can learn, for models without tool
           templates::

               <call calculator>12*34</call>

           The text between the tags is the arguments: a JSON object (``{"query": "x", "k": 2}``),
           or else raw text bound to the tool's only required parameter (only parameter if none
           is required) — so a one-argument tool takes its argument as it is. Results are
           ``{"role": "tool", "content": "<result>408</result>"}``: the content is self-delimiting
           text meant to be appended to the transcript verbatim.

Both end a call with a fixed string (``ToolFormat.call_end``), so the rollout can stop a model's
turn as soon as a call is complete. ``parse`` never raises: a malformed call is a
``ToolCallError`` in the list (the runner turns it into an error observation and counts it).
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Mapping, Sequence

from rljax.envs.base import Message, Tool

__all__ = ["ToolCall", "ToolCallError", "ToolFormat", "JsonToolFormat", "PlainToolFormat",
           "get_tool_format", "tool_format_names"]


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One well-formed call. ``raw``: the plain format's un-keyed argument text (then
    ``arguments`` is empty and the runner binds ``raw`` to the tool's single parameter)."""
    name: str
    arguments: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    raw: str | None = None


@dataclasses.dataclass(frozen=True)
class ToolCallError:
    """A call the model tried to make but wrote malformed; ``message`` says what is wrong."""
    message: str


class ToolFormat:
    """Base class: ``parse`` a turn into calls, ``render_call``, ``render_results``, ``describe``."""

    name: str = ""
    call_start: str = ""
    call_end: str = ""

    def parse(self, text: str) -> list[ToolCall | ToolCallError]:
        """Every call in ``text`` in order; empty = no call (the turn is a final answer)."""
        out: list[ToolCall | ToolCallError] = []
        pos = text.find(self.call_start)
        while pos >= 0:
            end = text.find(self.call_end, pos + len(self.call_start))
            if end < 0:
                out.append(ToolCallError(f"unterminated tool call: no {self.call_end} after "
                                         f"{self.call_start}"))
                break
            try:
                out.append(self._parse_one(text[pos:end]))
            except (RecursionError, ValueError) as e:  # e.g. JSON nested thousands deep
                out.append(ToolCallError(f"malformed tool call: {type(e).__name__}"))
            pos = text.find(self.call_start, end + len(self.call_end))
        return out

    def _parse_one(self, opening: str) -> ToolCall | ToolCallError:
        """One call from ``call_start ...`` up to (without) ``call_end``."""
        raise NotImplementedError

    def render_call(self, call: ToolCall) -> str:
        """The text a model writes to make ``call`` (for SFT traces); ``parse`` reads it back."""
        raise NotImplementedError

    def render_results(self, results: Sequence[str]) -> list[Message]:
        """The observation messages for the results of one turn's calls, in call order."""
        raise NotImplementedError

    def describe(self, tools: Sequence[Tool]) -> str:
        """System-prompt text telling the model which tools exist and how to call them."""
        raise NotImplementedError


def _arguments_from_json(value: Any) -> dict | str:
    """A call's ``arguments`` value as a dict, or an error message. A JSON string holding an
    object is accepted too (the OpenAI wire form some models imitate)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            return "arguments must be a JSON object, got a string that is not JSON"
    if not isinstance(value, dict):
        return f"arguments must be a JSON object, got {type(value).__name__}"
    return value


class JsonToolFormat(ToolFormat):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen/Hermes)."""

    name, call_start, call_end = "json", "<tool_call>", "</tool_call>"

    def _parse_one(self, opening: str) -> ToolCall | ToolCallError:
        body = opening[len(self.call_start):].strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            return ToolCallError(f"malformed JSON in tool call: {e.msg} (char {e.pos})")
        if not isinstance(obj, dict):
            return ToolCallError(f"a tool call must be a JSON object, got {type(obj).__name__}")
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            return ToolCallError('a tool call needs "name": a non-empty string')
        arguments = _arguments_from_json(obj.get("arguments", {}))
        if isinstance(arguments, str):
            return ToolCallError(f"tool call {name!r}: {arguments}")
        return ToolCall(name, arguments)

    def render_call(self, call: ToolCall) -> str:
        if call.raw is not None:
            raise ValueError(f"the json tool format needs named arguments; {call.name!r} has raw "
                             "text (bind it to a parameter name first)")
        payload = json.dumps({"name": call.name, "arguments": dict(call.arguments)},
                             ensure_ascii=False)
        return f"{self.call_start}{payload}{self.call_end}"

    def render_results(self, results: Sequence[str]) -> list[Message]:
        return [{"role": "tool", "content": str(r)} for r in results]

    def describe(self, tools: Sequence[Tool]) -> str:
        schemas = "\n".join(json.dumps(t.schema(), ensure_ascii=False) for t in tools)
        return ("You may call tools. Available tools (JSON schemas):\n"
                f"{schemas}\n"
                "To call a tool, write exactly\n"
                '<tool_call>{"name": "<tool name>", "arguments": {<arguments as JSON>}}'
                "</tool_call>\nand stop; its result comes back in the next message. "
                "When you know the answer, reply without a tool call.")


_PLAIN_OPENING = re.compile(r"<call ([A-Za-z_][\w.\-]*)>(.*)", re.DOTALL)


class PlainToolFormat(ToolFormat):
    """``<call NAME>ARGS</call>``; ARGS a JSON object or one argument's raw text."""

    name, call_start, call_end = "plain", "<call ", "</call>"
    result_start, result_end = "<result>", "</result>"

    def _parse_one(self, opening: str) -> ToolCall | ToolCallError:
        match = _PLAIN_OPENING.fullmatch(opening)
        if match is None:
            return ToolCallError("malformed tool call: expected <call NAME>ARGUMENTS</call>")
        name, args = match.group(1), match.group(2).strip()
        if args.startswith("{"):
            try:
                obj = json.loads(args)
            except (json.JSONDecodeError, RecursionError):
                obj = None  # not JSON: raw text that happens to start with a brace
            if isinstance(obj, dict):
                return ToolCall(name, obj)
        return ToolCall(name, {}, raw=args)

    def render_call(self, call: ToolCall) -> str:
        if call.raw is not None:
            args = call.raw
        elif len(call.arguments) == 1 and isinstance(next(iter(call.arguments.values())), str):
            args = next(iter(call.arguments.values()))  # one string argument: written raw
        else:
            args = json.dumps(dict(call.arguments), ensure_ascii=False)
        return f"<call {call.name}>{args}{self.call_end}"

    def render_results(self, results: Sequence[str]) -> list[Message]:
        return [{"role": "tool", "content": f"{self.result_start}{r}{self.result_end}"}
                for r in results]

    def describe(self, tools: Sequence[Tool]) -> str:
        lines = [f"- {t.name}({', '.join(t.parameters.get('properties', {}))}): {t.description}"
                 for t in tools]
        return ("Tools:\n" + "\n".join(lines) + "\nCall one as <call NAME>ARGUMENT</call> (or a "
                "JSON object of arguments); the result comes back as <result>...</result>.")


_FORMATS: dict[str, type[ToolFormat]] = {"json": JsonToolFormat, "plain": PlainToolFormat}


def tool_format_names() -> tuple[str, ...]:
    return tuple(sorted(_FORMATS))


def get_tool_format(name: str | ToolFormat) -> ToolFormat:
    """The format registered as ``name`` ("json" or "plain"); a ``ToolFormat`` passes through."""
    if isinstance(name, ToolFormat):
        return name
    if name not in _FORMATS:
        raise KeyError(f"unknown tool format {name!r}; known: {', '.join(tool_format_names())}")
    return _FORMATS[name]()
