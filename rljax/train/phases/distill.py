"""On-policy distillation phase (``algo.name='distill'``): the student samples, a frozen
teacher scores every sampled token, and the student minimises its reverse KL to the teacher on
its own samples (GKD, arXiv 2306.13649; docs/algorithms.md has the formulas).

Why a named algorithm that is GRPO underneath, rather than a second update path or a GRPO
flag: the update is the GRPO one (``GroupedUpdate`` over ``grpo_loss``: the same micro-batch
planning, shared prompts, streams, clipping, LoRA, exact accumulation), and distillation is a
choice of per-token advantage -- ``-(log pi - log pi_T)`` with discount 0 -- which ``grpo_loss``
forms from the batch's ``teacher_logps``, mixed with the task advantage by
``algo.distill.reward_weight``. What differs is only the rollout, which also runs the teacher (the ``TeacherScores`` stage),
and the defaults (no reference model, G = 1 allowed when no task reward is mixed in); a name
makes those defaults and the teacher's required presence explicit in configs, the plan and the
metrics, while every GRPO option (estimators, mini-batches, epochs) keeps working.

Metrics besides GRPO's: ``distill/reverse_kl`` (mean per-token k_t of the pre-update student,
from the update), ``distill/teacher_agreement`` (share of sampled tokens that are the teacher's
most likely token, from the rollout), ``distill/jsd`` (with ``algo.distill.jsd_weight``),
``time/teacher``.
"""
from __future__ import annotations

import time

import numpy as np

from rljax import distributed as dist
from rljax.train.core import programs as programs_lib
from rljax.train.core import teacher as teacher_lib
from rljax.train.phases.grpo import GRPOPhase
from rljax.train.core.setup import Context
from rljax.train.core.rollout import RolloutStage


def _score_options(ctx: Context) -> dict:
    """How the teacher pass chunks the rollout batch (as the old/reference log-prob pass) and
    the temperature it scores at: ``algo.distill.teacher_temperature``, not the rollout's (the
    teacher's own distribution at the default 1, as the published on-policy distillation)."""
    cfg = ctx.cfg
    a, total = cfg.algo, int(cfg.rollout.batch_size)
    micro = a.micro_batch_size or a.mini_batch_size or total
    return dict(temperature=float(a.distill.teacher_temperature), num_micro=total // micro,
                mesh=ctx.mesh,
                top_k=int(a.distill.top_k) if a.distill.jsd_weight > 0 else 0)


def score_fn(ctx: Context, teacher_cfg, source: teacher_lib.Source):
    """The jitted teacher pass of this run (``teacher.build_score_fn``)."""
    return teacher_lib.build_score_fn(
        teacher_cfg, vocab=min(teacher_cfg.vocab_size, ctx.model_cfg.vocab_size),
        param_shardings=teacher_lib.shardings(teacher_cfg, ctx.mesh, source),
        **_score_options(ctx))


class TeacherScores(RolloutStage):
    """Rollout stage (``core.rollout.RolloutStage``): the teacher's scores of every sampled
    token in the assembled batch, ``teacher_logps`` f32 [R, N] (and, with the JSD term,
    ``teacher_topk_logps`` / ``teacher_topk_ids`` [R, N, k]). A stage rather than a rollout
    subclass, so any sampler composes with it (static, slot engine, trees, partial rollouts,
    asynchronous). The teacher is loaded at the first batch, not when the phase is built, so
    that ``rljax eval`` / ``sample`` of a distilled workdir never read it. Stateless: a resumed
    run reloads it from its source."""

    name = "teacher"

    def __init__(self, ctx: Context):
        self.ctx, self.cfg = ctx, ctx.cfg
        self._teacher = None   # (params, score fn)
        self._agreement, self._time = 0.0, 0.0

    def teacher(self):
        if self._teacher is None:
            source = teacher_lib.check(self.cfg, self.ctx.tokenizer)
            model_cfg, params = teacher_lib.load(source, self.ctx.mesh)
            self._teacher = params, score_fn(self.ctx, model_cfg, source)
        return self._teacher

    def finish_batch(self, batch: dict, rows: dict) -> None:
        params, score = self.teacher()
        t0 = time.perf_counter()
        seqs = {k: batch[k] for k in ("tokens", "mask", "loss_mask")}
        out = score(params, dist.device_batch(seqs, self.ctx.mesh))
        for key in teacher_lib.fields(self.cfg, 1):
            batch[key] = out[key]
        n = batch["loss_mask"].shape[1]
        sampled = np.asarray(batch["loss_mask"], bool)
        argmax = dist.to_host(out["teacher_argmax"])
        hits = (argmax == np.asarray(batch["tokens"])[:, -n:])[sampled]
        self._agreement = float(hits.mean()) if hits.size else 0.0
        self._time = time.perf_counter() - t0

    def metrics(self, rounds, rows) -> dict:
        return {"distill/teacher_agreement": self._agreement, "time/teacher": self._time}


class DistillPhase(GRPOPhase):
    """``steps`` distillation iterations: GRPO's loop and update, the teacher in the rollout."""

    name = "distill"

    def rollout_stages(self) -> list:
        return super().rollout_stages() + [TeacherScores(self.ctx)]

    @staticmethod
    def programs(ctx: Context, steps_: int):
        """GRPO's programs plus ``teacher``: the teacher's scoring pass over a rollout batch.
        Its parameters are that program's (non-resident) arguments: they are not train state
        (never optimised or checkpointed)."""
        state, out = GRPOPhase.programs(ctx, steps_)
        source = teacher_lib.resolve(ctx.cfg)
        model_cfg = teacher_lib.model_config(source)
        params = teacher_lib.abstract_params(model_cfg, ctx.mesh, source)
        rows = int(ctx.cfg.rollout.batch_size)
        out.append(programs_lib.Program("teacher", score_fn(ctx, model_cfg, source),
                                        (params, programs_lib.sequence_batch(ctx, rows)), 0))
        return state, out

