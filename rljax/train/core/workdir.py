"""A run's workdir: ``config.json``, ``metrics.jsonl``, TensorBoard events, ``checkpoints/``.

``resolve_train_config`` decides which config a ``train`` invocation uses: the given file, or
(when resuming a workdir without ``--config``) the workdir's own ``config.json``. A workdir with
a checkpoint resumes from it, and ``check_reuse`` compares the new config with the saved one
*before anything is written*:

* incompatible keys (``INCOMPATIBLE``: the model, the tokenizer, the phases, the optimizer's
  kind; the checkpoint cannot be restored under them) are always refused;
* ``FREE`` keys are allowed: a different ``steps`` extends the run (or ends it earlier);
  logging, checkpointing, evaluation cadence, memory check, compilation cache, remat (and its
  policy) and the attention kernel change how the run goes, not what it trains;
* any other difference is refused unless ``allow_config_change`` (``--allow-config-change``).

A refusal is one line naming the differing keys, and leaves ``config.json`` as it was, so the
workdir stays usable for ``sample``, ``eval`` and resuming.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
from typing import Sequence

from rljax import config as config_lib
from rljax.errors import ConfigError, UserError, WorkdirInUse
from rljax.train.core import paths
from rljax.train.core.paths import is_run_dir  # noqa: F401 - callers import it here
from rljax.train.core.checkpoint import checkpoint_dir, has_checkpoint

CONFIG_FILE = "config.json"
LOCK_FILE = ".rljax.lock"
_held: dict[str, list] = {}  # lock path -> [fd, count]: re-entrant within one process

__all__ = ["CONFIG_FILE", "INCOMPATIBLE", "FREE", "checkpoint_dir", "has_checkpoint",
           "config_path", "write_config", "load_workdir_config", "resolve_train_config",
           "config_diff", "check_reuse", "is_run_dir", "check_export_target", "lock",
           "removed_if_refused"]

# Keys (dotted; a trailing "." is a prefix) whose change makes a checkpoint unrestorable: the
# parameter shapes and vocabulary, the phase layout (global step numbering), the optimizer state.
INCOMPATIBLE = ("model.", "tokenizer.path", "tokenizer.kind", "algo.name", "sft.steps",
                "optimizer.name")
# Keys that change how (or how long, or what is logged), not what is trained: accepted without
# --allow-config-change (and reported).
FREE = ("steps", "eval_every", "eval_at_start", "checkpoint_every", "checkpoint.", "logging.",
        "memory.", "compilation_cache_dir", "compile_for", "model.remat",
        "model.overrides.attention_impl", "model.overrides.remat_policy")


def config_path(workdir: str) -> str:
    return paths.join(workdir, CONFIG_FILE)


def write_config(workdir: str, cfg) -> str:
    """Writes ``<workdir>/config.json`` atomically (safe if several hosts write the same)."""
    path = config_path(workdir)
    try:
        paths.makedirs(workdir)
        paths.write_text_atomic(path, config_lib.to_json(cfg) + "\n")
    except OSError as e:
        raise unwritable(workdir, e) from None
    return path


def code_files(cfg) -> list[tuple[str, str]]:
    """``[(dotted key, absolute path)]`` of every ``file.py:name`` in ``cfg`` (reward
    functions, data loaders and templates, environments, tools) and every file in ``imports``:
    the Python files a run of this config imports and runs. Relative paths resolve from the
    current directory, as ``rljax.usercode`` resolves them."""
    from rljax import usercode

    out: list[tuple[str, str]] = []

    def walk(node, key: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v, key)
        elif key == "imports" and isinstance(node, str) and node.endswith(".py"):
            out.append((key, os.path.abspath(node)))  # a whole file, imported before validation
        elif isinstance(node, str) and usercode.is_spec(node) and \
                node.rpartition(":")[0].endswith(".py"):
            out.append((key, os.path.abspath(node.rpartition(":")[0])))

    walk(cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg), "")
    return list(dict.fromkeys(out))


def code_files_line(cfg) -> str:
    """``"; its config runs code from a.py (reward.names), b.py (data.source)"`` or ``""``."""
    files = code_files(cfg)
    if not files:
        return ""
    return "; its config runs code from " + ", ".join(f"{path} ({key})" for key, path in files)


def unwritable(workdir: str, e: OSError) -> UserError:
    """The one-line error for a workdir that cannot be written (read-only, full, no access)."""
    what = e.strerror or str(e)
    where = f" ({e.filename})" if e.filename and str(e.filename) != str(workdir) else ""
    return UserError(f"cannot write in the workdir {workdir}: {what}{where}; --workdir must be "
                     "a writable directory")


def _load_config_json(path: str, overrides: Sequence[str] = ()):
    """``config_lib.load_config_json`` for a local file; the same read through epath for a URL."""
    if not paths.is_url(path):
        return config_lib.load_config_json(path, overrides)
    try:
        data = config_lib.json_loads(paths.read_text(path), path)
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


def _plain(cfg) -> dict:
    """A config as a plain dict with its unset algorithm-dependent keys filled in, as
    ``validate`` does (``config.resolve_defaults``), so that an unvalidated config compares
    equal to its validated self."""
    if isinstance(cfg, dict):
        return cfg
    cfg = cfg.copy_and_resolve_references()
    config_lib.resolve_defaults(cfg)
    return json.loads(config_lib.to_json(cfg))


def _diff(old, new, prefix: str = "") -> list[tuple[str, object, object]]:
    old_d, new_d = _plain(old), _plain(new)
    changes = []
    for key in sorted(set(old_d) | set(new_d)):
        a, b = old_d.get(key), new_d.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changes += _diff(a, b, f"{prefix}{key}.")
        elif a != b:
            changes.append((f"{prefix}{key}", a, b))
    return changes


def config_diff(old, new, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two configs (``a.b: 1 -> 2``)."""
    return [f"{k}: {a!r} -> {b!r}" for k, a, b in _diff(old, new, prefix)]


