"""The whole config: the sections in schema order, the names each key may take, and
validation, composed from one module per component (``train``, ``model``, ``data``,
``rollout``, ``algo``, ``optimizer``, ``reward``, ``mesh``). Each component module owns its
defaults, its ranges, its allowed names (closed sets as tuples, the rest read from the live
registries) and its cross-key checks; this module only puts them together.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Sequence

import ml_collections

from rljax.config import algo, data, mesh, model, optimizer, reward, rollout, search, train
from rljax.config.base import check_choice, check_ranges, check_schema, get, merged
from rljax.config.imports import import_user_modules
from rljax.errors import ConfigError

COMPONENTS = (train, model, data, rollout, algo, optimizer, reward, mesh)

# Sections in schema order (also the order of config.json's keys before sorting and of the
# "did you mean" search).
SECTION_ORDER = ("model", "tokenizer", "data", "rollout", "algo", "optimizer", "reward", "env",
                 "mesh", "logging", "sft", "memory", "checkpoint", "eval")


def default_config() -> ml_collections.ConfigDict:
    """Returns the full schema: every known key with its default value (and so its type)."""
    sections = merged(*(m.SECTIONS for m in COMPONENTS))
    assert set(sections) == set(SECTION_ORDER), sorted(set(sections) ^ set(SECTION_ORDER))
    c = ml_collections.ConfigDict()
    for key, value in train.top_level().items():
        c[key] = value
    for name in SECTION_ORDER:
        c[name] = sections[name]()
    return c


# Allowed names of string keys. Closed sets are tuples; registry-backed keys are looked up when
# read, so a name registered by user code (``imports``) is accepted from then on.
_STATIC: dict[str, tuple[str, ...]] = merged(*(m.CHOICES for m in COMPONENTS))
_REGISTRIES: dict[str, Callable[[], Sequence[str]]] = merged(
    *(getattr(m, "REGISTRIES", {}) for m in COMPONENTS))


class Choices(Mapping):
    """``CHOICES[key]``: the names ``key`` may take now. Reading a registry-backed key imports
    its owning module (jax for the algorithm registries); the closed sets import nothing."""

    def __getitem__(self, key: str) -> tuple[str, ...]:
        if key in _STATIC:
            return _STATIC[key]
        return tuple(_REGISTRIES[key]())

    def __iter__(self) -> Iterator[str]:
        yield from _REGISTRIES
        yield from _STATIC

    def __len__(self) -> int:
        return len(_REGISTRIES) + len(_STATIC)

    def registry_backed(self) -> tuple[str, ...]:
        return tuple(_REGISTRIES)


CHOICES = Choices()


def choices(key: str) -> tuple[str, ...]:
    """The names ``key`` may take now (see :data:`CHOICES`)."""
    return CHOICES[key]


# Every range rule and every optional number's lower bound, component by component.
RANGES = tuple(r for m in COMPONENTS for r in m.RANGES)
ABOVE = tuple(a for m in COMPONENTS for a in getattr(m, "ABOVE", ()))

# Cross-key checks in the order they report (the first problem found is the one shown).
CHECKS: tuple[Callable[..., None], ...] = (
    algo.check_clip_signs,
    algo.check_batch_sizes,
    algo.check_groups_and_clip,   # takes the keys resolve() filled (its message names them)
    data.check_step_mc,
    data.check_prm,
    rollout.check_temperature_schedule,
    algo.check_estimator_and_update,
    algo.check_guidance,
    rollout.check_tree,
    rollout.check_partial,
    rollout.check_allocation,
    algo.check_async,
    mesh.check_mesh,
    reward.check_rewards,
    data.check_path,
    algo.check_overlong,
    algo.check_distill,
    algo.check_routing_replay,
    algo.check_role_estimator,
    search.check_vine,
    search.check_mcts,
    search.check_process_reward,
    model.check_lora,
    model.check_images,
    reward.check_env,
    reward.check_selfplay,
    data.check_selection,
    train.check_eval,
)


def resolve(cfg: ml_collections.ConfigDict) -> dict[str, Any]:
    """Fills the keys whose default depends on other keys and are left at None (in place):
    ``algo.beta`` by ``algo.name``, ``algo.epsilon`` / ``algo.epsilon_high`` by
    ``algo.policy_loss`` (:func:`rljax.config.algo.resolve`). Idempotent; returns
    ``{dotted key: value filled in}``."""
    return algo.resolve(cfg)


def _check_names(cfg, extra: Mapping[str, Sequence[str]] | None) -> None:
    check_schema(cfg, default_config())
    import_user_modules(cfg)          # before names: what user code registers is allowed
    for key, names in {**CHOICES, **(extra or {})}.items():
        check_choice(key, get(cfg, key), names)


def _check_resolved(cfg, filled: Mapping[str, Any]) -> None:
    check_ranges(cfg, RANGES)
    for key, low in ABOVE:
        value = get(cfg, key)
        if value is not None and value <= low:
            raise ConfigError(f"{key}={value!r} must be > {low} (or None for off/default)")
    for fn in CHECKS:
        if fn is algo.check_groups_and_clip:
            fn(cfg, filled)
        else:
            fn(cfg)


def check(cfg: ml_collections.ConfigDict,
          choices: Mapping[str, Sequence[str]] | None = None) -> None:
    """Raises ConfigError for unknown/missing keys, wrong types, bad names or impossible
    combinations; leaves ``cfg`` as it is (the checks run on a resolved copy). Imports the
    modules named in ``imports`` first."""
    _check_names(cfg, choices)
    resolved = cfg.copy_and_resolve_references()
    _check_resolved(resolved, resolve(resolved))


def validate(cfg: ml_collections.ConfigDict,
             choices: Mapping[str, Sequence[str]] | None = None) -> ml_collections.ConfigDict:
    """``resolve`` then ``check``: the one call every entry point makes (files, ``config.json``,
    ``run.train``), because a run needs the filled values and its ``config.json`` records them.
    Fills only the None keys :func:`resolve` documents; use :func:`check` for a check that
    changes nothing.

    ``choices`` maps dotted keys to allowed names, overriding/extending :data:`CHOICES`.
    Returns ``cfg`` for chaining.
    """
    _check_names(cfg, choices)
    filled = resolve(cfg)
    _check_resolved(cfg, filled)
    return cfg
