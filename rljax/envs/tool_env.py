"""``ToolEnv`` (registered as env ``"tool"``): a question answered with the help of tools.

    env = make_env("tool", example, tools=("calculator",), tool_format="plain")
    env.reset()          # [system (tool descriptions), user (example["prompt"])]
    env.step("<call calculator>123*456</call>")   # observation: the tool result; not done
    env.step("56088")    # no tool call: the final answer; done, reward 0.0

The outcome is scored by the run's reward functions (``reward.names``) on the final model turn,
as for single-turn tasks, so the environment itself gives reward 0.0, unless ``call_reward``
pays a well-formed call (shaping for a model that has only begun to call). ``info`` carries the
turn's tool counters (``runner.call_tool``). ``trace_messages`` writes a complete, verified
episode for SFT warm-up on tool use.
"""
from __future__ import annotations

import collections
import json
import threading
from typing import Any, Mapping, Sequence

from rljax.envs.base import (Message, StepResult, Tool, lookup_factory, make_tool,
                             register_env)
from rljax.envs.runner import call_tool
from rljax.envs.tool_format import ToolCall, ToolFormat, get_tool_format

__all__ = ["ToolEnv", "trace_messages", "example_prompt", "shared_tool"]

_ZERO = {"tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0}


def _some_call_ran(counters: Mapping[str, int]) -> bool:
    """Some call counted in ``counters`` ran without an error or a timeout."""
    return counters["tool_calls"] > counters["tool_errors"] + counters["tool_timeouts"]


_TOOL_CACHE: dict[tuple, Tool] = {}
_TOOL_CACHE_LOCK = threading.Lock()


def shared_tool(name: str, **options) -> Tool:
    """``make_tool(name, **options)``, built once per process and shared by every episode.

    A rollout makes one environment per episode; building a tool each time (e.g. the ``search``
    index, ~16 ms) would cost seconds per iteration. Sharing is safe because a ``Tool`` is
    immutable and its ``fn`` must be thread-safe anyway (``step_all`` runs episodes in
    threads). The cache is keyed by the registered factory (re-registering a name builds anew)
    and the options (as JSON; options that are not JSON-able are not cached).
    """
    try:
        key = (name, lookup_factory("tool", name, "env.tools"),
               json.dumps(options, sort_keys=True))
    except TypeError:  # e.g. a callable option: build a fresh tool
        return make_tool(name, **options)
    with _TOOL_CACHE_LOCK:
        if key not in _TOOL_CACHE:
            _TOOL_CACHE[key] = make_tool(name, **options)
        return _TOOL_CACHE[key]


def example_prompt(example: Mapping[str, Any]) -> str:
    """The user message of an example: the rendered ``prompt`` the data pipeline adds, else the
    raw ``question``."""
    for key in ("prompt", "question"):
        if isinstance(example.get(key), str):
            return example[key]
    raise KeyError(f"example has no 'prompt' or 'question' text: {sorted(example)}")


class ToolEnv:
    """One episode of question answering with tools.

    tools: tool names (built with ``tool_kwargs[name]``, once per process: ``shared_tool``) or
      ``Tool`` objects.
    tool_format: "json", "plain" or a ``ToolFormat``.
    system_prompt: text put before the tool descriptions in the system message.
    describe_tools: put the tools' descriptions in the system message; turn it off when the chat
      template renders ``env.tool_schemas()`` itself (``tools=``). No system message at all
      when there is nothing to say.
    max_tool_calls: calls allowed per episode (None: no limit); a call past it is not run and
      its observation says so (counted as a tool error).
    call_reward: environment reward on the turn of the episode's first call that ran without
      error (once per episode, so calling again earns nothing). Shaping for a policy that
      calls too rarely, or too often malformed, for the answer's reward alone to teach the
      call. Below 1, so that an episode counts as correct (total reward >= 1) only when its
      answer is right.
    """

    def __init__(self, example: Mapping[str, Any], tools: Sequence[str | Tool] = ("calculator",),
                 tool_format: str | ToolFormat = "json", system_prompt: str | None = None,
                 describe_tools: bool = True, max_tool_calls: int | None = None,
                 tool_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
                 call_reward: float = 0.0):
        self.example = dict(example)
        kwargs = dict(tool_kwargs or {})
        self.tools = [t if isinstance(t, Tool) else shared_tool(t, **dict(kwargs.get(t, {})))
                      for t in tools]
        self.format = get_tool_format(tool_format)
        self.system_prompt, self.describe_tools = system_prompt, describe_tools
        if max_tool_calls is not None and max_tool_calls < 0:
            raise ValueError(f"max_tool_calls must be >= 0 or None, got {max_tool_calls}")
        self.max_tool_calls = max_tool_calls
        if not 0.0 <= call_reward < 1.0:
            raise ValueError(f"call_reward must be in [0, 1) (a correct episode is one with total "
                             f"reward >= 1, the answer's), got {call_reward}")
        self.call_reward = float(call_reward)
        self.counters: collections.Counter = collections.Counter()  # the episode's totals
        self.turns = 0

    def tool_schemas(self) -> list[dict]:
        """The ``tools=`` entries for a chat template that renders tools itself."""
        return [t.schema() for t in self.tools]

    def reset(self) -> list[Message]:
        self.counters.clear()
        self.turns = 0
        parts = [p for p in (self.system_prompt,
                             self.format.describe(self.tools) if self.describe_tools else None) if p]
        system = [{"role": "system", "content": "\n\n".join(parts)}] if parts else []
        return system + [{"role": "user", "content": example_prompt(self.example)}]

    def step(self, model_turn: str) -> StepResult:
        self.turns += 1
        calls = self.format.parse(model_turn)
        if not calls:  # a final answer: scored by the run's reward functions
            return StepResult((), 0.0, True, dict(_ZERO))
        results, turn_counters = [], collections.Counter(_ZERO)
        paid_before = _some_call_ran(self.counters)
        for call in calls:
            if self.max_tool_calls is not None and self.counters["tool_calls"] >= self.max_tool_calls:
                text = f"Error: tool call limit ({self.max_tool_calls}) reached; answer now"
                counters = {"tool_calls": 1, "tool_errors": 1}
            else:
                text, counters = call_tool(self.tools, call)
            results.append(text)
            turn_counters.update(counters)
            self.counters.update(counters)
        reward = self.call_reward if _some_call_ran(turn_counters) and not paid_before else 0.0
        return StepResult(self.format.render_results(results), reward, False, dict(turn_counters))


def trace_messages(example: Mapping[str, Any], tool_format: str | ToolFormat = "plain",
                   **env_kwargs) -> list[Message]:
    """A complete calculator episode for an arithmetic example (``{"question": "123*456=",
    "answer": "56088"}``), for SFT warm-up on tool use::

        [system?, user: prompt, assistant: <call>, tool: result, assistant: answer]

    Built by playing the real ``ToolEnv`` with the scripted turns, so the messages are exactly
    what a rollout shows. Raises ValueError if the calculator's result is not the answer.
    """
    fmt = get_tool_format(tool_format)
    env = ToolEnv(example, tools=("calculator",), tool_format=fmt, **env_kwargs)
    messages = env.reset()
    expression = str(example["question"]).strip().rstrip("=").strip()
    call_text = fmt.render_call(ToolCall("calculator", {"expression": expression}))
    result = env.step(call_text)
    answer = str(example["answer"])
    if result.info.get("tool_errors") or result.info.get("tool_timeouts"):
        raise ValueError(f"calculator failed on {expression!r}: {result.observation}")
    if list(result.observation) != fmt.render_results([answer]):
        raise ValueError(f"calculator result {result.observation} is not the answer {answer!r}")
    final = env.step(answer)
    assert final.done  # an answer without a call ends the episode
    return messages + [{"role": "assistant", "content": call_text}, *result.observation,
                       {"role": "assistant", "content": answer}]


register_env("tool", ToolEnv)
