"""Optimizers from config, learning-rate schedules, and skipping non-finite updates.

``make_optimizer(cfg.optimizer, total_steps)`` returns a plain ``optax.GradientTransformation``:
global-norm clipping, then adamw/adam/sgd driven by a warm-up + decay schedule. Gradient
accumulation is *not* done here (no ``optax.MultiSteps``): the trainer sums exact
``(weighted_sum, weight)`` pairs over micro-batches itself and calls ``update`` once.

``apply_if_finite`` applies an update only when the loss and every gradient are finite (inside
jit); ``NonFiniteGuard`` is the host-side policy that stops a run after too many skips in a row.
"""
from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from rljax.errors import ConfigError, TrainingDiverged

# Parameters whose path contains one of these names get no weight decay (norm scales, biases):
# decaying them only fights the normalisation. Matched on path names, not ndim, because
# layer-stacked params make norm scales 2-D.
# "vision": a multimodal model's tower, frozen by default: its gradient is zero then, and
# decoupled weight decay would still shrink it.
NO_DECAY_NAMES = ("norm", "bias", "scale", "vision")


def make_schedule(opt_cfg, total_steps: int) -> Callable[[Any], jax.Array]:
    """Learning rate as a function of the update count (0-based).

    Warm-up rises linearly to the peak over ``warmup_steps`` updates, reaching ``lr *
    (count+1)/warmup`` at ``count`` (so the very first update already moves). After warm-up:
    ``constant``, or ``linear``/``cosine`` decay to ``lr * min_lr_ratio`` at ``total_steps``.
    """
    peak = float(opt_cfg.learning_rate)
    warmup = int(opt_cfg.warmup_steps)
    kind = opt_cfg.schedule
    floor = float(opt_cfg.min_lr_ratio)
    decay_steps = max(int(total_steps) - warmup, 1)
    if kind not in ("constant", "linear", "cosine"):
        raise ConfigError(f"optimizer.schedule={kind!r} is not one of: constant, linear, cosine")

    def schedule(count):
        count = jnp.asarray(count, jnp.float32)
        warm = peak * jnp.minimum(1.0, (count + 1.0) / max(warmup, 1))
        progress = jnp.clip((count - warmup) / decay_steps, 0.0, 1.0)
        if kind == "constant":
            factor = jnp.ones_like(progress)
        elif kind == "linear":
            factor = 1.0 - (1.0 - floor) * progress
        else:
            factor = floor + (1.0 - floor) * 0.5 * (1.0 + jnp.cos(math.pi * progress))
        return jnp.where(count < warmup, warm, peak * factor)

    return schedule


def decay_mask(params: Any) -> Any:
    """Pytree of bools: True where weight decay applies (see ``NO_DECAY_NAMES``)."""
    def wants_decay(path, _):
        names = [str(getattr(k, "key", getattr(k, "name", ""))).lower() for k in path]
        return not any(tag in name for name in names for tag in NO_DECAY_NAMES)

    return jax.tree_util.tree_map_with_path(wants_decay, params)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """``optax.clip_by_global_norm`` (same arithmetic, same empty state) that takes the norm
    as the extra argument ``grad_norm`` when the caller has it: ``apply_if_finite`` computes it
    for the finiteness test, and a second reduction over every gradient inside the update was
    ~65 of the ~300 ms an AdamW step took at SmolLM2-135M's size on CPU."""
    def update_fn(updates, state, params=None, *, grad_norm=None, **extra_args):
        del params, extra_args
        norm = optax.tree.norm(updates) if grad_norm is None else grad_norm
        keep = norm < max_norm
        updates = jax.tree.map(
            lambda t: jax.lax.select(keep, t, (t / norm.astype(t.dtype)) * max_norm), updates)
        return updates, state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)


def make_optimizer(opt_cfg, total_steps: int, learning_rate: float | None = None
                   ) -> optax.GradientTransformation:
    """Builds the optimizer from ``cfg.optimizer`` (``learning_rate`` overrides the peak LR,
    e.g. for the critic or the SFT warm-up)."""
    if learning_rate is not None:
        opt_cfg = _with_lr(opt_cfg, learning_rate)
    lr = make_schedule(opt_cfg, total_steps)
    name, wd = opt_cfg.name, float(opt_cfg.weight_decay)
    parts = []
    if opt_cfg.max_grad_norm and opt_cfg.max_grad_norm > 0:
        parts.append(clip_by_global_norm(float(opt_cfg.max_grad_norm)))
    if name == "adamw":
        parts.append(optax.adamw(lr, b1=opt_cfg.b1, b2=opt_cfg.b2, eps=opt_cfg.eps,
                                 weight_decay=wd, mask=decay_mask))
    elif name in ("adam", "sgd"):
        if wd:  # coupled L2: the decay term goes through the optimizer like a gradient
            parts.append(optax.masked(optax.add_decayed_weights(wd), decay_mask))
        if name == "adam":
            parts.append(optax.adam(lr, b1=opt_cfg.b1, b2=opt_cfg.b2, eps=opt_cfg.eps))
        else:
            parts.append(optax.sgd(lr, momentum=opt_cfg.momentum or None))
    else:
        raise ConfigError(f"optimizer.name={name!r} is not one of: adamw, adam, sgd")
    return optax.chain(*parts)


