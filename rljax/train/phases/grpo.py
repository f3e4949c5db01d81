"""GRPO phase (and its variants: Dr. GRPO, DAPO, GSPO, CISPO, ... all by config).

One iteration: rollout (sample G per prompt, rewards, advantages, old/ref log-probs) ->
``algo.num_iterations`` epochs over the batch in mini-batches of ``algo.mini_batch_size``
completions, each one exact update (micro-batches of ``algo.micro_batch_size``).

Overlap and ``time/host_frac``: while the update runs on the device (dispatched
asynchronously) the controller draws the next iteration's prompt batch
(``PrefetchingIterator``; checkpoints keep the iterator state from before it, so resume is
exact). ``time/host_frac`` is the share of the iteration's wall time in which no device work
was pending (``metrics.host_fraction``): the device is counted busy from each dispatch to the
return of the blocking fetch of its result (sampling: ``time/sample``; the old/ref log-prob
passes and the update: from their first dispatch to the fetch of the update's metrics).
"""
from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from rljax import algorithms, models, streams as streams_lib
from rljax.config.base import ConfigError
from rljax.data.iterator import PrefetchingIterator
from rljax.models import lora as lora_lib
from rljax.train.core import length_groups, programs as programs_lib, steps
from rljax.train.core import sampler as sampler_lib
from rljax.train.core import partial as partial_lib
from rljax.train.methods import guidance, process_rewards, relift, vine
from rljax.train.core import teacher as teacher_lib
from rljax.train.core.metrics import host_fraction
from rljax.train.core.rollout import Rollout
from rljax.train.core.setup import Context, rl_iterator, sampler_context, update_sizes
from rljax.train.core.steps import to_host


# ----------------------------------------------------------------------------- loss

def _pair(x, m):
    m = m.astype(jnp.float32)
    return jnp.where(m > 0, x, 0.0).sum(), m.sum()


# Partial and asynchronous rollouts without an ``algo.tis_cap``: no cap on the behaviour
# weight. A cap of 2 (TIS's C, Yao et al. 2025) was the default until measured: on the demo
# recipe the tokens it truncates are mostly those the last update raised most, the ones being
# learned, and the capped runs ended 4-11 points below the synchronous loop where the uncapped
# ones stayed within 3 (docs/internals.md, "Does the rollout mode change what is learned?").
# Gradient clipping (``optimizer.max_grad_norm``) still bounds a step.
PARTIAL_BEHAVIOUR_CAP = float("inf")


def policy_loss_options(algo_cfg, partial: bool = False) -> dict:
    """Keyword options of the configured policy loss (``algo.policy_loss``). A clip key that
    is None is left out, so the loss's own default applies (``config.validate`` has already
    filled the unset ones with the same per-loss defaults, ``config.POLICY_LOSS_DEFAULTS``).
    ``partial`` (``rollout.partial``): the behaviour weight is always on, capped at
    ``algo.tis_cap`` if set, else uncapped (``PARTIAL_BEHAVIOUR_CAP``; see ``grpo_loss``)."""
    name = algo_cfg.policy_loss
    opts: dict = {}
    for key in ("epsilon", "epsilon_high"):
        if algo_cfg[key] is not None:
            opts[key] = float(algo_cfg[key])
    if name in ("ppo", "vanilla"):
        opts["clip_ratio_c"] = algo_cfg.clip_ratio_c
        opts["ratio_level"] = algo_cfg.importance_sampling_level
    if algo_cfg.tis_cap is not None:
        opts["tis_cap"] = float(algo_cfg.tis_cap)
    elif partial:
        opts["tis_cap"] = PARTIAL_BEHAVIOUR_CAP
    return opts


