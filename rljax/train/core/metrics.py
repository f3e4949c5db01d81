"""Metrics: ``metrics.jsonl``, TensorBoard event files and a throttled console progress line.

``MetricsWriter(workdir).write(step, {"reward/mean": ..., "loss": ...})`` appends one JSON
object per call (always with ``step``), writes TensorBoard scalars to the workdir, and prints
a progress line at most every ``console_every_s`` seconds (plus the first and last step).
Only process 0 writes anything; other processes get a no-op writer, so the loop can call it
unconditionally on every host.

A URL workdir (``gs://...``; any ``etils.epath`` scheme) gets the same files: they are written
to a local staging directory and copied to the workdir at most every ``sync_every_s`` seconds
and on :meth:`MetricsWriter.flush` / :meth:`MetricsWriter.close` (object stores cannot append,
and tensorboardX writes ``gs://`` only with extra packages).

With ``wandb=dict(project=..., mode="online"|"offline")`` every record's numbers also go to
Weights & Biases (the run's ``config`` as the W&B config; ``wandb`` imported only then). Offline
mode needs no network: the run is written under ``WORKDIR/wandb/offline-run-*`` for a later
``wandb sync``. A resumed run continues the same W&B run (its id is kept in
``WORKDIR/wandb/rljax_run_id``).

Values may be Python/numpy/jax scalars; size-1 arrays become scalars; other arrays are stored
as lists in the JSON only. Non-finite floats are written as ``null`` (standard JSON).
"""
from __future__ import annotations

import collections
import json
import math
import os
import secrets
import shutil
import sys
import tempfile
import time
from typing import Any, Iterable, Mapping

import numpy as np

from rljax.errors import RljaxError
from rljax.train.core import paths

METRICS_FILE = "metrics.jsonl"
# Shown first on the console line when present (then other keys, up to CONSOLE_KEYS in all).
CONSOLE_PRIORITY = ("reward/mean", "eval/accuracy", "loss", "kl", "completion/length_mean")
CONSOLE_KEYS = 5
RATE_WINDOW = 20  # logged steps the console's steps/s and ETA are measured over


class MetricsWriteError(RljaxError):
    """``metrics.jsonl`` or the TensorBoard events cannot be written (disk full, read-only).

    One line (exit 1). A checkpoint save may still be pending in orbax's threads on the same
    full disk: the CLI exits without joining them (``abandon_threads``), as for a failed
    checkpoint, so nothing hangs and the last committed checkpoint stays as it was."""

    abandon_threads = True


def _write_error(workdir: str, e: OSError) -> MetricsWriteError:
    what = e.strerror or os.strerror(e.errno or 0) or str(e)
    where = f": {e.filename}" if e.filename else ""
    return MetricsWriteError(f"cannot write metrics in {workdir}: {what}{where}")


def write_events_synchronously(tb) -> bool:
    """Makes a tensorboardX ``SummaryWriter`` write each event on the caller's thread.

    tensorboardX hands events to a writer thread through a 10-slot queue; when that thread
    dies (ENOSPC on a full disk) the queue fills and the next ``add_scalar`` blocks forever.
    Written here instead, a write error is an ``OSError`` in the caller. Returns False (and
    changes nothing) for a tensorboardX without these internals (2.6 has them)."""
    writer = getattr(getattr(tb, "file_writer", None), "event_writer", None)
    if writer is None or not hasattr(writer, "_ev_writer") or not hasattr(writer, "_worker"):
        return False
    writer._worker.stop()  # nothing queued yet: it ends at once
    writer.add_event = lambda event: writer._ev_writer.write_event(event)
    return True


def to_python(value: Any) -> Any:
    """JSON-able Python value: scalars to int/float/bool (non-finite floats to None),
    recursing into lists and dicts."""
    if hasattr(value, "__array__") or isinstance(value, np.generic):
        arr = np.asarray(value)
        if arr.size == 1:
            value = arr.reshape(()).item()
        else:
            return [to_python(v) for v in arr.tolist()]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)):
        return [to_python(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): to_python(v) for k, v in value.items()}
    return value


def _is_process_zero() -> bool:
    import jax  # local: metrics.jsonl readers (plot) should not need a backend

    return jax.process_index() == 0


