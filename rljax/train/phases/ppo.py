"""PPO with a learned critic (Schulman et al. 2017; the RLHF recipe of Ouyang et al. 2022).

One iteration: sample completions -> score them (host reward functions) -> ``ppo_prepare``
(old log-probs, reference log-probs, critic values, token-level rewards, GAE, whitened
advantages; no gradients) -> K epochs x minibatches of ``ppo_step`` updating policy and critic.

Batches use the sequence layout of ``rljax.train.core.steps`` (prompt bucket P, completion slot N)::

    tokens     int32 [B, P+N]   mask bool [B, P+N]   loss_mask bool [B, N]
    rewards    f32   [B]        sequence scores from the reward functions

``ppo_prepare`` adds, in completion space [B, N] (entry t belongs to completion token t):
``old_logps``, ``old_values`` (V of the prefix *before* token t), ``advantages``, ``returns``
and, when a KL to the reference is used, ``ref_logps``.

Multi-turn episodes (``env.name``): the completion slot holds the whole trajectory and
``loss_mask`` only the model's tokens, so values, rewards, GAE and both losses live on model
tokens; observation tokens are skipped by the GAE recursion (neither discounted nor a break:
the last token of turn t bootstraps from the first token of turn t+1, whose value reads the
observation as context). With ``env.turn_discount`` the rollout also gives ``token_rewards``
(each turn's reward on its last model token) and ``next_discount`` (that gamma at turn ends).

Token-level reward: the sequence reward sits on the last real completion token; with
``algo.kl_in_reward`` every token also pays ``-beta * KL_t(pi_old || pi_ref)`` (estimator
``algo.kl_estimator``). Without it, ``beta > 0`` adds the KL as a loss term, as in GRPO.

The critic is ``models.value_forward`` over ``state.critic_params`` (initialise it from the
policy with ``models.init_value_params(cfg, rng, from_params=params)``) with its own optimizer
(``state.critic_opt_state``).

Routing replay (``algo.routing_replay``, a mixture of experts): ``batch["routes"]`` [B, P+N,
L, k] are the sampler's, so the policy's passes (old and reference log-probs, the update)
replay them as GRPO's do. The critic routes freely: its router is its own (trained by the value
loss from the policy's copy), the recorded routes are the policy's choice, and what replay
fixes -- the sampler and the trainer scoring one token under different experts -- concerns
only the policy's log-probs (R3 replays the policy alone).
"""
from __future__ import annotations

import functools
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from rljax import algorithms, models
from rljax import distributed as dist
from rljax.models import lora as lora_lib, vision
from rljax.train.core import programs as programs_lib, steps
from rljax.train.phases.grpo import (check_replay_model, policy_loss_options, round_source,
                                     routes_field)
from rljax.train.core.optim import all_finite, apply_if_finite
from rljax.train.core.rollout import RewardRollout
from rljax.train.core.setup import Context, rl_iterator, update_sizes
from rljax.train.core.state import reference_params
from rljax.train.core.metrics import host_fraction
from rljax.train.core.steps import to_host
from rljax.train.methods import guidance, relift
from rljax.train.methods.demos import demo_old_logps

Array = jax.Array
sg = jax.lax.stop_gradient


# ----------------------------------------------------------------------------- pieces

def completion_values(model_cfg, critic_params, batch, lora_dropout_rng=None) -> Array:
    """Critic values [B, N]: entry t is V(prompt ++ completion[:t]), the state in which
    completion token t is chosen, read at the position just before it (like its logits).
    ``lora_dropout_rng``: LoRA dropout on the critic's adapters (training loss only). A row's
    images (``batch["pixels"]`` [B, I, C, S, S]) go through the critic's own copy of the tower,
    so the critic values the state the policy acts in."""
    n = batch["loss_mask"].shape[1]
    images = (vision.image_embeddings(model_cfg, critic_params["trunk"], batch["pixels"])
              if "pixels" in batch else None)
    values = models.value_forward(model_cfg, critic_params, batch["tokens"],
                                  attention_mask=batch["mask"],
                                  lora_dropout_rng=lora_dropout_rng, image_embeds=images)
    return values[:, -n - 1:-1]


