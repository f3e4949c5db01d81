"""Weighted composition of reward functions with error and timeout isolation.

``combine([("gsm8k", 1.0), ("format", 0.2)], default_score=0.0, timeout_s=10.0)`` returns a
callable; calling it on a batch gives a ``RewardResult`` with the weighted total, each function's
own scores (the trainer logs them separately) and the number of scores each function failed to
produce. A function that raises, returns the wrong number of scores or non-finite values, or does
not finish within ``timeout_s`` gets ``default_score`` for the whole batch and an error count;
the other functions and the batch go on.

How timeouts are enforced (``isolation``):

* ``"thread"`` (default): each call runs in a fresh daemon thread joined with a deadline. Works
  for any callable, including closures over device arrays (the reward-model scorer). A Python
  thread cannot be killed, so a truly hung function keeps running in the background (daemon, so
  it never blocks interpreter exit); ``leaked_threads`` counts them and a warning is logged.
* ``"process"``: calls run in a spawned worker process pool; on a timeout the workers are killed
  and a fresh pool is started for the next batch. Use it for verifiers that may hang for real
  (sympy, sandboxes). The functions must be picklable: built-in names, or module-level functions.
* ``timeout_s=None``: calls run directly on the calling thread (exceptions are still caught).
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import math
import multiprocessing
import threading
import time
from typing import Callable, Sequence

__all__ = ["RewardResult", "CombinedReward", "combine"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RewardResult:
    """Scores for one batch. ``errors[name]`` counts scores replaced by the default."""

    total: list[float]
    per_function: dict[str, list[float]]
    errors: dict[str, int]
    messages: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def num_errors(self) -> int:
        return sum(self.errors.values())

    def metrics(self, prefix: str = "reward") -> dict[str, float]:
        """Flat scalar metrics: ``reward/mean``, ``reward/<name>/mean``, ``reward/<name>/errors``."""
        mean = lambda xs: float(sum(xs) / len(xs)) if xs else 0.0  # noqa: E731
        out = {f"{prefix}/mean": mean(self.total), f"{prefix}/errors": float(self.num_errors)}
        for name, scores in self.per_function.items():
            out[f"{prefix}/{name}/mean"] = mean(scores)
            out[f"{prefix}/{name}/errors"] = float(self.errors[name])
        return out


def _call_in_child(fn, prompts, completions, fields):
    """Runs in a worker process: resolves a built-in name there (names pickle, closures don't)."""
    if isinstance(fn, tuple):
        from rljax import rewards

        name, kwargs = fn
        fn = rewards.get(name, **kwargs)
    return list(fn(prompts, completions, **fields))


def _ready() -> bool:
    """Warm-up task: a spawned worker has started and imported rljax.rewards."""
    import rljax.rewards  # noqa: F401

    return True


def _run_in_thread(fn: Callable, args: tuple, kwargs: dict, deadline: float):
    """Runs fn in a daemon thread; returns ("ok", value) / ("error", exc) / ("timeout", None)."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - any failure becomes a counted error
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True, name=f"reward-{getattr(fn, '__name__', 'fn')}")
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    if thread.is_alive():
        return "timeout", None
    return ("error", box["error"]) if "error" in box else ("ok", box["value"])


class CombinedReward:
    """Callable ``(prompts, completions, **fields) -> RewardResult``; see module docstring."""

    def __init__(self, functions: Sequence, default_score: float = 0.0,
                 timeout_s: float | None = None, isolation: str = "thread"):
        from rljax.rewards import get  # late import: rewards/__init__ imports this module

        if isolation not in ("thread", "process"):
            raise ValueError(f"isolation must be 'thread' or 'process', got {isolation!r}")
        if not functions:
            raise ValueError("combine needs at least one reward function")
        self.names, self.fns, self.weights, self._specs = [], [], [], []
        for entry in functions:
            fn_or_name, weight, kwargs = (tuple(entry) + ({},))[:3]
            if isinstance(fn_or_name, str):
                name, fn = fn_or_name, get(fn_or_name, **kwargs)
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
        self.leaked_threads = 0
        self.total_errors = {n: 0 for n in self.names}  # cumulative, for end-of-run summaries
        self._pool: cf.ProcessPoolExecutor | None = None

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
        per_fn, errors, messages = {}, {}, {}
        for name, (status, value) in zip(self.names, outcomes):
            scores, problem = self._validate(status, value, n)
            if problem:
                scores = [self.default_score] * n
                errors[name], messages[name] = n, problem
                self.total_errors[name] += n
                log.warning("reward %r failed on a batch of %d: %s", name, n, problem)
            else:
                errors[name] = 0
            per_fn[name] = scores
        total = [sum(w * per_fn[name][i] for name, w in zip(self.names, self.weights)) for i in range(n)]
        return RewardResult(total, per_fn, errors, messages)

    def _validate(self, status: str, value, n: int) -> tuple[list[float], str | None]:
        """Turns one call's outcome into scores, or a description of what went wrong."""
        if status == "timeout":
            return [], f"timed out after {self.timeout_s} s"
        if status == "error":
            return [], f"{type(value).__name__}: {value}"
        try:
            scores = [float(s) for s in value]
        except (TypeError, ValueError) as e:
            return [], f"returned non-numeric scores ({e})"
        if len(scores) != n:
            return [], f"returned {len(scores)} scores for {n} completions"
        if not all(math.isfinite(s) for s in scores):
            return [], "returned a non-finite score"
        return scores, None

    def _run_all(self, prompts, completions, fields) -> list[tuple[str, object]]:
        if self.timeout_s is None:
            return [self._direct(fn, prompts, completions, fields) for fn in self.fns]
        if self.isolation == "process":  # all run concurrently against one deadline
            return self._in_processes(prompts, completions, fields,
                                      time.monotonic() + float(self.timeout_s))
        outcomes = []
        for fn in self.fns:  # sequential: each gets its own full timeout, hung ones are abandoned
            outcome = _run_in_thread(fn, (prompts, completions), fields,
                                     time.monotonic() + float(self.timeout_s))
            if outcome[0] == "timeout":
                self.leaked_threads += 1
                log.warning("a reward function is still running after its timeout; it cannot be "
                            "killed in a thread (%d abandoned so far); consider isolation='process'",
                            self.leaked_threads)
            outcomes.append(outcome)
        return outcomes

    @staticmethod
    def _direct(fn, prompts, completions, fields):
        try:
            return "ok", fn(prompts, completions, **fields)
        except Exception as e:  # noqa: BLE001
            return "error", e

    def _in_processes(self, prompts, completions, fields, deadline) -> list[tuple[str, object]]:
        if self._pool is None:
            self._start_pool()
        futures = [self._pool.submit(_call_in_child, spec, prompts, completions, fields)
                   for spec in self._specs]
        outcomes, timed_out = [], False
        for fut in futures:
            try:
                outcomes.append(("ok", fut.result(timeout=max(0.0, deadline - time.monotonic()))))
            except cf.TimeoutError:
                outcomes.append(("timeout", None))
                timed_out = True
            except Exception as e:  # noqa: BLE001 - includes pickling errors and dead workers
                outcomes.append(("error", e))
        if timed_out:
            self._kill_pool()
        return outcomes

    def _start_pool(self, startup_s: float = 120.0) -> None:
        """Starts one spawned worker per function and waits for them, so that interpreter
        start-up is not charged to the first batch's timeout."""
        ctx = multiprocessing.get_context("spawn")  # fork is unsafe once jax threads exist
        self._pool = cf.ProcessPoolExecutor(max_workers=len(self.fns), mp_context=ctx)
        # Each submit with no idle worker spawns a process, so this starts all of them.
        for fut in [self._pool.submit(_ready) for _ in self.fns]:
            fut.result(timeout=startup_s)

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
            isolation: str = "thread") -> CombinedReward:
    """Combines reward functions with weights.

    ``functions``: entries ``(name_or_fn, weight)`` or ``(name, weight, kwargs)`` where ``kwargs``
    go to ``rewards.get(name, **kwargs)``. See the module docstring for ``timeout_s`` and
    ``isolation``.
    """
    return CombinedReward(functions, default_score=default_score, timeout_s=timeout_s,
                          isolation=isolation)