def format_duration(seconds: float) -> str:
    """``3725`` -> ``1h02m``, ``75`` -> ``1m15s``, ``9.4`` -> ``9s``."""
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class MetricsWriter:
    """Writes metrics for one run's workdir. Use as a context manager or call :meth:`close`.

    Args:
      workdir: run directory (created if needed).
      total_steps: for the ETA; None hides it.
      phases: ``(name, first, last)`` global steps of each phase (its steps are ``first+1 ..
        last``): the steps/s and ETA are measured over the current phase's last
        ``RATE_WINDOW`` logged steps only (an SFT warm-up's fast steps say nothing about GRPO's
        pace), and the ETA covers the current phase. Default: one phase of ``total_steps``.
      clock: the console's time source (``time.monotonic``).
      eval_steps: the global steps after which an evaluation runs; the ETA adds the ones still
        to come at the last evaluation's ``time/eval`` (and counts them while none has run).
      console_every_s: minimum seconds between console lines (0 = every call).
      tensorboard: also write TensorBoard event files into ``workdir``.
      resume_step: when resuming from a checkpoint at this step, drop lines logged after it by
        the interrupted run, so ``metrics.jsonl`` has each step once (0: a run starting from
        scratch drops every line an aborted earlier attempt left).
      drop_eval_at_resume: also drop ``eval/*`` lines at ``resume_step`` (the checkpoint was
        written before its eval, which the resumed run redoes).
      sync_every_s: for a URL workdir, the minimum seconds between copies of the staged files.
      wandb: ``logging.wandb`` (project, mode, entity, name, tags); off without a project.
      config: the run's config as a dict, for W&B.
    """

    def __init__(self, workdir: str | os.PathLike, *, total_steps: int | None = None,
                 console_every_s: float = 10.0, tensorboard: bool = True,
                 resume_step: int | None = None, stream=None, enabled: bool | None = None,
                 sync_every_s: float = 30.0, wandb: Mapping | None = None,
                 config: Mapping | None = None, drop_eval_at_resume: bool = False,
                 phases: Iterable[tuple[str, int, int]] | None = None, clock=time.monotonic,
                 eval_steps: Iterable[int] = ()):
        self.workdir = os.fspath(workdir)
        self.clock = clock  # seconds, for steps/s and the ETA
        self.phases = [tuple(p) for p in phases or ()]
        self.eval_steps = sorted(int(s) for s in eval_steps)
        self._eval_s: float | None = None   # the last evaluation's time/eval
        self.sync_every_s = sync_every_s
        self.total_steps = total_steps
        self.console_every_s = console_every_s
        self.enabled = _is_process_zero() if enabled is None else enabled
        self.stream = stream if stream is not None else sys.stdout
        self._file = None
        self._tb = None
        self._wandb = None
        self._window: collections.deque = collections.deque(maxlen=RATE_WINDOW)  # (time, step)
        self._window_phase: int | None = None
        self._last_print = -math.inf
        self._staging: str | None = None  # local mirror of a URL workdir's log files
        self._failed = False  # a write failed (reported): closing does not report it again
        self._last_sync = -math.inf
        self.evals: list[tuple[int, dict]] = []  # (step, eval/* metrics) logged by this run
        if not self.enabled:
            return
        paths.makedirs(self.workdir)
        self.path = paths.join(self.workdir, METRICS_FILE)
        local_dir = self.workdir
        if paths.is_url(self.workdir):
            self._staging = local_dir = tempfile.mkdtemp(prefix="rljax_metrics_")
            if paths.isfile(self.path):  # resuming: continue the run's file
                with open(os.path.join(local_dir, METRICS_FILE), "wb") as f:
                    f.write(paths.as_path(self.path).read_bytes())
        local_path = os.path.join(local_dir, METRICS_FILE)
        if resume_step is not None:
            truncate_after(local_path, resume_step, drop_eval_at_step=drop_eval_at_resume)
            if resume_step and os.path.isfile(local_path):  # the summary covers the whole run
                self.evals = [(r["step"], {k: v for k, v in r.items() if k.startswith("eval/")})
                              for r in read_metrics(local_path)
                              if any(k.startswith("eval/") for k in r)]
        self._file = open(local_path, "a", encoding="utf-8")
        if tensorboard:
            from tensorboardX import SummaryWriter  # local: slow import, optional output

            self._tb = SummaryWriter(logdir=local_dir)
            write_events_synchronously(self._tb)
        wandb = dict(wandb or {})
        if wandb.get("project") and wandb.get("mode", "online") != "disabled":
            self._wandb = start_wandb(wandb, config or {}, self.workdir, resume_step is not None)
        self._sync()

    def write(self, step: int, metrics: Mapping[str, Any]) -> dict:
        """Logs ``metrics`` at ``step``; returns the JSON record written."""
        record = {"step": int(step)}
        record.update({str(k): to_python(v) for k, v in metrics.items()})
        if not self.enabled:
            return record
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()  # a killed run still leaves every logged step on disk
            if self._tb is not None:
                for key, value in record.items():
                    if key != "step" and isinstance(value, (int, float)) \
                            and not isinstance(value, bool):
                        self._tb.add_scalar(key, value, global_step=int(step))
        except OSError as e:  # full disk, read-only: one line, and close() stays quiet
            self._failed = True
            raise _write_error(self.workdir, e) from None
        if self._wandb is not None:
            self._log_wandb(record, int(step))
        self._maybe_print(int(step), record)
        if self._staging is not None and time.monotonic() - self._last_sync >= self.sync_every_s:
            self.flush()
        return record

    def _log_wandb(self, record: Mapping[str, Any], step: int) -> None:
        """Sends the record's numbers to W&B; a failure (its disk full, its process gone) is
        one warning line and W&B is off for the rest of the run (metrics.jsonl has it all)."""
        try:
            self._wandb.log({k: v for k, v in record.items() if k != "step" and
                             isinstance(v, (int, float)) and not isinstance(v, bool)},
                            step=step)
        except Exception as e:  # noqa: BLE001 - any W&B failure
            self._wandb = None
            text = " ".join(f"{type(e).__name__}: {e}".split())
            print(f"rljax: warning: W&B logging failed at step {step} ({text}); W&B is off "
                  f"for the rest of this run, {METRICS_FILE} keeps every step",
                  file=sys.stderr, flush=True)

    def _sync(self) -> None:
        """Copies the staged files to a URL workdir (whole files: object stores cannot append)."""
        if self._staging is None:
            return
        self._last_sync = time.monotonic()
        for name in sorted(os.listdir(self._staging)):
            local = os.path.join(self._staging, name)
            if os.path.isfile(local):
                with open(local, "rb") as f:
                    paths.as_path(paths.join(self.workdir, name)).write_bytes(f.read())

    def _maybe_print(self, step: int, record: Mapping[str, Any]) -> None:
        evals = {k: v for k, v in record.items() if str(k).startswith("eval/")}
        if evals:  # held-out results are rare and wanted: never throttled
            self.evals.append((step, evals))
            if isinstance(record.get("time/eval"), (int, float)):
                self._eval_s = float(record["time/eval"])
            if all(str(k).startswith(("eval/", "time/")) for k in record if k != "step"):
                print(eval_line(step, record), file=self.stream, flush=True)
                return
        now = self.clock()
        phase = self._phase_index(step)
        if phase != self._window_phase:  # a new phase: its own pace, from its first logged step
            self._window.clear()
            self._window_phase = phase
        self._window.append((now, step))
        last = self.total_steps is not None and step >= self.total_steps
        if now - self._last_print < self.console_every_s and not last and not evals \
                and self._last_print > -math.inf:
            return
        self._last_print = now
        print(self.progress_line(step, record, now), file=self.stream, flush=True)

    def _phase_index(self, step: int) -> int | None:
        """Index in ``phases`` of the phase global step ``step`` belongs to (None: no phases)."""
        for i, (_, first, last) in enumerate(self.phases):
            if first < step <= last:
                return i
        return len(self.phases) - 1 if self.phases else None

    def progress_line(self, step: int, record: Mapping[str, Any], now: float) -> str:
        """``step 40/100 | 2.31 steps/s | ETA 26s | reward/mean 0.41 | loss 0.12``; in an
        earlier phase ``... | ETA 12s (sft; then 800 grpo steps) | ...``."""
        parts = [f"step {step}" + (f"/{self.total_steps}" if self.total_steps else "")]
        rate = window_rate(list(self._window))  # the current phase's recent steps only
        if rate:
            parts.append(f"{rate:.3g} steps/s")
            if self.total_steps:
                parts.append("ETA " + self.eta(step, rate))
        for key in _console_keys(record):
            parts.append(f"{key} {_format_value(record[key])}")
        return " | ".join(parts)

    def eta(self, step: int, rate: float) -> str:
        """Time left in the current phase at ``rate`` steps/s, its evaluations included (at
        the last one's duration; counted while none has run: ``1m10s + 2 evals``); later
        phases, whose pace is not known yet, are named with their step and evaluation counts:
        ``12s (sft; then 800 grpo steps, 8 evals)``."""
        i = self._phase_index(step)
        final = i is None or i == len(self.phases) - 1
        last = self.total_steps if final else self.phases[i][2]
        seconds = (last - step) / rate
        evals = sum(step <= s <= last for s in self.eval_steps)   # (step's own eval follows it)
        if evals and self._eval_s is not None:
            seconds += evals * self._eval_s
        text = format_duration(seconds)
        if evals and self._eval_s is None:
            text += f" + {evals} eval" + ("s" if evals > 1 else "")
        if final:
            return text
        name = self.phases[i][0]
        later = ", ".join(f"{b - a} {n} steps" for n, a, b in self.phases[i + 1:])
        later_evals = sum(last < s <= self.total_steps for s in self.eval_steps)
        if later_evals:
            later += f", {later_evals} eval" + ("s" if later_evals > 1 else "")
        return f"{text} ({name}; then {later})"

    def flush(self) -> None:
        try:
            if self._file is not None:
                self._file.flush()
            if self._tb is not None:
                self._tb.flush()
            if self._file is not None:
                self._sync()
        except OSError as e:
            self._failed = True
            raise _write_error(self.workdir, e) from None

    def close(self) -> None:
        """Flushes and closes the files (idempotent). Every writer is closed even when one
        fails; a write error is raised once, as :class:`MetricsWriteError` (not again after
        :meth:`write` reported it)."""
        errors: list[OSError] = []

        def attempt(fn) -> None:
            try:
                fn()
            except OSError as e:
                errors.append(e)

        if self._file is not None:
            attempt(self._file.close)
        if self._tb is not None:
            tb, self._tb = self._tb, None
            attempt(tb.close)
            writer = getattr(getattr(tb, "file_writer", None), "event_writer", None)
            if errors and writer is not None and hasattr(writer, "_closed"):
                writer._closed = True  # its atexit hook would only fail again, as a traceback
        if self._wandb is not None:
            wandb, self._wandb = self._wandb, None
            try:
                wandb.finish()
            except Exception as e:  # noqa: BLE001 - W&B's own failure is not the run's
                print(f"rljax: warning: W&B did not finish cleanly ({type(e).__name__}: {e})",
                      file=sys.stderr, flush=True)
        if self._file is not None:
            self._file = None
            if self._staging is not None:
                attempt(self._sync)
                shutil.rmtree(self._staging, ignore_errors=True)
                self._staging = None
        if errors and not self._failed:
            self._failed = True
            raise _write_error(self.workdir, errors[0])

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def window_rate(points: list[tuple[float, int]]) -> float | None:
    """Steps per second over ``(time, step)`` points (oldest first), None with fewer than two
    or no time between them. Measured from the first point: a phase's first logged step
    carries its compilation, which later steps do not repeat."""
    if len(points) < 2:
        return None
    (t0, s0), (t1, s1) = points[0], points[-1]
    return (s1 - s0) / (t1 - t0) if t1 > t0 and s1 > s0 else None