def token_rewards(rewards: Array, mask: Array, kl: Array | None = None,
                  beta: float = 0.0) -> Array:
    """Sequence rewards [B] placed on each row's last real token of ``mask`` [B, N], minus
    ``beta * kl`` [B, N] on every real token (KL-in-reward). [B, N], 0 where masked."""
    mask = mask.astype(bool)
    n = mask.shape[1]
    last = n - 1 - jnp.argmax(mask[:, ::-1], axis=1)
    at_last = jnp.arange(n)[None, :] == last[:, None]
    r = jnp.where(at_last & mask, jnp.asarray(rewards, jnp.float32)[:, None], 0.0)
    if kl is not None and beta:
        r = r - beta * sg(kl)
    return jnp.where(mask, r, 0.0)


def advantages_and_returns(algo_cfg, rewards, values, old_logps, ref_logps, mask,
                           placed_rewards=None, next_discount=None):
    """GAE on token-level rewards. All [B, N] except ``rewards`` [B]; ``ref_logps`` may be None.

    ``placed_rewards`` [B, N] (multi-turn per-turn rewards, each on its turn's last model
    token) replace ``rewards`` [B] on the last token; ``next_discount`` [B, N] scales gamma
    per step (``algorithms.gae``: the turn discount at turn ends). Tokens outside ``mask``
    (observations) are skipped by the recursion.

    Returns ``(advantages, returns, metrics)``. Advantages are whitened over the real tokens of
    the whole rollout batch when ``algo.whiten_advantages`` (before minibatching, so every
    minibatch sees the same normalisation); returns are never whitened (critic targets).
    """
    m = mask.astype(bool)
    metrics = {}
    kl = None
    if ref_logps is not None:
        kl = algorithms.get_kl_estimator(algo_cfg.kl_estimator)(old_logps, ref_logps)
        metrics["kl_ref"] = algorithms.masked_mean(kl, m)
    kl_term = kl if algo_cfg.kl_in_reward else None
    if placed_rewards is None:
        r = token_rewards(rewards, m, kl_term, float(algo_cfg.beta))
    else:
        r = token_rewards(jnp.zeros_like(rewards), m, kl_term, float(algo_cfg.beta)) + \
            jnp.where(m, placed_rewards, 0.0)
    adv, returns = algorithms.gae(r, values, m, gamma=float(algo_cfg.gamma),
                                  lam=float(algo_cfg.lam), next_discount=next_discount)
    metrics["advantages/raw_mean"] = algorithms.masked_mean(adv, m)
    if algo_cfg.whiten_advantages:
        adv = algorithms.masked_whiten(adv, m)
    metrics["values/mean"] = algorithms.masked_mean(values, m)
    metrics["returns/mean"] = algorithms.masked_mean(returns, m)
    return adv, returns, metrics


def build_prepare(model_cfg, algo_cfg, *, temperature: float = 1.0) -> Callable:
    """Jitted ``prepare(state, batch) -> (batch + PPO fields, metrics)`` (no gradients).

    ``old_logps`` are the trainer's own log-probs before the first update (not the sampler's),
    so the first PPO ratio is exactly 1; taken from the batch when the rollout computed them. The reference is used when ``algo.beta > 0`` and
    ``state.ref_params`` is set.
    """
    temperature = models.scoring_temperature(temperature)

    def prepare(state, batch):
        m = batch["loss_mask"].astype(bool)
        if "old_logps" in batch:  # the rollout already computed them
            old = batch["old_logps"]
        else:
            old, _ = steps.completion_logps(model_cfg, state.params, batch,
                                            temperature=temperature)
        ref = None
        ref_params = reference_params(state)  # with LoRA: the base, adapters off
        if algo_cfg.beta > 0 and ref_params is not None:
            ref, _ = steps.completion_logps(model_cfg, ref_params, batch,
                                            temperature=temperature)
        values = completion_values(model_cfg, lora_lib.value_on_base(state.params,
                                                                     state.critic_params), batch)
        adv, returns, metrics = advantages_and_returns(
            algo_cfg, batch["rewards"], values, old, ref, m,
            placed_rewards=batch.get("token_rewards"), next_discount=batch.get("next_discount"))
        if "demo" in batch:   # demonstrations: the ratio's anchor is mu = 1 (the KL above
            old = demo_old_logps(old, batch["demo"])   # in the reward used the policy's own)
        out = dict(batch, old_logps=jnp.where(m, old, 0.0), old_values=jnp.where(m, values, 0.0),
                   advantages=adv, returns=returns)
        if ref is not None:
            out["ref_logps"] = jnp.where(m, ref, 0.0)
        return out, metrics

    return jax.jit(prepare)


