"""Up-front checks of an ``env`` config section's names (called from ``config.validate``), so an
unknown environment, tool or tool format fails with one line naming the key, before compiling.
Names may also be user code (``path/to/file.py:factory``, ``package.module:factory``): it is
imported here, so a missing file or attribute fails just as early (a UserError naming the key)."""
from __future__ import annotations

from typing import Sequence

from rljax import usercode
from rljax.envs.base import env_names, lookup_factory, tool_names
from rljax.envs.tool_format import tool_format_names
from rljax.errors import ConfigError

__all__ = ["check_env_config"]


def check_env_config(name: str, tools: Sequence[str] = (), tool_format: str | None = None,
                     max_tool_calls: int | None = None, prefix: str = "env") -> None:
    """Raises ConfigError naming ``env.name`` / ``env.tools`` / ``env.tool_format`` /
    ``env.max_tool_calls`` (with ``prefix`` for another section) and listing the known names."""
    if usercode.is_spec(name):  # user code: loading it now reports a missing file/attribute
        lookup_factory("environment", name, f"{prefix}.name")
    elif name not in env_names():
        raise ConfigError(f"{prefix}.name: unknown environment {name!r}; known: "
                          f"{', '.join(env_names())} (or path/to/file.py:factory)")
    if isinstance(tools, str):
        raise ConfigError(f"{prefix}.tools: expected a list of tool names, got the string "
                          f"{tools!r} (write ({tools!r},))")
    for tool in tools:
        if usercode.is_spec(tool):
            lookup_factory("tool", tool, f"{prefix}.tools")
        elif tool not in tool_names():
            raise ConfigError(f"{prefix}.tools: unknown tool {tool!r}; known: "
                              f"{', '.join(tool_names())} (or path/to/file.py:factory)")
    if len(set(tools)) != len(tuple(tools)):
        raise ConfigError(f"{prefix}.tools: a tool is named twice: {list(tools)}")
    if tool_format is not None and tool_format not in tool_format_names():
        raise ConfigError(f"{prefix}.tool_format: unknown tool format {tool_format!r}; known: "
                          f"{', '.join(tool_format_names())}")
    if max_tool_calls is not None and (not isinstance(max_tool_calls, int) or max_tool_calls < 0):
        raise ConfigError(f"{prefix}.max_tool_calls: must be a non-negative integer or None, "
                          f"got {max_tool_calls!r}")
