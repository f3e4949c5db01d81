"""The single controller: ``rljax train | eval | sample | export``.

    train(cfg, workdir)

reads top to bottom: check inputs (before anything compiles), build mesh / tokenizer / model,
restore the latest checkpoint if there is one, then run the phases: the SFT warm-up
(``sft.steps``), then ``steps`` iterations of ``algo.name``. Every iteration is
``rollout -> reward -> advantage -> update`` inside the phase, then ``log -> eval -> checkpoint``
here. SIGTERM / SIGINT finish the current iteration, save, and return (0 / 130).

Algorithms plug in through ``ALGORITHMS``: ``name -> factory(ctx, steps) -> Phase`` (see
``setup.Phase``). Global step numbers (metrics, checkpoints) count iterations over all phases:
the warm-up's ``1..sft.steps``, then the RL iterations.
"""
from __future__ import annotations

import os
import shutil
import sys
from typing import Callable

import jax
import jax.numpy as jnp

from rljax import config as config_lib
from rljax import distributed, models, sampling, tokenizers
from rljax import plan as plan_lib
from rljax.errors import UserError
from rljax.train import evaluate as eval_lib
from rljax.train import paths
from rljax.train.checkpoint import CheckpointManager, checkpoint_dir
from rljax.train.faults import StopSignal
from rljax.train.dpo import DPOPhase
from rljax.train.grpo import GRPOPhase
from rljax.train.metrics import MetricsWriter
from rljax.train.optim import NonFiniteGuard
from rljax.train.ppo import PPOPhase
from rljax.train.rm import RMPhase
from rljax.train.setup import Context, Phase, build_context, check_inputs
from rljax.train.sft import SFTPhase
from rljax.train.state import TrainState, abstract_train_state

evaluate = eval_lib.evaluate  # `rljax eval`

# algo.name -> factory(ctx, steps) -> Phase. Other algorithm files register themselves here.
ALGORITHMS: dict[str, Callable[[Context, int], Phase]] = {
    "grpo": GRPOPhase,
    "ppo": PPOPhase,
    "dpo": DPOPhase,
    "rm": RMPhase,
    "sft": lambda ctx, steps: SFTPhase(ctx, steps, ctx.cfg.optimizer.learning_rate),
}


def register_algorithm(name: str, factory: Callable[[Context, int], Phase]) -> None:
    """Makes ``algo.name=name`` run ``factory(ctx, steps)``."""
    ALGORITHMS[name] = factory


def make_phases(ctx: Context) -> list[Phase]:
    """The run's phases in order: optional SFT warm-up, then the main algorithm."""
    cfg = ctx.cfg
    if cfg.algo.name not in ALGORITHMS:
        raise UserError(f"algo.name={cfg.algo.name!r} is not available in this version "
                        f"(available: {', '.join(sorted(ALGORITHMS))})")
    phases: list[Phase] = []
    if cfg.sft.steps:
        phases.append(SFTPhase(ctx, cfg.sft.steps, cfg.sft.learning_rate, name="sft_warmup"))
    phases.append(ALGORITHMS[cfg.algo.name](ctx, cfg.steps))
    return phases


def initial_state(ctx: Context) -> TrainState:
    """Step 0, the built/loaded params, no optimizer yet (each phase makes its own)."""
    return TrainState(step=jnp.zeros((), jnp.int32), params=ctx.params, opt_state=None,
                      rng=jax.random.PRNGKey(ctx.cfg.seed))


def start_phase(ctx: Context, phase: Phase, state: TrainState) -> TrainState:
    """``phase.init_state`` compiled with the phase's state shardings."""
    shardings = ctx.state_shardings(jax.eval_shape(phase.init_state, state))
    return jax.jit(phase.init_state, out_shardings=shardings)(state)


def abstract_state(ctx: Context, phases: list[Phase], index: int):
    """Shapes + shardings of the state during phase ``index`` (checkpoint restore target)."""
    shape = jax.eval_shape(phases[index].init_state, initial_state(ctx))
    return abstract_train_state(shape, ctx.state_shardings(shape))


