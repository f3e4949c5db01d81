"""Environments and tools for multi-turn (agentic) rollouts; the protocol is in ``base``.

Importing this package registers the built-ins: tools ``calculator``, ``python``, ``search``
(``tools``), environments ``tool`` (``tool_env``), ``guess_number`` (``games``), ``tictactoe``,
``kuhn_poker``, ``negotiation`` and ``propose_solve`` (``game_env``, over the pure-Python rules
of ``board_games`` and ``propose_solve``), and the tool formats ``json`` and ``plain``
(``tool_format``). See docs/agents.md.
"""
from rljax.envs.base import (Environment, Message, StepResult, Tool, ToolError, ToolTimeout,
                             env_names, make_env, make_tool, register_env, register_tool,
                             tool_names)
from rljax.envs.tool_format import (ToolCall, ToolCallError, ToolFormat, get_tool_format,
                                    tool_format_names)
from rljax.envs.runner import call_tool, merge_counters, step_all
from rljax.envs import tools  # noqa: F401  (registers the built-in tools)
from rljax.envs.tool_env import ToolEnv, trace_messages
from rljax.envs.games import GuessNumberEnv, guess_trace
from rljax.envs.game_env import GAME_ENVS, GameEnv, game_trace
from rljax.envs.checks import check_env_config
from rljax.envs.metrics import env_metrics, wilson_interval

__all__ = ["Environment", "Message", "StepResult", "Tool", "ToolError", "ToolTimeout",
           "env_names", "make_env", "make_tool", "register_env", "register_tool", "tool_names",
           "ToolCall", "ToolCallError", "ToolFormat", "get_tool_format", "tool_format_names",
           "call_tool", "merge_counters", "step_all", "ToolEnv", "trace_messages",
           "GuessNumberEnv", "guess_trace", "GAME_ENVS", "GameEnv", "game_trace",
           "check_env_config", "env_metrics", "wilson_interval"]
