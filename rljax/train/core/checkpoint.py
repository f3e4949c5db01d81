"""Checkpoints: a thin wrapper over orbax's ``CheckpointManager``.

Each step directory ``<workdir>/checkpoints/<step>/`` holds two items:

* ``state``: the train-state pytree (params, opt state, step, rng, critic/ref), saved with
  ``StandardSave``; each host writes its own shards, and restore reshards into whatever
  shardings the caller's abstract state asks for.
* ``meta``: one JSON dict: the caller's JSON-able extras (data-iterator state, config, ...)
  plus ``host`` metadata written by us. Process 0 writes it, so iterator state must be the
  global state (identical on every host).

Atomicity: orbax writes ``<step>.orbax-checkpoint-tmp-*`` and renames it to ``<step>`` only
after every item is complete, so an interrupted save (crash, SIGKILL, preemption) never shows up
in ``latest_step()``. Leftover tmp directories are deleted by a background thread that the
manager starts when it is created; its first save waits for that deletion (close does not).

Integrity: just before that rename, process 0 (after orbax's commit barrier, so every host's
shards are written) records the size and CRC-32 of every file of the step (``manifest``) in
``<step>/rljax_manifest.json``. :meth:`CheckpointManager.verify` re-checks them before a restore
reads anything, so a truncated, deleted or garbled file is reported (step, file, problem)
instead of failing deep inside TensorStore or, worse, loading silently. CRC-32 runs at
~2 GB/s per core here and files are hashed in parallel. The first step committed with a
manifest is recorded in ``<checkpoints>/rljax_manifests_since.json``: a later step without one
(the manifest was deleted) is damaged; an earlier one (written by an older rljax) is restored
unverified, with a warning.

A damaged checkpoint is moved aside to ``<step>.damaged`` (never deleted) by
:meth:`CheckpointManager.move_aside`; orbax ignores such names, so it is no longer a step.
"""
from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import platform
import socket
import sys
import time
from typing import Any, Mapping, NamedTuple

import jax
import orbax.checkpoint as ocp
from etils import epath

from rljax.errors import RljaxError
from rljax.train.core import paths
from rljax.train.core.manifest import (MANIFEST_FILE, first_manifested_step, manifests_since,
                                      verify_step_dir, with_manifest)

STATE_ITEM = "state"
META_ITEM = "meta"


class CheckpointDamaged(RljaxError):
    """A committed checkpoint cannot be read back (a file is missing, truncated or garbled)."""

    def __init__(self, step: int, problem: str):
        super().__init__(f"checkpoint {step} is damaged: {problem}")
        self.step, self.problem = step, problem


class CheckpointWriteError(RljaxError):
    """A checkpoint could not be written (read-only folder, disk full, ...).

    orbax's background threads may be left waiting on the failed save; the CLI therefore exits
    the process without joining them (``abandon_threads``)."""

    abandon_threads = True


class _QuietOrbaxErrors(logging.Filter):
    """Drops orbax's ERROR log records (each a long traceback, several per failed save): the
    same failure reaches the caller as an exception, which rljax reports in one line (and an
    unexpected one keeps its own traceback)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR
                    and f"{os.sep}orbax{os.sep}" in (record.pathname or ""))


class _LateCallbacksIgnored(asyncio.DefaultEventLoopPolicy):
    """New event loops ignore thread-safe callbacks posted after they are closed.

    orbax runs each save in a loop it closes as soon as the save raises; TensorStore writes of
    the same save still in flight (the disk filled under all of them) then post their
    completions to the closed loop, and each ``RuntimeError: Event loop is closed`` is printed
    as a traceback by TensorStore's thread around rljax's one-line error. Nothing can run those
    callbacks any more, so dropping them loses nothing."""

    def new_event_loop(self):
        loop = super().new_event_loop()
        post = loop.call_soon_threadsafe

        def call_soon_threadsafe(callback, *args, context=None):
            if loop.is_closed():
                return None
            return post(callback, *args, context=context)

        loop.call_soon_threadsafe = call_soon_threadsafe
        return loop


def _quiet_orbax_errors() -> None:
    logger = logging.getLogger("absl")
    if not any(isinstance(f, _QuietOrbaxErrors) for f in logger.filters):
        logger.addFilter(_QuietOrbaxErrors())
    # Only replaces asyncio's default policy (a user's own, e.g. uvloop's, is left alone).
    if type(asyncio.get_event_loop_policy()) is asyncio.DefaultEventLoopPolicy:
        asyncio.set_event_loop_policy(_LateCallbacksIgnored())


def io_cause(exc: BaseException) -> OSError | None:
    """The OSError (or ENOSPC text) behind an orbax/TensorStore failure, if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError):
            return exc
        if "No space left on device" in str(exc):
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        exc = exc.__cause__ or exc.__context__
    return None