def grpo_loss(model_cfg, algo_cfg, temperature, params, state, batch, *, partial=False):
    """GRPO-family loss on one micro-batch.

    batch (besides the sequence layout): ``advantages`` f32 [B] (one per completion) or
    [B, N] (token-level estimators), ``old_logps`` f32 [B, N]
    (trainer's own log-probs before the first update; when absent -- one update per rollout,
    the policy has not moved since sampling -- this forward's own log-probs under
    ``stop_gradient``, and the step reports ``rollout/logp_diff_mean``/``_max`` against the
    sampler's), ``sampler_logps`` f32 [B, N], and
    ``ref_logps`` f32 [B, N] when a KL-to-reference loss is on; ``temperatures`` f32 [B, N]
    with a sampler temperature schedule (log-probs, ratios and entropies at each token's own
    temperature; see ``completion_logps``); on-policy distillation
    (``rljax.train.phases.distill``): ``teacher_logps`` f32 [B, N] and, with its JSD term,
    ``teacher_topk_logps`` f32 / ``teacher_topk_ids`` i32 [B, N, k]. Returns
    ``((weighted_sum, weight), metric pairs)`` aggregated by ``algo.loss_agg_mode``.

    Partial rollouts (``partial``; ``rljax.train.core.partial``): a completion's tokens come from
    several policy versions, ``sampler_logps`` holding each token's behaviour log-prob. The
    loss is AReaL's decoupled objective (Fu et al. 2025, arXiv 2505.24298), the behaviour
    weight truncated as in TIS when a cap is set::

        l_t = min(pi_prox / pi_behav, C) * max(-A u_t, -A clip(u_t, 1 - eps, 1 + eps_high)),
        u_t = pi_theta / pi_prox

    with pi_prox the policy this iteration started from (``old_logps``: the trainer's
    recomputation, or this pass's own log-probs under ``stop_gradient`` when there is one
    update per rollout). Why this and not plain TIS against the behaviour policy: the clip
    is a trust region around the policy being improved; anchored at a behaviour policy two
    versions back it would clip most tokens of carried samples (their ratio is already far
    from 1 before any update) and their gradient with them, while a weight pi_prox/pi_behav
    outside the clip keeps the estimate unbiased for the mixture (when uncapped). With one
    update per rollout u_t = 1, the clip is inactive and the two coincide: the gradient is
    ``min(pi_prox / pi_behav, C) * A * grad log pi``. The cap C is ``algo.tis_cap``, or
    none (``PARTIAL_BEHAVIOUR_CAP``); AReaL masks tokens above its cap instead of truncating
    them.
    """
    m = batch["loss_mask"]
    # With LoRA dropout, this pass (and ``old`` below when taken from it) sees the dropped
    # adapters; old/ref log-probs computed beforehand never do.
    rng = steps.training_dropout_rng(model_cfg, state, batch)
    moe_stats = {} if model_cfg.is_moe else None
    scored = steps.completion_logps(model_cfg, params, batch, temperature=temperature,
                                    with_entropy=True, lora_dropout_rng=rng,
                                    extra_ids=batch.get("teacher_topk_ids"),
                                    moe_stats=moe_stats)
    logps, ent = scored[:2]
    opts = policy_loss_options(algo_cfg, partial)
    if "tis_cap" in opts:
        opts["sampler_logps"] = batch["sampler_logps"]
    old = batch.get("old_logps")
    diff_metrics = {}
    if old is None:
        old = jax.lax.stop_gradient(logps)
        n = m.shape[1]
        # Sampler log-probs exist for sampled tokens only (multi-turn: not observations).
        real = batch.get("model_mask", batch["mask"][:, -n:])
        diff = jnp.where(real, jnp.abs(old - batch["sampler_logps"]), 0.0)
        diff_metrics = {"rollout/logp_diff_mean": _pair(diff, real),
                        "rollout/logp_diff_max": (jnp.max(diff), jnp.ones((), jnp.float32))}
    adv, distill_tokens, distill_metrics = batch["advantages"], None, {}
    if "teacher_logps" in batch:   # on-policy distillation: the teacher's per-token signal
        adv, distill_tokens, distill_metrics = _distill_terms(algo_cfg, batch, old, scored, m)
    pg, metrics = algorithms.get_policy_loss(algo_cfg.policy_loss)(logps, old, adv, m, **opts)
    metrics.update(diff_metrics)
    metrics.update(distill_metrics)
    kl = None
    if algo_cfg.beta > 0 and not algo_cfg.kl_in_reward:
        kl = algorithms.get_kl_estimator(algo_cfg.kl_estimator)(logps, batch["ref_logps"])
        metrics["kl_ref"] = _pair(kl, m)
    total = algorithms.combine_token_losses(pg, m, kl_tokens=kl, kl_coef=float(algo_cfg.beta),
                                            entropy_tokens=ent,
                                            entropy_coef=float(algo_cfg.entropy_coef))
    if distill_tokens is not None:
        total = total + float(algo_cfg.distill.jsd_weight) * distill_tokens
    n = batch.get(steps.COMPLETION_SLOTS, m.shape[1])
    metrics["pg_loss"] = algorithms.aggregate(pg, m, algo_cfg.loss_agg_mode, max_len=n)
    metrics["entropy"] = _pair(jax.lax.stop_gradient(ent), m)
    num, den = algorithms.aggregate(total, m, algo_cfg.loss_agg_mode, max_len=n)
    if moe_stats is not None:
        num = num + _load_balance_term(model_cfg, algo_cfg, moe_stats["stats"], den, metrics)
    return (num, den), metrics


