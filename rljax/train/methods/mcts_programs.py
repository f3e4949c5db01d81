"""The MCTS search's device side: its batch sizes on a mesh, its PRM scorer, and the programs
``rljax plan`` compiles for it.

A wave's sampler call (``mcts_search.MCTSSearch``) has ``search_rows`` prefix rows: the
round's prompts rounded up to a multiple of the data-parallel size (``data`` x ``fsdp``), so
its rows, their forks and their keys split evenly over the mesh; padding rows repeat the last
real one and are dropped. Each row is prefilled once at ``data.max_prompt_length +
rollout.max_new_tokens`` columns and forked ``max(algo.mcts.children, algo.mcts.rollouts)``
ways. With ``algo.mcts.value='prm'`` the PRM of ``algo.mcts.prm`` scores the new children
in batches of ``search_rows x children`` stepwise rows, its trunk sharded as the policy's
and its batch over the data-parallel axes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rljax import distributed as dist
from rljax import models, sampling
from rljax import sharding as shd
from rljax.models import lora as lora_lib
from rljax.train.core import programs as programs_lib
from rljax.train.core import sampler as sampler_lib
from rljax.train.methods import prm_rerank


def search_rows(prompts: int, dp_size: int) -> int:
    """Prefix rows of a wave's sampler call: ``prompts`` (a wave expands at most one leaf per
    prompt) rounded up to a multiple of ``dp_size``."""
    return -(-int(prompts) // int(dp_size)) * int(dp_size)


def forks(cfg) -> int:
    """Continuations per prefix row: ``max(algo.mcts.children, algo.mcts.rollouts)``."""
    return max(int(cfg.algo.mcts.children), int(cfg.algo.mcts.rollouts))


def prefix_len(cfg) -> int:
    """Prompt columns of the sampler call: prompt ++ prefix, ``data.max_prompt_length +
    rollout.max_new_tokens``."""
    return int(cfg.data.max_prompt_length) + int(cfg.rollout.max_new_tokens)


# ----------------------------------------------------------------------------- the PRM

def value_shardings(ctx, value) -> dict:
    """Shardings of a value tree ``{"trunk", "head"}`` whose trunk has the policy's arrays
    (without the LM head; with LoRA, the base and the PRM's adapters, shaped as the policy's):
    the trunk as the policy's parameters, the head replicated."""
    trunk = {k: ctx.param_shardings[k] for k in value["trunk"]}
    return {"trunk": trunk, "head": jax.tree.map(lambda _: ctx.replicated, value["head"])}


def abstract_value(ctx) -> dict:
    """The PRM's value tree as ``ShapeDtypeStruct`` leaves with their shardings, as
    ``load_prm_scorer`` holds it (the PRM run has the policy's model section, so its trees are
    the ones a PRM run of this model makes: ``phases.rm``'s init)."""
    key = jax.random.key(0)
    if lora_lib.has_lora(ctx.params):
        shape = jax.eval_shape(lambda p: lora_lib.value_on_base(
            p, lora_lib.init_value_adapters(ctx.model_cfg, p, key)), ctx.params)
    else:
        shape = jax.eval_shape(lambda p: models.init_value_params(ctx.model_cfg, key,
                                                                  from_params=p), ctx.params)
    return programs_lib.with_shardings(shape, value_shardings(ctx, shape))


def prm_batch_struct(ctx, rows: int) -> dict:
    """Abstract ``stepwise.stepwise_batch`` of ``rows`` rows: prompts [rows,
    data.max_prompt_length], prefixes [rows, rollout.max_new_tokens], split over the batch."""
    cfg, mesh = ctx.cfg, ctx.mesh
    p, c = int(cfg.data.max_prompt_length), int(cfg.rollout.max_new_tokens)
    s = lambda shape, dtype: programs_lib.batch_struct(mesh, shape, dtype)   # noqa: E731
    return {"prompt_tokens": s((rows, p), jnp.int32), "prompt_mask": s((rows, p), bool),
            "completion_tokens": s((rows, c), jnp.int32), "completion_mask": s((rows, c), bool),
            "labels": s((rows, c), jnp.float32), "label_mask": s((rows, c), bool),
            "row_mask": s((rows,), bool)}