def restore(ctx: Context, phases: list[Phase], ckpt: CheckpointManager, step: int | None = None):
    """(state, meta, global step) of checkpoint ``step`` (default: latest)."""
    meta = ckpt.restore_meta(step)
    index = int(meta["phase"])
    if index >= len(phases) or phases[index].name != meta["phase_name"]:
        raise UserError(f"checkpoint was written in phase {meta['phase_name']!r}, which this "
                        f"config does not have (phases: {[p.name for p in phases]})")
    restored = ckpt.restore(step, abstract_state(ctx, phases, index))
    return restored.state, meta, restored.step


def phase_offsets(phases: list[Phase]) -> list[int]:
    offsets, total = [], 0
    for p in phases:
        offsets.append(total)
        total += p.steps
    return offsets


# ----------------------------------------------------------------------------- train

def train(cfg, workdir: str, *, devices=None, stop: StopSignal | None = None) -> int:
    """``rljax train``: runs (or resumes) the run in ``workdir``; returns the exit code."""
    distributed.initialize()  # multi-host (SPMD): the same loop on every host
    config_lib.validate(cfg)
    check_inputs(cfg, len(devices) if devices is not None else None)
    plan_lib.check(cfg, devices)  # stop before allocating anything if it cannot fit
    paths.makedirs(workdir)  # a local directory or a URL (gs://...)
    paths.write_text_atomic(paths.join(workdir, "config.json"), config_lib.to_json(cfg) + "\n")
    ctx = build_context(cfg, workdir, devices)
    phases = make_phases(ctx)
    offsets = phase_offsets(phases)
    total = offsets[-1] + phases[-1].steps
    guard = NonFiniteGuard(cfg.optimizer.max_consecutive_nonfinite)
    stop = stop or StopSignal()
    ckpt = CheckpointManager(checkpoint_dir(workdir), max_to_keep=cfg.checkpoint.max_to_keep,
                             async_save=cfg.checkpoint.async_save)
    # Position: the next iteration to run is `start` of phase `index`.
    index, start, gstep, state = 0, 0, 0, None
    if ckpt.latest_step() is not None:
        state, meta, gstep = restore(ctx, phases, ckpt)
        index, start = int(meta["phase"]), int(meta["phase_step"])
        phases[index].load_state_dict(meta["phase_state"])
        guard.load_state_dict(meta["guard"])
        print(f"rljax: resumed at step {gstep} ({phases[index].name} {start}/"
              f"{phases[index].steps})", file=sys.stderr, flush=True)

    def save(phase_index: int, phase_step: int, step: int, wait: bool = False):
        meta = {"phase": phase_index, "phase_name": phases[phase_index].name,
                "phase_step": phase_step, "phase_state": phases[phase_index].state_dict(),
                "guard": guard.state_dict()}
        ckpt.save(step, state, meta, wait=wait)

    def run_eval(step: int) -> None:
        rng = jax.random.fold_in(jax.random.fold_in(state.rng, eval_lib.EVAL_STREAM), step)
        if hasattr(phases[index], "evaluate"):  # a phase with its own held-out metrics (dpo, rm)
            writer.write(step, phases[index].evaluate(state, rng))
        else:
            writer.write(step, eval_lib.run_eval(ctx, state.params, rng, examples))

    examples = (eval_lib.eval_examples(ctx)
                if any(not hasattr(p, "evaluate") for p in phases) else None)
    writer = MetricsWriter(workdir, total_steps=total, console_every_s=cfg.logging.console_every_s,
                           tensorboard=cfg.logging.tensorboard,
                           resume_step=gstep if state is not None else None)
    try:
        with stop:
            for index in range(index, len(phases)):
                phase = phases[index]
                if state is None or start == 0:
                    state = start_phase(ctx, phase, state if state is not None
                                        else initial_state(ctx))
                for step in range(start, phase.steps):
                    state, metrics = phase.iteration(state, step)
                    gstep = offsets[index] + step + 1
                    last = step + 1 == phase.steps
                    guard.update(metrics.get("skipped", 0) > 0, gstep)
                    metrics["train/skipped_total"] = guard.total
                    if gstep % cfg.logging.log_every == 0 or last:
                        writer.write(gstep, metrics)
                    if last or (cfg.eval_every and gstep % cfg.eval_every == 0):
                        run_eval(gstep)  # always after the warm-up and at the end
                    if last or (cfg.checkpoint_every and gstep % cfg.checkpoint_every == 0):
                        save(index, step + 1, gstep)
                    if stop.should_stop(sync=True):
                        if cfg.checkpoint.save_on_stop:
                            save(index, step + 1, gstep, wait=True)
                        print(f"rljax: stopped by {stop.reason} at step {gstep}; "
                              f"checkpoint in {ckpt.directory}", file=sys.stderr, flush=True)
                        return stop.exit_code
                start = 0
    finally:
        writer.close()
        ckpt.close()
    return 0


