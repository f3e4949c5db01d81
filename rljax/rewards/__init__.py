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

from typing import Callable

from rljax import usercode
from rljax.errors import ConfigError, UserError
from rljax.rewards import shaping, verifiers
from rljax.rewards.combine import (CombinedReward, RewardResult, call_reward, combine,
                                   required_fields)
from rljax.rewards.monitor import RewardFunctionFailed, RewardMonitor

__all__ = ["get", "register", "names", "combine", "from_config", "CombinedReward", "RewardResult",
           "RewardModelScorer", "RewardMonitor", "RewardFunctionFailed", "display_name", "check",
           "call_reward", "required_fields"]

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


def display_name(name: str) -> str:
    """The name metrics use: ``"my/file.py:exact"`` -> ``"exact"``; registry names unchanged."""
    return usercode.attribute_name(name) if usercode.is_spec(name) else name


def _from_user_code(spec: str, kwargs: dict, key: str) -> Callable:
    obj = usercode.load(spec, key)
    if kwargs:
        try:
            fn = obj(**kwargs)
        except TypeError as e:
            raise UserError(f"{key}: {spec} was given options {sorted(kwargs)} (reward.kwargs), "
                            f"so it is called as a factory {usercode.attribute_name(spec)}"
                            f"(**options) returning the reward function, which failed: {e}"
                            ) from None
        if not callable(fn):
            raise UserError(f"{key}: factory {spec}(**{kwargs}) returned "
                            f"{type(fn).__name__}, not a reward function")
        return fn
    if not callable(obj):
        raise UserError(f"{key}: {spec} is a {type(obj).__name__}, not a function")
    return obj


def get(name: str, *, _key: str = "reward.names", **kwargs) -> Callable:
    """The reward function called ``name``; ``kwargs`` configure factories such as ``format``.

    ``name`` may also be ``path/to/file.py:function`` or ``package.module:function`` (see the
    module docstring); errors in such code raise ``UserError`` naming the file and line.
    """
    if name in _REGISTRY:
        return _REGISTRY[name](**kwargs)
    if usercode.is_spec(name):
        return _from_user_code(name, kwargs, _key)
    raise KeyError(f"unknown reward {name!r}; known: {', '.join(names())} (or your own "
                   "function as path/to/file.py:function or package.module:function)")


def check(name: str, kwargs: dict | None = None, key: str = "reward.names") -> None:
    """Raises UserError if ``name`` is neither registered nor loadable user code (imports it)."""
    if name in _REGISTRY:
        return
    if not usercode.is_spec(name):
        raise ConfigError(f"{key}: unknown reward {name!r}; known: {', '.join(names())} (or your "
                        "own function as path/to/file.py:function or package.module:function)")
    get(name, _key=key, **(kwargs or {}))


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
