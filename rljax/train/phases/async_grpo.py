"""Asynchronous GRPO (``algo.asynchronous``): the sampler draws batch k + s while the trainer
updates on batch k, s = ``algo.async_lag``.

A fixed schedule on the single controller (docs/internals.md, "Asynchronous RL"). Iteration k:

1. **publish** the policy of version k (``state.params`` before update k) to the sampler: a
   ``jax.device_put`` onto the rollout mesh's shardings (``mesh.rollout_devices``), or a copy
   on the one mesh (the update donates the state); blocking, timed (``time/weight_transfer``);
2. **train** on batch k, sampled earlier by version k - s (the first s batches by version 0):
   the proximal and reference log-prob passes and the updates are dispatched on the training
   mesh, not fetched;
3. **sample** batch k + s on the rollout mesh with the version-k copy (rewards, advantages on
   the host; with ``algo.kl_in_reward`` the KL of version k to the reference, a copy of it on
   the rollout mesh, enters the rewards first) while the training devices run step 2;
4. with ``algo.relift``, ReLIFT's SFT step when it is due (after the update: version k + 1
   includes it); fetch the update's metrics.

With ``algo.inflight_updates`` the sampler does not wait for iteration k + 1 to see version
k + 1: between the slot engine's decode chunks of batch k + s (the episode engine's, for
multi-turn episodes; with trees, between levels too) it asks whether update k has finished, and
if so publishes its result and decodes the rest of the batch with it (a completion or an
episode may then span versions k and k + 1; each token records its own). Which tokens the new
weights draw depends on when the update finishes: such a run is not reproducible.

Otherwise which version samples which batch depends only on the step, so a run is
reproducible and a resumed run equals an uninterrupted one: the s batches in flight after update k (sampled by
versions k - s + 1 .. k) are saved with the checkpoint (``state_dict``: host arrays, exact),
with the data iterator and, with ``rollout.partial``, the pool behind them.

Off-policy correction: every token of batch k was drawn by version k - s (with partial
rollouts, each token by its own version, recorded by the pool); the update is the decoupled
loss of partial rollouts (``grpo.grpo_loss(..., partial=True)``: the behaviour weight
``min(pi_prox / pi_behav, C)``, C = ``algo.tis_cap`` or no cap; pi_prox the version-k
policy).

Metrics: ``rollout/sample_version`` (the version that drew the batch; partial: the last one
that decoded it), ``rollout/staleness_mean`` / ``_max`` (k minus each completion token's
version), ``time/weight_transfer`` (s), ``time/trainer_idle_frac`` (share of the iteration
the training devices had no work: from the dispatch of the log-prob passes to the moment a
watcher thread sees the update's outputs ready is busy), ``time/sampler_idle_frac`` (share
outside this iteration's sampling calls, ``time/sample`` of the batch drawn now).
"""
from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rljax import distributed as dist
from rljax import sharding as shd
from rljax.models import lora as lora_lib
from rljax.sampling.partial import decode_array, encode_array
from rljax.train.phases.grpo import (GRPOPhase, carry_role_baseline, merge_updates,
                                     single_update)
from rljax.train.core.rollout_metrics import staleness_metrics
from rljax.train.core import rollout as rollout_lib, sampler as sampler_lib
from rljax.train.methods.demos import demo_old_logps
from rljax.train.core.setup import sampler_context
from rljax.train.core.steps import to_host


@dataclasses.dataclass
class SamplerState:
    """What the rollout reads of a train state: the sampler's copy of the policy and the run's
    base key, both on the sampler's mesh."""
    params: Any
    rng: Any
    ref_params: Any = None
    role_baseline: Any = None   # RAE: the baseline after the batches sampled so far
    critic_params: Any = None   # the search's refitted PRM (``algo.mcts.refit_prm``)