def host_fraction(wall_s: float, pending_s: float) -> float:
    """Share of ``wall_s`` in which no device work was pending, given the seconds
    ``pending_s`` from dispatches to the return of the fetches of their results, clipped to
    [0, 1]. ``pending_s`` over-counts device time (a fetch returns only when the host asks,
    and a dispatch includes its host-side launch), so this is a lower bound of the device's
    idle share; on a CPU backend "device" work runs on the same cores as the host."""
    if wall_s <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - pending_s / wall_s))


def start_wandb(options: Mapping, config: Mapping, workdir: str, resuming: bool):
    """``wandb.init`` for a run (process 0). Local workdir: files under ``WORKDIR/wandb``
    (a URL workdir: ``./wandb``); the run id is kept there so a resume continues the run."""
    from rljax.errors import UserError

    try:
        import wandb
    except ImportError:
        raise UserError("logging.wandb.project is set but wandb is not installed: "
                        "pip install wandb (or this project's [wandb] extra)") from None
    root = "." if paths.is_url(workdir) else workdir
    os.makedirs(os.path.join(root, "wandb"), exist_ok=True)
    id_file = os.path.join(root, "wandb", "rljax_run_id")
    run_id = None
    if resuming and os.path.isfile(id_file):
        with open(id_file) as f:
            run_id = f.read().strip() or None
    if run_id is None:
        run_id = secrets.token_hex(4)  # W&B ids: lowercase letters and digits
        with open(id_file, "w") as f:
            f.write(run_id + "\n")
    name = options.get("name") or os.path.basename(os.path.normpath(workdir)) or None
    try:
        return wandb.init(
            project=options["project"], entity=options.get("entity") or None, name=name,
            tags=list(options.get("tags") or ()) or None, mode=options.get("mode", "online"),
            config=dict(config), dir=root, id=run_id, resume="allow",
            settings=wandb.Settings(console="off", silent=True))
    except Exception as e:  # noqa: BLE001 - e.g. online mode without an API key
        raise UserError(f"logging.wandb: wandb.init failed ({type(e).__name__}: {e}); "
                        "run `wandb login`, or set logging.wandb.mode=offline") from None