def _matches(key: str, names) -> bool:
    return any(key.startswith(k) if k.endswith(".") else key == k for k in names)


def check_reuse(workdir: str, cfg, allow_config_change: bool = False) -> list[str]:
    """Compares ``cfg`` with the config of the checkpointed run in ``workdir``; writes nothing.

    Returns the accepted changes (``key: old -> new``); raises UserError (one line naming the
    keys) for an incompatible change, or for any change to a key not in ``FREE`` unless
    ``allow_config_change``. A workdir without a checkpoint (or without ``config.json``) has
    nothing to compare with and accepts any config.
    """
    saved = config_path(workdir)
    if not has_checkpoint(workdir) or not paths.isfile(saved):
        return []
    try:
        old = json.loads(paths.read_text(saved))
    except (OSError, ValueError, RecursionError):
        old = None
    if not isinstance(old, dict) or not isinstance(old.get("model"), dict):
        raise UserError(f"{saved} is not an rljax config, so this workdir's checkpoint cannot "
                        f"be checked against the new config; restore that file or use a new "
                        f"--workdir")
    changes = _diff(_load_config_json(saved), cfg)
    show = lambda items: ", ".join(f"{k} ({a!r} -> {b!r})" for k, a, b in items)  # noqa: E731
    bad = [c for c in changes if _matches(c[0], INCOMPATIBLE) and not _matches(c[0], FREE)]
    if bad:
        raise UserError(f"{workdir} holds a checkpoint of a run this config cannot resume: "
                        f"{show(bad)} differ(s) from its config.json; use a new --workdir "
                        f"(nothing was changed in {workdir})")
    other = [c for c in changes if not _matches(c[0], FREE)]  # e.g. steps: extend the run
    if other and not allow_config_change:
        raise UserError(f"{workdir} holds a checkpoint of a run with a different config: "
                        f"{show(other)}; pass --allow-config-change to resume with the new "
                        f"values, or use a new --workdir (nothing was changed in {workdir})")
    return [f"{k}: {a!r} -> {b!r}" for k, a, b in changes]


