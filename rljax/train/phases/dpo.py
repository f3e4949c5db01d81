"""DPO training: offline from preference data, or online iterative from the policy's own samples.

Preference batches are the arrays of ``data.encode_preference``::

    prompt_tokens  int32 [B, P]  left-padded      prompt_mask   bool [B, P]
    chosen_tokens  int32 [B, C]  right-padded     chosen_mask   bool [B, C]
    rejected_tokens int32 [B, C]                  rejected_mask bool [B, C]
    pair_mask      bool  [B]     optional: False marks padding pairs (count for nothing)

The policy scores ``prompt ++ completion``; a completion's log-probability is the sum of its
real tokens' log-probs. Chosen and rejected completions go through one forward pass that
computes their shared prompt once (``sequence_logps``). Reference log-probs come from the frozen ``state.ref_params`` (computed once per
batch, without gradient); ``simpo`` is reference-free and needs no reference params.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from rljax import algorithms, models
from rljax import data as data_lib
from rljax import distributed as dist
from rljax.errors import UserError
from rljax.models import lora as lora_lib
from rljax.train.core import evaluate as eval_lib
from rljax.train.core import programs as programs_lib, steps
from rljax.train.core.rollout import RewardRollout
from rljax.train.core.preference_data import (PreferenceData, best_worst_pairs,
                                              eval_pair_batches, pair_metrics)
from rljax.train.core.setup import rl_iterator
from rljax.train.phases.grpo import merge_updates, round_source
from rljax.train.methods import mcts_matches, mcts_programs, mcts_search, prm_refit
from rljax.train.methods.step_mc import StepMCPairs
from rljax.train.methods.step_mc_episodes import EpisodeStepMCPairs
from rljax.train.methods.step_mc_matches import MatchStepMCPairs
from rljax.train.core.state import reference_params
from rljax.train.core.steps import to_host

Array = jax.Array
sg = jax.lax.stop_gradient

# Loss types defined on length-normalised log-probs (see algorithms.dpo_loss).
LENGTH_NORMALISED = ("ipo", "simpo")


def pair_sequences(batch: dict) -> dict:
    """Chosen and rejected rows stacked as one batch of full sequences.

    Returns ``tokens int32 [2B, P+C]`` (rows ``[:B]`` chosen, ``[B:]`` rejected),
    ``attention_mask bool [2B, P+C]`` (prompt and completion tokens) and
    ``completion_mask bool [2B, P+C]`` (completion tokens only: the ones scored).
    """
    prompt, pmask = batch["prompt_tokens"], batch["prompt_mask"].astype(bool)
    comp = jnp.concatenate([batch["chosen_tokens"], batch["rejected_tokens"]], axis=0)
    cmask = jnp.concatenate([batch["chosen_mask"], batch["rejected_mask"]], axis=0).astype(bool)
    prompt2 = jnp.concatenate([prompt, prompt], axis=0)
    pmask2 = jnp.concatenate([pmask, pmask], axis=0)
    return {
        "tokens": jnp.concatenate([prompt2, comp], axis=1).astype(jnp.int32),
        "attention_mask": jnp.concatenate([pmask2, cmask], axis=1),
        "completion_mask": jnp.concatenate([jnp.zeros_like(pmask2), cmask], axis=1),
    }


def sequence_logps(model_cfg: models.ModelConfig, params: Any, batch: dict,
                   lora_dropout_rng=None) -> tuple[Array, Array]:
    """(summed completion log-probs [2B], completion lengths [2B]) of a preference batch, rows
    ``[:B]`` chosen and ``[B:]`` rejected (the order of ``pair_sequences``).

    The chosen and rejected completions of a pair share its prompt, computed once
    (``models.shared_prompt``, G = 2), and the LM head runs over completion positions only:
    the sums of ``models.token_logps`` over ``pair_sequences`` rows, up to float32 summation
    order. ``lora_dropout_rng``: LoRA dropout of a training pass (None = none). Pairs of
    multi-turn episodes score their ``chosen_score_mask`` / ``rejected_score_mask`` tokens
    only (the model's; observations are context)."""
    b, c = batch["chosen_tokens"].shape
    def pairs(chosen, rejected):   # [B, C] x 2 -> [2B, C], each pair's two rows adjacent
        return jnp.stack([chosen, rejected], axis=1).reshape(2 * b, c)
    tokens = pairs(batch["chosen_tokens"], batch["rejected_tokens"]).astype(jnp.int32)
    mask = pairs(batch["chosen_mask"], batch["rejected_mask"]).astype(bool)
    score = mask if "chosen_score_mask" not in batch else pairs(
        batch["chosen_score_mask"], batch["rejected_score_mask"]).astype(bool)
    logps, _ = models.shared_prompt.completion_logps(
        model_cfg, params, batch["prompt_tokens"].astype(jnp.int32),
        batch["prompt_mask"].astype(bool), tokens, mask, lora_dropout_rng=lora_dropout_rng)
    unpair = lambda x: x.reshape(b, 2).T.reshape(2 * b)   # noqa: E731  chosen rows, then rejected
    return (unpair(jnp.where(score, logps, 0.0).sum(axis=1)),
            unpair(score.sum(axis=1).astype(jnp.float32)))


def reference_logps(model_cfg: models.ModelConfig, ref_params: Any, batch: dict) -> dict:
    """Reference log-probs of a preference batch: ``{"ref_chosen_logps", "ref_rejected_logps"}``
    [B] each. Computed once per batch (no gradient) and stored in it, so that repeated epochs
    over the same pairs do not recompute them."""
    ref, _ = sequence_logps(model_cfg, ref_params, batch)
    ref = sg(ref)
    b = batch["chosen_tokens"].shape[0]
    return {"ref_chosen_logps": ref[:b], "ref_rejected_logps": ref[b:]}


def dpo_loss(model_cfg: models.ModelConfig, algo_cfg, params: Any, state, batch: dict):
    """Micro-batch DPO loss in the ``steps.accumulate`` convention.

    ``algo.loss_type`` / ``algo.beta`` / ``algo.label_smoothing`` choose the variant
    (``algorithms.dpo_loss``); ``ipo`` and ``simpo`` use length-normalised log-probs.
    Reference log-probs are ``batch["ref_chosen_logps"/"ref_rejected_logps"]`` when present,
    else computed here from the frozen ``state.ref_params`` (each pair is seen once per batch,
    so that is once per batch); ``simpo`` needs none.

    Returns ``((loss sum over real pairs, number of real pairs), metric pairs)``: accuracy
    (implicit reward of chosen > rejected), rewards/chosen, rewards/rejected, rewards/margin,
    logps/chosen, logps/rejected (summed completion log-probs).
    """
    loss_type = algo_cfg.loss_type
    b = batch["chosen_tokens"].shape[0]
    # LoRA dropout on the policy's pass only; the reference below is deterministic.
    logps, lengths = sequence_logps(model_cfg, params, batch,
                                    steps.training_dropout_rng(model_cfg, state, batch))
    pc, pr = logps[:b], logps[b:]
    if loss_type == "simpo":
        rc = rr = None
    elif "ref_chosen_logps" in batch:
        rc, rr = batch["ref_chosen_logps"], batch["ref_rejected_logps"]
    else:
        ref = reference_logps(model_cfg, reference_params(state), batch)
        rc, rr = ref["ref_chosen_logps"], ref["ref_rejected_logps"]
    lengths_kw = {}
    if loss_type in LENGTH_NORMALISED:
        lengths_kw = dict(chosen_lengths=lengths[:b], rejected_lengths=lengths[b:])
    losses, chosen_r, rejected_r = algorithms.dpo_loss(
        pc, pr, rc, rr, beta=float(algo_cfg.beta), loss_type=loss_type,
        label_smoothing=float(algo_cfg.label_smoothing), **lengths_kw)
    m = pair_mask(batch)
    weight = m.astype(jnp.float32).sum()
    msum = lambda x: jnp.where(m, x, 0.0).sum()  # noqa: E731
    correct, _ = algorithms.preference_accuracy(chosen_r, rejected_r, m)
    metrics = {
        "accuracy": (correct, weight),
        "rewards/chosen": (msum(chosen_r), weight),
        "rewards/rejected": (msum(rejected_r), weight),
        "rewards/margin": (msum(chosen_r - rejected_r), weight),
        "logps/chosen": (sg(msum(pc)), weight),
        "logps/rejected": (sg(msum(pr)), weight),
    }
    return (msum(losses), weight), metrics


def pair_mask(batch: dict) -> Array:
    """bool [B]: the real pairs (``batch["pair_mask"]``, default all)."""
    b = batch["chosen_tokens"].shape[0]
    return batch["pair_mask"].astype(bool) if "pair_mask" in batch else jnp.ones((b,), bool)


def build_dpo_step(model_cfg, algo_cfg, optimizer, *, num_micro: int = 1,
                   state_shardings=None, mesh=None) -> Callable:
    """Jitted ``dpo_step(state, batch) -> (state, metrics)`` on a preference batch.
    Metrics: loss, accuracy, rewards/{chosen,rejected,margin}, logps/{chosen,rejected},
    grad_norm, skipped."""
    loss_fn = functools.partial(dpo_loss, model_cfg, algo_cfg)

    def dpo_step(state, batch):
        return steps.update(optimizer, loss_fn, state, batch, num_micro)
    return steps.jit_step(dpo_step, state_shardings, mesh)


# ----------------------------------------------------------------------------- phase

def num_pairs(cfg) -> int:
    """Pairs per update: ``rollout.batch_size`` offline, one per prompt online
    (``algo.step_mc.max_steps`` per prompt with step-level pairs)."""
    a, b = cfg.algo, int(cfg.rollout.batch_size)
    pairs = b // int(a.num_generations) if a.online else b
    return pairs * int(a.step_mc.max_steps) if cfg.data.pairs in ("step_mc", "mcts") else pairs


def _optimizer(ctx, steps: int):   # online: algo.num_iterations updates per step
    a = ctx.cfg.algo
    return ctx.optimizer(ctx.cfg.optimizer.learning_rate, int(steps) * (a.num_iterations
                                                                        if a.online else 1))


def _init_state(ctx, optimizer, state):
    copy_ref = ctx.cfg.algo.loss_type != "simpo" and not lora_lib.has_lora(state.params)
    ref = jax.tree.map(jnp.copy, state.params) if copy_ref else None
    return state.replace(opt_state=optimizer.init(lora_lib.trainable(state.params)),
                         ref_params=ref)


def _build(ctx, optimizer, state):
    micro, pairs = ctx.cfg.algo.micro_batch_size, num_pairs(ctx.cfg)
    num_micro = pairs // micro if micro and pairs % micro == 0 else 1
    return build_dpo_step(ctx.model_cfg, ctx.cfg.algo, optimizer, num_micro=num_micro,
                          state_shardings=ctx.state_shardings(state), mesh=ctx.mesh)


class DPOPhase:
    """``steps`` DPO updates (``algo.num_iterations`` per step when online).

    Offline (default): each step takes ``rollout.batch_size`` pairs from ``PreferenceData``.
    Online (``algo.online``): each step is a round: sample ``algo.num_generations`` completions
    for each of ``rollout.batch_size / num_generations`` prompts, rank them with the reward
    functions, pair the best with the worst (ties are skipped), then update on those pairs.
    With ``data.pairs="step_mc"`` the pairs are step-level instead (``methods.step_mc``: steps
    valued by Monte-Carlo continuations; ``algo.step_mc.max_steps`` pairs per prompt at most;
    prompt selection and dynamic sampling pick the prompts on their first samples);
    with ``data.pairs="mcts"`` they are sibling steps of an MCTS over steps
    (``methods.mcts_search.MCTSPairs``: the best- and worst-valued children of a node), and
    with ``algo.mcts.refit_prm`` the search's PRM (in the state) is refitted on the round's
    trees before the updates (``methods.prm_refit``). The reference starts as a copy of the
    phase's starting policy and is refreshed every ``algo.ref_update_every`` steps (0 = frozen;
    1 = every round, iterative DPO).
    Evaluation: the policy's task accuracy (as for GRPO, when the data has prompts with
    answers) and, on held-out pairs with a frozen reference, ``eval/pref_accuracy`` (implicit
    reward of chosen > rejected), ``eval/pref_loss`` and ``eval/pref_rewards/*``.
    """

    name = "dpo"

    def __init__(self, ctx, steps: int):
        cfg = ctx.cfg
        a = cfg.algo
        self.ctx, self.steps, self.online = ctx, int(steps), bool(a.online)
        self.g = int(a.num_generations)
        self.step_mc = cfg.data.pairs in ("step_mc", "mcts")   # step-level pairs, sampled
        self.num_pairs = num_pairs(cfg)
        if self.num_pairs % ctx.dp_size:
            raise UserError(f"DPO trains on {self.num_pairs} pairs per step, which does not "
                            f"split over the data-parallel mesh size {ctx.dp_size}")
        self.refit = None
        if self.step_mc:   # prompt selection picks the prompts whose step pairs are built
            self.iterator = rl_iterator(ctx, cfg.rollout.batch_size // self.g)
            if cfg.data.pairs == "mcts" and cfg.algo.mcts.refit_prm:   # refitted each round
                self.refit = prm_refit.PRMRefit(ctx, cfg.rollout.batch_size // self.g,
                                                self.steps)
            # (asynchronous DPO samples the pair batches ahead with it: ``rollout``)
            self.source = self.rollout = self._step_pairs(ctx)
        elif self.online:   # GRPO's rounds: prompt selection, partial rollouts' pool
            examples = self.num_pairs
            if cfg.env.name and cfg.env.selfplay.mode == "self":   # a group (pair) per seat
                from rljax.train.methods import selfplay
                examples = selfplay.examples_per_round(cfg, examples)
            self.iterator = rl_iterator(ctx, examples)
            self.source = self.rollout = RewardRollout(
                ctx, self.iterator, rounds=round_source(ctx, self.num_pairs))
        else:
            self.source = PreferenceData(ctx, self.num_pairs)
        self.updates = a.num_iterations if self.online else 1
        self.optimizer = _optimizer(ctx, self.steps)
        self.uses_ref = a.loss_type != "simpo"
        self._step_fn = self._eval_fn = None
        self._eval_batches = self._eval_examples = None

    def _step_pairs(self, ctx):
        """The source of step-level pairs: MCTS siblings (``data.pairs='mcts'``) or step-MC
        values; with ``env.name`` both take an episode's model turns as its steps (with
        ``env.selfplay`` the learner seat's turns in matches)."""
        if ctx.cfg.data.pairs == "mcts":
            return mcts_search.MCTSPairs(
                ctx, self.iterator, None if self.refit is None else self.refit.scorer,
                make_search=mcts_matches.turn_searcher if ctx.cfg.env.name else None)
        if not ctx.cfg.env.name:
            return StepMCPairs(ctx, self.iterator)
        selfplay_on = ctx.cfg.env.selfplay.mode != "off"   # over the learner seat's turns
        return (MatchStepMCPairs if selfplay_on else EpisodeStepMCPairs)(ctx, self.iterator)

    def init_state(self, state):
        """Fresh optimizer; the reference is a copy of the starting policy, or with LoRA the
        base model (adapters off: no copy, ``ref_params`` stays None). With
        ``algo.mcts.refit_prm`` the state holds the search's PRM (``prm_refit``)."""
        state = _init_state(self.ctx, self.optimizer, state)
        return state if self.refit is None else self.refit.init_state(state)

    def _compiled(self, state):
        if self._step_fn is None:
            self._step_fn = _build(self.ctx, self.optimizer, state)
        return self._step_fn

    @staticmethod
    def programs(ctx, steps: int):
        """``(abstract state, [Program])``: online, the rollout's sampler and log-prob passes
        (``core.programs``; ``data.pairs='mcts'``: the search's, ``mcts_programs``); the eval
        sampler when the policy is evaluated on prompts; the update (``programs.pair_batch``)."""
        cfg, optimizer = ctx.cfg, _optimizer(ctx, steps)
        mcts = cfg.algo.online and cfg.data.pairs == "mcts"
        refit = mcts and cfg.algo.mcts.refit_prm
        prompts = cfg.rollout.batch_size // cfg.algo.num_generations

        def init(s):
            s = _init_state(ctx, optimizer, s)
            return prm_refit.planned_state(ctx, steps, s) if refit else s
        state = programs_lib.phase_state(ctx, init)
        params, out = programs_lib.shard_bytes(state.params), []
        if mcts:   # the search samples the pairs (and with refit_prm its PRM is refitted)
            out += [p for p in programs_lib.sampler_programs(ctx, state.params, params)
                    if p.name.startswith("eval")]
            out += mcts_programs.programs(ctx, state.params, params, prompts)
            if refit:
                out.append(prm_refit.program(ctx, steps, state, prompts))
        elif cfg.algo.online:
            out += programs_lib.sampler_programs(ctx, state.params, params)
            out.append(programs_lib.logps_program(ctx, state.params, params))
        elif cfg.data.source in data_lib.TASKS:   # evaluated on prompts: the eval sampler
            out += programs_lib.sampler_programs(ctx, state.params, params)[1:]
        batch = programs_lib.pair_batch(ctx, num_pairs(cfg))
        return state, out + [programs_lib.Program("update", _build(ctx, optimizer, state),
                                                  (state, batch), programs_lib.shard_bytes(state))]

    def _online_pairs(self, state, step: int) -> tuple[dict, dict]:
        batch, metrics = self.source(state, step)
        return self._pairs(batch, metrics), metrics

    def _pairs(self, batch: dict, metrics: dict) -> dict:
        """The pairs of one sampled batch: step pairs as they are, else each group's best
        and worst completion."""
        if not self.step_mc:
            return self._group_pairs(batch, metrics)
        metrics["dpo/pairs_frac"] = float(np.mean(batch["pair_mask"]))
        return batch

    def _group_pairs(self, batch: dict, metrics: dict) -> dict:
        """The best and worst completion of each group of a rollout batch, as pairs."""
        n = batch["loss_mask"].shape[1]
        tokens, mask = np.asarray(batch["tokens"]), np.asarray(batch["mask"], bool)
        p = tokens.shape[1] - n
        prompts = {"prompt_tokens": tokens[::self.g, :p], "prompt_mask": mask[::self.g, :p]}
        completions = {"tokens": tokens[:, p:], "mask": mask[:, p:]}
        if "model_mask" in batch:   # episodes: the model's tokens are scored, not observations
            completions["score_mask"] = np.asarray(batch["model_mask"], bool)
        pairs = best_worst_pairs(prompts, completions, batch["rewards"], self.g)
        metrics["dpo/pairs_frac"] = float(pairs["pair_mask"].mean())
        return pairs

    def train_on(self, state, batch: dict, metrics: dict, step: int):
        """The updates on a sampled batch's pairs (``_pairs``), dispatched (their metrics not
        fetched): ``(state, updates)``. (Asynchronous DPO trains batches sampled earlier;
        with ``algo.mcts.refit_prm`` the PRM is refitted first on the rows the batch carries.)"""
        if self.refit is not None:
            batch, rows, count = prm_refit.split_refit_rows(batch)
            state, refit_metrics = self.refit.fit(state, rows, count)
            metrics.update(refit_metrics)
        return self._update(state, self._pairs(batch, metrics), metrics, step)

    def _update(self, state, pairs: dict, metrics: dict, step: int):
        step_fn = self._compiled(state)
        updates = []
        for _ in range(self.updates):
            state, m = step_fn(state, dist.device_batch(pairs, self.ctx.mesh))
            updates.append(m)
        every = self.ctx.cfg.algo.ref_update_every
        if state.ref_params is not None and every and (step + 1) % every == 0:
            state = state.replace(ref_params=jax.tree.map(jnp.copy, state.params))
        metrics["dpo/pairs"] = int(pairs["pair_mask"].sum())
        return state, updates

    def iteration(self, state, step: int):
        t0 = time.perf_counter()
        if self.online:
            pairs, metrics = self._online_pairs(state, step)
        else:
            pairs, metrics = next(self.source), {}
        if self.refit is not None:   # the PRM on the search's values, for the next round
            state, refit_metrics = self.refit(state, self.source.last)
            metrics.update(refit_metrics)
        t1 = time.perf_counter()
        state, updates = self._update(state, pairs, metrics, step)
        merge_updates(metrics, [to_host(m) for m in updates])
        t2 = time.perf_counter()
        metrics.update({"time/rollout": t1 - t0, "time/update": t2 - t1, "time/step": t2 - t0})
        return state, metrics

    def evaluate(self, state, rng) -> dict:
        """Task accuracy of the policy (prompt data only) + held-out preference metrics."""
        out = {}
        if self.online or self.ctx.cfg.data.source in data_lib.TASKS:
            if self._eval_examples is None:
                self._eval_examples = eval_lib.eval_examples(self.ctx)
            from rljax.train.methods.agent import run_agent_eval   # (episodes: env.name)
            out.update(eval_lib.run_eval(self.ctx, state.params, rng, self._eval_examples,
                                         episodes=run_agent_eval))
        # A moving reference (ref_update_every > 0) makes implicit rewards relative to the last
        # refresh (all 0 right after one), so held-out pair metrics are only reported for a
        # frozen reference; step_mc pairs and pairs of episodes are sampled, the data has no
        # held-out pairs of them.
        if ((self.uses_ref and self.ctx.cfg.algo.ref_update_every) or self.step_mc
                or self.ctx.cfg.env.name):
            return out
        if self._eval_batches is None:
            self._eval_batches = eval_pair_batches(self.ctx)
            # Evaluation sees the deterministic model: LoRA dropout off (a static setting).
            cfg, algo = self.ctx.model_cfg.replace(lora_dropout=0.0), self.ctx.cfg.algo
            self._eval_fn = jax.jit(lambda s, b: dpo_loss(cfg, algo, s.params, s, b))
        if self._eval_batches:
            m = pair_metrics(lambda b: self._eval_fn(state, b), self._eval_batches, "eval/pref_")
            out.update({k: v for k, v in m.items() if not k.startswith("eval/pref_logps")})
        return out

    def state_dict(self) -> dict:
        out = {"data": (self.iterator if self.online else self.source).state()}
        rounds = getattr(self.source, "rounds", None)
        if rounds is not None:   # partial rollouts: the groups in flight
            out["partial"] = rounds.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        (self.iterator if self.online else self.source).restore(state["data"])
        rounds = getattr(self.source, "rounds", None)
        if rounds is not None and "partial" in state:
            rounds.load_state_dict(state["partial"])