def _load_balance_term(model_cfg, algo_cfg, stats, den, metrics):
    """``algo.moe_aux_loss_coef * load_balance * den`` (so the update's loss gains
    ``coef * load_balance``, weighted by each micro-batch's share); adds the metrics
    ``moe/load_balance``, ``moe/expert_frac/<e>`` (each expert's share of the
    micro-batch's top-k assignments) and ``moe/dropped_frac`` (the share of its real tokens'
    assignments past ``model.moe_capacity_factor``'s capacity; 0 when dropless) to
    ``metrics``."""
    lb, fractions = models.moe.load_balance(model_cfg, stats)
    one = jnp.ones((), jnp.float32)
    metrics["moe/load_balance"] = (jax.lax.stop_gradient(lb), one)
    assignments = jnp.sum(stats["tokens"]) * model_cfg.num_experts_per_tok
    metrics["moe/dropped_frac"] = (jax.lax.stop_gradient(jnp.sum(stats["dropped"])),
                                   jnp.maximum(assignments, 1.0))
    for e in range(model_cfg.num_experts):
        metrics[f"moe/expert_frac/{e}"] = (fractions[e], one)
    return float(algo_cfg.moe_aux_loss_coef) * lb * den


def _distill_terms(algo_cfg, batch, old, scored, m):
    """(advantages, JSD tokens or None, metrics) of on-policy distillation: the per-token
    reverse KL of the pre-update student (``old``) to the teacher as the advantage, mixed with
    the task advantage (``algo.distill``), and GKD's JSD over the teacher's top-k when the
    batch carries it (``rljax.algorithms.distill``)."""
    d = algo_cfg.distill
    teacher = batch["teacher_logps"]
    if "demo" in batch:   # a demonstration's old log-probs are mu = 1's zeros (the ratio's
        # anchor); its reverse KL to the teacher is the student's own on those tokens
        old = jnp.where(batch["demo"][:, None], jax.lax.stop_gradient(scored[0]), old)
    adv = algorithms.distill_advantages(old, teacher, m, batch["advantages"],
                                        kl_weight=float(d.kl_weight),
                                        reward_weight=float(d.reward_weight))
    metrics = {"distill/reverse_kl": _pair(algorithms.reverse_kl_tokens(old, teacher), m)}
    jsd = None
    if "teacher_topk_ids" in batch:
        jsd = algorithms.generalized_jsd_tokens(scored[2], batch["teacher_topk_logps"],
                                                float(d.jsd_beta))
        metrics["distill/jsd"] = _pair(jax.lax.stop_gradient(jsd), m)
    return adv, jsd, metrics


def grpo_loss_fn(model_cfg, algo_cfg, temperature: float = 1.0,
                 partial: bool = False) -> steps.LossFn:
    """``grpo_loss`` with its configuration bound: ``loss_fn(params, state, batch)``."""
    temperature = models.scoring_temperature(temperature)
    return functools.partial(grpo_loss, model_cfg, algo_cfg, temperature, partial=partial)


