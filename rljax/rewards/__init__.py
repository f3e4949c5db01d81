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

``RewardModelScorer(cfg, value_params, tokenizer)`` scores with a value-head model; build it
yourself (it needs parameters), then pass it to ``combine`` like any function.
"""
from __future__ import annotations

from typing import Callable

from rljax.rewards import shaping, verifiers
from rljax.rewards.combine import CombinedReward, RewardResult, combine

__all__ = ["get", "register", "names", "combine", "from_config", "CombinedReward", "RewardResult",
           "RewardModelScorer"]

# name -> factory(**kwargs) returning a reward function.
_REGISTRY: dict[str, Callable[..., Callable]] = {}


def _plain(fn: Callable) -> Callable[..., Callable]:
    """Factory for a reward that takes no construction arguments."""
    def factory(**kwargs):
        if kwargs:
            raise TypeError(f"reward {fn.__name__!r} takes no options, got {sorted(kwargs)}")
        return fn
    return factory


def register(name: str, factory: Callable[..., Callable], overwrite: bool = False) -> None:
    """Registers ``factory(**kwargs) -> reward_fn`` under ``name`` (for user-defined rewards)."""
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"reward {name!r} is already registered")
    _REGISTRY[name] = factory


def names() -> list[str]:
    """Registered reward names."""
    return sorted(_REGISTRY)


def get(name: str, **kwargs) -> Callable:
    """The reward function called ``name``; ``kwargs`` configure factories such as ``format``."""
    if name not in _REGISTRY:
        raise KeyError(f"unknown reward {name!r}; known: {', '.join(names())}")
    return _REGISTRY[name](**kwargs)


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


register("gsm8k", _plain(verifiers.gsm8k))
register("arithmetic", _plain(verifiers.arithmetic))
register("countdown", _plain(verifiers.countdown))
register("math", _plain(verifiers.math_equivalence))
register("format", shaping.make_format)
register("overlong", shaping.make_overlong)
register("length", shaping.make_overlong)
