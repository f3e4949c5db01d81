"""PRM-shaped GRPO: a process reward model scores every step of every sampled completion, and
the estimator ``grpo_process`` adds the steps' process advantages to GRPO's outcome advantage
(``rljax.algorithms.process_advantages``; DeepSeekMath's process supervision).

A rollout stage (``core.rollout.RolloutStage``), so it composes with the samplers and modes the
GRPO rollout has (static, slot engine, partial and asynchronous rollouts). Each completion is
cut into steps at ``data.step_delimiter`` (``step_mc.step_ends``: a step ends with the token
that completes the delimiter; the stop token, or the completion's end, ends the last), and the
PRM of ``algo.process_reward.prm`` (an ``algo.name='prm'`` run with this run's model and
tokenizer) reads prompt ++ completion once, in batches of the update's micro-batch rows
placed on the run's mesh (``prm_scoring``); the sigmoid of its logit at each step's last token
is that step's reward. The PRM is frozen and not checkpointed (a resumed run reloads it).
``rljax plan`` plans its pass as ``process/prm``.

Multi-turn episodes (``env.name``): the PRM reads prompt ++ the whole trajectory (model turns
and observations), so each step is scored on the transcript up to it; steps are cut within
the model's turns only (``step_mc.turn_step_ends``: at the delimiter, and at each turn's end),
so every step reward sits on a model token and observations are never a step.
"""
from __future__ import annotations

import time

import numpy as np

from rljax.train.core import programs as programs_lib
from rljax.train.methods import prm_scoring
from rljax.train.core.rollout import RolloutStage


def scoring_rows(cfg) -> int:
    """Rows of one PRM scoring batch: the update's micro-batch (as the log-prob passes)."""
    a = cfg.algo
    return int(a.micro_batch_size or a.mini_batch_size or cfg.rollout.batch_size)


def program(ctx):
    """The PRM's scoring pass for ``rljax plan``: ``scoring_rows`` rows at the longest prompt
    bucket and a training row's completion columns (episodes: the whole trajectory)."""
    return prm_scoring.program(ctx, "process/prm", scoring_rows(ctx.cfg),
                               programs_lib.prompt_len(ctx.cfg),
                               programs_lib.completion_len(ctx.cfg))


class ProcessRewards(RolloutStage):
    """Rollout stage: the step rewards [R, N] of the assembled batch's completions (or
    episodes' trajectories, at model tokens only), given to the estimator
    (``rows["estimator_inputs"]``: ``step_rewards`` f32 and ``step_ends`` bool, [R, N]; next
    to ``group_ids`` [R] when the groups have sizes of their own)."""

    name = "process_rewards"

    def __init__(self, ctx):
        self.ctx, self.cfg = ctx, ctx.cfg
        self._scorer = None     # loaded at the first batch, not when the phase is built
        self._metrics: dict = {}

    def scorer(self) -> prm_scoring.PRMScorer:
        if self._scorer is None:
            saved = prm_scoring.load_prm_checkpoint(self.ctx, "algo.process_reward.prm",
                                                    self.cfg.algo.process_reward.prm)
            value = prm_scoring.prm_value(self.ctx, saved)
            self._scorer = prm_scoring.prm_scorer(self.ctx, value, scoring_rows(self.cfg))
        return self._scorer

    def finish_batch(self, batch: dict, rows: dict) -> None:
        t0 = time.perf_counter()
        comp_tok, comp_mask = np.asarray(rows["tokens"]), np.asarray(rows["mask"], bool)
        n = comp_tok.shape[1]
        seqs, seq_mask = np.asarray(batch["tokens"]), np.asarray(batch["mask"], bool)
        p = seqs.shape[1] - n   # the batch's prompt bucket (left-padded prompts)
        prompts = [t[:p][m[:p]].tolist() for t, m in zip(seqs, seq_mask)]
        # Completions (and trajectories) are right-padded: column k is token k.
        comps = [t[m].tolist() for t, m in zip(comp_tok, comp_mask)]
        turns = None
        if "model_mask" in rows:   # episodes: each token's model turn, -1 on observations
            model = np.asarray(rows["model_mask"], bool)
            turn_ids = rows.get("turn_ids", np.zeros(model.shape, np.int32))
            turns = [np.where(mm, ids, -1)[m].tolist() for ids, mm, m in
                     zip(turn_ids, model, comp_mask)]
        probs, ends = self.scorer().step_probabilities(prompts, comps, p, turns, n)
        # Added to what the round source gave (knapsack allocation: ``group_ids``).
        rows.setdefault("estimator_inputs", {}).update(step_rewards=probs, step_ends=ends)
        steps = ends.sum(axis=1)
        self._metrics = {"process/step_score_mean": float(probs[ends].mean()) if ends.any()
                         else 0.0,
                         "process/steps_mean": float(steps.mean()) if len(steps) else 0.0,
                         "time/prm": time.perf_counter() - t0}

    def metrics(self, rounds, rows) -> dict:
        return dict(self._metrics)
