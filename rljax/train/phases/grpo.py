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

import time

import jax
import jax.numpy as jnp
import numpy as np

from rljax import distributed as dist
from rljax.data.iterator import PrefetchingIterator
from rljax.models import lora as lora_lib
from rljax.train import guidance, length_groups
from rljax.train.metrics import host_fraction
from rljax.train.rollout import Rollout
from rljax.train.setup import Context, rl_iterator, update_sizes
from rljax.train.steps import build_grpo_step, to_host


class GRPOPhase:
    """``steps`` GRPO iterations at ``optimizer.learning_rate``."""

    name = "grpo"
    prefetch = True   # draw the next prompts while the update runs (results do not change)

    def __init__(self, ctx: Context, steps: int):
        cfg = ctx.cfg
        self.ctx, self.steps = ctx, int(steps)
        a = cfg.algo
        self.batch_size = cfg.rollout.batch_size
        self.mini, self.num_micro, self.updates_per_step = update_sizes(cfg)
        self.iterator = rl_iterator(ctx, self.batch_size // a.num_generations)
        # One update per rollout (one epoch, one mini-batch): the policy has not moved since
        # sampling, so the update's own log-probs are the old ones (no separate forward).
        # (Not with mixed-policy demonstrations: their old log-probs are set apart.)
        single_update = (a.num_iterations == 1 and self.mini == self.batch_size
                         and not a.mixed_policy)
        rollout_cls = Rollout
        if cfg.env.name:   # multi-turn episodes (rljax.train.agent)
            from rljax.train.agent import MultiTurnRollout as rollout_cls
        self.rollout = rollout_cls(ctx, self.iterator, old_logps=not single_update)
        # Wrapped after the rollout has seen the raw iterator (it looks for a selector there).
        self.iterator = self.rollout.iterator = PrefetchingIterator(self.iterator)
        # ReLIFT SFT steps share the optimizer (and its schedule) with the RL updates.
        self.relift = guidance.Relift(ctx, self.rollout.guide) if a.relift.every else None
        relift_updates = self.steps // a.relift.every if self.relift else 0
        self.optimizer = ctx.optimizer(cfg.optimizer.learning_rate,
                                       self.steps * self.updates_per_step + relift_updates)
        self._step_fn = None

    def init_state(self, state):
        """Fresh optimizer; the reference policy is a copy of the starting policy (beta > 0),
        or with LoRA the base model itself (adapters off: no copy, ``ref_params`` stays None)."""
        copy_ref = self.ctx.cfg.algo.beta > 0 and not lora_lib.has_lora(state.params)
        ref = jax.tree.map(jnp.copy, state.params) if copy_ref else None
        return state.replace(opt_state=self.optimizer.init(lora_lib.trainable(state.params)),
                             ref_params=ref)

    def _compiled(self, state):
        if self._step_fn is None:
            cfg = self.ctx.cfg
            build = (length_groups.build_grpo_step if length_groups.host_planned(cfg.algo)
                     else build_grpo_step)
            self._step_fn = build(
                self.ctx.model_cfg, cfg.algo, self.optimizer,
                temperature=cfg.rollout.temperature, num_micro=self.num_micro,
                state_shardings=self.ctx.state_shardings(state), mesh=self.ctx.mesh)
        return self._step_fn

    def iteration(self, state, step: int):
        t0 = time.perf_counter()
        batch, metrics = self.rollout(state, step)
        t1 = time.perf_counter()
        step_fn = self._compiled(state)
        updates = []
        for _ in range(self.ctx.cfg.algo.num_iterations):
            for start in range(0, self.batch_size, self.mini):
                mb = jax.tree.map(lambda x: x[start:start + self.mini], batch)
                if length_groups.host_planned(self.ctx.cfg.algo):   # plans the host rows itself
                    state, m = step_fn(state, mb)
                else:
                    state, m = step_fn(state, dist.device_batch(mb, self.ctx.mesh))
                    # Real tokens / positions the update computes (grouped: its own figure).
                    m = dict(m, **{"update/token_efficiency": float(np.mean(mb["mask"]))})
                updates.append(m)
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
        for key in updates[0]:
            values = [u[key] for u in updates]
            metrics[key] = int(sum(values)) if key == "skipped" else float(np.mean(values))
        metrics.update({
            "time/rollout": t1 - t0, "time/update": t2 - t1, "time/step": t2 - t0,
            "tokens_per_s": (metrics["rollout/tokens"] + metrics["rollout/train_tokens"]
                             * self.ctx.cfg.algo.num_iterations) / max(t2 - t0, 1e-9),
        })
        return state, metrics

    def state_dict(self) -> dict:
        out = {"data": self.iterator.state()}
        if self.rollout.guide is not None:
            out["guidance"] = self.rollout.guide.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        self.iterator.restore(state["data"])
        if self.rollout.guide is not None and "guidance" in state:
            self.rollout.guide.load_state_dict(state["guidance"])
