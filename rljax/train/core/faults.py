"""Graceful stop on SIGTERM / SIGINT: finish the step, checkpoint, exit.

The handler only sets a flag; the controller loop checks ``should_stop()`` at step boundaries,
saves a checkpoint and returns. Exit codes (what ``StopSignal.exit_code`` reports and
``rljax train`` exits with):

* ``0``   after SIGTERM: a preemption or a scheduler asking us to stop. The checkpoint is saved,
          and running the same command again resumes, so this is a successful exit (a job
          system must not count it as a failure).
* ``130`` after Ctrl-C (SIGINT): the user interrupted; the checkpoint is saved too.

A second Ctrl-C (or SIGTERM) while stopping exits immediately with code 130 without waiting
for the step or the checkpoint; an unfinished checkpoint is never picked up as the latest.

Multi-host: every host must stop at the same step (saving is a collective), so hosts agree with
``should_stop(sync=True)``, which ORs the flag across processes (one tiny allgather).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType

EXIT_PREEMPTED = 0
EXIT_INTERRUPTED = 130


class StopSignal:
    """Installs SIGTERM/SIGINT handlers that request a graceful stop.

    Use as a context manager around the training loop (previous handlers are restored on
    exit). Outside the main thread (e.g. some notebook runners) signals cannot be caught;
    installation is then skipped and ``should_stop`` only reflects :meth:`request_stop`.
    """

    def __init__(self, signals=(signal.SIGTERM, signal.SIGINT), *, quiet: bool = False):
        self.signals = tuple(signals)
        self.quiet = quiet
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    # -- installation --------------------------------------------------------------------

    def install(self) -> "StopSignal":
        """Installs the handlers (main thread only); returns self."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        """Restores the handlers that were there before :meth:`install`."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def __enter__(self) -> "StopSignal":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    # -- state ---------------------------------------------------------------------------

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            # Second signal: the user does not want to wait. Skip cleanup on purpose.
            self._say(f"received {signal.Signals(signum).name} again; exiting now")
            os._exit(EXIT_INTERRUPTED)
        self.signum = signum
        self._say(f"received {signal.Signals(signum).name}; stopping after this step and "
                  "saving a checkpoint (press Ctrl-C again to exit immediately)")

    def _say(self, message: str) -> None:
        if not self.quiet:
            print(f"rljax: {message}", file=sys.stderr, flush=True)

    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        """Asks for a graceful stop from code (tests, notebooks, a time budget)."""
        if self.signum is None:
            self.signum = signum

    def should_stop(self, sync: bool = False) -> bool:
        """True once a stop was requested. ``sync=True`` ORs the flag over all processes;
        every process must then call it at the same step."""
        local = self.signum is not None
        if not sync:
            return local
        import jax  # local: keep this module importable without initialising a backend

        if jax.process_count() == 1:
            return local
        import numpy as np
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.array([local], dtype=np.int32))
        if np.any(flags) and self.signum is None:
            self.signum = signal.SIGTERM  # another host was preempted: behave the same
        return bool(np.any(flags))

    def poll(self, sync: bool = False) -> bool:
        """``should_stop`` for checks inside a step (between eval batches): same answer, but
        not a step boundary (subclasses that count steps in ``should_stop`` do not see it)."""
        return StopSignal.should_stop(self, sync)

    @property
    def exit_code(self) -> int:
        """0 after SIGTERM (preemption, resumable), 130 after SIGINT, 0 if never signalled."""
        return EXIT_INTERRUPTED if self.signum == signal.SIGINT else EXIT_PREEMPTED

    @property
    def reason(self) -> str | None:
        """Name of the signal that requested the stop (e.g. ``"SIGTERM"``), or None."""
        return None if self.signum is None else signal.Signals(self.signum).name
