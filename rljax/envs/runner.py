"""Running tool calls safely and stepping many episodes at once.

``call_tool(tools, call) -> (text, counters)`` never raises: an unknown tool, a malformed call,
arguments that do not fit the tool's schema, a tool that raises and a tool that hangs past its
``timeout_s`` all become an ``"Error: ..."`` observation the model reads, and are counted:

=================  ===========================================================================
``tool_calls``     every call the model made, well-formed or not
``tool_errors``    calls that failed for any reason but time (malformed, unknown name, bad
                   arguments, the tool raised)
``tool_timeouts``  calls that ran out of time (the runner stopped waiting, or the tool stopped
                   itself with ``ToolTimeout``); disjoint from ``tool_errors``
``tool:<name>``    calls of each registered tool the turn named (made, whatever the outcome)
=================  ===========================================================================

A hung tool runs in a daemon thread the runner stops waiting for after ``timeout_s``; Python
cannot kill a thread, so a tool that may never return should bound itself (the ``python`` tool
runs code in a child process it kills).

``step_all(envs, turns)`` steps every episode's environment in a thread pool, so tools that wait
on subprocesses (or I/O) run in parallel; results keep the episodes' order.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import threading
from typing import Any, Mapping, Sequence

from rljax.envs.base import Environment, StepResult, Tool, ToolError, ToolTimeout
from rljax.envs.tool_format import ToolCall, ToolCallError

__all__ = ["call_tool", "check_arguments", "bind_arguments", "step_all", "merge_counters",
           "MAX_OBSERVATION_CHARS"]

# Longest observation a tool may return; the rest is cut (a result is context tokens).
MAX_OBSERVATION_CHARS = 4000
_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool,
               "array": list, "object": dict, "null": type(None)}


def check_arguments(parameters: Mapping[str, Any], arguments: Mapping[str, Any]) -> str | None:
    """What is wrong with ``arguments`` under the JSON schema ``parameters`` (None if nothing).

    Checks the subset of JSON schema tool definitions use: required keys, unknown keys (unless
    ``additionalProperties`` is true), each property's ``type`` (a name or list of names) and
    ``enum``. Booleans are not integers/numbers, as in JSON, and ``3.0`` is not an integer (so
    a tool's ``fn`` gets the Python type its schema promises).
    """
    props = parameters.get("properties", {})
    missing = [k for k in parameters.get("required", ()) if k not in arguments]
    if missing:
        return f"missing required argument(s) {missing}"
    if not parameters.get("additionalProperties", False):
        unknown = sorted(set(arguments) - set(props))
        if unknown:
            return f"unknown argument(s) {unknown}; expected {sorted(props)}"
    for key, value in arguments.items():
        spec = props.get(key, {})
        types = spec.get("type")
        types = [types] if isinstance(types, str) else list(types or ())
        if types and not any(_is_type(value, t) for t in types):
            return f"argument {key!r} must be {' or '.join(types)}, got {_json_type(value)}"
        if "enum" in spec and value not in spec["enum"]:
            return f"argument {key!r} must be one of {list(spec['enum'])}, got {value!r}"
    return None


def _is_type(value: Any, name: str) -> bool:
    if name in ("integer", "number") and isinstance(value, bool):
        return False
    return isinstance(value, _JSON_TYPES.get(name, object))


def _json_type(value: Any) -> str:
    for name, types in _JSON_TYPES.items():
        if _is_type(value, name):
            return name
    return type(value).__name__


def bind_arguments(tool: Tool, call: ToolCall) -> dict:
    """The call's arguments as a dict: raw text (plain format) goes to the tool's only required
    parameter, or its only parameter when none is required. Raises ToolError otherwise."""
    if call.raw is None:
        return dict(call.arguments)
    props = list(tool.parameters.get("properties", {}))
    required = list(tool.parameters.get("required", ()))
    target = required if required else props
    if len(target) != 1:
        raise ToolError(f"tool {tool.name!r} takes arguments {props}; give them as a JSON object")
    return {target[0]: call.raw}


def _as_mapping(tools: Tool | Mapping[str, Tool] | Sequence[Tool]) -> Mapping[str, Tool]:
    if isinstance(tools, Tool):
        return {tools.name: tools}
    if isinstance(tools, Mapping):
        return tools
    return {t.name: t for t in tools}


def _run_with_timeout(tool: Tool, arguments: dict) -> Any:
    """``tool.fn(**arguments)``, in a daemon thread when it has a timeout; raises what it
    raised, or ToolTimeout when it did not return within ``timeout_s``."""
    if not tool.timeout_s or tool.timeout_s <= 0:
        return tool.fn(**arguments)
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = tool.fn(**arguments)
        except BaseException as e:  # noqa: BLE001 - SystemExit from a tool is an error too
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True, name=f"tool-{tool.name}")
    thread.start()
    thread.join(tool.timeout_s)
    if thread.is_alive():
        raise ToolTimeout(f"tool {tool.name!r} timed out after {tool.timeout_s:g}s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _truncate(text: str, limit: int = MAX_OBSERVATION_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} chars cut]"


def call_tool(tools: Tool | Mapping[str, Tool] | Sequence[Tool],
              call: ToolCall | ToolCallError) -> tuple[str, dict[str, int]]:
    """Runs one parsed call against ``tools`` (a Tool, a list, or a name -> Tool mapping).

    Returns ``(observation text, counters)``; never raises (see the module docstring), except
    KeyboardInterrupt, so Ctrl-C still stops a run in the middle of a tool call.
    """
    counters = collections.Counter(tool_calls=1, tool_errors=0, tool_timeouts=0)
    if isinstance(call, ToolCallError):
        counters["tool_errors"] += 1
        return f"Error: {call.message}", dict(counters)
    by_name = _as_mapping(tools)
    tool = by_name.get(call.name)
    if tool is None:
        counters["tool_errors"] += 1
        return (f"Error: unknown tool {call.name!r}; available: {', '.join(sorted(by_name))}",
                dict(counters))
    counters[f"tool:{tool.name}"] += 1
    try:
        arguments = bind_arguments(tool, call)
        problem = check_arguments(tool.parameters, arguments)
        if problem is not None:
            raise ToolError(f"tool {tool.name!r}: {problem}")
        value = _run_with_timeout(tool, arguments)
        return _truncate(str(value)), dict(counters)
    except ToolTimeout as e:
        counters["tool_timeouts"] += 1
        return f"Error: {e}", dict(counters)
    except ToolError as e:
        counters["tool_errors"] += 1
        return f"Error: {e}", dict(counters)
    except KeyboardInterrupt:  # the user stopping the run is not the tool's failure
        raise
    except BaseException as e:  # noqa: BLE001 - a tool's bug is the episode's observation
        counters["tool_errors"] += 1
        return _truncate(f"Error: {type(e).__name__}: {e}"), dict(counters)


def merge_counters(*parts: Mapping[str, int]) -> dict[str, int]:
    """Sums counter dicts key by key."""
    total: collections.Counter = collections.Counter()
    for part in parts:
        total.update(part)
    return dict(total)


_POOL: cf.ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
MAX_WORKERS = 64


def _pool() -> cf.ThreadPoolExecutor:
    """One shared pool (threads are reused across rollout turns)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = cf.ThreadPoolExecutor(max_workers=MAX_WORKERS, thread_name_prefix="env-step")
        return _POOL


def step_all(envs: Sequence[Environment], turns: Sequence[str | None]) -> list[StepResult | None]:
    """``[env.step(turn) for env, turn in zip(envs, turns)]`` run concurrently, in order.

    A ``None`` turn (a finished episode) is skipped and gives ``None``. An exception raised by
    an environment's ``step`` (a bug in the environment, not a tool failure: tools never raise
    through ``call_tool``) propagates, naming the episode.
    """
    if len(envs) != len(turns):
        raise ValueError(f"step_all: {len(envs)} environments but {len(turns)} turns")
    active = [i for i, t in enumerate(turns) if t is not None]
    results: list[StepResult | None] = [None] * len(envs)
    if len(active) == 1:  # no thread hop for a single episode
        results[active[0]] = envs[active[0]].step(turns[active[0]])
        return results
    futures = {i: _pool().submit(envs[i].step, turns[i]) for i in active}
    for i, future in futures.items():
        try:
            results[i] = future.result()
        except Exception as e:
            raise RuntimeError(f"environment of episode {i} ({type(envs[i]).__name__}) raised "
                               f"in step: {type(e).__name__}: {e}") from e
    return results