class AsyncSchedule:
    """The asynchronous schedule over a phase with a ``rollout`` (module docstring): mixed in
    before the phase (``class AsyncXPhase(AsyncSchedule, XPhase)``), which supplies
    ``train_on(state, batch, metrics, step) -> (state, updates)``: the update of one batch,
    its device work dispatched, its metrics not fetched."""

    prefetch = False   # the sampler itself runs ahead of the update

    def __init__(self, ctx, steps: int):
        super().__init__(ctx, steps)
        cfg = ctx.cfg
        self.lag = int(cfg.algo.async_lag)
        # The rollout was built on the training context: its log-prob passes (used at update
        # time, under the proximal policy) run on the training mesh. It samples on the
        # sampler's context, and computes log-probs itself only for GRPO's KL in the reward.
        self.rollout.ctx = self.sampler_ctx = sampler_context(ctx)
        # GRPO's KL in the reward is the sampling policy's (as in synchronous GRPO, where it
        # is also the update's): the sampler runs the policy and reference log-prob passes
        # on its own mesh, with a copy of the reference there, before the advantages. (PPO
        # shapes its token rewards at update time, in ``prepare``.)
        self.kl_shaping = sampler_lib.scores_kl(cfg.algo)
        self.rollout.old_logps = self.rollout.needs_ref = self.kl_shaping
        if self.kl_shaping and self.sampler_ctx is not ctx:
            self.rollout.own_logps = rollout_lib.logps_fns(self.sampler_ctx)
        self.sampler_ref = None
        self.inflight: dict[int, tuple[dict, dict, int]] = {}   # step -> (batch, metrics, v)
        self.sampler_params, self.sampler_version, self._sampler_rng = None, None, None
        self.sampler_critic = None   # a phase that refits a PRM its sampler reads places it
        # RAE's per-role baseline moves with the rewards of each batch as it is sampled, so the
        # sampler keeps its own (the train state's follows as the batches train).
        self.sampler_baseline = None
        self.inflight_updates = bool(cfg.algo.inflight_updates)

    # -- the two meshes ------------------------------------------------------------------------

    def publish(self, state, version: int) -> float:
        """Places the policy of ``version`` (``state.params``) where the sampler reads it;
        returns the seconds it took (blocking). A LoRA run copies its adapters only once the
        frozen base is there."""
        t0 = time.perf_counter()
        params = state.params
        lora = lora_lib.has_lora(params) and self.sampler_params is not None
        if lora:   # the base never changes: keep the sampler's copy of it
            params = {"lora": params["lora"]}
        sh = self.ctx.rollout_shardings
        if sh is not None:
            sh = {"lora": sh["lora"]} if lora else sh
            params = shd.transfer(params, sh)
        else:   # one mesh: a copy, since the update donates (deletes) the state's arrays
            params = jax.tree.map(jnp.copy, params)
        if lora:
            params = {**self.sampler_params, "lora": params["lora"]}
        if self._sampler_rng is None:
            rep = self.sampler_ctx.replicated
            self._sampler_rng = (shd.transfer(state.rng, rep) if sh is not None
                                 else jax.device_put(jnp.copy(state.rng), rep))
        if self.kl_shaping and state.ref_params is not None and self.sampler_ref is None:
            # The reference never changes: placed once (a copy on one mesh, where the
            # update donates the state).
            self.sampler_ref = (shd.transfer(state.ref_params, self.ctx.rollout_shardings)
                                if sh is not None else jax.tree.map(jnp.copy, state.ref_params))
        self.sampler_params = jax.block_until_ready(params)
        self.sampler_version = int(version)
        return time.perf_counter() - t0

    def sample(self, step: int) -> None:
        """Samples the batch update ``step`` trains on with the published policy."""
        rounds = getattr(self.rollout, "rounds", None)   # (a pair source has none)
        if hasattr(rounds, "params_version"):   # partial rollouts: versions
            rounds.params_version = self.sampler_version
        view = SamplerState(self.sampler_params, self._sampler_rng, ref_params=self.sampler_ref,
                            role_baseline=self.sampler_baseline,
                            critic_params=self.sampler_critic)
        t0 = time.perf_counter()
        batch, metrics = self.rollout(view, step)
        metrics.setdefault("time/sample", time.perf_counter() - t0)   # (a pair source's)
        if "role_baseline" in batch:   # the next batch's advantages start from this one's
            self.sampler_baseline = batch["role_baseline"]
        v = self.sampler_version
        metrics["rollout/sample_version"] = v
        if "rollout/staleness_mean" not in metrics:   # every token drawn by version v
            metrics.update(staleness_metrics(np.full(1, step - v)))
        self.inflight[step] = (batch, metrics, v)

    def _new_weights(self, state, ready: "_Watch", version: int, transfer: list):
        """In-flight weight updates: the sampler's ``() -> (params, version)``, publishing
        ``state`` (the result of the update being watched) as ``version`` once it is ready.
        Several processes each see the update finish at their own time; they swap at the
        first poll where every one has seen it (``distributed.every_process``: they poll at
        the same points, since they drive the same host loop), so all decode alike."""
        def current():
            if self.sampler_version < version and dist.every_process(ready.done()):
                transfer.append(self.publish(state, version))
            return self.sampler_params, self.sampler_version
        return current

    # -- one iteration -------------------------------------------------------------------------

    def iteration(self, state, step: int):
        t0 = time.perf_counter()
        transfer, sampled = 0.0, 0.0
        if step not in self.inflight:   # a fresh start: the first `lag` batches by this policy
            transfer += self.publish(state, step)
            if state.role_baseline is not None:
                self.sampler_baseline = np.asarray(jax.device_get(state.role_baseline))
            for j in range(step, min(step + self.lag, self.steps)):
                self.sample(j)
                sampled += self.inflight[j][1]["time/sample"]
        batch, metrics, _ = self.inflight.pop(step)
        metrics = dict(metrics)
        if self.sampler_version != step:
            transfer += self.publish(state, step)
        t_train = time.perf_counter()
        state, updates = self.train_on(state, batch, metrics, step)
        ready = _Watch((state, updates))
        t_sample = time.perf_counter()
        relift = getattr(self, "relift", None)
        if step + self.lag < self.steps:
            swapped = []
            # Not when ReLIFT's SFT step may follow this update: the version it would publish
            # in flight would lack the SFT step, so the next iteration publishes it whole.
            if self.inflight_updates and not (relift is not None and relift.due_after(step)):
                self.rollout.weights = self._new_weights(state, ready, step + 1, swapped)
            try:
                self.sample(step + self.lag)
            finally:
                self.rollout.weights = None
            sampled += self.inflight[step + self.lag][1]["time/sample"]
            transfer += sum(swapped)
        t_wait = time.perf_counter()
        if relift is not None:
            # ReLIFT's SFT step follows the update, so version step + 1 includes it. It donates
            # the updated state, which the watcher must be done waiting on first.
            ready.at(t_wait)
            state, relift_metrics = relift.maybe_step(state, step, self.optimizer)
            metrics.update(relift_metrics)
        updates = [to_host(m) for m in updates]
        t_end = time.perf_counter()
        wall = t_end - t0
        merge_updates(metrics, updates)
        rollout_tokens = metrics.get("rollout/tokens", 0)
        metrics.update({
            "time/weight_transfer": transfer,
            "time/trainer_idle_frac": _idle(wall, ready.at(t_end) - t_train),
            "time/sampler_idle_frac": _idle(wall, sampled),
            "time/sample": sampled,   # this iteration's sampling (of later batches)
            "time/rollout": t_wait - t_sample, "time/update": t_sample - t_train,
            "time/wait_update": t_end - t_wait, "time/step": wall,
            "tokens_per_s": (rollout_tokens + metrics.get("rollout/train_tokens", 0)
                             * self.ctx.cfg.algo.num_iterations) / max(wall, 1e-9),
        })
        return state, metrics

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict:
        out = super().state_dict()
        out["inflight"] = {str(j): {"version": v, "metrics": _plain(m),
                                    "batch": {k: encode_array(np.asarray(x))
                                              for k, x in b.items()}}
                           for j, (b, m, v) in sorted(self.inflight.items())}
        return out

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.inflight = {int(j): ({k: decode_array(x) for k, x in item["batch"].items()},
                                  dict(item["metrics"]), int(item["version"]))
                         for j, item in state.get("inflight", {}).items()}
        if self.inflight:   # RAE: the baseline the last batch in flight left
            self.sampler_baseline = self.inflight[max(self.inflight)][0].get("role_baseline")