# ----------------------------------------------------------------------------- loss / step

def _pair(x, m):
    m = m.astype(jnp.float32)
    return jnp.where(m > 0, sg(x), 0.0).astype(jnp.float32).sum(), m.sum()


def ppo_loss(model_cfg, algo_cfg, temperature, params, state, batch, *, partial=False):
    """Micro-batch PPO loss; ``params = {"policy": ..., "critic": ...}`` (both differentiated).

    ``policy loss + vf_coef * value loss``, both aggregated by ``algo.loss_agg_mode`` over the
    same mask, so they share one weight. ``partial``: samples drawn by earlier versions
    (partial or asynchronous rollouts), the behaviour weight on as in ``grpo_loss``. Returns
    ``((weighted_sum, weight), metric pairs)``.
    """
    m = batch["loss_mask"].astype(bool)
    n = m.shape[1]
    entropy_coef = float(algo_cfg.entropy_coef)
    # LoRA dropout: independent masks for the policy's and the critic's adapters.
    rng = steps.training_dropout_rng(model_cfg, state, batch)
    policy_rng, critic_rng = (None, None) if rng is None else jax.random.split(rng)
    logps, ent = steps.completion_logps(model_cfg, params["policy"], batch,
                                        temperature=temperature, with_entropy=entropy_coef > 0,
                                        lora_dropout_rng=policy_rng)
    # Tokens drawn by earlier versions (asynchronous, or carried by partial rollouts): the
    # behaviour weight is on.
    opts = policy_loss_options(algo_cfg, partial=partial)
    if "tis_cap" in opts:
        opts["sampler_logps"] = batch["sampler_logps"]
    pg, metrics = algorithms.get_policy_loss(algo_cfg.policy_loss)(
        logps, batch["old_logps"], batch["advantages"], m, **opts)
    kl = None
    if algo_cfg.beta > 0 and not algo_cfg.kl_in_reward and "ref_logps" in batch:
        kl = algorithms.get_kl_estimator(algo_cfg.kl_estimator)(logps, batch["ref_logps"])
        metrics["kl_loss"] = _pair(kl, m)
    policy_tokens = algorithms.combine_token_losses(
        pg, m, kl_tokens=kl, kl_coef=float(algo_cfg.beta), entropy_tokens=ent,
        entropy_coef=entropy_coef)
    values = completion_values(model_cfg,
                               lora_lib.value_on_base(params["policy"], params["critic"]), batch,
                               lora_dropout_rng=critic_rng)
    clip = float(algo_cfg.cliprange_value) or None
    vf, vf_clipped = algorithms.value_loss_tokens(values, batch["old_values"], batch["returns"],
                                                  m, clip_range=clip)
    pg_pair = algorithms.aggregate(policy_tokens, m, algo_cfg.loss_agg_mode, max_len=n)
    vf_pair = algorithms.aggregate(vf, m, algo_cfg.loss_agg_mode, max_len=n)
    metrics["pg_loss"] = jax.tree.map(sg, pg_pair)
    metrics["vf_loss"] = jax.tree.map(sg, vf_pair)
    metrics["vf_clipfrac"] = _pair(vf_clipped, m)
    metrics["values/pred_mean"] = _pair(values, m)
    if ent is not None:
        metrics["entropy"] = _pair(ent, m)
    total = pg_pair[0] + float(algo_cfg.vf_coef) * vf_pair[0]
    return (total, pg_pair[1]), metrics


