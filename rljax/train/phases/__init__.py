"""Algorithms as phases: each module here is one way to spend training iterations.

    sft   SFTPhase   supervised fine-tuning (also the RL warm-up)
    grpo  GRPOPhase  the GRPO family (Dr. GRPO, DAPO, GSPO, CISPO, RLOO, REINFORCE++);
                     AsyncGRPOPhase with algo.asynchronous (batches sampled ahead)
    distill DistillPhase  on-policy distillation from a frozen teacher (GRPO's update)
    ppo   PPOPhase   PPO with a critic and GAE
    dpo   DPOPhase   offline and online (iterative) DPO and its variants; AsyncDPOPhase
                     with algo.asynchronous (online groups or step pairs sampled ahead)
    rm    RMPhase    Bradley-Terry reward model
    prm   PRMPhase   process reward model (per-step labels at step-end tokens)

A phase is ``factory(ctx, steps) -> Phase`` (the protocol is ``rljax.train.core.setup.Phase``); it
builds on the machinery one level up (``rljax.train``: state, steps, rollout, evaluate, ...) and
never imports the controller. ``ALGORITHMS`` maps ``algo.name`` to a factory;
``register_algorithm`` adds one from outside the package. ``PROGRAMS`` maps it to the phase's
``programs(ctx, steps) -> (abstract state, [Program])``: the jitted programs its iterations run,
with abstract inputs (``rljax.train.core.programs``), which ``rljax plan`` compiles.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax
import jax.numpy as jnp

from rljax import sharding as shd

from rljax.errors import UserError
from rljax.train.phases.async_grpo import AsyncGRPOPhase, AsyncSchedule
from rljax.train.phases.distill import DistillPhase
from rljax.train.phases.dpo import DPOPhase
from rljax.train.phases.grpo import GRPOPhase
from rljax.train.phases.ppo import PPOPhase
from rljax.train.phases.prm import PRMPhase
from rljax.train.phases.rm import RMPhase
from rljax.train.phases.sft import SFTPhase
from rljax.train.core.setup import Context, Phase
from rljax.train.methods import mcts_programs, prm_refit, prm_scoring


class AsyncPPOPhase(AsyncSchedule, PPOPhase):
    """PPO on batches sampled ``algo.async_lag`` versions earlier: values, GAE and the
    proximal log-probs are computed at update time (``prepare``), and the loss weighs each
    token by its behaviour ratio (``algo.tis_cap``, uncapped by default)."""


class AsyncDistillPhase(AsyncGRPOPhase, DistillPhase):
    """Distillation on batches sampled ``algo.async_lag`` versions earlier: the teacher
    scores each batch where it is sampled; the update is distillation's."""


class AsyncDPOPhase(AsyncSchedule, DPOPhase):
    """Online DPO on groups sampled ``algo.async_lag`` versions earlier: best-worst pairs
    of each batch as it trains (DPO's loss reads no behaviour policy: stale pairs are pairs);
    with step-level pairs (``data.pairs='step_mc'``) the sampler builds whole pair batches
    ahead, its step values those of the version that sampled them.

    With ``algo.mcts.refit_prm`` the sampler's search reads its own copy of the PRM, published
    with the policy (version k: the PRM after the refits of updates 0 .. k-1), and each batch
    carries its trees' refit rows (``prm_refit.with_refit_rows``: in flight and in
    checkpoints), on which the PRM is refitted when the batch trains, before its updates."""

    def __init__(self, ctx, steps: int):
        super().__init__(ctx, steps)
        if self.refit is not None:   # the search scores on the sampler's mesh
            prompts = ctx.cfg.rollout.batch_size // self.g
            self.rollout.refit_scorer = prm_scoring.PRMScorer(
                self.sampler_ctx, mcts_programs.scorer_rows(self.sampler_ctx, prompts))

    def publish(self, state, version: int) -> float:
        seconds = super().publish(state, version)
        if self.refit is None:
            return seconds
        t0, critic = time.perf_counter(), state.critic_params
        if self.ctx.rollout_shardings is not None:
            critic = shd.transfer(critic, prm_scoring.value_shardings(self.sampler_ctx, critic))
        else:   # one mesh: a copy, since the update donates (deletes) the state's arrays
            critic = jax.tree.map(jnp.copy, critic)
        self.sampler_critic = jax.block_until_ready(critic)
        return seconds + time.perf_counter() - t0

    def sample(self, step: int) -> None:
        super().sample(step)
        if self.refit is not None:   # the refit rows of the trees that sampled the batch
            batch, metrics, version = self.inflight[step]
            self.inflight[step] = (prm_refit.with_refit_rows(
                batch, *self.refit.rows(self.rollout.last)), metrics, version)


