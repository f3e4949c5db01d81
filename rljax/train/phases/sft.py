"""Supervised fine-tuning phase: the SFT warm-up before RL (``sft.steps``) or ``algo.name='sft'``.

Examples come from ``sft.source`` (default ``data.source``); with ``sft.traces='mcts'`` the
main phase (not the warm-up) trains on the best verified traces of an MCTS over steps
instead (``methods.mcts_search``: ReST-MCTS*-style self-training; with ``algo.mcts.refit_prm``
the search's PRM is refitted on its values before each SFT update, ``methods.prm_refit``).
Synthetic tasks provide verified solutions (``task.solution``); file sources use a
``completion`` (or ``solution`` / ``answer``) field. Each example becomes prompt ++ solution ++ EOS in the shared sequence layout
(see ``steps``), with the loss on the solution and EOS only.
"""
from __future__ import annotations

import time

from rljax import data as data_lib
from rljax import distributed as dist
from rljax.errors import UserError
from rljax.models import lora as lora_lib
import jax.numpy as jnp

from rljax.train.core import image_inputs, programs as programs_lib
from rljax.train.methods import (guidance, mcts_matches, mcts_programs, mcts_search,
                                 prm_refit)
from rljax.train.core.setup import Context, data_iterator
from rljax.train.core.steps import build_sft_step, to_host

SFT_SEED_OFFSET = 1  # the SFT iterator's order differs from the RL prompts' order


def _init_state(optimizer, state):
    return state.replace(opt_state=optimizer.init(lora_lib.trainable(state.params)),
                         ref_params=None)


def _build(ctx: Context, optimizer, state):
    cfg = ctx.cfg
    micro, bs = cfg.algo.micro_batch_size, cfg.sft.batch_size
    num_micro = bs // micro if micro and bs % micro == 0 else 1
    return build_sft_step(ctx.model_cfg, optimizer, num_micro=num_micro,
                          state_shardings=ctx.state_shardings(state), mesh=ctx.mesh)


