"""Reward-model training: Bradley-Terry loss on preference pairs with a value-head model.

The reward model is ``models.value_forward`` (trunk + scalar head, usually initialised from a
policy checkpoint with ``models.init_value_params(from_params=...)``); the score of a
completion is the value at the *last real token* of ``prompt ++ completion``, i.e. after the
model has read the whole answer including its EOS. The loss per pair is
``-log sigmoid(r_chosen - r_rejected)`` (``algorithms.reward_model_loss``); accuracy is the
fraction of pairs with ``r_chosen > r_rejected``.

Batches are the arrays of ``data.encode_preference`` (see :mod:`rljax.train.phases.dpo`):
``prompt_tokens/prompt_mask [B, P]``, ``chosen_tokens/chosen_mask`` and
``rejected_tokens/rejected_mask [B, C]``. ``build_rm_step`` trains ``TrainState.params``
(value params); the run's ``RMPhase`` keeps the reward model in ``critic_params`` instead.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from rljax import algorithms, models
from rljax import distributed as dist
from rljax.errors import UserError
from rljax.models import lora as lora_lib
from rljax.train.core import programs as programs_lib, steps
from rljax.train.core import preference_data
from rljax.train.phases import dpo as dpo_lib
from rljax.train.core.steps import to_host
from rljax.train.methods.prm_scoring import initial_value

Array = jax.Array


def last_token_scores(values: Array, mask: Array) -> Array:
    """Values [B, T] at each row's last True position of ``mask`` [B, T] -> [B] (0 if empty)."""
    m = mask.astype(bool)
    t = mask.shape[1]
    # argmax finds the first True of the reversed row, i.e. the last True of the row.
    last = t - 1 - jnp.argmax(m[:, ::-1], axis=1)
    picked = jnp.take_along_axis(values, last[:, None], axis=1)[:, 0]
    return jnp.where(m.any(axis=1), picked, 0.0)


def pair_scores(model_cfg: models.ModelConfig, value_params: Any, batch: dict,
                lora_dropout_rng=None) -> tuple[Array, Array]:
    """Reward-model scores (chosen [B], rejected [B]) of a preference batch.

    Chosen and rejected rows go through the model together as one [2B, P+C] batch.
    ``lora_dropout_rng``: LoRA dropout of a training pass (None = none, as in evaluation).
    """
    seq = dpo_lib.pair_sequences(batch)
    values = models.value_forward(model_cfg, value_params, seq["tokens"],
                                  attention_mask=seq["attention_mask"],
                                  lora_dropout_rng=lora_dropout_rng)
    scores = last_token_scores(values, seq["attention_mask"])
    b = batch["chosen_tokens"].shape[0]
    return scores[:b], scores[b:]


def rm_loss(model_cfg: models.ModelConfig, params: Any, state, batch: dict):
    """Micro-batch Bradley-Terry loss in the ``steps.accumulate`` convention (``params`` are
    value params). Returns ``((loss sum over real pairs, number of real pairs), metric
    pairs)``: accuracy (score of chosen > rejected), score/chosen, score/rejected,
    score/margin."""
    chosen, rejected = pair_scores(model_cfg, params, batch,
                                   steps.training_dropout_rng(model_cfg, state, batch))
    m = dpo_lib.pair_mask(batch)
    loss_sum, weight = algorithms.reward_model_loss(chosen, rejected, mask=m)
    correct, _ = algorithms.preference_accuracy(chosen, rejected, m)
    msum = lambda x: jax.lax.stop_gradient(jnp.where(m, x, 0.0).sum())  # noqa: E731
    metrics = {
        "accuracy": (correct, weight),
        "score/chosen": (msum(chosen), weight),
        "score/rejected": (msum(rejected), weight),
        "score/margin": (msum(chosen - rejected), weight),
    }
    return (loss_sum, weight), metrics


def build_rm_step(model_cfg, optimizer, *, num_micro: int = 1, state_shardings=None,
                  mesh=None) -> Callable:
    """Jitted ``rm_step(state, batch) -> (state, metrics)``; ``state.params`` are value params.
    Metrics: loss, accuracy, score/{chosen,rejected,margin}, grad_norm, skipped."""
    loss_fn = functools.partial(rm_loss, model_cfg)

    def rm_step(state, batch):
        return steps.update(optimizer, loss_fn, state, batch, num_micro)
    return steps.jit_step(rm_step, state_shardings, mesh)


