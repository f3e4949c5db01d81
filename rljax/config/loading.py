"""Getting a config: files (``.py`` with ``get_config()``, or a workdir's ``config.json``),
laying them over the defaults, ``--config.a.b=value`` overrides typed by the schema, and
serialisation."""
from __future__ import annotations

import ast
import importlib.util
import json
import os
from typing import Any, Mapping, Sequence

import ml_collections

from rljax.config.base import coerce, get, is_open, unknown_key_message
from rljax.config.root import default_config, validate
from rljax.errors import ConfigError


def load_config(path: str | None, overrides: Sequence[str] = (),
                choices: Mapping[str, Sequence[str]] | None = None) -> ml_collections.ConfigDict:
    """Loads ``path`` (``file.py`` or ``file.py:arg``) over the defaults, applies overrides.

    ``overrides`` are ``--config.a.b=value`` strings (the ``--config.`` prefix is optional).
    ``path=None`` starts from the defaults. Returns a validated ConfigDict.
    """
    cfg = default_config()
    if path:
        merge_into(cfg, config_from_file(path))
    apply_overrides(cfg, overrides)
    validate(cfg, choices=choices)
    return cfg


def json_loads(text: str, path: str) -> Any:
    """``json.loads(text)``; a file nesting deeper than the parser can follow (a
    RecursionError, thousands of levels) is one ConfigError naming ``path``."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ConfigError(f"{path} nests too deeply to be a config (corrupt or "
                          "hand-edited?)") from None


def load_config_json(path: str, overrides: Sequence[str] = (),
                     choices: Mapping[str, Sequence[str]] | None = None):
    """Loads a ``config.json`` written by :func:`to_json` (e.g. a workdir's) plus overrides.

    A file written by an earlier version lacks the keys added since; they take their defaults
    (``imports``: none), so the config is the one that run used."""
    try:
        with open(path) as f:
            data = json_loads(f.read(), path)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    cfg = default_config()
    merge_into(cfg, data)
    _as_it_ran(cfg, data)
    apply_overrides(cfg, overrides)
    validate(cfg, choices=choices)
    return cfg


def _as_it_ran(cfg: ml_collections.ConfigDict, data: Any) -> None:
    """Keys added since ``data`` was written whose default would change what that run did:
    a distillation teacher scored at the rollout's temperature before
    ``algo.distill.teacher_temperature`` existed."""
    distill = data.get("algo", {}).get("distill") if isinstance(data, Mapping) else None
    if isinstance(distill, Mapping) and "teacher_temperature" not in distill:
        cfg.algo.distill.teacher_temperature = float(cfg.rollout.temperature) or 1.0


def to_json(cfg: ml_collections.ConfigDict) -> str:
    """Serialises a config (placeholders become ``null``); inverse of :func:`load_config_json`."""
    return cfg.to_json(indent=2, sort_keys=True)


def config_from_file(spec: str) -> Any:
    """Imports ``file.py`` and returns its ``get_config()`` (``file.py:arg`` passes ``arg``).

    Config files build on each other with it: a variant loads its base and changes a few keys.
    """
    path, _, arg = spec.partition(":")
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    if path.endswith(".json"):
        with open(path) as f:
            return json_loads(f.read(), path)
    module_spec = importlib.util.spec_from_file_location("_rljax_user_config", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"{path} has no get_config() function")
    return module.get_config(arg) if arg else module.get_config()


def _as_dict(value: Any) -> Any:
    if isinstance(value, (ml_collections.ConfigDict, ml_collections.FrozenConfigDict)):
        return value.to_dict()
    return value


def merge_into(cfg: ml_collections.ConfigDict, update: Any, prefix: str = "") -> None:
    """Lays ``update`` (dict or ConfigDict) over ``cfg``, checking keys and types as it goes."""
    update = _as_dict(update)
    if not isinstance(update, Mapping):
        raise ConfigError(f"{prefix or 'config'}: expected a dict of keys, got {type(update).__name__}")
    for key, value in update.items():
        dotted = f"{prefix}{key}"
        if is_open(dotted) or is_open(prefix.rstrip(".")):
            cfg[key] = value
        elif key not in cfg:
            raise ConfigError(unknown_key_message(dotted, cfg.keys(), default_config()))
        elif isinstance(cfg[key], ml_collections.ConfigDict):
            merge_into(cfg[key], value, dotted + ".")
        else:
            cfg[key] = coerce(dotted, value, cfg.get_type(key), _nullable(dotted))


def apply_overrides(cfg: ml_collections.ConfigDict, overrides: Sequence[str]) -> None:
    """Applies ``[--config.]a.b=value`` strings; the value is parsed by the key's type."""
    for item in overrides:
        text = item[len("--config."):] if item.startswith("--config.") else item
        key, eq, raw = text.partition("=")
        if not eq:
            raise ConfigError(f"override {item!r} has no '=value'")
        parent, name = _resolve_parent(cfg, key)
        if is_open(key.rpartition(".")[0]) or is_open(key):
            value = _literal(raw)
            try:
                parent[name] = value
            except TypeError:  # ConfigDict keeps an existing key's type
                kind = type(parent[name]).__name__
                raise ConfigError(f"{key}: expected {kind}, got {type(value).__name__} "
                                  f"({value!r})") from None
            continue
        if isinstance(parent[name], ml_collections.ConfigDict):
            raise ConfigError(f"{key} is a section; override its keys, e.g. {key}.<name>=...")
        kind = parent.get_type(name)
        parent[name] = coerce(key, parse_value(key, raw, kind), kind, _nullable(key))


def _resolve_parent(cfg: ml_collections.ConfigDict, dotted: str):
    """Walks to the ConfigDict holding ``dotted``'s last part; unknown parts raise ConfigError."""
    parts = dotted.split(".")
    node, path = cfg, []
    for part in parts[:-1]:
        path.append(part)
        if is_open(".".join(path)):
            if part not in node:  # a new entry of a free-form section: reward.kwargs.NAME.k=v
                node[part] = ml_collections.ConfigDict()
            if not isinstance(node[part], ml_collections.ConfigDict):
                raise ConfigError(f"{'.'.join(path)}={node[part]!r} is not a section; cannot "
                                  f"set {dotted}")
            node = node[part]
            continue
        if part not in node or not isinstance(node[part], ml_collections.ConfigDict):
            raise ConfigError(unknown_key_message(".".join(path), node.keys(), default_config()))
        node = node[part]
    if parts[-1] not in node and not is_open(".".join(parts[:-1])):
        raise ConfigError(unknown_key_message(dotted, node.keys(), default_config()))
    return node, parts[-1]


def parse_value(key: str, raw: str, kind: type | None) -> Any:
    """Parses an override string the way its default's type says (bools accept true/false/1/0)."""
    if kind is bool:
        low = raw.strip().lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        raise ConfigError(f"{key}: expected true/false, got {raw!r}")
    if kind is str:
        return raw
    if kind in (tuple, list):
        value = _literal(raw)
        if isinstance(value, (tuple, list)):
            return tuple(value)
        if isinstance(value, str) and "," in value:
            return tuple(s.strip() for s in value.split(",") if s.strip())
        return () if raw.strip() == "" else (value,)
    if raw.strip().lower() in ("none", "null"):
        return None
    return _literal(raw)


def _literal(raw: str) -> Any:
    """Python literal if it parses (``3``, ``1e-6``, ``(1, 2)``), else the raw string."""
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw


def _nullable(dotted: str) -> bool:
    """True if the schema's default for ``dotted`` is None (a typed placeholder)."""
    try:
        return get(default_config(), dotted) is None
    except (KeyError, AttributeError):
        return False
