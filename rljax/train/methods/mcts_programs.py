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


def prm_scorer(ctx, value, rows: int):
    """``(prompt ids, prefix ids) lists -> scores [R]``: the value tree's sigmoid score at each
    prefix's last step end, in stepwise batches of ``rows`` rows (static) split over the
    mesh's data-parallel axes, the tree placed by ``value_shardings``."""
    cfg, tok, mesh = ctx.cfg, ctx.tokenizer, ctx.mesh
    fn = prm_rerank.value_logits_program(ctx.model_cfg)
    value = jax.device_put(value, value_shardings(ctx, value))
    p_len, n = int(cfg.data.max_prompt_length), int(cfg.rollout.max_new_tokens)

    def logits(batch):
        out = fn(value, shd.shard_batch(dist.device_batch(batch, mesh), mesh))
        return dist.to_host(out) if dist.is_multiprocess() else out

    def score(prompt_ids, prefixes):
        step_rows = prm_rerank.step_rows(prompt_ids, prefixes, tok.decode,
                                         cfg.data.step_delimiter, tuple(ctx.stop_ids))
        return prm_rerank.completion_scores(logits, step_rows, rows, p_len, n, tok.pad_id,
                                            "last")
    return score


def load_prm_scorer(ctx, rows: int):
    """``prm_scorer`` of the PRM trained in ``algo.mcts.prm`` (its latest checkpoint). The PRM
    run must share the policy's model and tokenizer sections (its trunk is read with the
    policy's config: ``inputs.check_mcts_prm``)."""
    from rljax.errors import UserError
    from rljax.train.core import checkpoint as ckpt_lib
    from rljax.train.core.inputs import check_mcts_prm

    where = ctx.cfg.algo.mcts.prm
    check_mcts_prm(ctx.cfg)   # (also run by check_inputs, before the model loads)
    with ckpt_lib.CheckpointManager(ckpt_lib.checkpoint_dir(where)) as ckpt:
        if ckpt.latest_step() is None:
            raise UserError(f"algo.mcts.prm={where} has no checkpoint")
        saved = ckpt.restore().state
    if saved.get("critic_params") is None:
        raise UserError(f"algo.mcts.prm={where}: its latest checkpoint is from the SFT "
                        "warm-up, before the PRM was trained")
    return prm_scorer(ctx, lora_lib.value_on_base(saved["params"], saved["critic_params"]),
                      rows)


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