class PRMScorer:
    """``(prompt ids, prefix ids) lists -> scores [R]``: the value tree ``value`` (settable
    between rounds: a refitted PRM) at each prefix's last step end, its sigmoid, in stepwise
    batches of ``rows`` rows (static: one compilation whatever ``value`` holds) split over the
    mesh's data-parallel axes."""

    def __init__(self, ctx, rows: int, value=None):
        self.ctx, self.rows, self.value = ctx, int(rows), value
        self._fn = prm_rerank.value_logits_program(ctx.model_cfg)

    def _logits(self, batch):
        mesh = self.ctx.mesh
        out = self._fn(self.value, shd.shard_batch(dist.device_batch(batch, mesh), mesh))
        return dist.to_host(out) if dist.is_multiprocess() else out

    def __call__(self, prompt_ids, prefixes) -> np.ndarray:
        cfg, tok = self.ctx.cfg, self.ctx.tokenizer
        step_rows = prm_rerank.step_rows(prompt_ids, prefixes, tok.decode,
                                         cfg.data.step_delimiter, tuple(self.ctx.stop_ids))
        return prm_rerank.completion_scores(
            self._logits, step_rows, self.rows, int(cfg.data.max_prompt_length),
            int(cfg.rollout.max_new_tokens), tok.pad_id, "last")


def load_prm(ctx) -> dict:
    """The latest checkpoint state of the PRM run in ``algo.mcts.prm``."""
    return prm_rerank.load_prm_checkpoint(ctx, "algo.mcts.prm", ctx.cfg.algo.mcts.prm)


def scorer_rows(ctx, prompts: int) -> int:
    """Prefixes per PRM scoring batch: a wave's new children (``children`` per prefix row)."""
    return search_rows(prompts, ctx.dp_size) * int(ctx.cfg.algo.mcts.children)


def prm_scorer(ctx, value, rows: int) -> PRMScorer:
    """A ``PRMScorer`` of the frozen value tree ``value``, placed by ``value_shardings``."""
    return PRMScorer(ctx, rows, jax.device_put(value, value_shardings(ctx, value)))


def load_prm_scorer(ctx, rows: int) -> PRMScorer:
    """``prm_scorer`` of the PRM trained in ``algo.mcts.prm`` (its latest checkpoint)."""
    return prm_scorer(ctx, prm_rerank.prm_value(load_prm(ctx)), rows)


# ----------------------------------------------------------------------------- the plan

def programs(ctx, params, resident: int, prompts: int) -> list:
    """The search's programs for ``rljax plan`` (``programs.Program``) with ``prompts`` prompts
    a round: ``mcts/sample``, one wave's sampler call (``search_rows`` prefix rows of
    ``prefix_len`` columns forked ``forks`` ways, ``rollout.max_new_tokens`` new tokens, a
    key per output row; the rows' noise is drawn inside it); with ``algo.mcts.value='prm'``,
    ``mcts/prm``, the PRM's pass over ``search_rows x children`` stepwise rows (its parameters
    are that program's non-resident arguments: not train state)."""
    cfg, mcfg, mesh, tok = ctx.cfg, ctx.model_cfg, ctx.mesh, ctx.tokenizer
    r, m = cfg.rollout, cfg.algo.mcts
    rows, s, p = search_rows(prompts, ctx.dp_size), forks(cfg), prefix_len(cfg)
    merge = sampler_lib.merges_for_sampling(cfg, mcfg, params)

    def sample_fn(params, prompt_tokens, prompt_mask, key, row_keys):
        if merge:
            params = lora_lib.merge(mcfg, params)
        return sampling.generate(
            mcfg, params, prompt_tokens, prompt_mask, rng=key, num_samples=s,
            max_new_tokens=int(r.max_new_tokens), temperature=r.temperature, top_k=r.top_k,
            top_p=r.top_p, eos_id=ctx.stop_ids, pad_id=tok.pad_id, mesh=mesh,
            record_routes=bool(cfg.algo.get("routing_replay")), row_keys=row_keys)

    args = (params, programs_lib.batch_struct(mesh, (rows, p), jnp.int32),
            programs_lib.batch_struct(mesh, (rows, p), bool),
            jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=ctx.replicated),
            programs_lib.batch_struct(mesh, (rows * s, 2), jnp.uint32))
    out = [programs_lib.Program("mcts/sample", jax.jit(sample_fn), args, resident)]
    if m.value == "prm":
        out.append(programs_lib.Program(
            "mcts/prm", prm_rerank.value_logits_program(mcfg),
            (abstract_value(ctx), prm_batch_struct(ctx, rows * int(m.children))), 0))
    return out
