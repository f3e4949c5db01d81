"""The environment protocol of multi-turn rollouts: episodes, tools, and what a step returns.

An *environment* is one episode's state machine, created per episode by a factory registered
by name (``register_env`` / ``make_env``). It speaks chat messages (``{"role", "content"}``
dicts), never tokens: the rollout renders messages through the tokenizer's chat template (or a
plain-text wrapper) and appends the new tokens to the episode's KV cache.

    env = make_env("tool", example, tools=("calculator",))
    messages = env.reset()                 # the first messages: system / user
    while True:
        text = <model's turn, decoded>
        result = env.step(text)            # StepResult
        if result.done: break
        messages += result.observation     # tool / user messages, rendered as context tokens

Rewards: ``StepResult.reward`` is the reward of the turn just taken (0.0 for most turns of an
outcome-reward task, the outcome on the last). The rollout sums them (or discounts them, per
config) into the episode's return; ``info`` carries counters the rollout aggregates into
``env/*`` metrics (``tool_calls``, ``tool_errors``, ``tool_timeouts``, ``tool:<name>``).

Tools are plain callables with a name, a description and a JSON schema of their arguments
(the form chat templates with tool support take in ``tools=``). A tool returns a string; a tool
that raises, hangs or gets malformed arguments must become an error observation, never an
exception out of ``step``: an episode is data, and one bad call must not end a run.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

from rljax import usercode
from rljax.errors import UserError

Message = dict  # {"role": "system"|"user"|"assistant"|"tool", "content": str, ...}


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What ``Environment.step`` returns after one model turn.

    observation: messages to append before the model's next turn (tool results, feedback);
      empty when ``done``.
    reward: this turn's reward (float).
    done: the episode ended (solved, failed, or the environment's own turn limit).
    info: counters and facts for metrics/logging, e.g. ``{"tool_calls": 1, "tool_errors": 0}``.
    """
    observation: Sequence[Message] = ()
    reward: float = 0.0
    done: bool = False
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """One episode. Created by a registered factory from one dataset example."""

    def reset(self) -> list[Message]:
        """Returns the episode's first messages (system and user); the model speaks next."""
        ...

    def step(self, model_turn: str) -> StepResult:
        """Consumes the model's decoded turn; returns observation, reward, done, info."""
        ...


@dataclasses.dataclass(frozen=True)
class Tool:
    """A callable the model may invoke by name.

    fn: takes the call's arguments as keyword arguments, returns a string observation.
    parameters: JSON schema (``{"type": "object", "properties": {...}, "required": [...]}``).
    timeout_s: wall-clock bound of one call; 0 = none.
    """
    name: str
    description: str
    parameters: Mapping[str, Any]
    fn: Callable[..., str]
    timeout_s: float = 10.0

    def schema(self) -> dict:
        """The OpenAI/HF ``tools=`` entry for chat templates."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": dict(self.parameters)}}


class ToolError(Exception):
    """Raised by a tool for a failure the model should read as ``"Error: <message>"`` (bad
    input, a program that crashed); any other exception is reported with its type name."""


class ToolTimeout(ToolError):
    """Raised by a tool that enforces its own time limit (e.g. the python sandbox killed a
    program); counted as ``tool_timeouts`` like a call the runner gave up waiting for."""


EnvFactory = Callable[..., Environment]   # factory(example: dict, **kwargs) -> Environment
ToolFactory = Callable[..., Tool]         # factory(**kwargs) -> Tool

_ENVS: dict[str, EnvFactory] = {}
_TOOLS: dict[str, ToolFactory] = {}


def register_env(name: str, factory: EnvFactory) -> EnvFactory:
    """Registers ``factory(example, **kwargs) -> Environment`` under ``name`` (overwrites)."""
    _ENVS[name] = factory
    return factory


def register_tool(name: str, factory: ToolFactory) -> ToolFactory:
    """Registers ``factory(**kwargs) -> Tool`` under ``name`` (overwrites)."""
    _TOOLS[name] = factory
    return factory


def env_names() -> tuple[str, ...]:
    return tuple(sorted(_ENVS))


def tool_names() -> tuple[str, ...]:
    return tuple(sorted(_TOOLS))


def lookup_factory(what: str, name: str, key: str) -> Callable:
    """The factory of environment (``what="environment"``) or tool (``"tool"``) ``name``:
    registered, or the user code it names (``path/to/file.py:attr`` or ``package.module:attr``,
    loaded once per process; a missing file/attribute is a UserError naming ``key``)."""
    registry = {"environment": _ENVS, "tool": _TOOLS}[what]
    if name in registry:
        return registry[name]
    if usercode.is_spec(name):
        factory = usercode.load(name, key)
        if not callable(factory):
            raise UserError(f"{key}: {name} is a {type(factory).__name__}, not a {what} factory")
        return factory
    known = ", ".join(sorted(registry)) or "none"
    raise KeyError(f"unknown {what} {name!r}; known: {known} (or path/to/file.py:factory)")


def make_env(name: str, example: Mapping[str, Any], **kwargs) -> Environment:
    """A fresh episode of environment ``name`` (registered, or ``file.py:factory``) for one
    dataset example."""
    return lookup_factory("environment", name, "env.name")(dict(example), **kwargs)


def make_tool(name: str, **kwargs) -> Tool:
    """Tool ``name`` (registered, or ``file.py:factory`` returning a ``Tool``)."""
    tool = lookup_factory("tool", name, "env.tools")(**kwargs)
    if not isinstance(tool, Tool):
        raise UserError(f"env.tools: {name} returned a {type(tool).__name__}, not a Tool")
    return tool