class SFTPhase:
    """``steps`` SFT updates with learning rate ``learning_rate``."""

    def __init__(self, ctx: Context, steps: int, learning_rate: float, name: str = "sft"):
        cfg = ctx.cfg
        self.ctx, self.name, self.steps = ctx, name, int(steps)
        source = cfg.sft.source or cfg.data.source
        self.iterator = data_iterator(ctx, cfg.sft.batch_size, seed_offset=SFT_SEED_OFFSET,
                                      source=source, path=cfg.sft.path or None)
        self.task = None
        if source in data_lib.TASKS:
            self.task = data_lib.get_task(ctx.data_config(source))
        self.completion_len = cfg.sft.max_length - cfg.data.max_prompt_length
        self.optimizer = ctx.optimizer(learning_rate, self.steps)
        self._step_fn = None
        self.num_too_long = 0
        self.images = image_inputs.image_inputs(ctx)
        self.traces = self.refit = None
        if cfg.sft.traces == "mcts" and name == "sft":   # the main phase (not the warm-up)
            self.iterator = data_iterator(ctx, cfg.sft.batch_size)   # the RL prompts' order
            if cfg.algo.mcts.refit_prm:   # the search's PRM, refitted each round
                self.refit = prm_refit.PRMRefit(ctx, int(cfg.sft.batch_size), self.steps)
            self.traces = mcts_search.MCTSTraces(
                ctx, self.iterator, self.completion_len,
                refit_scorer=None if self.refit is None else self.refit.scorer,
                search=(mcts_matches.turn_searcher(   # over the environment's turns
                    ctx, int(cfg.sft.batch_size), None if self.refit is None else
                    self.refit.scorer) if cfg.env.name else None))

    def init_state(self, state):
        state = _init_state(self.optimizer, state)
        return state if self.refit is None else self.refit.init_state(state)

    @staticmethod
    def programs(ctx: Context, steps: int, learning_rate: float, main: bool = False):
        """``(abstract state, [Program])``: the update on ``sft.batch_size`` rows of the longest
        prompt bucket + ``sft.max_length - data.max_prompt_length`` completion columns
        (``rljax.train.core.programs``). ``main`` (not the warm-up) with ``sft.traces='mcts'``
        also runs the search's (``mcts_programs.programs``), and with ``algo.mcts.refit_prm``
        the state holds the PRM, refitted by a second update."""
        cfg = ctx.cfg
        optimizer = ctx.optimizer(learning_rate, int(steps))
        refit = main and cfg.sft.traces == "mcts" and cfg.algo.mcts.refit_prm

        def init(s):
            s = _init_state(optimizer, s)
            return prm_refit.planned_state(ctx, steps, s) if refit else s
        state = programs_lib.phase_state(ctx, init)
        bs, n = int(cfg.sft.batch_size), int(cfg.sft.max_length - cfg.data.max_prompt_length)
        p = programs_lib.prompt_len(cfg)
        batch = programs_lib.with_images(ctx, {
            "tokens": programs_lib.batch_struct(ctx.mesh, (bs, p + n), jnp.int32),
            "mask": programs_lib.batch_struct(ctx.mesh, (bs, p + n), bool),
            "loss_mask": programs_lib.batch_struct(ctx.mesh, (bs, n), bool)}, bs)
        out = [programs_lib.Program("update", _build(ctx, optimizer, state), (state, batch),
                                    programs_lib.shard_bytes(state))]
        if main and cfg.sft.traces == "mcts":
            out += mcts_programs.programs(ctx, state.params, programs_lib.shard_bytes(
                state.params), bs)
        if refit:
            out.append(prm_refit.program(ctx, steps, state, bs))
        return state, out

    def solution(self, example: dict) -> str:
        try:
            return guidance.solution_of(example, self.task)
        except UserError:
            raise UserError(f"SFT data has no completion/solution/answer field: "
                            f"{sorted(example)}") from None

    def make_batch(self, examples: list[dict], step: int = 0) -> dict:
        """Prompt ++ solution ++ EOS; solutions longer than the slot are cut (and counted).
        With ``sft.env_traces``: prompt ++ the environment's scripted episode, the loss on the
        model's turns only (noisy traces draw from an rng seeded by ``seed`` and ``step``, so a
        resumed run sees the same games). A model with a vision tower: each row carries its
        example's images (``pixels``), the scripted episode's prompt too."""
        tok, n = self.ctx.tokenizer, self.completion_len
        if self.ctx.cfg.sft.env_traces:
            import numpy as np
            from rljax.train.methods.agent import trace_sft_batch
            rng = np.random.default_rng([int(self.ctx.cfg.seed), SFT_SEED_OFFSET, int(step)])
            batch, cut = trace_sft_batch(self.ctx.cfg, tok, examples, n, rng)
        else:
            batch, cut = guidance.sft_batch(
                tok, [ex["prompt"] for ex in examples], [self.solution(ex) for ex in examples],
                self.ctx.cfg.data.max_prompt_length, n)
        self.num_too_long += cut
        if self.images is not None:   # a model with a vision tower: each row's images
            batch["pixels"] = self.images.pixels(examples)
        return batch

    def _compiled(self, state):
        if self._step_fn is None:
            self._step_fn = _build(self.ctx, self.optimizer, state)
        return self._step_fn

    def iteration(self, state, step: int):
        t0 = time.perf_counter()
        extra = {}
        if self.traces is not None:   # the search's best verified traces (sft.traces='mcts')
            batch, extra = self.traces(state, step)
            if self.refit is not None:   # the PRM on the search's values, for the next round
                state, refit_metrics = self.refit(state, self.traces.last)
                extra.update(refit_metrics)
        else:
            batch = self.make_batch(next(self.iterator), step)
        state, m = self._compiled(state)(state, dist.device_batch(batch, self.ctx.mesh))
        m = to_host(m)
        dt = time.perf_counter() - t0
        ntok = int(batch["loss_mask"].sum())
        m = {f"sft/{k}" if k not in ("skipped", "grad_norm") else k: v for k, v in m.items()}
        m.update({"sft/tokens": ntok, "time/update": dt, "tokens_per_s": ntok / max(dt, 1e-9),
                  "sft/too_long": self.num_too_long, **extra})
        return state, m

    def state_dict(self) -> dict:
        return {"data": self.iterator.state(), "too_long": self.num_too_long}

    def load_state_dict(self, state: dict) -> None:
        self.iterator.restore(state["data"])
        self.num_too_long = int(state.get("too_long", 0))