def ppo_update(optimizer, critic_optimizer, loss_fn, state, batch, num_micro: int = 1):
    """One exact update of policy and critic (pure). Returns ``(new_state, metrics)``.

    Gradients of both models come from one accumulation (``steps.accumulate`` over a view of
    the state whose ``params`` are ``{"policy", "critic"}``). Each model then takes its own
    optimizer step; if anything is non-finite *both* are skipped, so they stay in step.
    """
    joint = state.replace(params={"policy": state.params, "critic": state.critic_params})
    grads, num, den, metric_sums = steps.accumulate(loss_fn, joint, batch, num_micro)
    grads = jax.tree.map(lambda g: algorithms.safe_divide(g, den), grads)
    loss = algorithms.safe_divide(num, den)
    # Each apply_if_finite checks its own grads and the loss; fold the other model's
    # finiteness into the loss it sees so that a skip is joint.
    nan = jnp.asarray(jnp.nan, loss.dtype)
    pol = apply_if_finite(optimizer, lora_lib.trainable(state.params), state.opt_state,
                          grads["policy"], jnp.where(all_finite(grads["critic"]), loss, nan))
    cri = apply_if_finite(critic_optimizer, state.critic_params, state.critic_opt_state,
                          grads["critic"], jnp.where(all_finite(grads["policy"]), loss, nan))
    new_state = state.replace(step=state.step + 1, opt_state=pol.opt_state,
                              params=lora_lib.with_trainable(state.params, pol.params),
                              critic_params=cri.params, critic_opt_state=cri.opt_state)
    metrics = {"loss": loss, "grad_norm": pol.grad_norm, "critic_grad_norm": cri.grad_norm,
               "skipped": pol.skipped.astype(jnp.int32), **steps.finalize_metrics(metric_sums)}
    return new_state, metrics


def build_ppo_step(model_cfg, algo_cfg, optimizer, critic_optimizer, *, temperature: float = 1.0,
                   num_micro: int = 1, state_shardings=None, mesh=None,
                   partial: bool = False) -> Callable:
    """Jitted ``ppo_step(state, batch) -> (state, metrics)`` on a prepared minibatch
    (``ppo_prepare`` fields). Metrics: loss, pg_loss, vf_loss, vf_clipfrac, clipfrac_*,
    approx_kl, values/pred_mean, entropy (entropy_coef > 0), kl_loss (KL as a loss term),
    grad_norm, critic_grad_norm, skipped. ``partial``: see ``ppo_loss``."""
    temperature = models.scoring_temperature(temperature)
    loss_fn = functools.partial(ppo_loss, model_cfg, algo_cfg, temperature, partial=partial)

    def ppo_step(state, batch):
        return ppo_update(optimizer, critic_optimizer, loss_fn, state, batch, num_micro)
    return steps.jit_step(ppo_step, state_shardings, mesh)


# ----------------------------------------------------------------------------- phase

CRITIC_STREAM = 4  # rng stream of the critic head's initialisation


def _optimizers(ctx: Context, steps_: int):
    """(policy optimizer, critic optimizer) over the phase's updates."""
    o = ctx.cfg.optimizer
    updates = int(steps_) * update_sizes(ctx.cfg)[2]
    return (ctx.optimizer(o.learning_rate, updates),
            ctx.optimizer(o.critic_learning_rate or o.learning_rate, updates))


def _init_state(ctx: Context, optimizer, critic_optimizer, state):
    rng = jax.random.fold_in(state.rng, CRITIC_STREAM)
    if lora_lib.has_lora(state.params):
        critic = lora_lib.init_value_adapters(ctx.model_cfg, state.params, rng)
        ref = None
    else:
        critic = models.init_value_params(ctx.model_cfg, rng, from_params=state.params)
        ref = jax.tree.map(jnp.copy, state.params) if ctx.cfg.algo.beta > 0 else None
    return state.replace(opt_state=optimizer.init(lora_lib.trainable(state.params)),
                         critic_params=critic, critic_opt_state=critic_optimizer.init(critic),
                         ref_params=ref)


def _build(ctx: Context, optimizer, critic_optimizer, state):
    cfg = ctx.cfg
    return build_ppo_step(ctx.model_cfg, cfg.algo, optimizer, critic_optimizer,
                          temperature=cfg.rollout.temperature, num_micro=update_sizes(cfg)[1],
                          state_shardings=ctx.state_shardings(state), mesh=ctx.mesh,
                          partial=bool(cfg.rollout.partial or cfg.algo.get("asynchronous")))