def eval_line(step: int, record: Mapping[str, Any]) -> str:
    """``eval at step 60 | eval/accuracy 0.41 | eval/pass@2 0.5 | ...``."""
    keys = [k for k in _console_keys({k: v for k, v in record.items()
                                      if str(k).startswith("eval/")}, limit=6)]
    return " | ".join([f"eval at step {step}"] + [f"{k} {_format_value(record[k])}" for k in keys])


def _console_keys(record: Mapping[str, Any], limit: int = CONSOLE_KEYS) -> list[str]:
    scalars = [k for k, v in record.items()
               if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)]
    first = [k for k in CONSOLE_PRIORITY if k in scalars]
    rest = [k for k in scalars if k not in first]
    return (first + rest)[:limit]


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Reads ``metrics.jsonl`` (a file, or a workdir containing one); skips a torn last line."""
    path = os.fspath(path)
    if paths.is_url(path):  # gs://...: a workdir unless it names the .jsonl file
        if not path.endswith(".jsonl"):
            path = paths.join(path, METRICS_FILE)
        lines = paths.read_text(path).splitlines()
    else:
        if os.path.isdir(path):
            path = os.path.join(path, METRICS_FILE)
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    records = []
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a run killed mid-write leaves a partial final line
    return records


def truncate_after(path: str, step: int, drop_eval_at_step: bool = False) -> None:
    """Drops records with ``step`` > ``step`` (and, with ``drop_eval_at_step``, the ``eval/*``
    records at ``step``); rewrites the file atomically."""
    if not os.path.exists(path):
        return

    def keep(r):
        s = r.get("step", 0)
        if drop_eval_at_step and s == step and any(k.startswith("eval/") for k in r):
            return False
        return s <= step

    kept = [r for r in read_metrics(path) if keep(r)]
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(tmp, path)


def numeric_series(records: Iterable[Mapping[str, Any]]) -> dict[str, tuple[list, list]]:
    """``{key: (steps, values)}`` for every scalar numeric key (None/NaN points skipped)."""
    series: dict[str, tuple[list, list]] = {}
    for record in records:
        step = record.get("step")
        for key, value in record.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            steps, values = series.setdefault(key, ([], []))
            steps.append(step)
            values.append(value)
    return series
