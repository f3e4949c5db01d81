"""What every section module shares: dotted-key access, types, ranges, names and messages.

Nothing here knows a section's keys; the messages name the dotted key and, where a near miss
exists, suggest it ("did you mean ...?"). Loads without jax.
"""
from __future__ import annotations

import difflib
import math
from typing import Any, Iterable, Mapping, Sequence

import ml_collections
from ml_collections import config_dict

from rljax.errors import ConfigError

# Free-form dicts: any keys allowed below these paths (their owner validates them).
OPEN_SECTIONS = ("model.overrides", "data.kwargs", "reward.kwargs", "env.kwargs")


def opt_float():
    """A typed None: "off" or "derive from another key". One placeholder per field (a shared
    FieldReference would tie the fields together)."""
    return config_dict.placeholder(float)


def opt_int():
    return config_dict.placeholder(int)


def get(cfg: ml_collections.ConfigDict, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


def is_open(dotted: str) -> bool:
    return any(dotted == s or dotted.startswith(s + ".") for s in OPEN_SECTIONS)


def coerce(key: str, value: Any, kind: type | None, nullable: bool = False) -> Any:
    """Checks ``value`` against the schema type; ints widen to float, lists become tuples.

    ``None`` is accepted only where the default is ``None`` (``nullable``: a placeholder).
    """
    if value is None:
        if nullable or kind is None:
            return None
        raise ConfigError(f"{key}: expected {kind.__name__}, got None")
    if kind is None or kind is type(None):
        return value
    if isinstance(value, float) and not math.isfinite(value):
        # json reads Infinity / NaN; NaN passes every range check (comparisons are False)
        raise ConfigError(f"{key}={value!r} must be a finite number")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind in (tuple, list) and isinstance(value, (tuple, list)):
        return tuple(value)
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(f"{key}: expected {kind.__name__}, got {type(value).__name__} "
                          f"({value!r})")
    return value


def all_keys(cfg: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    """Every dotted key of ``cfg`` (sections included, free-form sections not entered)."""
    keys = []
    for key in cfg.keys():
        dotted = prefix + key
        keys.append(dotted)
        if isinstance(cfg[key], ml_collections.ConfigDict) and not is_open(dotted):
            keys.extend(all_keys(cfg[key], dotted + "."))
    return keys


def unknown_key_message(dotted: str, siblings: Iterable[str],
                        schema: ml_collections.ConfigDict) -> str:
    """'unknown config key a.bx (did you mean a.b?)', looking at siblings, then anywhere in
    ``schema`` (the full ``default_config()``)."""
    prefix, _, name = dotted.rpartition(".")
    close = difflib.get_close_matches(name, list(siblings), n=1, cutoff=0.7)
    if close:
        hint = f"{prefix}.{close[0]}" if prefix else close[0]
    else:
        everywhere = all_keys(schema)
        same_name = [k for k in everywhere if k.rpartition(".")[2] == name]
        close = same_name or difflib.get_close_matches(dotted, everywhere, n=1, cutoff=0.6)
        hint = close[0] if close else None
    msg = f"unknown config key '{dotted}'"
    return f"{msg} (did you mean '{hint}'?)" if hint else msg


def check_schema(cfg, schema, prefix: str = "") -> None:
    """Every key of ``cfg`` exists in ``schema`` with a compatible type, and none is missing."""
    _check_schema(cfg, schema, schema, prefix)


def _check_schema(cfg, node, root, prefix: str) -> None:
    for key in cfg.keys():
        dotted = prefix + key
        if is_open(dotted):
            continue
        if key not in node:
            raise ConfigError(unknown_key_message(dotted, node.keys(), root))
        value = cfg[key]
        if isinstance(node[key], ml_collections.ConfigDict):
            if not isinstance(value, ml_collections.ConfigDict):
                raise ConfigError(f"{dotted}: expected a section (dict), got {value!r}")
            _check_schema(value, node[key], root, dotted + ".")
        else:
            coerce(dotted, value, node.get_type(key), node[key] is None)
    missing = [k for k in node.keys() if k not in cfg]
    if missing:
        raise ConfigError(f"config key '{prefix}{missing[0]}' is missing")


def check_ranges(cfg, ranges: Iterable[tuple[str, Any, Any]]) -> None:
    """``ranges``: (dotted key, lowest allowed, highest allowed); None = unbounded."""
    for key, low, high in ranges:
        value = get(cfg, key)
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise ConfigError(f"{key}={value!r} must be {bounds}")


def check_choice(key: str, value: Any, names: Sequence[str]) -> None:
    """One line: ``key='x' is not one of: a, b (did you mean 'a'?)``."""
    names = tuple(names)
    if value in names:
        return
    close = (difflib.get_close_matches(value, [str(n) for n in names], n=1, cutoff=0.6)
             if isinstance(value, str) else [])
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise ConfigError(f"{key}={value!r} is not one of: {', '.join(map(str, names))}{hint}")


def registered(names: Iterable[str]) -> tuple[str, ...]:
    """A registry's names in registration order (built-ins first, then the user's)."""
    return tuple(dict.fromkeys(names))


def merged(*tables: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for table in tables:
        out.update(table)
    return out


def step_pairs(cfg) -> str:
    """Online DPO's step-level pairs, ``data.pairs`` ('step_mc' or 'mcts'), else '': their
    source samples (or searches) the prompts it draws itself, level by level."""
    if cfg.algo.name == "dpo" and cfg.algo.online and cfg.data.pairs in ("step_mc", "mcts"):
        return cfg.data.pairs
    return ""


def online_dpo_groups(cfg) -> bool:
    """Online DPO that pairs the best and worst of sampled groups (not step pairs, which its
    search samples itself): it samples rounds as GRPO does, so prompt selection and partial
    rollouts apply to it."""
    return (cfg.algo.name == "dpo" and bool(cfg.algo.online)
            and cfg.data.pairs not in ("step_mc", "mcts"))