class AsyncGRPOPhase(AsyncSchedule, GRPOPhase):
    """``steps`` GRPO iterations on batches sampled ``algo.async_lag`` versions earlier."""

    def __init__(self, ctx, steps: int):
        super().__init__(ctx, steps)
        self.needs_old = not single_update(ctx.cfg)
        self.needs_ref = ctx.cfg.algo.beta > 0 and not self.kl_shaping   # the KL loss's

    def _compiled(self, state):
        """The GRPO update; ``algo.update_streams`` left at auto runs one stream: concurrent
        streams block the controller until their gradients are done, and the controller has
        the sampler to drive meanwhile."""
        if self._step_fn is None:
            self._step_fn = super()._compiled(state)
            if not self.ctx.cfg.algo.update_streams:
                self._step_fn.streams = 1
        return self._step_fn

    def train_on(self, state, batch: dict, metrics: dict, step: int):
        """Batch k's log-prob passes, then the update (dispatched, not fetched); RAE's
        baseline after batch k goes into the state, as in the synchronous phase."""
        state, batch = carry_role_baseline(self.ctx, state, batch)
        return self.update(state, self._logp_passes(state, batch, metrics))

    def _logp_passes(self, state, batch: dict, metrics: dict) -> dict:
        """Batch k's proximal log-probs (``old_logps``: version k, when the policy moves within
        the iteration) and reference log-probs, on the training mesh."""
        batch = dict(batch)
        mesh = self.ctx.mesh
        if self.needs_old:   # (always with mixed-policy demonstrations: single_update)
            batch["old_logps"] = self.rollout.logps_fn(state.params, dist.device_batch(batch, mesh))
            m = np.asarray(batch["loss_mask"])
            if "demo" in batch:   # demonstrations: mu = 1 (``demos.insert_demos``)
                batch["old_logps"] = demo_old_logps(batch["old_logps"], batch["demo"])
                m = m & ~np.asarray(batch["demo"], bool)[:, None]
            old = np.asarray(batch["old_logps"])
            diff = np.abs(old - np.asarray(batch["sampler_logps"]))[m]
            metrics["rollout/logp_diff_mean"] = float(diff.mean()) if diff.size else 0.0
            metrics["rollout/logp_diff_max"] = float(diff.max()) if diff.size else 0.0
        if self.needs_ref:
            fn, ref = ((self.rollout.logps_fn, state.ref_params) if state.ref_params is not None
                       else (self.rollout.base_logps_fn, state.params))
            batch["ref_logps"] = fn(ref, dist.device_batch(batch, mesh))
        return batch



class _Watch:
    """The time at which ``tree``'s arrays are ready, seen by a thread that waits on them
    (the controller goes on sampling meanwhile)."""

    def __init__(self, tree):
        self._t = None
        self._thread = threading.Thread(target=self._wait, args=(tree,), daemon=True)
        self._thread.start()

    def _wait(self, tree):
        jax.block_until_ready(tree)
        self._t = time.perf_counter()

    def done(self) -> bool:
        """Whether the arrays are ready (without waiting)."""
        return self._t is not None

    def at(self, fallback: float) -> float:
        self._thread.join()
        return fallback if self._t is None else self._t


def _idle(wall: float, busy: float) -> float:
    return min(1.0, max(0.0, 1.0 - busy / wall)) if wall > 0 else 0.0


def _plain(metrics: dict) -> dict:
    """Metrics as JSON values (numpy scalars as Python numbers)."""
    return json.loads(json.dumps(metrics, default=lambda x: x.item() if isinstance(
        x, np.generic) else x.tolist()))
