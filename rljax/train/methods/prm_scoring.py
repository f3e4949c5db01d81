"""A process reward model run's value model on this run's mesh: read from its checkpoint,
placed as the policy, scoring step ends in static stepwise batches, and the program
``rljax plan`` compiles for it. Used by the tree search's leaf values and its refit
(``mcts_search``, ``prm_refit``) and by PRM-shaped GRPO (``process_rewards``).

The PRM run shares the policy's model and tokenizer sections (``inputs.check_prm_run``), so
its value tree ``{"trunk", "head"}`` has the policy's trunk arrays: the trunk is sharded as
the policy's parameters, the head replicated, and each stepwise batch is split over the
mesh's data-parallel axes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rljax import distributed as dist
from rljax import models
from rljax import sharding as shd
from rljax.models import lora as lora_lib
from rljax.train.core import programs as programs_lib
from rljax.train.methods import prm_rerank


def load_prm_checkpoint(ctx, key: str, where: str) -> dict:
    """The latest checkpoint state of the process reward model run in workdir ``where``
    (``params``: its policy, ``critic_params``: its value model; config key ``key`` names it
    in errors)."""
    from rljax.errors import UserError
    from rljax.train.core import checkpoint as ckpt_lib
    from rljax.train.core.inputs import check_prm_run

    check_prm_run(ctx.cfg, key, where)   # (also run by check_inputs, before the model loads)
    with ckpt_lib.CheckpointManager(ckpt_lib.checkpoint_dir(where)) as ckpt:
        if ckpt.latest_step() is None:
            raise UserError(f"{key}={where} has no checkpoint")
        saved = ckpt.restore().state
    if saved.get("critic_params") is None:
        raise UserError(f"{key}={where}: its latest checkpoint is from the SFT warm-up, "
                        "before the PRM was trained")
    return saved


def prm_value(ctx, saved: dict):
    """The full value model (trunk and head) of a PRM run's checkpoint state. With LoRA the
    checkpoint holds the PRM's adapters and head without the frozen base, which is this run's
    (the PRM run has this run's model section): ``ctx.params``' base."""
    return lora_lib.value_on_base(ctx.params, saved["critic_params"])


def value_shardings(ctx, value) -> dict:
    """Shardings of a value tree ``{"trunk", "head"}`` whose trunk has the policy's arrays
    (without the LM head; with LoRA, the base and the PRM's adapters, shaped as the policy's):
    the trunk as the policy's parameters, the head replicated."""
    trunk = {k: ctx.param_shardings[k] for k in value["trunk"]}
    return {"trunk": trunk, "head": jax.tree.map(lambda _: ctx.replicated, value["head"])}


def initial_value(model_cfg, params, key):
    """A fresh value model as a PRM run of this model makes it (``phases.rm``'s init): the
    policy's trunk and a head, or with LoRA (``params`` has adapters) fresh adapters and a
    head only, on the policy's frozen base (``lora.value_on_base``)."""
    if lora_lib.has_lora(params):
        return lora_lib.init_value_adapters(model_cfg, params, key)
    return models.init_value_params(model_cfg, key, from_params=params)


def abstract_value(ctx) -> dict:
    """The PRM's value tree as ``ShapeDtypeStruct`` leaves with their shardings, as
    ``prm_scorer`` holds it (``initial_value`` on the policy's base)."""
    key = jax.random.key(0)
    shape = jax.eval_shape(lambda p: lora_lib.value_on_base(
        p, initial_value(ctx.model_cfg, p, key)), ctx.params)
    return programs_lib.with_shardings(shape, value_shardings(ctx, shape))


def batch_struct(ctx, rows: int, prompt_len: int | None = None,
                 completion_len: int | None = None) -> dict:
    """Abstract ``stepwise.stepwise_batch`` of ``rows`` rows: prompts [rows, ``prompt_len``
    (default data.max_prompt_length)], completions [rows, ``completion_len`` (default
    rollout.max_new_tokens)], split over the batch."""
    cfg, mesh = ctx.cfg, ctx.mesh
    p = int(cfg.data.max_prompt_length if prompt_len is None else prompt_len)
    c = int(cfg.rollout.max_new_tokens if completion_len is None else completion_len)
    s = lambda shape, dtype: programs_lib.batch_struct(mesh, shape, dtype)   # noqa: E731
    return {"prompt_tokens": s((rows, p), jnp.int32), "prompt_mask": s((rows, p), bool),
            "completion_tokens": s((rows, c), jnp.int32), "completion_mask": s((rows, c), bool),
            "labels": s((rows, c), jnp.float32), "label_mask": s((rows, c), bool),
            "row_mask": s((rows,), bool)}


def program(ctx, name: str, rows: int, prompt_len: int | None = None,
            completion_len: int | None = None):
    """The PRM's pass over a ``batch_struct`` as a ``programs.Program`` for ``rljax plan``
    (its parameters are the program's non-resident arguments: not train state)."""
    return programs_lib.Program(name, prm_rerank.value_logits_program(ctx.model_cfg),
                                (abstract_value(ctx),
                                 batch_struct(ctx, rows, prompt_len, completion_len)), 0)


class PRMScorer:
    """The value tree ``value`` (settable between rounds: a refitted PRM) scoring stepwise
    batches of ``rows`` rows (static: one compilation whatever ``value`` holds) split over the
    mesh's data-parallel axes. Called with ``(prompt ids, prefix ids)`` lists: the score
    (sigmoid) at each prefix's last step end, [R]; with ``turns`` too (per prefix, each
    token's model turn, -1 on observations) the prefixes are multi-turn trajectories
    (``programs.completion_len`` columns: ``env.max_total_tokens``), whose last step end is
    their last model turn's end."""

    def __init__(self, ctx, rows: int, value=None):
        self.ctx, self.rows, self.value = ctx, int(rows), value
        self._fn = prm_rerank.value_logits_program(ctx.model_cfg)

    def logits(self, batch) -> jax.Array:
        """Value-head logits [rows, C] at a stepwise batch's completion positions."""
        mesh = self.ctx.mesh
        out = self._fn(self.value, shd.shard_batch(dist.device_batch(batch, mesh), mesh))
        return dist.to_host(out) if dist.is_multiprocess() else out

    def step_rows(self, prompt_ids, completions, turns=None) -> list[tuple]:
        """``prm_rerank.step_rows`` of completions cut at ``data.step_delimiter``; with
        ``turns`` (per completion, each token's model turn, -1 on observations) the steps of
        multi-turn trajectories (``step_mc.turn_step_ends``)."""
        cfg, tok = self.ctx.cfg, self.ctx.tokenizer
        return prm_rerank.step_rows(prompt_ids, completions, tok.decode,
                                    cfg.data.step_delimiter, tuple(self.ctx.stop_ids), turns)

    def step_probabilities(self, prompt_ids, completions, prompt_len: int, turns=None,
                           completion_len: int | None = None):
        """``(probs f32 [R, N], step_ends bool [R, N])``: each step's score on its last token
        (``prm_rerank.step_probabilities``), prompts padded to ``prompt_len``, completions to
        ``completion_len`` N (default rollout.max_new_tokens); ``turns``: as ``step_rows``."""
        n = int(self.ctx.cfg.rollout.max_new_tokens if completion_len is None else
                completion_len)
        return prm_rerank.step_probabilities(
            self.logits, self.step_rows(prompt_ids, completions, turns), self.rows, prompt_len,
            n, self.ctx.tokenizer.pad_id)

    def __call__(self, prompt_ids, prefixes, turns=None) -> np.ndarray:
        cfg = self.ctx.cfg
        return prm_rerank.completion_scores(
            self.logits, self.step_rows(prompt_ids, prefixes, turns), self.rows,
            int(cfg.data.max_prompt_length), programs_lib.completion_len(cfg),
            self.ctx.tokenizer.pad_id, "last")


def prm_scorer(ctx, value, rows: int) -> PRMScorer:
    """A ``PRMScorer`` of the frozen value tree ``value``, placed by ``value_shardings``."""
    return PRMScorer(ctx, rows, jax.device_put(value, value_shardings(ctx, value)))
