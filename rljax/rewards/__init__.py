"""Reward functions (host Python) and their weighted composition.

Every reward function has the shape ``fn(prompts, completions, **dataset_fields) -> list[float]``
(see the public contract in DESIGN.md). Built-ins, by name:

=============  ==================================================================================
``gsm8k``      final number == reference (field ``answer``: "... #### 18" or "18")
``arithmetic`` final number == ``answer`` (built-in arithmetic task)
``countdown``  expression over ``numbers`` equals ``target`` (fields from the countdown task)
``math``       math-verify equivalence with ``answer`` (\\frac, \\boxed{}, decimals, ...)
``format``     regex layout; ``get("format", pattern=..., mode="search")``
``overlong``   DAPO soft overlong penalty; ``get("overlong", max_length=..., buffer=...)``
``length``     alias of ``overlong``
=============  ==================================================================================

Your own function, without registering it: ``get("path/to/file.py:my_reward")`` or
``get("package.module:my_reward")`` (what ``reward.names`` entries of that form do). Without
options the attribute is the reward function; with options (``get(spec, **kwargs)``, from
``reward.kwargs[<function name>]``) it is a factory called once as ``attr(**kwargs)`` that
returns the reward function.

``RewardModelScorer(cfg, value_params, tokenizer)`` scores with a value-head model; build it
yourself (it needs parameters), then pass it to ``combine`` like any function.
"""
from __future__ import annotations

from rljax.rewards import shaping, verifiers  # noqa: F401  (modules of the package)
from rljax.rewards.combine import (CombinedReward, RewardResult, call_reward, combine,
                                   required_fields)
from rljax.rewards.monitor import RewardFunctionFailed, RewardMonitor
from rljax.rewards.registry import (check, display_name, get, names, option_problem,
                                    register)

__all__ = ["get", "register", "names", "combine", "from_config", "CombinedReward", "RewardResult",
           "RewardModelScorer", "RewardMonitor", "RewardFunctionFailed", "display_name", "check",
           "call_reward", "required_fields"]


def from_config(config) -> CombinedReward:
    """Builds a ``CombinedReward`` from a config section (dict or ConfigDict)::

        {"functions": [{"name": "gsm8k", "weight": 1.0},
                       {"name": "format", "weight": 0.1, "pattern": "..."}],
         "default_score": 0.0, "timeout_s": 10.0, "isolation": "thread"}
    """
    config = dict(config.to_dict() if hasattr(config, "to_dict") else config)
    allowed = {"functions", "default_score", "timeout_s", "isolation"}
    unknown = set(config) - allowed
    if unknown:
        raise ValueError(f"unknown reward config key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    entries = []
    for item in config.get("functions", []):
        item = dict(item)
        if "name" not in item:
            raise ValueError(f"reward config entry {item} has no 'name'")
        name, weight = item.pop("name"), item.pop("weight", 1.0)
        entries.append((name, weight, item))
    return combine(entries, default_score=config.get("default_score", 0.0),
                   timeout_s=config.get("timeout_s"), isolation=config.get("isolation", "thread"))


def __getattr__(attr):
    # RewardModelScorer imports jax and rljax.models; load it only when asked for.
    if attr == "RewardModelScorer":
        from rljax.rewards.reward_model import RewardModelScorer
        return RewardModelScorer
    raise AttributeError(f"module 'rljax.rewards' has no attribute {attr!r}")