def build_update(model_cfg, algo_cfg, optimizer, *, temperature: float = 1.0,
                 num_micro: int = 1, state_shardings=None, mesh=None, partial: bool = False,
                 prompts: int = 0) -> length_groups.GroupedUpdate:
    """The GRPO update: ``update(state, host batch) -> (state, metrics)``, one exact optimizer
    step of ``grpo_loss`` (see it for the batch) over the host-planned micro-batches of
    ``length_groups.planner`` (``algo.shared_prompt``, ``algo.group_by_length``; with neither,
    the batch's rows in order), in ``algo.update_streams`` concurrent streams. Metrics: loss,
    pg_loss, clipfrac_low/high/dual, approx_kl, kl_ref (beta > 0), entropy, tis_weight
    (tis_cap or ``partial``), grad_norm, skipped, update/token_efficiency,
    update/shared_prompt. ``partial``: partial rollouts' behaviour weight (``grpo_loss``).
    ``prompts``: the batch's prompt count when its groups have different sizes (knapsack
    allocation: ``length_groups.planner``)."""
    return length_groups.GroupedUpdate(
        optimizer, grpo_loss_fn(model_cfg, algo_cfg, temperature, partial),
        length_groups.planner(algo_cfg, num_micro, mesh, prompts), state_shardings,
        streams=streams_lib.resolve(int(algo_cfg.get("update_streams", 1)), mesh))


def single_update(cfg) -> bool:
    """One update per rollout (one epoch, one mini-batch): the policy has not moved since
    sampling, so the update's own log-probs are the old ones (no separate forward). (Not with
    mixed-policy demonstrations: their old log-probs are set apart.)"""
    a = cfg.algo
    return (a.num_iterations == 1 and update_sizes(cfg)[0] == cfg.rollout.batch_size
            and not a.mixed_policy)


def batch_fields(cfg, model_cfg=None) -> dict:
    """The GRPO update batch's fields besides ``tokens``/``mask`` (what the rollout gives):
    {name: (shape after the row axis, dtype)}; ``routes`` (routing replay, given
    ``model_cfg``): (0, L, k), its sequence axis P+N (``length_groups.SEQUENCE_KEYS``);
    ``pixels`` (a model with a vision tower): (I, C, S, S)."""
    a, n = cfg.algo, programs_lib.completion_len(cfg)
    f32 = jnp.float32
    fields = {"loss_mask": ((n,), bool), "sampler_logps": ((n,), f32),
              "advantages": ((n,) if algorithms.is_token_level(a.adv_estimator) else (), f32)}
    if not single_update(cfg) or (a.beta > 0 and a.kl_in_reward):
        fields["old_logps"] = ((n,), f32)
    if a.beta > 0 and not a.kl_in_reward:
        fields["ref_logps"] = ((n,), f32)
    if cfg.rollout.temperature_schedule.name != "constant":
        fields["temperatures"] = ((n,), f32)
    if cfg.env.name:   # multi-turn episodes: the model's own tokens (rljax.train.methods.agent)
        fields["model_mask"] = ((n,), bool)
    if a.name == "distill":   # the teacher's scores of the sampled tokens
        fields.update(teacher_lib.fields(cfg, n))
    if model_cfg is not None:   # a model with a vision tower: each row's prompt's images
        fields.update(programs_lib.image_fields(cfg, model_cfg))
    return dict(fields, **routes_field(cfg, model_cfg))


def routes_field(cfg, model_cfg=None) -> dict:
    """``{"routes": ((0, L, k), int32)}`` under routing replay given ``model_cfg`` (its
    sequence axis P+N, ``length_groups.SEQUENCE_KEYS``), else {}."""
    if not cfg.algo.get("routing_replay") or model_cfg is None:
        return {}
    return {"routes": ((0, model_cfg.num_layers, model_cfg.num_experts_per_tok), jnp.int32)}


def check_replay_model(cfg, model_cfg) -> None:
    """ConfigError: routing replay on a dense model (nothing to route)."""
    if cfg.algo.get("routing_replay") and not model_cfg.is_moe:
        raise ConfigError(f"algo.routing_replay=true needs a mixture-of-experts model "
                          f"(model_type {model_cfg.model_type!r} is dense)")


