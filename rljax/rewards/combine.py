"""Weighted composition of reward functions with error and timeout isolation.

``combine([("gsm8k", 1.0), ("format", 0.2)], default_score=0.0, timeout_s=30.0)`` returns a
callable; calling it on a batch gives a ``RewardResult`` with the weighted total, each function's
own scores (the trainer logs them separately), how many samples each function failed to score
(``errors``, timeouts included) and how many of those were timeouts (``timeouts``), and one line
per failed function saying why (``messages``). What counts as a failure:

* the call raises (any exception, ``SystemExit`` included, and ``KeyboardInterrupt`` unless
  it may be the user's Ctrl-C: a call on the main thread under Python's default SIGINT
  handler), returns something that is not a list of numbers, or a list of the wrong length:
  every sample of the call gets ``default_score``;
* a NaN or infinite score, or one too large for float32 reward statistics (|weighted
  total| above ``MAX_REWARD``, 1e15, so that group means and stds stay finite): that sample
  gets ``default_score``, the others keep theirs;
* the call does not finish within ``timeout_s``: every sample gets ``default_score``.

The message names the exception type and text and, for an exception, the last line of the
function's own file in the traceback (``my_reward.py:12``). The other functions and the batch
go on; ``rljax.rewards.monitor`` turns these counts into console warnings and a stop.

How timeouts are enforced (``isolation``):

* ``"thread"`` (default): each call runs in a daemon thread that the caller waits on with a
  deadline. Works for any callable, including closures over device arrays (the reward-model
  scorer). A Python thread cannot be killed: a hung call keeps running in the background
  (daemon, so it never blocks interpreter exit; ``leaked_threads`` counts them). While a
  function's abandoned call is still running it is not called again: its next batches fail at
  once as timeouts ("still running"), so one hang costs one timeout, not one per step, and
  threads do not pile up.
* ``"process"``: calls run in a spawned worker process pool; on a timeout the workers are killed
  and a fresh pool is started for the next batch. Use it for verifiers that may hang for real
  (sympy, sandboxes, code execution). The functions must be importable in the worker: built-in
  names, ``path/to/file.py:function`` / ``package.module:function`` specs, or module-level
  functions.
* ``timeout_s=None``: calls run directly on the calling thread (failures are still caught; a
  hang is a hang).

``should_abort`` (a no-argument callable) is polled while waiting: when it returns True (the
trainer's SIGTERM/Ctrl-C flag) the calls still running are abandoned as timeouts, so a stop
request is not held up by a hung function.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import inspect
import logging
import math
import multiprocessing
import threading
import time
from typing import Callable, Sequence

from rljax.rewards.registry import display_name, get
from rljax.usercode import describe_exception

__all__ = ["RewardResult", "CombinedReward", "combine", "call_reward", "describe_exception",
           "required_fields", "STANDARD_FIELDS"]

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often a wait checks ``should_abort``
FLOAT32_MAX = 3.4028234663852886e38  # rewards are float32 on the device
# Largest |weighted total reward|: far beyond any real reward, small enough that a group's
# mean, deviations and their squares (the advantages' std) stay finite in float32 (3e38,
# which fits float32 itself, made every std inf and every update train nothing).
MAX_REWARD = 1e15


@dataclasses.dataclass
class RewardResult:
    """Scores for one batch. ``errors[name]`` counts scores replaced by the default (timeouts
    included); ``timeouts[name]`` the part of those that timed out; ``messages[name]`` says why."""

    total: list[float]
    per_function: dict[str, list[float]]
    errors: dict[str, int]
    messages: dict[str, str] = dataclasses.field(default_factory=dict)
    timeouts: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def num_errors(self) -> int:
        return sum(self.errors.values())

    @property
    def num_samples(self) -> int:
        return len(self.total)

    def metrics(self, prefix: str = "reward") -> dict[str, float]:
        """Flat scalar metrics: ``reward/mean``, ``reward/<name>/mean|errors|timeouts``."""
        mean = lambda xs: float(sum(xs) / len(xs)) if xs else 0.0  # noqa: E731
        out = {f"{prefix}/mean": mean(self.total), f"{prefix}/errors": float(self.num_errors)}
        for name, scores in self.per_function.items():
            out[f"{prefix}/{name}/mean"] = mean(scores)
            out[f"{prefix}/{name}/errors"] = float(self.errors[name])
            out[f"{prefix}/{name}/timeouts"] = float(self.timeouts.get(name, 0))
        return out


# ----------------------------------------------------------------------------- calling one fn

def _accepted_fields(fn: Callable, fields: dict) -> dict:
    """``fields`` a function can take: all of them with ``**kwargs``, else the named ones.

    So ``def my_reward(prompts, completions, answer)`` works although the trainer also passes
    ``completion_lengths`` and every other dataset field.
    """
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins, some C callables
        return fields
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return fields
    names = {p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                  inspect.Parameter.KEYWORD_ONLY)}
    return {k: v for k, v in fields.items() if k in names}


STANDARD_FIELDS = ("prompts", "completions", "completion_lengths")  # the trainer passes these


def required_fields(fn: Callable) -> tuple[str, ...]:
    """Dataset fields every row must have for ``fn``: its ``rljax_fields`` attribute when set
    (built-ins whose fields default to None, such as ``gsm8k``'s ``answer``), else the
    parameters after ``prompts, completions`` that have no default, less ``STANDARD_FIELDS``.

    ``def close_enough(prompts, completions, answer)`` -> ``("answer",)``; a ``**kwargs``
    function names only what it lists before it."""
    declared = getattr(fn, "rljax_fields", None)
    if declared is not None:
        return tuple(declared)
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins, some C callables: nothing to go by
        return ()
    positional = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                  inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    skip = {p.name for p in positional[:2]} | set(STANDARD_FIELDS)
    return tuple(p.name for p in params
                 if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                               inspect.Parameter.KEYWORD_ONLY)
                 and p.default is inspect.Parameter.empty and p.name not in skip)


def call_reward(fn: Callable, prompts, completions, fields: dict):
    """``fn(prompts, completions, **fields)`` with only the fields ``fn`` accepts."""
    return fn(prompts, completions, **_accepted_fields(fn, fields))


class ChildFailure(Exception):
    """A reward function failed in a worker process; the message is its description."""


def _call_in_child(fn, prompts, completions, fields):
    """Runs in a worker process: resolves a name there (names pickle, closures don't)."""
    if isinstance(fn, tuple):
        name, kwargs = fn
        fn = get(name, **kwargs)
    try:
        return list(call_reward(fn, prompts, completions, fields))
    except BaseException as e:  # noqa: BLE001 - the message travels; the traceback does not
        raise ChildFailure(describe_exception(e, fn)) from None


def _exit_codes(workers) -> str:
    """How a broken pool's worker processes ended: ``"exit code 7"``, ``"killed by SIGKILL
    (out of memory?)"``; the pool's own SIGTERM of the survivors is left out."""
    import signal

    # The pool's own thread reaps the same processes: a join that loses that race sees no exit
    # code yet (ECHILD), so poll until the winner has stored it.
    deadline = time.monotonic() + 5.0
    for p in workers:
        while p.exitcode is None and time.monotonic() < deadline:
            p.join(timeout=0.05)
    codes = [p.exitcode for p in workers if p.exitcode is not None]
    codes = [c for c in codes if c != -signal.SIGTERM] or codes
    if not codes:
        return "exit status unknown"
    code = codes[0]
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else -code
        return f"killed by {name}" + (" (out of memory?)" if code == -signal.SIGKILL else "")
    return f"exit code {code}"


def _ctrl_c_raises() -> bool:
    """True when a Ctrl-C would raise KeyboardInterrupt here (Python's default SIGINT handler);
    under the trainer's handler (``rljax.train.core.faults``) it only requests a stop."""
    import signal

    return signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _ready() -> bool:
    """Warm-up task: a spawned worker has started and imported rljax.rewards (unpickling this
    function imports the package before this module)."""
    return True


class _Call:
    """One call of a reward function in a daemon thread."""

    def __init__(self, fn: Callable, args: tuple, fields: dict, name: str):
        self.fn, self.done, self.started = fn, threading.Event(), time.monotonic()
        self.value = self.error = None
        self.thread = threading.Thread(target=self._target, args=args + (fields,), daemon=True,
                                       name=f"reward-{name}")
        self.thread.start()

    def _target(self, prompts, completions, fields):
        try:
            self.value = call_reward(self.fn, prompts, completions, fields)
        except BaseException as e:  # noqa: BLE001 - any failure becomes a counted error
            self.error = e
        finally:
            self.done.set()


def _wait(done: Callable[[], bool], deadline: float, should_abort,
          block: Callable[[float], object] = time.sleep) -> bool:
    """Waits until ``done()`` or the deadline or ``should_abort()``; returns ``done()``.

    ``block(seconds)`` waits at most that long and should return as soon as the calls may be
    done (an event's or futures' wait): with a plain ``time.sleep`` every call cost at least
    one ``POLL_S`` (50 ms) even when the function took 5 ms, ~13% of a demo GRPO iteration.
    ``should_abort`` is still checked at least every ``POLL_S``."""
    while not done():
        left = deadline - time.monotonic()
        if left <= 0 or (should_abort is not None and should_abort()):
            return done()
        block(min(left, POLL_S))
    return True


def _first_pending(calls: list[_Call]):
    """``seconds -> None``: waits on the first unfinished call's event (returns at once when
    every call is done), so ``_wait`` wakes when a call finishes, not at the next poll."""
    def block(seconds: float) -> None:
        for c in calls:
            if not c.done.is_set():
                c.done.wait(seconds)
                return
    return block


# ----------------------------------------------------------------------------- combined

class CombinedReward:
    """Callable ``(prompts, completions, **fields) -> RewardResult``; see module docstring."""

    def __init__(self, functions: Sequence, default_score: float = 0.0,
                 timeout_s: float | None = None, isolation: str = "thread",
                 should_abort: Callable[[], bool] | None = None):
        if isolation not in ("thread", "process"):
            raise ValueError(f"isolation must be 'thread' or 'process', got {isolation!r}")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 (or None for no timeout), got {timeout_s}")
        if not functions:
            raise ValueError("combine needs at least one reward function")
        self.names, self.fns, self.weights, self._specs = [], [], [], []
        for entry in functions:
            fn_or_name, weight, kwargs = (tuple(entry) + ({},))[:3]
            if isinstance(fn_or_name, str):
                name, fn = display_name(fn_or_name), get(fn_or_name, **kwargs)
                spec = (fn_or_name, dict(kwargs))  # picklable stand-in for process isolation
            else:
                name, fn, spec = getattr(fn_or_name, "__name__", "reward"), fn_or_name, fn_or_name
            self.names.append(self._unique(name))
            self.fns.append(fn)
            self.weights.append(float(weight))
            self._specs.append(spec)
        self.default_score = float(default_score)
        self.timeout_s = timeout_s
        self.isolation = isolation
        self.should_abort = should_abort
        self.leaked_threads = 0
        self.total_errors = {n: 0 for n in self.names}  # cumulative, for end-of-run summaries
        self._pool: cf.ProcessPoolExecutor | None = None
        self._workers: list = []  # the pool's processes (process isolation)
        self._hung: dict[str, _Call] = {}  # thread isolation: abandoned calls still running

    def _unique(self, name: str) -> str:
        base, i = name, 2
        while name in self.names:
            name, i = f"{base}_{i}", i + 1
        return name

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **fields) -> RewardResult:
        n = len(completions)
        if len(prompts) != n:
            raise ValueError(f"{len(prompts)} prompts for {n} completions")
        outcomes = self._run_all(list(prompts), list(completions), fields)
        per_fn, errors, timeouts, messages = {}, {}, {}, {}
        for name, fn, w, (status, value) in zip(self.names, self.fns, self.weights, outcomes):
            scores, bad, problem = self._validate(status, value, n, fn, self._limit(w))
            errors[name], timeouts[name] = bad, (bad if status == "timeout" else 0)
            if problem:
                messages[name] = problem
                self.total_errors[name] += bad
                log.info("reward %r failed on %d of %d samples: %s", name, bad, n, problem)
            per_fn[name] = scores
        total = [sum(w * per_fn[name][i] for name, w in zip(self.names, self.weights))
                 for i in range(n)]
        return RewardResult(total, per_fn, errors, messages, timeouts)

    def _limit(self, weight: float) -> float:
        """Largest |score| a function with ``weight`` may return: the trainer casts scores and
        their weighted total to float32, so each weighted score stays below float32's maximum
        divided by the number of functions (a finite 1e308 would become inf there)."""
        return MAX_REWARD / len(self.fns) / max(abs(weight), 1.0)

    def _validate(self, status: str, value, n: int, fn, limit: float = math.inf
                  ) -> tuple[list[float], int, str | None]:
        """(scores, samples that failed, why) for one call's outcome; a score beyond
        ``limit`` in magnitude fails like a NaN."""
        default = [self.default_score] * n
        if status == "timeout":
            return default, n, value or f"timed out after {self.timeout_s:g} s"
        if status == "error":
            if isinstance(value, ChildFailure):
                return default, n, str(value)
            own = " (raised by the function, not Ctrl-C)" if isinstance(
                value, KeyboardInterrupt) else ""
            return default, n, describe_exception(value, fn) + own
        if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
            return default, n, (f"returned {type(value).__name__}, not a list of {n} scores "
                                "(one per completion)")
        if len(value) != n:
            return default, n, f"returned {len(value)} scores for {n} completions"
        try:
            scores = [float(s) for s in value]
        except (TypeError, ValueError) as e:
            return default, n, f"returned non-numeric scores ({e})"
        bad = [i for i, s in enumerate(scores) if not math.isfinite(s) or abs(s) > limit]
        if not bad:
            return scores, 0, None
        huge = [scores[i] for i in bad if math.isfinite(scores[i])]
        kinds = sorted({"NaN" if math.isnan(scores[i]) else "inf" for i in bad
                        if not math.isfinite(scores[i])})
        if huge:  # finite in Python, inf once cast to float32
            kinds.append(f"{huge[0]:.3g} (too large for float32 reward statistics: |score| "
                         f"must be <= {limit:.3g})")
        for i in bad:
            scores[i] = self.default_score
        return scores, len(bad), (f"returned {'/'.join(kinds)} for {len(bad)} of {n} samples "
                                  f"(first: sample {bad[0]})")

    def _run_all(self, prompts, completions, fields) -> list[tuple[str, object]]:
        if self.timeout_s is None:
            return [self._direct(fn, prompts, completions, fields) for fn in self.fns]
        deadline = time.monotonic() + float(self.timeout_s)
        if self.isolation == "process":  # all run concurrently against one deadline
            return self._in_processes(prompts, completions, fields, deadline)
        return self._in_threads(prompts, completions, fields, deadline)

    def _in_threads(self, prompts, completions, fields, deadline) -> list[tuple[str, object]]:
        """All functions at once, each in its own thread, against one deadline. A function
        marked ``rljax_main_thread = True`` (it enforces its own time limits with signals, as
        ``math`` does) runs on the calling thread meanwhile, when that is the main thread."""
        calls: list[_Call | None] = []
        outcomes: list[tuple[str, object] | None] = []
        on_main = threading.current_thread() is threading.main_thread()
        direct = []
        for name, fn in zip(self.names, self.fns):
            if on_main and getattr(fn, "rljax_main_thread", False):
                calls.append(None)
                outcomes.append(None)
                direct.append((len(outcomes) - 1, fn))
                continue
            hung = self._hung.get(name)
            if hung is not None and not hung.done.is_set():
                calls.append(None)
                age = time.monotonic() - hung.started
                outcomes.append(("timeout", f"still running from a call {age:.0f} s ago that "
                                 f"timed out after {self.timeout_s:g} s; not called again until "
                                 "it returns"))
                continue
            self._hung.pop(name, None)
            calls.append(_Call(fn, (prompts, completions), fields, name))
            outcomes.append(None)
        for i, fn in direct:
            outcomes[i] = self._direct(fn, prompts, completions, fields)
        live = [c for c in calls if c is not None]
        _wait(lambda: all(c.done.is_set() for c in live), deadline, self.should_abort,
              block=_first_pending(live))
        for i, (name, call) in enumerate(zip(self.names, calls)):
            if call is None:  # not called (still running) or run directly
                continue
            if not call.done.is_set():
                self._hung[name] = call
                self.leaked_threads += 1
                aborted = time.monotonic() < deadline
                outcomes[i] = ("timeout", "abandoned: the run is stopping" if aborted else None)
            elif call.error is not None:  # a KeyboardInterrupt here is the function's own:
                #                               Ctrl-C goes to the main thread
                outcomes[i] = ("error", call.error)
            else:
                outcomes[i] = ("ok", call.value)
        return outcomes

    @staticmethod
    def _direct(fn, prompts, completions, fields):
        try:
            return "ok", call_reward(fn, prompts, completions, fields)
        except KeyboardInterrupt as e:
            if _ctrl_c_raises():
                raise  # may be the user's Ctrl-C
            return "error", e  # the trainer's SIGINT handler sets a flag: the function's own
        except BaseException as e:  # noqa: BLE001 - SystemExit included
            return "error", e

    def _in_processes(self, prompts, completions, fields, deadline) -> list[tuple[str, object]]:
        if self._pool is not None and not all(p.is_alive() for p in self._workers):
            self._kill_pool()  # a worker died since the last batch (the OOM killer while idle)
        if self._pool is None:
            self._start_pool()
        try:
            futures = [self._pool.submit(_call_in_child, spec, prompts, completions, fields)
                       for spec in self._specs]
        except cf.process.BrokenProcessPool:  # it died between that check and the submit
            self._kill_pool()
            self._start_pool()
            futures = [self._pool.submit(_call_in_child, spec, prompts, completions, fields)
                       for spec in self._specs]
        _wait(lambda: all(f.done() for f in futures), deadline, self.should_abort,
              block=lambda seconds: cf.wait(futures, timeout=seconds))
        outcomes, timed_out = [], False
        for fut in futures:
            if not fut.done():
                outcomes.append(("timeout", None if time.monotonic() >= deadline
                                 else "abandoned: the run is stopping"))
                timed_out = True
                continue
            try:
                outcomes.append(("ok", fut.result()))
            except BaseException as e:  # noqa: BLE001 - pickling errors, dead workers, SystemExit
                outcomes.append(("error", e))
        broken = [i for i, (status, e) in enumerate(outcomes)
                  if isinstance(e, cf.process.BrokenProcessPool)]
        if broken:  # every call still in the pool fails with it; the pool is unusable
            died = ChildFailure(f"its worker process died ({_exit_codes(self._workers)}) during "
                                "the call; a fresh worker pool is started for the next batch")
            for i in broken:
                outcomes[i] = ("error", died)
        if timed_out or broken:
            self._kill_pool()
        return outcomes

    def _start_pool(self, startup_s: float = 120.0) -> None:
        """Starts one spawned worker per function and waits for them, so that interpreter
        start-up is not charged to the first batch's timeout."""
        from rljax.config.imports import import_again, imported

        ctx = multiprocessing.get_context("spawn")  # fork is unsafe once jax threads exist
        # A worker resolves reward names itself: it imports the config's user code first, so
        # names that code registered (the config's ``imports``) exist there too.
        self._pool = cf.ProcessPoolExecutor(max_workers=len(self.fns), mp_context=ctx,
                                            initializer=import_again, initargs=(imported(),))
        # Each submit with no idle worker spawns a process, so this starts all of them.
        for fut in [self._pool.submit(_ready) for _ in self.fns]:
            fut.result(timeout=startup_s)
        self._workers = list(getattr(self._pool, "_processes", {}).values())  # for exit codes

    def _kill_pool(self) -> None:
        """Kills the pool's worker processes (a hung call cannot be cancelled otherwise)."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        # ProcessPoolExecutor has no public way to kill busy workers before Python 3.14.
        for proc in list(getattr(pool, "_processes", {}).values()):
            proc.kill()
        pool.shutdown(wait=True, cancel_futures=True)

    def close(self) -> None:
        """Stops worker processes (process isolation); safe to call more than once."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def combine(functions: Sequence, default_score: float = 0.0, timeout_s: float | None = None,
            isolation: str = "thread", should_abort: Callable[[], bool] | None = None
            ) -> CombinedReward:
    """Combines reward functions with weights.

    ``functions``: entries ``(name_or_fn, weight)`` or ``(name, weight, kwargs)`` where ``kwargs``
    go to ``rewards.get(name, **kwargs)``. See the module docstring for ``timeout_s``,
    ``isolation`` and ``should_abort``.
    """
    return CombinedReward(functions, default_score=default_score, timeout_s=timeout_s,
                          isolation=isolation, should_abort=should_abort)
