"""The controller's loop and the hooks around it (in the manner of Levanter's ``TrainerHooks``).

``run_phases(run, hooks)`` runs every phase's iterations from where the run stands; after each
iteration it calls each hook's ``after_step(run, info)`` in order:

  NoSignal     says once when every group's completions got the same reward for a while
  Guard        counts skipped (non-finite) updates and stops a run that keeps skipping
  LogMetrics   writes the step's metrics every ``logging.log_every`` steps and at a phase's end
  Checkpoint   saves every ``checkpoint_every`` steps and at a phase's end, before the eval
  Evaluate     evaluates every ``eval_every`` steps and at a phase's end
  StopRequest  a SIGTERM / SIGINT ends the run after the step (saved when configured)

A hook returns True to end the run there (it has saved what it needs). ``Run`` holds what the
hooks share: the position, the train state, the checkpoint manager, the metrics writer.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import sys
import threading
import time
from typing import Any, Callable, Protocol

import jax

from rljax.errors import TrainingDiverged
from rljax.train.core import evaluate as eval_lib
from rljax.train.core.learning_signal import NoSignalHint
from rljax.train.core.state import for_checkpoint, nonfinite_fields

ANNOUNCE_AFTER_S = 3.0  # start-up work that takes longer says what it is doing


@dataclasses.dataclass
class Run:
    """What the loop and its hooks share. ``index``/``start``: the next iteration to run is
    ``start`` of phase ``index``; ``gstep``: global steps done (over all phases)."""
    cfg: Any
    ctx: Any
    phases: list
    offsets: list[int]
    ckpt: Any                   # CheckpointManager
    writer: Any                 # MetricsWriter
    guard: Any                  # NonFiniteGuard
    stop: Any                   # StopSignal
    evaluate_fn: Callable       # (params, rng, stop) -> eval metrics, or None if stopped
    eval_size: int = 0          # held-out examples (for the first eval's announcement)
    state: Any = None
    index: int = 0
    start: int = 0
    gstep: int = 0
    evals_run: list = dataclasses.field(default_factory=list)

    def save(self, phase_step: int, wait: bool = False, eval_pending: bool = False) -> None:
        """Checkpoints the state after ``phase_step`` iterations of the current phase."""
        bad = nonfinite_fields(self.state)
        if bad:  # never rotate good checkpoints out for a NaN one
            raise TrainingDiverged(
                f"{' and '.join(bad)} became non-finite (NaN/inf) by step {self.gstep}: not "
                f"saving checkpoint {self.gstep}; the last good one is "
                f"{self.ckpt.latest_step()} in {self.ckpt.directory}. Lower "
                f"{self.guard.learning_rate_key} (or check optimizer.max_grad_norm, the data "
                "and the rewards), then resume")
        phase = self.phases[self.index]
        meta = {"phase": self.index, "phase_name": phase.name, "phase_step": phase_step,
                "phase_state": phase.state_dict(), "guard": self.guard.state_dict(),
                "eval_pending": eval_pending}
        self.ckpt.save(self.gstep, for_checkpoint(self.state), meta, wait=wait)  # LoRA: adapters

    def evaluate(self, step: int) -> bool:
        """Evaluates at global ``step``; False if a stop request interrupted it (nothing
        written)."""
        rng = jax.random.fold_in(jax.random.fold_in(self.state.rng, eval_lib.EVAL_STREAM),
                                 step)
        phase = self.phases[self.index]
        own = hasattr(phase, "evaluate")   # a phase with its own held-out metrics (dpo, rm)
        if jax.process_index() == 0:   # an eval may take a while: never a silent console
            first = "" if self.evals_run or own else " (the first compiles the sampler)"
            size = "" if own else f" on {self.eval_size} held-out examples"
            print(f"rljax: evaluating step {step}{size}{first} ...", file=sys.stderr,
                  flush=True)
        self.evals_run.append(step)
        if own:
            self.writer.write(step, phase.evaluate(self.state, rng))
            return True
        metrics = self.evaluate_fn(self.state.params, rng, self.stop)
        if metrics is None:
            return False
        self.writer.write(step, metrics)
        return True

    def eval_due(self, last: bool) -> bool:
        return eval_due(self.cfg, self.gstep, last)

    def stopped(self) -> int:
        print(f"rljax: stopped by {self.stop.reason} at step {self.gstep}; checkpoint in "
              f"{self.ckpt.directory}", file=sys.stderr, flush=True)
        return self.stop.exit_code


def eval_due(cfg, gstep: int, last: bool) -> bool:
    """Whether an evaluation follows global step ``gstep`` (``last``: a phase's last step)."""
    return last or bool(cfg.eval_every and gstep % cfg.eval_every == 0)


def eval_schedule(cfg, phases, offsets) -> list[int]:
    """The global steps an evaluation follows, over all phases (for the ETA)."""
    return [offset + s for phase, offset in zip(phases, offsets)
            for s in range(1, phase.steps + 1)
            if eval_due(cfg, offset + s, s == phase.steps)]


@dataclasses.dataclass
class StepInfo:
    """One finished iteration: step ``step`` (1-based) of the current phase."""
    step: int
    last: bool
    metrics: dict


class Hook(Protocol):
    def after_step(self, run: Run, info: StepInfo) -> bool:
        """Runs after each iteration; True ends the run (the hook saved what it needs)."""


class NoSignal:
    def __init__(self, cfg):
        self.hint = NoSignalHint(cfg.rollout.temperature, cfg.algo.num_generations,
                                 enabled=jax.process_index() == 0)

    def after_step(self, run: Run, info: StepInfo) -> bool:
        self.hint.observe(run.gstep, info.metrics)  # all groups equal for a while: say so, once
        return False


class Guard:
    def after_step(self, run: Run, info: StepInfo) -> bool:
        run.guard.update(info.metrics.get("skipped", 0) > 0, run.gstep)
        info.metrics["train/skipped_total"] = run.guard.total
        return False


class LogMetrics:
    def after_step(self, run: Run, info: StepInfo) -> bool:
        if run.gstep % run.cfg.logging.log_every == 0 or info.last:
            run.writer.write(run.gstep, info.metrics)
        return False


class Checkpoint:
    """The checkpoint comes before the (possibly long) eval: a stop during the eval loses no
    trained step; the eval it owes is redone on resume."""

    def after_step(self, run: Run, info: StepInfo) -> bool:
        every = run.cfg.checkpoint_every
        if info.last or (every and run.gstep % every == 0):
            run.save(info.step, eval_pending=run.eval_due(info.last))
        return False


class Evaluate:
    def after_step(self, run: Run, info: StepInfo) -> bool:
        if not run.eval_due(info.last) or run.evaluate(run.gstep):
            return False
        if run.cfg.checkpoint.save_on_stop:  # stopped during the eval: it is owed on resume
            run.save(info.step, wait=True, eval_pending=True)
        return True


class StopRequest:
    def after_step(self, run: Run, info: StepInfo) -> bool:
        if not run.stop.should_stop(sync=True):
            return False
        if run.cfg.checkpoint.save_on_stop:
            run.save(info.step, wait=True)
        return True


def default_hooks(cfg) -> list:
    """The controller's hooks, in the order they run after each iteration."""
    return [NoSignal(cfg), Guard(), LogMetrics(), Checkpoint(), Evaluate(), StopRequest()]


def run_phases(run: Run, hooks: list, start_phase: Callable, initial_state: Callable,
               eval_pending: bool, cache_note: str = "") -> int | None:
    """Runs the phases from ``run``'s position to the end; returns an exit code if a hook (or
    a stop during an owed eval) ended the run, else None. ``start_phase(phase, state)``: the
    phase's starting state; ``initial_state()``: the state before the first phase."""
    cfg = run.cfg
    if eval_pending and not run.evaluate(run.gstep):
        return run.stopped()
    for run.index in range(run.index, len(run.phases)):
        phase = run.phases[run.index]
        run.guard.learning_rate_key = getattr(phase, "learning_rate_key",
                                              "optimizer.learning_rate")
        if run.state is None or run.start == 0:
            run.state = start_phase(phase, run.state if run.state is not None
                                    else initial_state())
        if run.gstep == 0 and run.start == 0 and cfg.eval_at_start and not run.evaluate(0):
            return run.stopped()  # eval of the starting policy, before any update
        for step in range(run.start, phase.steps):
            with (announced_if_slow(f"compiling the {phase.name} iteration{cache_note}")
                  if step == run.start else contextlib.nullcontext()):  # the first compiles
                run.state, metrics = phase.iteration(run.state, step)
            run.gstep = run.offsets[run.index] + step + 1
            info = StepInfo(step=step + 1, last=step + 1 == phase.steps, metrics=metrics)
            if any(hook.after_step(run, info) for hook in hooks):
                return run.stopped()
        run.start = 0
    return None


@contextlib.contextmanager
def announced_if_slow(what: str, after_s: float | None = None, stream=None):
    """Prints ``rljax: WHAT ...`` on stderr (process 0) once the block has run ``after_s``
    seconds (``ANNOUNCE_AFTER_S``), and then ``rljax: WHAT: done in N s`` when it ends: a
    model that loads for a minute, or a first iteration that compiles for one, is not a
    silent console; quick blocks (and refusals, which stay one line) print nothing."""
    if jax.process_index() != 0:
        yield
        return
    stream = stream or sys.stderr
    t0, said = time.perf_counter(), threading.Event()

    def announce():
        said.set()
        print(f"rljax: {what} ...", file=stream, flush=True)

    timer = threading.Timer(ANNOUNCE_AFTER_S if after_s is None else after_s, announce)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()  # an announcement being printed now finishes first
    if said.is_set():  # (not after a failure: its own message says what happened)
        print(f"rljax: {what}: done in {time.perf_counter() - t0:.0f} s", file=stream,
              flush=True)


@contextlib.contextmanager
def setup_objects_frozen():
    """Moves every object that exists now (modules, tokenizer, data, config, model state) out
    of the cyclic garbage collector's view until the block ends (``gc.freeze``).

    They live for the whole run, and tracing the first iteration's programs allocates enough
    to set off full collections, each of which rescanned them all: ~0.2 s per collection over
    ~520k objects at the toy GRPO benchmark (``bench/RESULTS.md``). Reference
    counting still frees frozen objects; on exit they are handed back to the collector."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