def _with_lr(opt_cfg, learning_rate: float):
    copy = opt_cfg.copy_and_resolve_references()
    copy.learning_rate = float(learning_rate)
    return copy


class UpdateResult(NamedTuple):
    """Output of :func:`apply_if_finite`."""

    params: Any
    opt_state: Any
    skipped: jax.Array      # bool scalar: True when the update was dropped
    grad_norm: jax.Array    # global norm of the raw gradients (inf/nan when non-finite)


def all_finite(tree: Any) -> jax.Array:
    """Bool scalar: every element of every leaf is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def apply_if_finite(optimizer: optax.GradientTransformation, params: Any, opt_state: Any,
                    grads: Any, loss: jax.Array) -> UpdateResult:
    """One optimizer update, kept only if ``loss`` and the global norm of ``grads`` are finite
    (jit-safe): any NaN or inf in the gradients makes their norm non-finite.

    When anything is non-finite the old params *and* optimizer state are returned unchanged
    (so Adam moments and the schedule count are not polluted) and ``skipped`` is True.
    The update runs under ``lax.cond``. Selecting new or old values with ``jnp.where`` after
    the update made XLA copy every Adam moment first (the old values had to outlive the
    in-place update): at SmolLM2-135M's size on CPU an apply took 0.51 s that way, 0.29 s now.
    """
    # A NaN or inf anywhere makes the global norm NaN or inf, so the norm (needed for the
    # metric and for clipping anyway) is the finiteness test: one reduction over the gradients
    # instead of a second one per leaf (~0.3 s less XLA compile at a 12-leaf model on CPU).
    # It also skips finite gradients whose norm overflows float32 (> ~1.8e19), which clipping
    # would have scaled to zero.
    grad_norm = optax.tree.norm(grads)
    ok = jnp.logical_and(jnp.all(jnp.isfinite(loss)), jnp.isfinite(grad_norm))

    # Optimizers from make_optimizer reuse the norm for clipping (clip_by_global_norm).
    extra = ({"grad_norm": grad_norm}
             if isinstance(optimizer, optax.GradientTransformationExtraArgs) else {})

    def update(params, opt_state, grads):
        updates, new_opt_state = optimizer.update(grads, opt_state, params, **extra)
        # float32 gradients of bfloat16 params promote Adam's moments to float32; both cond
        # branches must keep the state's own dtypes.
        new_opt_state = jax.tree.map(lambda new, old: new.astype(old.dtype),
                                     new_opt_state, opt_state)
        return optax.apply_updates(params, updates), new_opt_state

    new_params, new_opt_state = jax.lax.cond(ok, update, lambda p, s, _: (p, s),
                                             params, opt_state, grads)
    return UpdateResult(params=new_params, opt_state=new_opt_state,
                        skipped=jnp.logical_not(ok), grad_norm=grad_norm)


class NonFiniteGuard:
    """Host-side policy: count consecutive skipped updates; raise after ``max_consecutive``.

    ``update(skipped, step)`` is called once per optimizer step with the (fetched) flag.
    """

    def __init__(self, max_consecutive: int):
        self.max_consecutive = int(max_consecutive)
        self.consecutive = 0
        self.total = 0
        self.learning_rate_key = "optimizer.learning_rate"  # the current phase's LR key

    def update(self, skipped: Any, step: int | None = None) -> bool:
        """Records one step; returns the flag as a bool. Raises TrainingDiverged at the limit."""
        skipped = bool(skipped)
        if not skipped:
            self.consecutive = 0
            return False
        self.consecutive += 1
        self.total += 1
        if self.consecutive >= self.max_consecutive:
            where = f" (last at step {step})" if step is not None else ""
            raise TrainingDiverged(
                f"loss or gradients were non-finite for {self.consecutive} consecutive steps"
                f"{where}; the update was skipped each time. Lower {self.learning_rate_key}, "
                "check the data/rewards, or raise optimizer.max_consecutive_nonfinite.")
        return True

    def state_dict(self) -> dict:
        """JSON-able counters, for checkpoint meta (so a resume keeps counting)."""
        return {"consecutive": self.consecutive, "total": self.total}

    def load_state_dict(self, state: dict) -> None:
        self.consecutive = int(state.get("consecutive", 0))
        self.total = int(state.get("total", 0))