def _optimizer(ctx: Context, steps_: int):
    """The phase's optimizer; ReLIFT SFT steps share it (and its schedule) with the RL
    updates."""
    a = ctx.cfg.algo
    relift_updates = steps_ // a.relift.every if a.relift.every else 0
    return ctx.optimizer(ctx.cfg.optimizer.learning_rate,
                         steps_ * update_sizes(ctx.cfg)[2] + relift_updates)


def _init_state(ctx: Context, optimizer, state):
    copy_ref = ctx.cfg.algo.beta > 0 and not lora_lib.has_lora(state.params)
    ref = jax.tree.map(jnp.copy, state.params) if copy_ref else None
    return state.replace(opt_state=optimizer.init(lora_lib.trainable(state.params)),
                         ref_params=ref, role_baseline=initial_role_baseline(ctx.cfg))


def carry_role_baseline(ctx, state, batch: dict):
    """(state, batch): RAE's baselines after this batch (``batch["role_baseline"]``, made by
    ``methods.episode_credit.RoleBaseline``) moved into the train state, which carries them to the next
    batch and into checkpoints; unchanged without them."""
    if "role_baseline" not in batch:
        return state, batch
    batch = dict(batch)
    baseline = jnp.asarray(batch.pop("role_baseline"), jnp.float32)
    return state.replace(role_baseline=jax.device_put(baseline, ctx.replicated)), batch


def initial_role_baseline(cfg):
    """f32 [K] zeros (one baseline per role key of the built-in games,
    ``envs.game_env.NUM_ROLES``) for an estimator with role baselines
    (``algorithms.uses_roles``: RAE), else None (no state field)."""
    if not algorithms.uses_roles(cfg.algo.adv_estimator):
        return None
    from rljax.envs.game_env import NUM_ROLES
    return jnp.zeros((NUM_ROLES,), jnp.float32)


def _build(ctx: Context, optimizer, state) -> length_groups.GroupedUpdate:
    cfg = ctx.cfg
    return build_update(ctx.model_cfg, cfg.algo, optimizer, temperature=cfg.rollout.temperature,
                        num_micro=update_sizes(cfg)[1], state_shardings=ctx.state_shardings(state),
                        mesh=ctx.mesh,
                        partial=bool(cfg.rollout.partial or cfg.algo.get("asynchronous")),
                        prompts=(cfg.rollout.batch_size // cfg.algo.num_generations
                                 if cfg.rollout.allocation == "knapsack" else 0))


# ----------------------------------------------------------------------------- phase


def round_source(ctx: Context, num_prompts: int):
    """The round source of a sampling phase's rollout (GRPO, distillation, PPO): per-prompt
    group sizes (``methods.allocation``, of completions or of episodes), multi-turn episodes
    (``methods.agent``), or partial rollouts' groups carried across iterations; None for the
    plain rollout."""
    cfg = ctx.cfg
    if cfg.rollout.allocation == "knapsack":   # with rollout.partial, the pool's groups
        from rljax.train.methods.allocation import knapsack_rounds
        return knapsack_rounds(ctx, num_prompts)
    if cfg.env.name:   # with rollout.partial, groups of episodes carried across iterations
        from rljax.train.methods.episode_partial import episode_rounds
        return episode_rounds(ctx, num_prompts)
    return partial_lib.rounds_of(ctx, num_prompts)