# TensorStore/orbax read failures that mean "the files are not what was written".
_READ_ERRORS = ("OUT_OF_RANGE", "DATA_LOSS", "NOT_FOUND", "Error reading", "Error opening",
                "No such file", "Encountered error while reading")


def read_problem(exc: BaseException) -> str | None:
    """A one-line description if ``exc`` (raised while restoring) is a read failure of damaged
    files; None for anything else (e.g. a shape mismatch after a config change)."""
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    for e in reversed(chain):  # the innermost error names the file and the problem
        for line in str(e).splitlines():
            if any(k in line for k in _READ_ERRORS):
                return " ".join(line.split())[:400]
    for e in chain:
        if isinstance(e, (FileNotFoundError, json.JSONDecodeError, EOFError)):
            return " ".join(f"{type(e).__name__}: {e}".split())[:400]
    return None


class Restored(NamedTuple):
    """What :meth:`CheckpointManager.restore` returns."""

    step: int
    state: Any
    meta: dict


def host_metadata() -> dict:
    """Small JSON record of where and with what a checkpoint was written (for debugging)."""
    import rljax  # local: avoid an import cycle at package import time

    return {
        "time": time.time(),
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "rljax": rljax.__version__,
        "backend": jax.default_backend(),
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
    }


class CheckpointManager:
    """Saves and restores (train state, JSON meta) per step; keeps the last ``max_to_keep``.

    Use as a context manager, or call :meth:`close` (which waits for pending async saves).
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 3,
                 async_save: bool = True):
        from orbax.checkpoint._src.path import atomicity_defaults

        _quiet_orbax_errors()
        self.directory = paths.absolute(directory)  # a URL (gs://...) stays as it is
        self.max_to_keep = max_to_keep
        tmp_class = with_manifest(atomicity_defaults.get_default_temporary_path_class(
            epath.Path(self.directory)))
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.LatestN(n=max_to_keep),
            enable_async_checkpointing=async_save,
            # A crash mid-save leaves <step>.orbax-checkpoint-tmp-*; never reuse it.
            cleanup_tmp_directories=True,
            create=True,
            temporary_path_class=tmp_class,
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=(STATE_ITEM, META_ITEM))
        # The step of an async save not known to be committed yet: a failure that surfaces
        # later (in the next save, or at the final wait) is that step's, and is named so.
        self._pending: int | None = None

    # -- queries -------------------------------------------------------------------------

    def latest_step(self) -> int | None:
        """The newest fully written step, or None when there is none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """All fully written steps, oldest first."""
        return sorted(self._manager.all_steps())

    # -- save / restore ------------------------------------------------------------------

    def save(self, step: int, state: Any, meta: Mapping[str, Any] | None = None, *,
             wait: bool = False) -> bool:
        """Starts saving ``state`` and ``meta`` at ``step`` (async unless ``wait``).

        Returns False (and saves nothing) if ``step`` is already saved, e.g. a final save that
        lands on a periodic one. ``meta`` must be JSON-able; host metadata is added under
        ``"host"``. All processes must call this (it is a collective).
        """
        if step in self._manager.all_steps():
            # Already saved, or still being saved in the background (an in-flight step is
            # listed too): `wait` must still mean "committed when this returns".
            if wait:
                self.wait_until_finished()
            return False
        meta = {**dict(meta or {}), "host": host_metadata()}
        if self._pending is not None:   # the previous async save first: its failure is its own
            self.wait_until_finished()
        try:
            saved = self._manager.save(
                int(step),
                args=ocp.args.Composite(**{
                    STATE_ITEM: ocp.args.StandardSave(state),
                    META_ITEM: ocp.args.JsonSave(meta),
                }),
                force=True,  # the caller decides when to save (checkpoint_every, on stop)
            )
        except Exception as e:  # noqa: BLE001 - a previous async save may surface here
            raise self._write_error(e, step) from e
        self._pending = int(step) if saved else None
        if wait:
            self.wait_until_finished()
        return bool(saved)

    def _write_error(self, exc: BaseException, step: int | None = None) -> BaseException:
        cause = io_cause(exc)
        if cause is None:
            return exc
        what = cause.strerror or os.strerror(cause.errno or 0) or str(cause)
        where = cause.filename or self.directory
        at = f" (step {step})" if step is not None else ""
        return CheckpointWriteError(f"cannot write checkpoint{at} in {self.directory}: {what}: "
                                    f"{where}")

    def check_writable(self) -> None:
        """Raises CheckpointWriteError now, before any training, if the folder is read-only."""
        probe = paths.join(self.directory, f".rljax-write-test-{os.getpid()}")
        try:
            paths.as_path(probe).write_text("ok")
            paths.as_path(probe).unlink()
        except OSError as e:
            raise CheckpointWriteError(
                f"cannot write checkpoints in {self.directory}: "
                f"{e.strerror or e}") from None

    # -- integrity -----------------------------------------------------------------------

    def step_dir(self, step: int) -> epath.Path:
        return epath.Path(self.directory) / str(int(step))

    def verify(self, step: int) -> str | None:
        """None if ``step``'s files match the manifest written at commit, else the problem.

        A step without a manifest is damaged when this directory's marker says its steps are
        written with one from an earlier step on; otherwise (an older rljax's checkpoint) it
        is restored unverified, with a warning."""
        since = manifests_since(self.directory)
        if since is None:   # the marker deleted too: an earlier step's manifest says the same
            since = first_manifested_step(self.directory)
        required = since is not None and int(step) >= since
        try:
            problem = verify_step_dir(self.step_dir(step), required=required)
            if problem is None and not (self.step_dir(step) / MANIFEST_FILE).exists():
                if jax.process_index() == 0:
                    print(f"rljax: warning: checkpoint {step} has no {MANIFEST_FILE} (written "
                          "by an older rljax?): restoring it unverified", file=sys.stderr,
                          flush=True)
            return problem
        except OSError as e:
            return f"cannot read it ({e.strerror or e})"

    def move_aside(self, step: int, suffix: str = "damaged") -> str:
        """Renames ``<step>`` to ``<step>.<suffix>`` (``.<suffix>.N`` if taken); returns the new
        path. Process 0 renames; every process reloads the step list."""
        src = self.step_dir(step)
        dst = epath.Path(f"{src}.{suffix}")
        n = 1
        while dst.exists():
            dst, n = epath.Path(f"{src}.{suffix}.{n}"), n + 1
        if jax.process_index() == 0:
            src.rename(dst)
        _barrier(f"rljax_move_aside_{step}_{suffix}")
        self._manager.reload()
        return str(dst)

    def prune(self) -> list[int]:
        """Deletes the oldest committed steps beyond ``max_to_keep`` (a run killed between
        committing a step and deleting an old one leaves one too many); returns them."""
        extra = self.all_steps()[:-self.max_to_keep] if self.max_to_keep else []
        for step in extra:
            self._manager.delete(step)
        return extra

    def restore(self, step: int | None = None, abstract_state: Any = None) -> Restored:
        """Restores ``step`` (default: latest) into ``abstract_state``'s shapes and shardings.

        ``abstract_state`` is a pytree of ``jax.ShapeDtypeStruct`` with ``sharding`` set (see
        ``rljax.train.core.state.abstract_train_state``); arrays are resharded as needed. Without
        it, arrays come back as saved (only safe on the same topology).
        """
        step = self.latest_step() if step is None else int(step)
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**{
                STATE_ITEM: ocp.args.StandardRestore(abstract_state),
                META_ITEM: ocp.args.JsonRestore(),
            }))
        except Exception as e:  # noqa: BLE001 - only read failures are re-raised as damage
            problem = read_problem(e)
            if problem is None:
                raise
            raise CheckpointDamaged(step, problem) from e
        return Restored(step, restored[STATE_ITEM], dict(restored[META_ITEM] or {}))

    def restore_meta(self, step: int | None = None) -> dict:
        """Reads only the JSON item (cheap: no arrays are loaded)."""
        step = self.latest_step() if step is None else int(step)
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        try:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()}))
        except Exception as e:  # noqa: BLE001
            problem = read_problem(e)
            if problem is None:
                raise
            raise CheckpointDamaged(step, problem) from e
        if not restored[META_ITEM]:
            raise CheckpointDamaged(step, "its meta item is empty or missing")
        return dict(restored[META_ITEM])

    # -- lifecycle -----------------------------------------------------------------------

    def wait_until_finished(self) -> None:
        """Blocks until pending async saves are committed (call before exiting)."""
        pending, self._pending = self._pending, None
        try:
            self._manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self._write_error(e, pending) from e

    def close(self) -> None:
        """Waits for pending saves, then releases orbax's background resources (also when
        the wait failed; the failure is then raised, as CheckpointWriteError for I/O)."""
        try:
            self.wait_until_finished()
        finally:
            try:
                self._manager.close()
            except Exception:  # noqa: BLE001 - the save's own error is the one to report
                pass

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def checkpoint_dir(workdir: str | os.PathLike) -> str:
    """Where a run's checkpoints live inside its workdir (public contract: ``checkpoints/``)."""
    return paths.join(workdir, "checkpoints")


def has_checkpoint(workdir: str | os.PathLike) -> bool:
    """True if ``workdir`` holds at least one complete checkpoint (so ``train`` resumes)."""
    # Finished steps are plain integer directory names; tmp ones carry a suffix. Listing (not
    # building a manager) keeps this query free of side effects such as tmp-dir cleanup.
    directory = epath.Path(checkpoint_dir(workdir))
    return directory.is_dir() and any(p.name.isdigit() and p.is_dir() for p in directory.iterdir())