def build_score_fn(model_cfg) -> Callable:
    """Jitted ``score(value_params, batch) -> (chosen [B], rejected [B])`` for evaluation."""
    return jax.jit(functools.partial(pair_scores, model_cfg))


# ----------------------------------------------------------------------------- phase

RM_STREAM = 5  # rng stream of the value head's initialisation


def _optimizer(ctx, steps: int):
    o = ctx.cfg.optimizer
    return ctx.optimizer(o.critic_learning_rate or o.learning_rate, int(steps))


def _init_state(ctx, optimizer, state):
    # With LoRA: adapters + head on the frozen base, no copy.
    value = initial_value(ctx.model_cfg, state.params, jax.random.fold_in(state.rng, RM_STREAM))
    return state.replace(opt_state=None, ref_params=None, critic_params=value,
                         critic_opt_state=optimizer.init(value))


def _build(ctx, optimizer, state):
    cfg = ctx.cfg
    micro, pairs = cfg.algo.micro_batch_size, cfg.rollout.batch_size
    num_micro = pairs // micro if micro and pairs % micro == 0 else 1
    return steps.build_value_step(ctx.model_cfg, optimizer, rm_loss, num_micro=num_micro,
                                  state_shardings=ctx.state_shardings(state), mesh=ctx.mesh)


class RMPhase:
    """``steps`` reward-model updates on ``rollout.batch_size`` pairs each (``PreferenceData``:
    a preference file, or right-vs-wrong pairs from a synthetic task).

    The reward model (``critic_params``) is the policy's trunk (after any SFT warm-up) plus a
    fresh scalar head; the policy itself is not trained. Evaluation: pairwise accuracy on
    held-out pairs (``eval/accuracy``), loss and score margin.
    """

    name = "rm"

    def __init__(self, ctx, steps: int):
        cfg = ctx.cfg
        self.ctx, self.steps = ctx, int(steps)
        self.num_pairs = cfg.rollout.batch_size
        if self.num_pairs % ctx.dp_size:
            raise UserError(f"rollout.batch_size={self.num_pairs} pairs do not split over the "
                            f"data-parallel mesh size {ctx.dp_size}")
        self.data = preference_data.PreferenceData(ctx, self.num_pairs)
        self.optimizer = _optimizer(ctx, self.steps)
        self._step_fn = self._eval_fn = self._eval_batches = None

    def init_state(self, state):
        return _init_state(self.ctx, self.optimizer, state)

    def _compiled(self, state):
        if self._step_fn is None:
            self._step_fn = _build(self.ctx, self.optimizer, state)
        return self._step_fn

    @staticmethod
    def programs(ctx, steps: int):
        """``(abstract state, [Program])``: the update on ``rollout.batch_size`` pairs
        (``programs.pair_batch``)."""
        optimizer = _optimizer(ctx, steps)
        state = programs_lib.phase_state(ctx, lambda s: _init_state(ctx, optimizer, s))
        batch = programs_lib.pair_batch(ctx, int(ctx.cfg.rollout.batch_size))
        return state, [programs_lib.Program("update", _build(ctx, optimizer, state),
                                            (state, batch), programs_lib.shard_bytes(state))]

    def iteration(self, state, step: int):
        t0 = time.perf_counter()
        batch = next(self.data)
        state, m = self._compiled(state)(state, dist.device_batch(batch, self.ctx.mesh))
        m = to_host(m)
        m.update({"rm/pairs": int(batch["pair_mask"].sum()),
                  "time/step": time.perf_counter() - t0})
        return state, m

    def evaluate(self, state, rng) -> dict:
        """Held-out pairs: eval/accuracy (score of chosen > rejected), eval/loss, margins."""
        del rng
        if self._eval_batches is None:
            self._eval_batches = preference_data.eval_pair_batches(self.ctx)
            cfg = self.ctx.model_cfg.replace(lora_dropout=0.0)  # evaluation: no LoRA dropout
            self._eval_fn = jax.jit(lambda v, b: rm_loss(cfg, v, None, b))
        if not self._eval_batches:
            return {}
        value = lora_lib.value_on_base(state.params, state.critic_params)
        return preference_data.pair_metrics(lambda b: self._eval_fn(value, b),
                                    self._eval_batches)

    def state_dict(self) -> dict:
        return {"data": self.data.state()}

    def load_state_dict(self, state: dict) -> None:
        self.data.restore(state["data"])
