"""From a config (and a checkpoint) to a train state: the phases' state shapes, restoring a
checkpoint into them, and loading a run's parameters for inference.

Below both the controller (``run.train``) and the inference verbs (``run.evaluate | sample |
export``); above the phases, whose ``init_state`` defines what a checkpoint of each holds.
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from rljax import compilation_cache
from rljax import config as config_lib
from rljax.errors import RljaxError, UserError
from rljax.train.core.checkpoint import CheckpointDamaged, CheckpointManager, checkpoint_dir
from rljax.train.phases import make_phases
from rljax.train.core.setup import Context, Phase, build_context, check_inputs
from rljax.train.core.state import (TrainState, abstract_train_state, for_checkpoint,
                                from_checkpoint)


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
    """(state, meta, global step) of checkpoint ``step`` (default: latest).

    Checks the step's files against the manifest written at commit first; raises
    :class:`CheckpointDamaged` (one line: step, file, problem) on a mismatch or read failure."""
    step = ckpt.latest_step() if step is None else int(step)
    if step is not None:
        problem = ckpt.verify(step)
        if problem is not None:
            raise CheckpointDamaged(step, problem)
    meta = ckpt.restore_meta(step)
    index = int(meta["phase"])
    if index >= len(phases) or phases[index].name != meta["phase_name"]:
        raise UserError(f"checkpoint was written in phase {meta['phase_name']!r}, which this "
                        f"config does not have (phases: {[p.name for p in phases]})")
    try:
        # With LoRA a checkpoint holds the adapters only; the frozen base is ctx.params.
        restored = ckpt.restore(step, for_checkpoint(abstract_state(ctx, phases, index)))
    except (ValueError, TypeError, KeyError) as e:  # orbax: the tree or a shape differs
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise UserError(f"checkpoint {ckpt.latest_step() if step is None else step} does not "
                        f"fit this config (the state's structure or shapes differ, e.g. "
                        f"algo.beta switching the reference model on/off): {first}") from None
    return from_checkpoint(restored.state, initial_state(ctx)), meta, restored.step


def restore_for_training(ctx: Context, phases: list[Phase], ckpt: CheckpointManager,
                         step: int | None = None, *, fallback: bool = True):
    """``restore`` for ``rljax train``: the newest readable checkpoint (or ``step``).

    A damaged checkpoint (manifest mismatch, read failure) is reported in one line; with
    ``fallback`` it is moved aside to ``<step>.damaged`` and the next older one is tried, with a
    loud warning. Without ``fallback``, or for an explicit ``step``, the damage is raised
    (exit 1). Returns None when there is no checkpoint at all.
    """
    candidates = [int(step)] if step is not None else ckpt.all_steps()[::-1]
    damaged = []
    for s in candidates:
        try:
            return restore(ctx, phases, ckpt, s)
        except CheckpointDamaged as e:
            _say(str(e))
            if step is not None or not fallback:
                hint = ("" if step is not None else "; checkpoint.fallback_on_damage=False, so "
                        "not falling back (use --checkpoint STEP to pick an older one)")
                raise CheckpointDamaged(e.step, e.problem + hint) from None
            moved = ckpt.move_aside(s)
            damaged.append(s)
            older = [t for t in ckpt.all_steps() if t < s]
            _say(f"WARNING: moved damaged checkpoint {s} aside to {moved}; "
                 + (f"falling back to checkpoint {older[-1]}" if older else
                    "no older checkpoint is left"))
    if damaged:
        raise RljaxError(f"no readable checkpoint in {ckpt.directory} (damaged, moved aside: "
                         f"{damaged}); running again starts from scratch")
    return None


def _say(message: str) -> None:
    if jax.process_index() == 0:
        print(f"rljax: {message}", file=sys.stderr, flush=True)


def phase_offsets(phases: list[Phase]) -> list[int]:
    offsets, total = [], 0
    for p in phases:
        offsets.append(total)
        total += p.steps
    return offsets


def load_for_inference(cfg, workdir: str, checkpoint: str | None = None, devices=None):
    """(ctx, state, step) with the params of checkpoint ``checkpoint`` (default latest)."""
    config_lib.validate(cfg)
    compilation_cache.from_config(cfg)
    # A distilled student is evaluated, sampled and exported without its teacher.
    check_inputs(cfg, len(devices) if devices is not None else None, teacher=False)
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


def prm_best_of_n(cfg, workdir: str, prm_workdir: str, n: int, mode: str | None = None,
                  checkpoint: str | None = None, devices=None, beams: int = 0) -> dict:
    """``rljax eval --prm DIR``: best-of-``n`` on the run's held-out problems, the policy of
    ``workdir`` sampling and the process reward model of the run in ``prm_workdir`` picking
    (each sample's ``mode`` step score: the PRM run's ``algo.prm.step_score`` by default).
    Returns ``eval/best_of_n/*`` metrics: accuracy of the picked sample, sample_accuracy (of
    all samples: a random pick), pass@n (an oracle pick), auroc and pair_accuracy of the
    scores against correctness (``methods.prm_rerank.best_of_n``). ``beams`` > 0: step-level
    beam search instead (``beams`` prefixes kept, ``n`` continuations of each per step):
    ``eval/beam/accuracy`` of the solutions it chooses."""
    from rljax.models import lora as lora_lib
    from rljax.train.core import evaluate as eval_lib
    from rljax.train.core import workdir as wd
    from rljax.train.methods import prm_rerank

    prm_cfg = wd.load_workdir_config(prm_workdir)
    if prm_cfg.algo.name != "prm":
        raise UserError(f"--prm {prm_workdir}: its run trains algo.name="
                        f"{prm_cfg.algo.name!r}, not a process reward model ('prm')")
    if n < 1 or beams < 0:
        raise UserError(f"--best-of {n} --prm-beam {beams}: needs at least one sample per "
                        "problem (or step) and no negative beam width")
    ctx, state, step = load_for_inference(cfg, workdir, checkpoint, devices)
    prm_ctx, prm_state, _ = load_for_inference(prm_cfg, prm_workdir, None, devices)
    if prm_state.critic_params is None:
        raise UserError(f"--prm {prm_workdir}: its latest checkpoint is from the SFT warm-up, "
                        "before the PRM was trained")
    if prm_ctx.model_cfg.vocab_size != ctx.model_cfg.vocab_size:
        raise UserError(f"--prm {prm_workdir}: its vocabulary ({prm_ctx.model_cfg.vocab_size}) "
                        f"is not the policy's ({ctx.model_cfg.vocab_size})")
    value = lora_lib.value_on_base(prm_state.params, prm_state.critic_params)
    scorer = (prm_rerank.value_logits_fn(prm_ctx.model_cfg, value),
              mode or prm_cfg.algo.prm.step_score)
    rng = jax.random.fold_in(jax.random.fold_in(state.rng, eval_lib.EVAL_STREAM), step)
    e = cfg.eval
    if beams > 0:
        out = prm_rerank.beam_search_accuracy(
            ctx, state.params, scorer, eval_lib.eval_examples(ctx), rng, beams=beams, expand=n,
            temperature=e.temperature or 1.0, prompts_per_batch=max(1, e.batch_size // beams))
        return {"step": step, "eval/beam/accuracy": out["accuracy"],
                "eval/beam/num_examples": out["num_examples"]}
    out = prm_rerank.best_of_n(ctx, state.params, {"prm": scorer}, eval_lib.eval_examples(ctx),
                               rng, n=n, temperature=e.temperature or 1.0,
                               prompts_per_batch=max(1, e.batch_size // n))
    return {"step": step, "eval/best_of_n/accuracy": out["prm"]["accuracy"],
            "eval/best_of_n/sample_accuracy": out["accuracy"],
            f"eval/best_of_n/pass@{n}": out["pass@n"],
            "eval/best_of_n/auroc": out["prm"]["auroc"],
            "eval/best_of_n/pair_accuracy": out["prm"]["pair_accuracy"],
            "eval/best_of_n/num_examples": out["num_examples"]}