def batch_fields(cfg, prepared: bool) -> dict:
    """The fields of a PPO batch besides ``tokens``/``mask``: {name: (shape after the row
    axis, dtype)}; the rollout's (``RewardRollout``), or ``prepared`` (``build_prepare``'s)."""
    a, n, f32 = cfg.algo, programs_lib.completion_len(cfg), jnp.float32
    fields = {"loss_mask": ((n,), bool), "sampler_logps": ((n,), f32),
              "old_logps": ((n,), f32), "rewards": ((), f32)}
    if a.beta > 0 and (prepared or not a.kl_in_reward):
        fields["ref_logps"] = ((n,), f32)
    if cfg.rollout.temperature_schedule.name != "constant":
        fields["temperatures"] = ((n,), f32)
    if cfg.env.name:   # multi-turn episodes (rljax.train.methods.agent)
        fields["model_mask"] = ((n,), bool)
        if cfg.env.turn_discount:
            fields.update(token_rewards=((n,), f32), next_discount=((n,), f32))
    if prepared:
        fields.update(old_values=((n,), f32), advantages=((n,), f32), returns=((n,), f32))
    return fields


def _batch(ctx: Context, rows: int, prepared: bool) -> dict:
    out = programs_lib.sequence_batch(ctx, rows)
    width = out["tokens"].shape[1]
    fields = dict(batch_fields(ctx.cfg, prepared), **routes_field(ctx.cfg, ctx.model_cfg))
    for key, (tail, dtype) in fields.items():
        tail = (width, *tail[1:]) if key == "routes" else tail   # the P+N columns
        out.setdefault(key, programs_lib.batch_struct(ctx.mesh, (rows, *tail), dtype))
    return out