# ----------------------------------------------------------------------------- inference

def load_for_inference(cfg, workdir: str, checkpoint: str | None = None, devices=None):
    """(ctx, state, step) with the params of checkpoint ``checkpoint`` (default latest)."""
    config_lib.validate(cfg)
    check_inputs(cfg, len(devices) if devices is not None else None)
    ctx = build_context(cfg, workdir, devices)
    phases = make_phases(ctx)
    with CheckpointManager(checkpoint_dir(workdir), max_to_keep=cfg.checkpoint.max_to_keep,
                           async_save=False) as ckpt:
        if ckpt.latest_step() is None:
            raise UserError(f"{workdir} has no checkpoint")
        step = None
        if checkpoint is not None:
            if not str(checkpoint).isdigit() or int(checkpoint) not in ckpt.all_steps():
                raise UserError(f"checkpoint {checkpoint!r} not found; saved steps: "
                                f"{ckpt.all_steps()}")
            step = int(checkpoint)
        state, _, step = restore(ctx, phases, ckpt, step)
    return ctx, state, step


def sample(cfg, workdir: str | None, prompts: list[str], checkpoint: str | None = None,
           devices=None) -> int:
    """``rljax sample``: completions of ``prompts`` (eval temperature; greedy by default)."""
    if checkpoint and os.path.isfile(os.path.join(checkpoint, "config.json")):
        model_cfg, params = models.load_hf(checkpoint)
        tok = tokenizers.load(checkpoint)
    else:
        if not workdir:
            raise UserError("sample needs --workdir (or --checkpoint HF_DIR)")
        ctx, state, _ = load_for_inference(cfg, workdir, checkpoint, devices)
        model_cfg, params, tok = ctx.model_cfg, state.params, ctx.tokenizer
    p_tok, p_mask = sampling.pad_to_bucket([tok.encode(p) for p in prompts], pad_id=tok.pad_id)
    out = sampling.generate(model_cfg, params, p_tok, p_mask, rng=jax.random.PRNGKey(cfg.seed),
                            max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens,
                            temperature=cfg.eval.temperature, eos_id=tok.eos_id,
                            pad_id=tok.pad_id)
    for prompt, text in zip(prompts, tok.batch_decode(jax.device_get(out.tokens),
                                                       jax.device_get(out.mask))):
        print(f"{prompt}{text}", flush=True)
    return 0


def export(cfg, workdir: str, out: str, checkpoint: str | None = None, devices=None) -> int:
    """``rljax export``: the checkpoint's policy as HF safetensors + config.json in ``out``."""
    ctx, state, step = load_for_inference(cfg, workdir, checkpoint, devices)
    models.save_hf(ctx.model_cfg, state.params, out)
    char_file = paths.join(workdir, tokenizers.CHAR_TOKENIZER_FILE)
    if paths.isfile(char_file):  # the workdir may be a URL; `out` is a local directory
        if paths.is_url(char_file):
            with open(os.path.join(out, tokenizers.CHAR_TOKENIZER_FILE), "wb") as f:
                f.write(paths.as_path(char_file).read_bytes())
        else:
            shutil.copy(char_file, out)
    print(f"rljax: exported step {step} to {out}", file=sys.stderr, flush=True)
    return 0
