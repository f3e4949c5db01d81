"""Jitted update steps: exact micro-batch accumulation, non-finite skipping, the SFT loss.

Every step is ``new_state, metrics = step(state, batch)``, a pure function over the TrainState
pytree, compiled once with explicit shardings and the state donated.

Exactness (DESIGN principle 6): a loss function returns ``(weighted_sum, weight)`` and metric
``(sum, count)`` pairs. ``accumulate`` sums numerators, weights and the *gradients of the
numerators* over micro-batches, and divides once by the total weight, so the update does not
depend on how the batch was split (up to float rounding).

Batches are dicts of arrays with the batch on the leading axis. The sequence layout shared by
SFT and RL (built by ``rollout.build_sequences``)::

    tokens         int32 [B, P+N]   left-padded prompt bucket P, then the completion slot N
    mask           bool  [B, P+N]   True on real tokens (attention mask)
    loss_mask      bool  [B, N]     completion tokens that count in the loss

Only the last N positions carry a loss, so per-token arrays of the completion are ``[B, N]``.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from rljax import algorithms, compilation_cache, models
from rljax import sharding as shd
from rljax.models import lora as lora_lib, shared_prompt, vision
from rljax.sharding import BATCH_AXES
from rljax.train.core.optim import apply_if_finite
from rljax.train.core.state import TrainState

# loss_fn(params, state, micro_batch) -> ((weighted_sum, weight), {name: (sum, count)})
LossFn = Callable[[Any, TrainState, Mapping[str, jax.Array]], tuple]

# ``accumulate`` hands each loss its micro-batch's index under this key (int32 scalar; absent =
# 0), so a loss can key per-micro-batch randomness (LoRA dropout, ``training_dropout_rng``).
MICRO_INDEX = "micro_index"
# The full completion width N when a micro-batch's completion columns were trimmed
# (``length_groups``): the constant normaliser of ``seq-mean-token-sum-norm`` (a Python int
# added inside the step; absent = the micro-batch's own width).
COMPLETION_SLOTS = "completion_slots"
LORA_DROPOUT_STREAM = 6  # rng stream of LoRA dropout: fold_in(state.rng, 6), then step, micro


def training_dropout_rng(model_cfg, state: TrainState, batch: Mapping[str, jax.Array]):
    """The LoRA-dropout key of a training loss on one micro-batch, or None when
    ``model_cfg.lora_dropout`` is 0 (then nothing is drawn and the pass is the deterministic
    model, bit for bit). ``state`` None (an evaluation call of a loss) also means no dropout.

    ``fold_in(fold_in(fold_in(state.rng, LORA_DROPOUT_STREAM), state.step), micro index)``: a
    function of the state and the micro-batch only, so runs are deterministic and a resumed
    run draws the same masks as an uninterrupted one. Each update (``state.step``) and each
    micro-batch gets fresh masks. With dropout on, the update depends on how the batch is
    split into micro-batches (which rows share a key) and is exact only in expectation, as
    in every framework; with dropout 0 the split does not matter.
    """
    if not model_cfg.lora_dropout or state is None:
        return None
    key = jax.random.fold_in(jax.random.fold_in(state.rng, LORA_DROPOUT_STREAM), state.step)
    return jax.random.fold_in(key, batch.get(MICRO_INDEX, 0))


# ----------------------------------------------------------------------------- accumulation

def split_micro_batches(batch: Mapping[str, jax.Array], num_micro: int) -> dict:
    """[B, ...] leaves -> [M, B/M, ...], micro-batch m holding rows m, M+m, 2M+m, ...

    Strided rather than contiguous so that when the batch axis is sharded over devices, every
    micro-batch takes an equal slice from every device (no resharding inside the step).
    """
    def split(x):
        b = x.shape[0]
        if b % num_micro:
            raise ValueError(f"batch of {b} is not divisible into {num_micro} micro-batches")
        return jnp.swapaxes(x.reshape((b // num_micro, num_micro) + x.shape[1:]), 0, 1)
    return {k: split(v) for k, v in batch.items()}


def micro_grads(loss_fn: LossFn, state: TrainState, mb: Mapping[str, jax.Array], index=0):
    """One micro-batch: ``(grads of the numerator, numerator, weight, metric pairs)``.

    Gradients w.r.t. the trainable part only: with LoRA the frozen base is closed over (no
    base gradients, no optimizer state for it). ``index`` (int32 scalar) is the micro-batch's
    number, handed to the loss as ``mb[MICRO_INDEX]`` (it keys LoRA dropout)."""
    mb = {**mb, MICRO_INDEX: jnp.asarray(index, jnp.int32)}

    def numerator(t):
        (num, den), metrics = loss_fn(lora_lib.with_trainable(state.params, t), state, mb)
        return num, (den, metrics)
    (num, (den, metrics)), grads = jax.value_and_grad(numerator, has_aux=True)(
        lora_lib.trainable(state.params))
    return grads, num, den, metrics


def add_micro(total: tuple, out: tuple) -> tuple:
    """Adds one ``micro_grads`` output to a running total of the same structure (metric pairs
    named ``*_max`` combine by maximum)."""
    summed = jax.tree.map(jnp.add, total[:3], out[:3])
    metrics = {k: (_combine_max(total[3][k], v) if k.endswith("_max")
                   else jax.tree.map(jnp.add, total[3][k], v)) for k, v in out[3].items()}
    return (*summed, metrics)


def accumulate(loss_fn: LossFn, state: TrainState, batch: Mapping[str, jax.Array],
               num_micro: int = 1):
    """Gradients of the summed numerators, summed weights and summed metric pairs.

    Returns ``(grads_sum, weighted_sum, weight, metric_sums)``; the loss is
    ``weighted_sum / weight`` and its gradient ``grads_sum / weight``. Metric pairs named
    ``*_max`` are ``(max, 1)`` and combine by maximum instead.
    """
    one = functools.partial(micro_grads, loss_fn, state)
    if num_micro == 1:
        return one(batch)
    micro = split_micro_batches(batch, num_micro)
    first = jax.tree.map(lambda x: x[0], micro)
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(one, first))

    def body(carry, xs):
        return add_micro(carry, one(*xs)), None

    total, _ = jax.lax.scan(body, zeros, (micro, jnp.arange(num_micro, dtype=jnp.int32)))
    return total


def _combine_max(a, b):
    """Metric pairs named ``*_max`` hold ``(max, 1)`` and combine by maximum (values >= 0)."""
    return jnp.maximum(a[0], b[0]), jnp.maximum(a[1], b[1])


def finalize_metrics(metric_sums: Mapping[str, tuple]) -> dict:
    """{name: (sum, count)} -> {name: sum / count}."""
    return {k: algorithms.safe_divide(s, c) for k, (s, c) in metric_sums.items()}


def update(optimizer, loss_fn: LossFn, state: TrainState, batch, num_micro: int = 1):
    """One exact optimizer update (pure). Non-finite loss/grads leave params and optimizer
    state untouched and report ``skipped=1``. Returns ``(new_state, metrics)``."""
    return apply_accumulated(optimizer, state, accumulate(loss_fn, state, batch, num_micro))


def apply_accumulated(optimizer, state: TrainState, total: tuple):
    """The optimizer step from accumulated ``(grads_sum, weighted_sum, weight, metric_sums)``
    (``accumulate``): divides once by the total weight. Returns ``(new_state, metrics)``."""
    grads, num, den, metric_sums = total
    grads = jax.tree.map(lambda g: algorithms.safe_divide(g, den), grads)
    loss = algorithms.safe_divide(num, den)
    res = apply_if_finite(optimizer, lora_lib.trainable(state.params), state.opt_state, grads,
                          loss)
    new_state = state.replace(step=state.step + 1, opt_state=res.opt_state,
                              params=lora_lib.with_trainable(state.params, res.params))
    metrics = {"loss": loss, "grad_norm": res.grad_norm,
               "skipped": res.skipped.astype(jnp.int32), **finalize_metrics(metric_sums)}
    return new_state, metrics


def batch_sharding(mesh) -> NamedSharding | None:
    """Sharding prefix for a batch dict: leading axis over the data-parallel mesh axes."""
    if mesh is None:
        return None
    return NamedSharding(mesh, PartitionSpec(tuple(a for a in BATCH_AXES if a in mesh.shape)))


def jit_step(fn: Callable, state_shardings=None, mesh=None) -> Callable:
    """``jax.jit`` of ``fn(state, batch) -> (state, metrics)`` with the state donated and,
    when ``mesh`` is given, explicit in/out shardings (metrics replicated)."""
    options = compilation_cache.training_compiler_options()
    if mesh is None:
        return jax.jit(fn, donate_argnums=0, compiler_options=options)
    replicated = NamedSharding(mesh, PartitionSpec())
    # Traced on the mesh: the MoE dispatch splits the experts' work over it.
    return jax.jit(shd.traced_on(fn, mesh), donate_argnums=0,
                   in_shardings=(state_shardings, batch_sharding(mesh)),
                   out_shardings=(state_shardings, replicated), compiler_options=options)


# ----------------------------------------------------------------------------- losses

def completion_logps(model_cfg, params, batch, *, temperature: float = 1.0,
                     with_entropy: bool = False, lora_dropout_rng=None, extra_ids=None,
                     moe_stats=None):
    """Log-probs (and entropies) of the completion tokens: float32 [B, N] each (N from
    ``batch["loss_mask"]``); the [B, P+N, V] logits are never materialised at once.
    ``lora_dropout_rng``: training passes only (see ``training_dropout_rng``); None = none.

    ``batch["temperatures"]`` f32 [B, N], when present (a sampler temperature schedule,
    ``rollout.temperature_schedule``), scores each completion token at the temperature it was
    sampled at, instead of the scalar ``temperature``.

    Only the completion columns are scored (``token_logps(first_scored=P)``): the LM head
    never runs over the prompt, whose log-probs no loss reads.

    Shared-prompt layout (``length_groups.shared_layout``, ``algo.shared_prompt``): with
    ``batch["prompt_tokens"]``/``["prompt_mask"]`` [R/G, P] once per group of G rows,
    ``tokens``/``mask`` are the completion columns [R, N] only, and each prompt is computed
    once (``models.shared_prompt``): the same log-probs up to float32 summation order. With
    ``batch["prompt_index"]`` int [R] (groups of any sizes, ``length_groups.ragged_layout``)
    row r continues prompt ``prompt_index[r]``.

    ``extra_ids`` int [B, N, K] (optional): a third output, the log-probs of those ids at each
    completion column, from the same LM-head pass (a distillation teacher's top-k).

    Mixtures of experts: ``batch["routes"]`` int [B, P+N, L, k] (routing replay) sends each
    token to its recorded experts (in the shared-prompt layout ``routes`` [B, N, L, k] are the
    completion columns' and ``prompt_routes`` [B/G, P, L, k] each prompt's); ``moe_stats`` (a
    dict) receives the routing statistics (``models.token_logps``)."""
    n = batch["loss_mask"].shape[1]
    # Images (``batch["pixels"]`` [rows or prompts, I, C, S, S]) go through the vision tower
    # here, inside the loss: frozen unless ``model_cfg.train_vision``.
    images = (vision.image_embeddings(model_cfg, params, batch["pixels"])
              if "pixels" in batch else None)
    routes = batch.get("routes")
    if routes is not None:   # [L, B, T, k], as the trunks scan
        routes = jnp.transpose(routes, (2, 0, 1, 3))
    if "prompt_tokens" in batch:
        temperature = batch.get("temperatures", temperature)
        return shared_prompt.completion_logps(
            model_cfg, params, batch["prompt_tokens"], batch["prompt_mask"],
            batch["tokens"][:, :n], batch["mask"][:, :n], temperature=temperature,
            with_entropy=with_entropy, lora_dropout_rng=lora_dropout_rng,
            extra_targets=extra_ids, image_embeds=images, moe_stats=moe_stats,
            prompt_index=batch.get("prompt_index"), routes=routes,
            prompt_routes=(None if routes is None
                           else jnp.transpose(batch["prompt_routes"], (2, 0, 1, 3))))
    if "temperatures" in batch:
        per_token = jnp.asarray(batch["temperatures"], jnp.float32)
        prompt = jnp.ones((per_token.shape[0], batch["tokens"].shape[1] - n), jnp.float32)
        temperature = jnp.concatenate([prompt, per_token], axis=1)  # [B, P+N]
    out = models.token_logps(model_cfg, params, batch["tokens"],
                             attention_mask=batch["mask"], temperature=temperature,
                             with_entropy=with_entropy, lora_dropout_rng=lora_dropout_rng,
                             first_scored=batch["tokens"].shape[1] - n, extra_targets=extra_ids,
                             image_embeds=images, routes=routes, moe_stats=moe_stats)
    logps, ent = out[:2]
    return (logps[:, -n:], None if ent is None else ent[:, -n:]) + tuple(out[2:])


def _pair(x, m):
    m = m.astype(jnp.float32)
    return jnp.where(m > 0, x, 0.0).sum(), m.sum()


def sft_loss(model_cfg, params, state, batch):
    """Masked next-token cross-entropy over completion tokens: (sum of -log p, #tokens)."""
    logps, _ = completion_logps(model_cfg, params, batch,
                                lora_dropout_rng=training_dropout_rng(model_cfg, state, batch))
    m = batch["loss_mask"]
    num, den = _pair(-logps, m)
    return (num, den), {"nll": (num, den)}


# ----------------------------------------------------------------------------- step builders

def build_sft_step(model_cfg, optimizer, *, num_micro: int = 1, state_shardings=None,
                   mesh=None, loss_scale: float = 1.0) -> Callable:
    """Jitted ``sft_step(state, batch) -> (state, metrics)`` (metrics: loss, nll, grad_norm,
    skipped). ``loss_scale`` multiplies the loss (and gradient); ``nll`` stays unscaled."""
    loss_fn = functools.partial(sft_loss, model_cfg)
    if loss_scale != 1.0:
        unscaled = loss_fn

        def loss_fn(params, state, batch):
            (num, den), metrics = unscaled(params, state, batch)
            return (loss_scale * num, den), metrics

    def sft_step(state, batch):
        return update(optimizer, loss_fn, state, batch, num_micro)
    return jit_step(sft_step, state_shardings, mesh)


# What the log-prob passes read (``prompt_*``: the shared-prompt layout, see completion_logps).
def build_value_step(model_cfg, optimizer, loss: Callable, *, num_micro: int = 1,
                     state_shardings=None, mesh=None, count_steps: bool = True) -> Callable:
    """Jitted update of a value model that lives in ``critic_params`` / ``critic_opt_state``
    (so the run's sharding and checkpoint machinery handle it like a critic): a reward model,
    a process reward model; ``params`` (the policy it was initialised from) is carried
    unchanged. ``loss(model_cfg, value params, state, batch)`` in ``accumulate``'s convention.
    ``count_steps`` False: ``state.step`` stays (a value-model update inside another phase's
    iteration, whose own update counts the step)."""
    loss_fn = functools.partial(loss, model_cfg)

    def value_step(state, batch):
        # With LoRA the value model is adapters + head on the policy's frozen base.
        view = state.replace(params=lora_lib.value_on_base(state.params, state.critic_params),
                             opt_state=state.critic_opt_state)
        new, metrics = update(optimizer, loss_fn, view, batch, num_micro)
        return state.replace(step=new.step if count_steps else state.step,
                             critic_params=lora_lib.trainable(new.params),
                             critic_opt_state=new.opt_state), metrics
    return jit_step(value_step, state_shardings, mesh)


LOGPS_KEYS = ("tokens", "mask", "loss_mask", "temperatures", "prompt_tokens", "prompt_mask",
              "pixels", "routes", "prompt_routes")


def build_logps_fn(model_cfg, *, temperature: float = 1.0, num_micro: int = 1, mesh=None,
                   param_shardings=None, base_only: bool = False) -> Callable:
    """Jitted ``fn(params, batch) -> logps f32 [B, N]`` over the completion (old / reference
    log-probs; at ``batch["temperatures"]`` when present), computed ``num_micro`` row-chunks at
    a time to bound memory. ``base_only``:
    the LoRA adapters are switched off (the base model is the reference policy)."""
    temperature = models.scoring_temperature(temperature)

    def logps_fn(params, batch):
        if base_only:
            params = lora_lib.base_params(params)
        batch = {k: batch[k] for k in LOGPS_KEYS if k in batch}
        if num_micro == 1:
            return completion_logps(model_cfg, params, batch, temperature=temperature)[0]
        micro = split_micro_batches(batch, num_micro)
        out = jax.lax.map(lambda mb: completion_logps(model_cfg, params, mb,
                                                      temperature=temperature)[0], micro)
        b = batch["tokens"].shape[0]
        return jnp.swapaxes(out, 0, 1).reshape(b, -1)  # undo the strided split

    options = compilation_cache.training_compiler_options()
    if mesh is None:
        return jax.jit(logps_fn, compiler_options=options)
    return jax.jit(shd.traced_on(logps_fn, mesh),
                   in_shardings=(param_shardings, batch_sharding(mesh)),
                   out_shardings=batch_sharding(mesh), compiler_options=options)


def to_host(metrics: Mapping[str, Any]) -> dict:
    """Fetches a metrics dict to Python floats/ints (one device->host transfer)."""
    fetched = jax.device_get(dict(metrics))
    return {k: (np.asarray(v).item() if np.ndim(v) == 0 else np.asarray(v))
            for k, v in fetched.items()}
