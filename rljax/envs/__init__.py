"""Environments and tools for multi-turn (agentic) rollouts; the protocol is in ``base``."""
from rljax.envs.base import (Environment, Message, StepResult, Tool, env_names, make_env,
                             make_tool, register_env, register_tool, tool_names)

__all__ = ["Environment", "Message", "StepResult", "Tool", "env_names", "make_env", "make_tool",
           "register_env", "register_tool", "tool_names"]
