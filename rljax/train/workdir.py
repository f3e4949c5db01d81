"""A run's workdir: ``config.json``, ``metrics.jsonl``, TensorBoard events, ``checkpoints/``.

``resolve_train_config`` decides which config a ``train`` invocation uses: the given file, or
(when resuming a workdir without ``--config``) the workdir's own ``config.json``. The config is
written to ``config.json`` at train start; a workdir with a checkpoint resumes from it.
"""
from __future__ import annotations

import json
from typing import Sequence

from rljax import config as config_lib
from rljax.errors import ConfigError, UserError
from rljax.train import paths
from rljax.train.checkpoint import checkpoint_dir, has_checkpoint

CONFIG_FILE = "config.json"

__all__ = ["CONFIG_FILE", "checkpoint_dir", "has_checkpoint", "config_path", "write_config",
           "load_workdir_config", "resolve_train_config", "config_diff"]


def config_path(workdir: str) -> str:
    return paths.join(workdir, CONFIG_FILE)


def write_config(workdir: str, cfg) -> str:
    """Writes ``<workdir>/config.json`` atomically (safe if several hosts write the same)."""
    paths.makedirs(workdir)
    path = config_path(workdir)
    paths.write_text_atomic(path, config_lib.to_json(cfg) + "\n")
    return path


def _load_config_json(path: str, overrides: Sequence[str] = ()):
    """``config_lib.load_config_json`` for a local file; the same read through epath for a URL."""
    if not paths.is_url(path):
        return config_lib.load_config_json(path, overrides)
    try:
        data = json.loads(paths.read_text(path))
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    cfg = config_lib.default_config()
    config_lib.merge_into(cfg, data)
    config_lib.apply_overrides(cfg, overrides)
    config_lib.validate(cfg)
    return cfg


def load_workdir_config(workdir: str, overrides: Sequence[str] = ()):
    """The config a run was started with (``config.json``) plus ``overrides``."""
    path = config_path(workdir)
    if not paths.isfile(path):
        raise UserError(f"{workdir} has no {CONFIG_FILE}; is it a run directory?")
    return _load_config_json(path, overrides)


def config_diff(old, new, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two configs (``a.b: 1 -> 2``)."""
    old_d = old if isinstance(old, dict) else json.loads(config_lib.to_json(old))
    new_d = new if isinstance(new, dict) else json.loads(config_lib.to_json(new))
    changes = []
    for key in sorted(set(old_d) | set(new_d)):
        a, b = old_d.get(key), new_d.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changes += config_diff(a, b, f"{prefix}{key}.")
        elif a != b:
            changes.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return changes


def resolve_train_config(config_file: str | None, workdir: str, overrides: Sequence[str] = ()):
    """Returns ``(cfg, resuming, changes)`` for ``rljax train``.

    Without ``config_file`` the workdir's ``config.json`` is used (resuming a run by its
    directory alone). ``changes`` lists keys that differ from the saved config, so the caller
    can tell the user what a resumed run changed.
    """
    saved = config_path(workdir)
    resuming = has_checkpoint(workdir)
    if config_file is None:
        if not paths.isfile(saved):
            raise UserError(f"--config is required: {workdir} has no {CONFIG_FILE} to resume")
        return _load_config_json(saved, overrides), resuming, []
    cfg = config_lib.load_config(config_file, overrides)
    changes = []
    if resuming and paths.isfile(saved):
        changes = config_diff(_load_config_json(saved), cfg)
    return cfg, resuming, changes
