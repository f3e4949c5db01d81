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
in ``latest_step()``. Leftover tmp directories are deleted when the manager is created.
"""
from __future__ import annotations

import os
import platform
import socket
import time
from typing import Any, Mapping, NamedTuple

import jax
import orbax.checkpoint as ocp
from etils import epath

from rljax.train import paths

STATE_ITEM = "state"
META_ITEM = "meta"


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
        self.directory = paths.absolute(directory)  # a URL (gs://...) stays as it is
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.LatestN(n=max_to_keep),
            enable_async_checkpointing=async_save,
            # A crash mid-save leaves <step>.orbax-checkpoint-tmp-*; never reuse it.
            cleanup_tmp_directories=True,
            create=True,
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=(STATE_ITEM, META_ITEM))

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
            return False
        meta = {**dict(meta or {}), "host": host_metadata()}
        saved = self._manager.save(
            int(step),
            args=ocp.args.Composite(**{
                STATE_ITEM: ocp.args.StandardSave(state),
                META_ITEM: ocp.args.JsonSave(meta),
            }),
            force=True,  # the caller decides when to save (checkpoint_every, on stop)
        )
        if wait:
            self.wait_until_finished()
        return bool(saved)

    def restore(self, step: int | None = None, abstract_state: Any = None) -> Restored:
        """Restores ``step`` (default: latest) into ``abstract_state``'s shapes and shardings.

        ``abstract_state`` is a pytree of ``jax.ShapeDtypeStruct`` with ``sharding`` set (see
        ``rljax.train.state.abstract_train_state``); arrays are resharded as needed. Without
        it, arrays come back as saved (only safe on the same topology).
        """
        step = self.latest_step() if step is None else int(step)
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        restored = self._manager.restore(step, args=ocp.args.Composite(**{
            STATE_ITEM: ocp.args.StandardRestore(abstract_state),
            META_ITEM: ocp.args.JsonRestore(),
        }))
        return Restored(step, restored[STATE_ITEM], dict(restored[META_ITEM] or {}))

    def restore_meta(self, step: int | None = None) -> dict:
        """Reads only the JSON item (cheap: no arrays are loaded)."""
        step = self.latest_step() if step is None else int(step)
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        restored = self._manager.restore(
            step, args=ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()}))
        return dict(restored[META_ITEM] or {})

    # -- lifecycle -----------------------------------------------------------------------

    def wait_until_finished(self) -> None:
        """Blocks until pending async saves are committed (call before exiting)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves, then releases orbax's background resources."""
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def checkpoint_dir(workdir: str | os.PathLike) -> str:
    """Where a run's checkpoints live inside its workdir (public contract: ``checkpoints/``)."""
    return paths.join(workdir, "checkpoints")


def has_checkpoint(workdir: str | os.PathLike) -> bool:
    """True if ``workdir`` holds at least one complete checkpoint (so ``train`` resumes)."""
    # Finished steps are plain integer directory names; tmp ones carry a suffix. Listing (not
    # building a manager) keeps this query free of side effects such as tmp-dir cleanup.
    directory = epath.Path(checkpoint_dir(workdir))
    return directory.is_dir() and any(p.name.isdigit() and p.is_dir() for p in directory.iterdir())