def resolve_train_config(config_file: str | None, workdir: str, overrides: Sequence[str] = (),
                         allow_config_change: bool = False):
    """Returns ``(cfg, resuming, changes)`` for ``rljax train``; writes nothing.

    Without ``config_file`` the workdir's ``config.json`` (plus ``overrides``) is used (resuming
    a run by its directory alone). When resuming, ``check_reuse`` refuses a changed config (see
    the module doc); ``changes`` lists the accepted differences, so the caller can report them.
    """
    saved = config_path(workdir)
    resuming = has_checkpoint(workdir)
    if config_file is None:
        if not paths.isfile(saved):
            raise UserError(f"--config is required: {workdir} has no {CONFIG_FILE} to resume")
        cfg = _load_config_json(saved, overrides)
    else:
        cfg = config_lib.load_config(config_file, overrides)
    changes = check_reuse(workdir, cfg, allow_config_change) if resuming else []
    return cfg, resuming, changes


def check_export_target(workdir: str, out: str, overwrite: bool = False) -> None:
    """Raises UserError unless ``out`` may receive an export of ``workdir``: never the workdir,
    a directory inside it or another run's directory; an existing non-empty directory only
    with ``overwrite``. Writes nothing."""
    if paths.is_url(out):
        raise UserError(f"--out must be a local directory, not {out!r}")
    target = os.path.realpath(out)
    if not paths.is_url(workdir):
        run = os.path.realpath(workdir)
        if target == run or target.startswith(run.rstrip(os.sep) + os.sep):
            raise UserError(f"--out {out} is inside the run directory {workdir}; an export "
                            f"there would overwrite the run's files (choose another --out)")
    if os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"--out {out} exists and is not a directory")
    if os.path.isdir(out) and is_run_dir(out):
        raise UserError(f"--out {out} is an rljax run directory; export into another directory")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise UserError(f"--out {out} is not empty; pass --overwrite to replace its files, or "
                        f"choose a new directory")


@contextlib.contextmanager
def removed_if_refused(workdir: str):
    """A new (absent or empty) local ``workdir`` is left as it was found when the block is
    refused (a ``UserError``: one line, exit 2) before any step was logged or checkpointed:
    no ``config.json``, lock or tokenizer file behind, so the same command can simply be run
    again once fixed. A workdir that held anything before is never touched."""
    new = not paths.is_url(workdir) and (not os.path.exists(workdir) or (
        os.path.isdir(workdir) and not os.listdir(workdir)))
    existed = os.path.isdir(workdir)
    try:
        yield
    except UserError:
        if new and os.path.isdir(workdir) and not _has_results(workdir):
            try:  # best effort: the refusal's own line is what the user needs
                if existed:
                    for name in os.listdir(workdir):
                        full = os.path.join(workdir, name)
                        (shutil.rmtree if os.path.isdir(full) and not os.path.islink(full)
                         else os.remove)(full)
                else:
                    shutil.rmtree(workdir, ignore_errors=True)
            except OSError:  # e.g. a read-only folder
                pass
        raise


def _has_results(workdir: str) -> bool:
    """Whether a run wrote anything worth keeping: a checkpoint or logged metrics."""
    metrics = os.path.join(workdir, "metrics.jsonl")
    return has_checkpoint(workdir) or (os.path.isfile(metrics) and os.path.getsize(metrics) > 0)


def lock(workdir: str):
    """Takes the workdir's lock (one ``rljax train`` per workdir); returns ``release()``.

    ``fcntl.flock`` on ``<workdir>/.rljax.lock``: the kernel drops it when the process dies,
    so a killed run (even ``kill -9``) never leaves it stuck. Raises :class:`WorkdirInUse`
    (one line: who holds it) when another process has it. Re-entrant within one process. A URL
    workdir (``gs://``) has no lock: object stores cannot hold one; keep one run per workdir.
    """
    if paths.is_url(workdir):
        return lambda: None
    import fcntl

    path = os.path.realpath(os.path.join(workdir, LOCK_FILE))
    if path in _held:
        _held[path][1] += 1
        return lambda: _release(path)
    try:
        os.makedirs(workdir, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:  # read-only or full file system, no permission: one line, not a trace
        raise unwritable(workdir, e) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
        os.close(fd)
        raise WorkdirInUse(f"{workdir} is in use by another `rljax train` ({holder}); wait "
                           "for it to finish, stop it, or use another --workdir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
    _held[path] = [fd, 1]
    return lambda: _release(path)


def _release(path: str) -> None:
    entry = _held.get(path)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] <= 0:
        del _held[path]
        os.close(entry[0])  # closing the descriptor releases the flock
