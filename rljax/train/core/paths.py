"""Workdir paths: local directories or URLs (``gs://bucket/run``, any ``etils.epath`` scheme).

Local paths keep their plain-string form (``os.path``); a URL is joined with ``/`` and all I/O
on it goes through ``etils.epath.Path`` (the same layer orbax uses for checkpoints).
"""
from __future__ import annotations

import json
import os
import re

from etils import epath

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def is_url(path: str | os.PathLike) -> bool:
    """True for ``scheme://...`` paths (``gs://``, ``s3://``, ...), False for local ones."""
    return bool(_URL.match(os.fspath(path)))


def join(base: str | os.PathLike, *names: str) -> str:
    """``os.path.join`` for a local ``base``; ``/``-joined for a URL."""
    base = os.fspath(base)
    if not is_url(base):
        return os.path.join(base, *names)
    return "/".join([base.rstrip("/"), *names])


def absolute(path: str | os.PathLike) -> str:
    """A local path made absolute; a URL unchanged."""
    path = os.fspath(path)
    return path if is_url(path) else os.path.abspath(path)


def as_path(path: str | os.PathLike) -> epath.Path:
    return epath.Path(os.fspath(path))


def makedirs(path: str | os.PathLike) -> None:
    as_path(path).mkdir(parents=True, exist_ok=True)


def isfile(path: str | os.PathLike) -> bool:
    return as_path(path).is_file()


def read_text(path: str | os.PathLike) -> str:
    return as_path(path).read_text(encoding="utf-8")


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Writes ``text`` to ``path``: locally via a tmp file + rename (readers never see a partial
    file, and several hosts may write the same file); on object stores one object write is
    already all-or-nothing."""
    path = os.fspath(path)
    if is_url(path):
        as_path(path).write_text(text, encoding="utf-8")
        return
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def is_run_dir(path: str) -> bool:
    """Whether the local directory ``path`` looks like an rljax workdir (a ``checkpoints/``
    directory, a ``metrics.jsonl``, or a ``config.json`` that is an rljax config rather than a
    model's)."""
    if os.path.isdir(os.path.join(path, "checkpoints")) or os.path.isfile(
            os.path.join(path, "metrics.jsonl")):
        return True
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and isinstance(data.get("model"), dict) and "algo" in data
