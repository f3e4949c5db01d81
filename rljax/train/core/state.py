"""TrainState: everything a step reads and writes, as one pytree (principle 1: state is data).

``step`` counts optimizer updates (int32 scalar), ``rng`` is the run's base key (split per step
by the trainer). ``critic_*`` exist for PPO, ``ref_params`` for a frozen reference policy and
``role_baseline`` (f32 [K]) for an advantage estimator with a baseline per role kept across
steps (``algorithms.uses_roles``: RAE); unused fields are ``None``, which jax treats as an empty subtree (nothing stored, nothing
checkpointed).

Shardings: params (and ref/critic params) use the caller's shardings; optimizer-state leaves
mirror their parameter's sharding; scalars (step, counts, rng) are replicated.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec

from rljax.models import lora as lora_lib


@struct.dataclass
class TrainState:
    """Train state pytree; all fields are jax data (no static fields, so it jits as-is)."""

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    critic_params: Any = None
    critic_opt_state: Any = None
    ref_params: Any = None
    role_baseline: Any = None


def create_train_state(params: Any, optimizer: optax.GradientTransformation, rng: jax.Array, *,
                       critic_params: Any = None,
                       critic_optimizer: optax.GradientTransformation | None = None,
                       ref_params: Any = None) -> TrainState:
    """A fresh state at step 0 (works under ``jax.jit``/``jax.eval_shape``)."""
    if (critic_params is None) != (critic_optimizer is None):
        raise ValueError("critic_params and critic_optimizer go together")
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=optimizer.init(lora_lib.trainable(params)),  # LoRA: adapters only
        rng=rng,
        critic_params=critic_params,
        critic_opt_state=(None if critic_optimizer is None
                          else critic_optimizer.init(lora_lib.trainable(critic_params))),
        ref_params=ref_params,
    )


def reference_params(state: TrainState) -> Any:
    """The frozen reference policy: ``ref_params`` when the state holds a copy, else -- with
    LoRA -- the base model (the params without adapters, no copy), else None."""
    if state.ref_params is not None:
        return state.ref_params
    if lora_lib.has_lora(state.params):
        return lora_lib.base_params(state.params)
    return None


def for_checkpoint(state: TrainState) -> TrainState:
    """What a checkpoint holds: with LoRA, the adapters (+ optimizer state, ...) without the
    frozen base, which is rebuilt from ``model.path`` / the seed on restore."""
    critic = state.critic_params
    return state.replace(params=lora_lib.trainable(state.params),
                         critic_params=None if critic is None else lora_lib.trainable(critic))


def from_checkpoint(restored: TrainState, full: TrainState) -> TrainState:
    """Inverse of ``for_checkpoint``: the restored adapters back on ``full``'s frozen base. (A
    LoRA critic holds its adapters and head only; its base is the policy's, see
    ``lora.value_on_base``.)"""
    return restored.replace(params=lora_lib.attach(restored.params, full.params))


def eval_state_shape(params: Any, optimizer: optax.GradientTransformation, rng: Any, *,
                     critic_params: Any = None,
                     critic_optimizer: optax.GradientTransformation | None = None,
                     ref_params: Any = None) -> TrainState:
    """``create_train_state`` evaluated abstractly: a TrainState of ``ShapeDtypeStruct``.

    Inputs may be arrays or ``ShapeDtypeStruct``s; nothing is allocated.
    """
    def build(p, r, c, ref):
        return create_train_state(p, optimizer, r, critic_params=c,
                                  critic_optimizer=critic_optimizer, ref_params=ref)

    return jax.eval_shape(build, params, rng, critic_params, ref_params)


def _path_key(path) -> tuple[str, ...]:
    return tuple(str(entry) for entry in path)


def mirror_shardings(tree: Any, params_like: Any, param_shardings: Any,
                     replicated: jax.sharding.Sharding) -> Any:
    """Shardings for ``tree`` (e.g. an abstract optimizer state) that mirror the params'.

    A leaf of ``tree`` takes the sharding of the parameter whose key path is a suffix of the
    leaf's path (Adam's ``[0].mu['layers']['wq']`` ends with ``['layers']['wq']``) *and* whose
    shape equals the leaf's; every other leaf (counts, scalars, factored statistics) is
    replicated. Path matching is robust to masked/partial states that break tree structure.
    """
    by_path = {}
    flat_params = jax.tree_util.tree_flatten_with_path(params_like)[0]
    flat_shardings = jax.tree.leaves(param_shardings)
    if len(flat_params) != len(flat_shardings):
        raise ValueError("param_shardings must have the same structure as the params")
    for (path, leaf), sharding in zip(flat_params, flat_shardings):
        by_path[_path_key(path)] = (tuple(leaf.shape), sharding)

    def pick(path, leaf):
        key = _path_key(path)
        for start in range(len(key) + 1):
            hit = by_path.get(key[start:])
            if hit is not None and hit[0] == tuple(leaf.shape):
                return hit[1]
        return replicated

    return jax.tree_util.tree_map_with_path(pick, tree)


def _replicated_like(param_shardings: Any) -> jax.sharding.Sharding:
    """A fully replicated sharding on the same devices as the given param shardings."""
    first = jax.tree.leaves(param_shardings)[0]
    if isinstance(first, NamedSharding):
        return NamedSharding(first.mesh, PartitionSpec())
    return first  # single-device (or other) sharding: nothing to replicate over


def state_shardings(shape_state: TrainState, param_shardings: Any,
                    critic_shardings: Any = None) -> TrainState:
    """A TrainState of shardings for ``shape_state`` (from :func:`eval_state_shape`).

    ``param_shardings`` is a pytree of shardings matching ``params`` (and ``ref_params``);
    ``critic_shardings`` matches ``critic_params`` when there is a critic.
    """
    replicated = _replicated_like(param_shardings)
    has_critic = shape_state.critic_params is not None
    trainable = lora_lib.trainable  # optimizer state mirrors the trainable part only
    if has_critic and critic_shardings is None:
        raise ValueError("the state has a critic: pass critic_shardings")
    return TrainState(
        step=replicated,
        params=param_shardings,
        opt_state=mirror_shardings(shape_state.opt_state, trainable(shape_state.params),
                                   trainable(param_shardings), replicated),
        rng=jax.tree.map(lambda _: replicated, shape_state.rng),
        critic_params=critic_shardings if has_critic else None,
        critic_opt_state=(mirror_shardings(shape_state.critic_opt_state,
                                           trainable(shape_state.critic_params),
                                           trainable(critic_shardings),
                                           replicated) if has_critic else None),
        ref_params=(lora_lib.base_params(param_shardings) if lora_lib.has_lora(param_shardings)
                    else param_shardings) if shape_state.ref_params is not None else None,
        role_baseline=None if shape_state.role_baseline is None else replicated,
    )


def abstract_train_state(shape_state: TrainState, shardings: TrainState) -> TrainState:
    """Zips shapes and shardings into ``ShapeDtypeStruct(shape, dtype, sharding=...)`` leaves:
    the target that ``CheckpointManager.restore`` and ``jax.jit(out_shardings=...)`` want."""
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shape_state, shardings)


TRAINED_FIELDS = ("params", "opt_state", "critic_params", "critic_opt_state")


@jax.jit
def _finite_flags(fields: dict) -> dict:
    """``{field: bool scalar}``: every floating-point element of that subtree is finite."""
    def finite(tree):
        leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
                  if jnp.issubdtype(x.dtype, jnp.inexact)]
        return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)
    return {name: finite(tree) for name, tree in fields.items()}


def nonfinite_fields(state: TrainState) -> list[str]:
    """Names of the trained fields of ``state`` (params, opt_state, critic_params,
    critic_opt_state) holding a NaN or inf anywhere: one reduction over each, on device
    (a collective in multi-host runs: every process calls it). ``[]`` when all are finite."""
    fields = {n: getattr(state, n) for n in TRAINED_FIELDS if getattr(state, n) is not None}
    flags = jax.device_get(_finite_flags(fields))
    return [n for n in TRAINED_FIELDS if n in flags and not bool(flags[n])]