class PPOPhase:
    """``steps`` PPO iterations: rollout -> ``prepare`` (values, GAE) -> ``algo.num_iterations``
    epochs over the batch in shuffled minibatches of ``algo.mini_batch_size`` completions.

    The critic is initialised from the phase's starting policy (after any SFT warm-up) and
    trained with ``optimizer.critic_learning_rate`` (default ``optimizer.learning_rate``).
    With ``algo.beta > 0`` the reference is a copy of the starting policy, refreshed every
    ``algo.ref_update_every`` iterations (0 = never).
    """

    name = "ppo"

    def __init__(self, ctx: Context, steps: int):
        cfg = ctx.cfg
        self.ctx, self.steps = ctx, int(steps)
        a = cfg.algo
        check_replay_model(cfg, ctx.model_cfg)
        self.batch_size = cfg.rollout.batch_size
        self.mini = update_sizes(cfg)[0]
        groups = self.batch_size // a.num_generations
        if cfg.env.name and cfg.env.selfplay.mode == "self":   # a group per seat of a game
            from rljax.train.methods import selfplay
            groups = selfplay.examples_per_round(cfg, groups)
        self.iterator = rl_iterator(ctx, groups)
        # Hints, ReLIFT and demonstrations act on failed groups as in GRPO (the critic values
        # the guided rows like any other); first, so the stages after it see the rows that train.
        self.guide = guidance.Guide(ctx, a.num_generations) if guidance.enabled(cfg) else None
        stages = [self.guide] if self.guide is not None else []
        if cfg.env.name:   # multi-turn episodes: the critic and GAE over model tokens
            from rljax.train.methods.episode_credit import credit_stages
            stages += credit_stages(cfg, rewards_only=True)
        # GRPO's round sources: knapsack group sizes, episodes, partial rollouts' pool.
        self.rollout = RewardRollout(ctx, self.iterator, rounds=round_source(
            ctx, self.batch_size // a.num_generations), stages=stages)
        self.relift = relift.Relift(ctx, self.guide) if a.relift.every else None
        self.optimizer, self.critic_optimizer = _optimizers(ctx, self.steps)
        self.prepare = build_prepare(ctx.model_cfg, a, temperature=cfg.rollout.temperature)
        self._step_fn = None

    def init_state(self, state):
        """Fresh optimizers, a critic copied from the policy, the reference (beta > 0). With
        LoRA: the critic is a value head + its own adapters on the shared frozen base, and the
        reference is the base itself (no copies)."""
        return _init_state(self.ctx, self.optimizer, self.critic_optimizer, state)

    def _compiled(self, state):
        if self._step_fn is None:
            self._step_fn = _build(self.ctx, self.optimizer, self.critic_optimizer, state)
        return self._step_fn

    @staticmethod
    def programs(ctx: Context, steps_: int):
        """``(abstract state, [Program])``: the rollout's sampler and log-prob passes
        (``rljax.train.core.programs``), ``prepare`` (values, reference log-probs, GAE) over the
        whole batch and the update of policy and critic on a mini-batch."""
        cfg = ctx.cfg
        optimizer, critic_optimizer = _optimizers(ctx, steps_)
        state = programs_lib.phase_state(
            ctx, lambda s: _init_state(ctx, optimizer, critic_optimizer, s))
        resident, params = programs_lib.shard_bytes(state), programs_lib.shard_bytes(state.params)
        out = programs_lib.sampler_programs(ctx, state.params, params)
        out.append(programs_lib.logps_program(ctx, state.params, params))
        prepare = build_prepare(ctx.model_cfg, cfg.algo, temperature=cfg.rollout.temperature)
        out.append(programs_lib.Program(
            "prepare", prepare, (state, _batch(ctx, int(cfg.rollout.batch_size), False)),
            resident))
        out.append(programs_lib.Program(
            "update", _build(ctx, optimizer, critic_optimizer, state),
            (state, _batch(ctx, update_sizes(cfg)[0], True)), resident))
        return state, out

    def train_on(self, state, batch: dict, metrics: dict, step: int):
        """``prepare`` (values, GAE; fetched) and the epochs of minibatch updates on one
        batch, dispatched; returns ``(state, updates)`` (the updates' metrics not fetched)."""
        cfg, mesh = self.ctx.cfg, self.ctx.mesh
        prepared, pm = self.prepare(state, dist.device_batch(batch, mesh))
        prepared = {k: dist.to_host(v) for k, v in prepared.items()}
        metrics.update({k: float(dist.to_host(v)) for k, v in pm.items()})
        self._prepared_at = time.perf_counter()
        step_fn = self._compiled(state)
        # Shuffled minibatches, reproducible from (seed, step, epoch) so a resume replays them.
        rng = np.random.default_rng([cfg.seed, step])
        updates = []
        for _ in range(cfg.algo.num_iterations):
            order = rng.permutation(self.batch_size) if self.mini < self.batch_size else None
            for start in range(0, self.batch_size, self.mini):
                rows = slice(start, start + self.mini) if order is None else \
                    order[start:start + self.mini]
                mb = {k: v[rows] for k, v in prepared.items()}
                state, m = step_fn(state, dist.device_batch(mb, mesh))
                updates.append(m)
        every = cfg.algo.ref_update_every
        if state.ref_params is not None and every and (step + 1) % every == 0:
            state = state.replace(ref_params=jax.tree.map(jnp.copy, state.params))
        return state, updates

    def iteration(self, state, step: int):
        t0 = time.perf_counter()
        batch, metrics = self.rollout(state, step)
        t_prepare = time.perf_counter()
        state, updates = self.train_on(state, batch, metrics, step)
        if self.relift is not None:  # every algo.relift.every steps: SFT on the hardest
            state, relift_metrics = self.relift.maybe_step(state, step, self.optimizer)
            metrics.update(relift_metrics)
        t1 = self._prepared_at
        updates = [to_host(m) for m in updates]
        t2 = time.perf_counter()
        # Device work pending (see the GRPO phase): sampling, the rollout's own passes, the
        # critic/GAE pass until its fetch, and the updates until their metrics' fetch.
        since = self.rollout.pending_since if self.rollout.pending_since is not None \
            else t_prepare
        pending = metrics.get("time/sample", 0.0) + (t1 - since) + (t2 - t1)
        metrics["time/host_frac"] = host_fraction(t2 - t0, pending)
        for key in updates[0]:
            values = [u[key] for u in updates]
            metrics[key] = int(sum(values)) if key == "skipped" else float(np.mean(values))
        metrics.update({"time/rollout": t1 - t0, "time/update": t2 - t1, "time/step": t2 - t0})
        return state, metrics

    def state_dict(self) -> dict:
        out = {"data": self.iterator.state()}
        for stage in self.rollout.stages:   # guidance: hint fractions, the ReLIFT buffer
            out[stage.name] = stage.state_dict()
        rounds = self.rollout.rounds.state_dict() if self.rollout.rounds is not None else {}
        if rounds:   # partial rollouts: the groups (of texts or episodes) in flight
            out["partial"] = rounds
        return out

    def load_state_dict(self, state: dict) -> None:
        self.iterator.restore(state["data"])
        for stage in self.rollout.stages:
            if stage.name in state:
                stage.load_state_dict(state[stage.name])
        if self.rollout.rounds is not None and "partial" in state:
            self.rollout.rounds.load_state_dict(state["partial"])