class GRPOPhase:
    """``steps`` GRPO iterations at ``optimizer.learning_rate``."""

    name = "grpo"
    prefetch = True   # draw the next prompts while the update runs (results do not change)

    def __init__(self, ctx: Context, steps: int):
        cfg = ctx.cfg
        self.ctx, self.steps = ctx, int(steps)
        a = cfg.algo
        check_replay_model(cfg, ctx.model_cfg)
        self.batch_size = cfg.rollout.batch_size
        self.mini, self.num_micro, self.updates_per_step = update_sizes(cfg)
        groups = self.batch_size // a.num_generations
        if cfg.env.name and cfg.env.selfplay.mode == "self":   # a group per seat of a game
            from rljax.train.methods import selfplay
            groups = selfplay.examples_per_round(cfg, groups)
        self.iterator = rl_iterator(ctx, groups)
        self.guide = guidance.Guide(ctx, a.num_generations) if guidance.enabled(cfg) else None
        rounds = round_source(ctx, self.batch_size // a.num_generations)
        self.rollout = Rollout(ctx, self.iterator, old_logps=not single_update(cfg),
                               stages=self.rollout_stages(), rounds=rounds)
        # Wrapped after the rollout has seen the raw iterator (it looks for a selector there).
        self.iterator = self.rollout.iterator = PrefetchingIterator(self.iterator)
        self.relift = relift.Relift(ctx, self.guide) if a.relift.every else None
        self.optimizer = _optimizer(ctx, self.steps)
        self._step_fn = None

    def rollout_stages(self) -> list:
        """Method features the rollout runs at fixed points of every call, each owning its
        state (``core.rollout.RolloutStage``): hints/ReLIFT/demonstrations when configured; a
        phase built on this one adds its own (distillation: the teacher's scores). The
        estimators ``grpo_process`` and ``vineppo`` get their per-token inputs from a stage: a
        process reward model's step scores, forked step-prefix values. Episodes' per-turn and
        per-role credit is a stage too (``episode_credit.credit_stages``)."""
        # Guidance first: the stages after it see the rows that train (VinePPO values them).
        stages = [self.guide] if self.guide is not None else []
        cfg = self.ctx.cfg
        estimator = cfg.algo.adv_estimator
        if estimator == "grpo_process":
            stages.append(process_rewards.ProcessRewards(self.ctx))
        elif estimator == "vineppo":   # forked step-prefix values (VinePPO)
            stages.append(vine.VineValues(self.ctx))
        if cfg.env.name:
            from rljax.train.methods.episode_credit import credit_stages
            stages += credit_stages(cfg)
        return stages

    def init_state(self, state):
        """Fresh optimizer; the reference policy is a copy of the starting policy (beta > 0),
        or with LoRA the base model itself (adapters off: no copy, ``ref_params`` stays None)."""
        return _init_state(self.ctx, self.optimizer, state)

    def _compiled(self, state):
        if self._step_fn is None:
            self._step_fn = _build(self.ctx, self.optimizer, state)
        return self._step_fn

    @staticmethod
    def programs(ctx: Context, steps_: int):
        """``(abstract state, [Program])``: the rollout's sampler and log-prob passes (and with
        ``grpo_process`` the PRM's, ``process/prm``; with a game's checkpoint opponent its
        sampler's, ``selfplay.opponent_programs``) and the update's programs
        (``GroupedUpdate.programs``) at the config's largest shapes
        (``rljax.train.core.programs``; ``ctx.params`` may be abstract)."""
        cfg = ctx.cfg
        optimizer = _optimizer(ctx, steps_)
        state = programs_lib.phase_state(ctx, lambda s: _init_state(ctx, optimizer, s))
        update = _build(ctx, optimizer, state)
        resident = programs_lib.shard_bytes(state)
        params = programs_lib.shard_bytes(state.params)
        out = programs_lib.sampler_programs(ctx, state.params, params)
        if ctx.rollout_mesh is not None:   # asynchronous RL: the sampler on its own mesh,
            # its copy of the policy as its resident state (eval stays on the training mesh)
            copy = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                                state.params, ctx.rollout_shardings)
            out = [p for p in out if p.name == "eval"] + programs_lib.sampler_programs(
                sampler_context(ctx), copy, programs_lib.shard_bytes(copy), with_eval=False)
            if sampler_lib.scores_kl(cfg.algo):   # the policy's and the reference's passes there
                scores = programs_lib.logps_program(sampler_context(ctx), copy,
                                                    programs_lib.shard_bytes(copy))
                out.append(dataclasses.replace(scores, name="sample/logps"))
        if cfg.env.selfplay.mode == "checkpoint":   # the frozen opponent's own sampler
            from rljax.train.methods import agent, selfplay
            out += selfplay.opponent_programs(ctx, renderer=agent.make_renderer(
                cfg, ctx.tokenizer), limits=agent.limits(cfg))
        if not single_update(cfg) or cfg.algo.beta > 0:
            out.append(programs_lib.logps_program(ctx, state.params, params))
        if cfg.algo.adv_estimator == "grpo_process":   # the PRM's pass over the samples
            out.append(process_rewards.program(ctx))
        for name, fn, args, copies in update.programs(
                state, update_sizes(cfg)[0], programs_lib.prompt_len(cfg),
                programs_lib.completion_len(cfg), batch_fields(cfg, ctx.model_cfg)):
            out.append(programs_lib.Program(name, fn, args, resident, copies))
        return state, out

    def iteration(self, state, step: int):
        t0 = time.perf_counter()
        batch, metrics = self.rollout(state, step)
        state, batch = carry_role_baseline(self.ctx, state, batch)
        t1 = time.perf_counter()
        state, updates = self.update(state, batch)
        if self.relift is not None:  # every algo.relift.every steps: SFT on the hardest
            state, relift_metrics = self.relift.maybe_step(state, step, self.optimizer)
            metrics.update(relift_metrics)
        t_prefetch = time.perf_counter()
        if self.prefetch and step + 1 < self.steps:   # host work while the update runs
            self.iterator.prefetch()
        metrics["time/prefetch"] = time.perf_counter() - t_prefetch
        updates = [to_host(m) for m in updates]
        t2 = time.perf_counter()
        # Device work pending: sampling rounds, then from the first post-sampling dispatch
        # (old/ref log-probs, else the update) until the update's metrics are on the host.
        since = self.rollout.pending_since if self.rollout.pending_since is not None else t1
        pending = metrics.get("time/sample", 0.0) + t2 - since
        metrics["time/host_frac"] = host_fraction(t2 - t0, pending)
        merge_updates(metrics, updates)
        metrics.update({
            "time/rollout": t1 - t0, "time/update": t2 - t1, "time/step": t2 - t0,
            "tokens_per_s": (metrics["rollout/tokens"] + metrics["rollout/train_tokens"]
                             * self.ctx.cfg.algo.num_iterations) / max(t2 - t0, 1e-9),
        })
        return state, metrics

    def update(self, state, batch):
        """``algo.num_iterations`` epochs of mini-batch updates on ``batch``, dispatched (not
        fetched): ``(state, [device metrics of each update])``."""
        step_fn = self._compiled(state)
        updates = []
        for _ in range(self.ctx.cfg.algo.num_iterations):
            for start in range(0, self.batch_size, self.mini):
                mb = jax.tree.map(lambda x: x[start:start + self.mini], batch)
                state, m = step_fn(state, mb)   # plans the host rows itself
                updates.append(m)
        return state, updates

    def state_dict(self) -> dict:
        out = {"data": self.iterator.state()}
        for stage in self.rollout.stages:
            out[stage.name] = stage.state_dict()
        rounds = self.rollout.rounds.state_dict() if self.rollout.rounds is not None else {}
        if rounds:   # partial rollouts' groups in flight, knapsack's pass-rate posteriors
            out[self._rounds_key()] = rounds
        return out

    def load_state_dict(self, state: dict) -> None:
        self.iterator.restore(state["data"])
        for stage in self.rollout.stages:
            if stage.name in state:
                stage.load_state_dict(state[stage.name])
        if self.rollout.rounds is not None and self._rounds_key() in state:
            self.rollout.rounds.load_state_dict(state[self._rounds_key()])

    def _rounds_key(self) -> str:
        """The round source's key in the phase state (episodes keep none unless partial)."""
        return "allocation" if self.ctx.cfg.rollout.allocation == "knapsack" else "partial"


def merge_updates(metrics: dict, updates: list) -> None:
    """The iteration's update metrics (host values of each update) into ``metrics``: the mean
    of each, the sum of ``skipped``."""
    for key in updates[0]:
        values = [u[key] for u in updates]
        metrics[key] = int(sum(values)) if key == "skipped" else float(np.mean(values))
