"""Algorithms as phases: each module here is one way to spend training iterations.

    sft   SFTPhase   supervised fine-tuning (also the RL warm-up)
    grpo  GRPOPhase  the GRPO family (Dr. GRPO, DAPO, GSPO, CISPO, RLOO, REINFORCE++)
    ppo   PPOPhase   PPO with a critic and GAE
    dpo   DPOPhase   offline and online (iterative) DPO and its variants
    rm    RMPhase    Bradley-Terry reward model

A phase is ``factory(ctx, steps) -> Phase`` (the protocol is ``rljax.train.setup.Phase``); it
builds on the machinery one level up (``rljax.train``: state, steps, rollout, evaluate, ...) and
never imports the controller. ``ALGORITHMS`` maps ``algo.name`` to a factory;
``register_algorithm`` adds one from outside the package.
"""
from __future__ import annotations

from typing import Callable

from rljax.errors import UserError
from rljax.train.phases.dpo import DPOPhase
from rljax.train.phases.grpo import GRPOPhase
from rljax.train.phases.ppo import PPOPhase
from rljax.train.phases.rm import RMPhase
from rljax.train.phases.sft import SFTPhase
from rljax.train.setup import Context, Phase

# algo.name -> factory(ctx, steps) -> Phase.
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
        warmup = SFTPhase(ctx, cfg.sft.steps, cfg.sft.learning_rate, name="sft_warmup")
        warmup.learning_rate_key = "sft.learning_rate"  # named in the non-finite stop message
        phases.append(warmup)
    phases.append(ALGORITHMS[cfg.algo.name](ctx, cfg.steps))
    return phases
