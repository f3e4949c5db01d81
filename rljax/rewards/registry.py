"""Reward functions by name (``rljax.rewards.get``): the built-ins, ``register``-ed factories
and user code (``path/to/file.py:function`` or ``package.module:function``).

A module of its own so that ``combine`` resolves names (in worker processes too) without
importing the package's ``__init__``, which imports ``combine``.
"""
from __future__ import annotations

import inspect
from typing import Callable

from rljax import usercode
from rljax.errors import ConfigError, UserError
from rljax.rewards import shaping, verifiers

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


def option_problem(name: str, kwargs: dict) -> str | None:
    """What is wrong with ``kwargs`` as the options of the registered reward ``name``, naming
    the config keys (``reward.kwargs.NAME.OPTION``): a required option missing or an option
    its factory does not take. None when they fit (or the factory takes ``**kwargs``)."""
    try:
        params = inspect.signature(_REGISTRY[name]).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None   # _plain: "takes no options" when called
    key = f"reward.kwargs.{name}"
    named = {n: p for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD,
                                                            p.KEYWORD_ONLY)}
    unknown = sorted(set(kwargs) - set(named))
    if unknown:   # first: a misspelt option also leaves the right one missing
        return (f"{key}.{unknown[0]} is not an option of reward {name!r} (its options: "
                f"{', '.join(named)})")
    missing = [n for n, p in named.items() if p.default is p.empty and n not in kwargs]
    if missing:
        return (f"reward {name!r} needs {' and '.join(f'{key}.{n}' for n in missing)} "
                f"(e.g. --config.{key}.{missing[0]}=...)")
    return None


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


register("gsm8k", _plain(verifiers.gsm8k))
register("arithmetic", _plain(verifiers.arithmetic))
register("countdown", _plain(verifiers.countdown))
register("math", _plain(verifiers.math_equivalence))
register("format", shaping.make_format)
register("overlong", shaping.make_overlong)
register("length", shaping.make_overlong)
