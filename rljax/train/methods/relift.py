"""ReLIFT's SFT steps (``algo.relift``): every ``relift.every`` RL steps, one SFT step on the
reference solutions (with episodes, the scripted episodes) of the prompts the ``guidance.Guide``
stage buffered for failing again and again. The GRPO phase calls it after each update.
"""
from __future__ import annotations

import numpy as np

from rljax import distributed as dist
from rljax.train.core import image_inputs
from rljax.train.core.steps import build_sft_step, to_host
from rljax.train.methods.guidance import Guide, sft_batch


class Relift:
    """Every ``algo.relift.every`` RL steps, one SFT step on the oldest buffered prompts'
    reference solutions (same train state and optimizer; ``steps.build_sft_step`` with the
    loss scaled by ``relift.coef``). Its state is the Guide's buffer."""

    def __init__(self, ctx, guide: Guide):
        self.ctx, self.guide, self.cfg = ctx, guide, ctx.cfg.algo.relift
        self.completion_len = int(ctx.cfg.rollout.max_new_tokens)
        self.images = image_inputs.image_inputs(ctx)   # None: a text model
        self._step_fn = None

    def batch(self, examples: list[dict]) -> tuple[dict, int]:
        """``relift.batch_size`` rows of prompt ++ solution ++ EOS (padding rows masked); with
        episodes, prompt ++ the environment's scripted episode, the loss on its model turns.
        A model with a vision tower: each row carries its example's images (``pixels``; the
        padding rows repeat the first example, as their prompts do)."""
        cfg, rows = self.ctx.cfg, int(self.cfg.batch_size)
        if cfg.env.name:
            from rljax.train.methods.agent import guide_trace, trace_sft_batch
            batch, cut = trace_sft_batch(cfg, self.ctx.tokenizer, examples,
                                         int(cfg.env.max_total_tokens),
                                         np.random.default_rng(int(cfg.seed)), rows=rows,
                                         trace=guide_trace)
        else:
            batch, cut = sft_batch(self.ctx.tokenizer, [ex["prompt"] for ex in examples],
                                   [self.guide.solution(ex) for ex in examples],
                                   self.ctx.cfg.data.max_prompt_length, self.completion_len,
                                   rows=rows)
        if self.images is not None:
            batch["pixels"] = self.images.pixels(
                list(examples) + [examples[0]] * (rows - len(examples)))
        return batch, cut

    def due_after(self, step: int) -> bool:
        """Whether an SFT step may follow RL step ``step`` (0-based): every ``relift.every``
        steps (it runs if the buffer then holds prompts)."""
        return (step + 1) % int(self.cfg.every) == 0

    def maybe_step(self, state, step: int, optimizer):
        """(state, metrics) after RL step ``step`` (0-based): an SFT step when it is due and
        the buffer holds prompts. Metrics: relift/buffer_size (before the step), and on SFT
        steps relift/sft_loss, relift/sft_rows, relift/sft_tokens."""
        buffer = self.guide.buffer
        metrics = {"relift/buffer_size": len(buffer)}
        if not self.due_after(step) or not len(buffer):
            return state, metrics
        examples = buffer.take(int(self.cfg.batch_size))
        batch, cut = self.batch(examples)
        if self._step_fn is None:
            self._step_fn = build_sft_step(
                self.ctx.model_cfg, optimizer, loss_scale=float(self.cfg.coef),
                state_shardings=self.ctx.state_shardings(state), mesh=self.ctx.mesh)
        state, m = self._step_fn(state, dist.device_batch(batch, self.ctx.mesh))
        m = to_host(m)
        metrics.update({"relift/sft_loss": m["nll"], "relift/sft_rows": len(examples),
                        "relift/sft_tokens": int(batch["loss_mask"].sum()),
                        "relift/sft_cut": cut, "relift/skipped": m["skipped"]})
        return state, metrics