def dpo_phase(ctx: Context, steps: int) -> Phase:
    """The DPO phase: online with groups sampled asynchronously (``algo.asynchronous``) or
    not."""
    if ctx.cfg.algo.get("asynchronous", False):
        return AsyncDPOPhase(ctx, steps)
    return DPOPhase(ctx, steps)


def grpo_phase(ctx: Context, steps: int) -> Phase:
    """The GRPO phase: asynchronous (``algo.asynchronous``) or not."""
    if ctx.cfg.algo.get("asynchronous", False):
        return AsyncGRPOPhase(ctx, steps)
    return GRPOPhase(ctx, steps)


def ppo_phase(ctx: Context, steps: int) -> Phase:
    """The PPO phase: asynchronous (``algo.asynchronous``) or not."""
    if ctx.cfg.algo.get("asynchronous", False):
        return AsyncPPOPhase(ctx, steps)
    return PPOPhase(ctx, steps)


def distill_phase(ctx: Context, steps: int) -> Phase:
    """The distillation phase: asynchronous (``algo.asynchronous``) or not."""
    if ctx.cfg.algo.get("asynchronous", False):
        return AsyncDistillPhase(ctx, steps)
    return DistillPhase(ctx, steps)


# algo.name -> factory(ctx, steps) -> Phase.
ALGORITHMS: dict[str, Callable[[Context, int], Phase]] = {
    "grpo": grpo_phase,
    "distill": distill_phase,
    "ppo": ppo_phase,
    "dpo": dpo_phase,
    "rm": RMPhase,
    "prm": PRMPhase,
    "sft": lambda ctx, steps: SFTPhase(ctx, steps, ctx.cfg.optimizer.learning_rate),
}


# algo.name -> programs(ctx, steps) -> (abstract state, [programs.Program]).
PROGRAMS: dict[str, Callable] = {
    "grpo": GRPOPhase.programs,
    "distill": DistillPhase.programs,
    "ppo": PPOPhase.programs,
    "dpo": DPOPhase.programs,
    "rm": RMPhase.programs,
    "prm": PRMPhase.programs,
    "sft": lambda ctx, steps: SFTPhase.programs(ctx, steps, ctx.cfg.optimizer.learning_rate,
                                                main=True),
}


def register_algorithm(name: str, factory: Callable[[Context, int], Phase],
                       programs: Callable | None = None) -> None:
    """Makes ``algo.name=name`` run ``factory(ctx, steps)``; ``programs(ctx, steps)``, when
    given, states its programs for ``rljax plan`` (else the plan notes it is not planned)."""
    ALGORITHMS[name] = factory
    if programs is not None:
        PROGRAMS[name] = programs
    else:
        PROGRAMS.pop(name, None)


def phase_programs(ctx: Context) -> list[tuple[str, object, list | None]]:
    """``[(phase name, abstract state or None, [Program] or None)]`` of the run's phases in
    order (``make_phases``): the SFT warm-up (its programs named ``sft_*``), then the main
    algorithm (None, None: registered without ``programs``). ``ctx.params`` may be abstract."""
    cfg = ctx.cfg
    out: list = []
    if cfg.sft.steps:
        state, progs = SFTPhase.programs(ctx, cfg.sft.steps, cfg.sft.learning_rate)
        out.append(("sft_warmup", state, [dataclasses.replace(p, name=f"sft_{p.name}")
                                          for p in progs]))
    name = cfg.algo.name
    if name in PROGRAMS:
        out.append((name, *PROGRAMS[name](ctx, cfg.steps)))
    else:
        out.append((name, None, None))
    return out


def make_phases(ctx: Context) -> list[Phase]:
    """The run's phases in order: optional SFT warm-up, then the main algorithm."""
    cfg = ctx.cfg
    if cfg.algo.name not in ALGORITHMS:
        raise UserError(f"algo.name={cfg.algo.name!r} is not available in this version "
                        f"(available: {', '.join(sorted(ALGORITHMS))})")
    phases: list[Phase] = []
    if cfg.sft.steps:
        warmup = SFTPhase(ctx, cfg.sft.steps, cfg.sft.learning_rate, name="sft_warmup")
        warmup.learning_rate_key = "sft.learning_rate"  # named in the non-finite stop message
        phases.append(warmup)
    phases.append(ALGORITHMS[cfg.algo.name](ctx, cfg.steps))
    return phases
