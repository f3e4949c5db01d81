"""One RL rollout: prompts -> G samples each (on device) -> rewards (host) -> advantages -> batch.

    rollout = Rollout(ctx, iterator)
    batch, metrics = rollout(state, step)

``batch`` (numpy / jax arrays, R = rollout.batch_size completions, prompt-major groups of G):

    tokens         int32 [R, P+N]  prompt (left-padded to bucket P) ++ completion (N slots)
    mask           bool  [R, P+N]  real tokens
    loss_mask      bool  [R, N]    completion tokens that train (see below)
    sampler_logps  f32   [R, N]    log-probs the sampler reported
    old_logps      f32   [R, N]    the trainer's log-probs before any update (recomputed;
                                   absent with ``Rollout(..., old_logps=False)``, see below)
    ref_logps      f32   [R, N]    reference policy (only with a KL-to-reference loss)
    temperatures   f32   [R, N]    each token's sampling temperature (only with a
                                   ``rollout.temperature_schedule``; log-probs use it)
    routes         int32 [R, P+N, L, k]  each token's experts in every layer, as the sampler
                                   routed it (``algo.routing_replay``, mixtures of experts)
    advantages     f32   [R]       one per completion (sequence-level estimators), or
                   f32   [R, N]    per token (token-level ones: reinforce_pp, ...;
                                   ``algorithms.is_token_level``), 0 outside ``loss_mask``

DAPO options (``algo.dynamic_sampling``, ``algo.overlong_buffer``): groups whose rewards are
all equal are dropped and more prompts sampled (at most ``algo.max_sampling_rounds`` extra
rounds); if the batch is still short, it is filled with dropped groups whose ``loss_mask`` is
all False, so shapes stay static and they count for nothing. Prompt selection
(``data.selection``, ``rljax.data.selection``) plugs in here: ``online_filter`` replaces the
all-equal test by a pass-rate band in the same loop, and every selector sees each round's
rewards (``observe``). ``rollout/tokens`` counts every sampled token, of dropped rounds too.
``mask_truncated_completions``
drops completions without a stop token from the loss (DAPO overlong filtering).

``old_logps=False`` (GRPO with ``num_iterations = 1`` and one mini-batch: the policy does not
move between sampling and the only update) skips the separate forward pass; the update step
then uses its own log-probs (under ``stop_gradient``) as the old ones and reports the
sampler-vs-trainer ``rollout/logp_diff_*`` metrics itself. The pass still runs when a sequence
KL is folded into the reward (it needs the old log-probs before the advantages).

``algo.kl_in_reward``: token-level estimators get the per-token KL ``-beta * KL_t`` in the
token rewards (so each token's return carries the KL from that token on); sequence-level ones
get the whole completion's KL subtracted from its outcome reward.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from rljax import algorithms, rewards, sampling
from rljax.sampling import tree as tree_sampling
from rljax.data import allocation, selection
from rljax import distributed as dist
from rljax.train.core import image_inputs, length_groups, rollout_metrics
# Re-exported: callers import these here.
from rljax.train.core.buckets import build_sequences, encode_prompts, prompt_buckets  # noqa: F401
from rljax.train.core.parts import RolloutStage, RoundSource  # noqa: F401
from rljax.train.core.sampler import (generate, rebucket_routes,  # noqa: F401
                                      rollout_temperatures, token_temperatures)
from rljax.train.core.steps import build_logps_fn

RL_STREAM = 2  # rng stream of RL rollouts: fold_in(fold_in(state.rng, RL_STREAM), step)


def expand_fields(examples: list[dict], g: int) -> dict[str, list]:
    """Dataset fields (all keys but ``prompt``) repeated G times, for the reward functions."""
    keys = [k for k in examples[0] if k != "prompt"]
    return {k: [ex.get(k) for ex in examples for _ in range(g)] for k in keys}


def logps_fns(ctx) -> tuple[Callable, Callable]:
    """The rollout's log-prob passes on ``ctx``'s mesh: ``(policy, base)``, each ``(params,
    batch) -> logps [R, N]``; ``base`` runs the base model with the LoRA adapters off (the
    reference policy of a LoRA run: the same arrays)."""
    cfg = ctx.cfg
    micro = cfg.algo.micro_batch_size or cfg.algo.mini_batch_size or cfg.rollout.batch_size
    opts = dict(temperature=cfg.rollout.temperature, num_micro=cfg.rollout.batch_size // micro,
                mesh=ctx.mesh, param_shardings=ctx.param_shardings)
    build = build_logps_fn
    if length_groups.host_planned(cfg.algo):
        build = functools.partial(length_groups.build_logps_fn, algo_cfg=cfg.algo)
    return build(ctx.model_cfg, **opts), build(ctx.model_cfg, base_only=True, **opts)


def group_filter(cfg, selector, group_size: int, informative: Callable):
    """The function ``(rewards [R], sizes int [B] or None) -> bool [B]`` of groups that may
    train (consecutive groups of ``sizes`` rows, or of ``group_size``), or None to keep all:
    DAPO dynamic sampling (``informative``, the same signature: groups whose rewards differ)
    or the selector's band (``data.selection.name='online_filter'``). Either samples extra
    rounds."""
    if cfg.algo.dynamic_sampling:
        return informative
    if selector is not None and selector.filters:
        return lambda rewards, sizes: selector.keep_groups(
            rewards, group_size if sizes is None else np.asarray(sizes))
    return None


class Rollout:
    """Collects one training batch per call; host state is the data iterator's."""

    def __init__(self, ctx, iterator, old_logps: bool = True, stages: Sequence = (),
                 rounds=None):
        cfg = ctx.cfg
        self.ctx, self.cfg, self.iterator = ctx, cfg, iterator
        # Prompt selection (data.selection): the iterator is a selector to report rounds to.
        self.selector = iterator if isinstance(iterator, selection.Selector) else None
        self.g = int(cfg.algo.num_generations)
        self.num_prompts = cfg.rollout.batch_size // self.g
        # An environment may be the only source of reward (``reward.names`` empty).
        self.reward_fn = ctx.reward_fn() if cfg.reward.names else None
        self.monitor = rewards.RewardMonitor(cfg.reward.max_consecutive_error_steps)
        self.logps_fn, self.base_logps_fn = logps_fns(ctx)
        # The (policy, reference) log-prob passes this rollout runs itself, when they are not
        # the update's (asynchronous RL's sampler has a mesh of its own): None, the above.
        self.own_logps = None
        a = cfg.algo
        self.needs_ref = a.beta > 0
        # Host-side group statistics as one jitted program each (run eagerly, every jnp op of
        # the estimator was a separate XLA compilation in the first iteration).
        g = self.g
        self._advantages = None   # built on first use (PPO's 'gae' is not an outcome estimator)
        self.token_level = algorithms.is_token_level(a.adv_estimator)
        self._informative = jax.jit(lambda r: algorithms.nonzero_variance_groups(r, g))
        self.old_logps = bool(old_logps) or (self.needs_ref and bool(a.kl_in_reward))
        self.temperatures = rollout_temperatures(cfg)   # None: rollout.temperature
        self._printed_at = None   # time of the last logging.num_completions_to_print output
        # Method features composed by the phase (``RolloutStage``): hints, ReLIFT, demos.
        self.stages = list(stages)
        for stage in self.stages:
            stage.check(iterator.render(0))
        # Tree sampling (docs/search.md): each prompt's group is the leaves of one tree.
        self.tree = tree_sampling.options_from_config(cfg.rollout.tree, g)
        self.pending_since = None   # see __call__
        self.images = image_inputs.image_inputs(ctx)   # None: a text model
        # In-flight weight updates (asynchronous RL sets it while a batch is sampled):
        # ``() -> (params, version)``, polled between the slot engine's decode chunks (the
        # episode engine's, for episodes: ``episodes.EngineWeights``).
        self.weights = None
        # Where rounds come from when not sampled here (``RoundSource``): partial rollouts'
        # pool of groups in flight, multi-turn episodes.
        self.rounds = rounds

    # -- one round: sample a prompt batch and score it ---------------------------------------

    def sample_round(self, params, rng, examples=None, prefixes=None) -> dict:
        """Samples G completions of each prompt (the iterator's next batch, or ``examples``)
        and scores them. ``prefixes`` (hints, ``guidance``): token ids appended to each prompt,
        i.e. placed at the start of the assistant turn; the reward judges prefix + completion.
        With a round source, a round of the iterator's prompts is the source's; ``examples``
        (hinted re-samples of its failed groups) are sampled here, by the current policy;
        hinted episodes by the round source (``sample_hinted``)."""
        if self.rounds is not None and examples is None:
            if prefixes is not None:
                raise ValueError("prefixes need their examples")
            return self.rounds.sample_round(self, params, rng)
        if self.cfg.env.name:   # hinted episodes: the round source plays them
            return self.rounds.sample_hinted(self, params, rng, examples, prefixes)
        cfg, g = self.cfg, self.g
        drawn = examples is None
        examples = next(self.iterator) if examples is None else examples
        if prefixes is None:
            prompt_tokens, prompt_mask = encode_prompts(self.ctx.tokenizer,
                                                        [ex["prompt"] for ex in examples],
                                                        cfg.data.max_prompt_length)
        else:
            prompt_tokens, prompt_mask = sampling.pad_to_bucket(
                [self.ctx.tokenizer.encode(ex["prompt"]) + list(p)
                 for ex, p in zip(examples, prefixes)],
                pad_id=self.ctx.tokenizer.pad_id,
                buckets=prompt_buckets(cfg.data.max_prompt_length))
        t0 = time.perf_counter()
        micro = cfg.rollout.micro_batch_size // g if cfg.rollout.micro_batch_size else 0
        pixels = None if self.images is None else self.images.pixels(
            examples, self._locations(examples) if drawn else None)
        out = generate(self.ctx, params, prompt_tokens, prompt_mask, rng, num_samples=g,
                       max_new_tokens=cfg.rollout.max_new_tokens,
                       temperature=cfg.rollout.temperature, top_k=cfg.rollout.top_k,
                       top_p=cfg.rollout.top_p, micro_prompts=micro,
                       temperatures=self.temperatures, tree=self.tree, pixels=pixels,
                       images=self.images, weights=self.weights)
        rnd = self.score_round(examples, prompt_tokens, prompt_mask, out, prefixes, t0)
        if pixels is not None:
            rnd.update(image_inputs.round_fields(pixels, self.images.usable))
        return rnd

    def _locations(self, examples) -> list[str] | None:
        """``file:line`` of each example the iterator just drew (None when it cannot say)."""
        from rljax.data.sources import where
        it = self.iterator
        indices, source = getattr(it, "last_indices", None), getattr(it, "source", None)
        if indices is None or source is None or len(indices) != len(examples):
            return None
        return [where(source, i) for i in indices]

    def score_round(self, examples, prompt_tokens, prompt_mask, out, prefixes, t0,
                    g: int | None = None) -> dict:
        """The round dict of sampled ``out`` (``generate``'s fields) for ``examples``: texts,
        rewards (every reward function), per-function counts; sampling timed from ``t0``.
        ``g``: samples per prompt row (default ``algo.num_generations``)."""
        cfg, g = self.cfg, self.g if g is None else g
        t1 = time.perf_counter()
        # Multi-host: each process scores its own rows, then every process gets all rewards.
        n = len(out["tokens"])
        rows = dist.local_rows(self.ctx.mesh, n) if dist.is_multiprocess() else slice(0, n)
        if prefixes is None:
            texts = self.ctx.tokenizer.batch_decode(out["tokens"][rows], out["mask"][rows])
        else:
            texts = [self.ctx.tokenizer.decode(list(prefixes[i // g]) + list(t[m]))
                     for i, t, m in zip(range(n)[rows], out["tokens"][rows], out["mask"][rows])]
        prompts = [ex["prompt"] for ex in examples for _ in range(g)][rows]
        fields = {k: v[rows] for k, v in expand_fields(examples, g).items()}
        result = self.reward_fn(prompts, texts, completion_lengths=list(out["lengths"][rows]),
                                **fields)
        self.monitor.observe(result)  # console warnings: which function failed, why, how often
        scores = {name: np.asarray(v, np.float32) for name, v in result.per_function.items()}
        total = np.asarray(result.total, np.float32)
        self._maybe_print_completions(prompts, texts, result.total)
        # Per function: [failed samples, timed-out samples, samples scored], summed over hosts.
        counts = np.asarray([[result.errors[k], result.timeouts.get(k, 0), len(texts)]
                             for k in result.per_function], np.int64)
        if dist.is_multiprocess():
            total, scores = dist.rows_to_global((total, scores), self.ctx.mesh, n)
            counts = dist.gather(counts[None], tiled=True).sum(0) // dist.row_replication(
                self.ctx.mesh, n)
        counts = {k: c for k, c in zip(result.per_function, counts.tolist())}
        errors = sum(c[0] for c in counts.values())
        buffer = int(cfg.algo.overlong_buffer)
        if buffer:  # DAPO soft overlong punishment on token lengths
            scores["overlong"] = np.asarray(algorithms.overlong_penalty(
                out["lengths"], cfg.rollout.max_new_tokens, buffer,
                cfg.algo.overlong_penalty_factor), np.float32)
            total = total + scores["overlong"]
        return dict(out, examples=examples,
                    prompt_ids=[list(r[m]) for r, m in zip(prompt_tokens, prompt_mask)],
                    prompt_len=int(prompt_tokens.shape[1]),
                    rewards=total, scores=scores, errors=errors, reward_counts=counts,
                    time_sample=t1 - t0, time_reward=time.perf_counter() - t1)

    def _maybe_print_completions(self, prompts, texts, rewards) -> None:
        """``logging.num_completions_to_print`` samples of this round on the console (stderr,
        process 0): at the first round, then at most every ``logging.console_every_s``."""
        n = int(self.cfg.logging.num_completions_to_print)
        if n <= 0 or jax.process_index() != 0:
            return
        now = time.monotonic()
        if self._printed_at is not None and now - self._printed_at < float(
                self.cfg.logging.console_every_s):
            return
        self._printed_at = now
        rollout_metrics.print_completions(prompts[:n], texts[:n], list(rewards)[:n])

    # -- the full batch ------------------------------------------------------------------------

    def __call__(self, state, step: int) -> tuple[dict, dict]:
        cfg, g = self.cfg, self.g
        if self.rounds is not None:
            self.rounds.begin(state, step)
        rng = jax.random.fold_in(jax.random.fold_in(state.rng, RL_STREAM), step)
        rounds, kept, dropped = [], [], []   # kept/dropped: (round, group) pairs
        keep_fn = self._group_filter()
        max_rounds = 1 + (cfg.algo.max_sampling_rounds if keep_fn is not None else 0)
        for r in range(max_rounds):
            rnd = self.sample_round(state.params, jax.random.fold_in(rng, r))
            self.observe_round(rnd)  # (the policy's own rewards, before hints)
            for stage in self.stages:  # e.g. hints for failed groups, ReLIFT visit counts
                rnd = stage.after_round(self, state.params, rnd, jax.random.fold_in(rng, r))
            rounds.append(rnd)
            keep = (np.ones(self.round_groups(rnd), bool) if keep_fn is None
                    else keep_fn(rnd["rewards"], rnd.get("group_sizes")))
            for i, ok in enumerate(keep):
                (kept if ok else dropped).append((r, i))
            groups, filler, full = self._pick_groups(rounds, kept, dropped)
            if full:
                break
        self._check_reward_failures(rounds, step)
        for stage in self.stages:   # e.g. VinePPO's values, of the rows that train only
            stage.picked(self, state.params, rounds, groups[:len(groups) - filler], rng)
        batch, rows = self._assemble(rounds, groups)
        # Multi-turn episodes: only the model's own tokens train (observations are context).
        model_mask = rows.get("model_mask", rows["mask"])
        loss_mask = model_mask & self._train_rows(rounds, groups, filler, len(model_mask))[:, None]
        if cfg.algo.mask_truncated_completions:
            loss_mask &= ~rows["truncated"][:, None]
        if "real" in rows:   # rows that only pad the batch to its fixed size weigh zero
            loss_mask &= rows["real"][:, None]
        if "image_ok" in rows:   # a prompt whose image was skipped costs its example
            loss_mask &= rows["image_ok"][:, None]
        batch["loss_mask"] = loss_mask

        t0 = time.perf_counter()
        # When device work is next dispatched (time/host_frac); None: the caller's update.
        self.pending_since = t0 if self.old_logps or self.needs_ref else None
        logps_fn, base_logps_fn = self.own_logps or (self.logps_fn, self.base_logps_fn)
        if self.old_logps:
            batch["old_logps"] = logps_fn(state.params, dist.device_batch(batch, self.ctx.mesh))
        rewards, token_kl = rows["rewards"], None
        metrics: dict[str, Any] = {}
        if self.needs_ref:
            ref_fn, ref = ((logps_fn, state.ref_params) if state.ref_params is not None
                           else (base_logps_fn, state.params))
            batch["ref_logps"] = ref_fn(ref, dist.device_batch(batch, self.ctx.mesh))
            if cfg.algo.kl_in_reward:  # KL penalty folded into the reward
                kl = dist.to_host(algorithms.get_kl_estimator(cfg.algo.kl_estimator)(
                    batch["old_logps"], batch["ref_logps"]))
                kl = np.where(model_mask, kl, 0.0).astype(np.float32)
                kl_seq = kl.sum(-1)
                rows["token_kl"] = kl   # per-turn credit folds each turn's own into its reward
                if self.token_level:  # per token, inside the return-to-go
                    token_kl = kl
                else:                 # the whole completion's KL off its outcome reward
                    rewards = rewards - cfg.algo.beta * kl_seq
                metrics["kl_ref_seq"] = float(kl_seq.mean())
                del batch["ref_logps"]
        for stage in self.stages:  # e.g. mixed-policy demonstrations: ratio pi_theta / 1
            stage.finish_batch(batch, rows)
        adv = None
        for stage in self.stages:  # a stage may own the credit (episodes: per-turn, per-role)
            if adv is None:
                adv = stage.advantages(self, state, rewards, loss_mask, rows, batch)
        if adv is None:
            # A stage may give the estimator more per-row inputs (process rewards: step scores).
            inputs = rows.get("estimator_inputs")
            if "demo" in rows and algorithms.uses_tree(cfg.algo.adv_estimator):
                # a demonstration shares no segment with the sampled leaves: its own tree
                inputs = dict(inputs or {}, node_ids=tree_sampling.own_branches(
                    self.tree_structure(len(rewards) // self.g)["node_ids"], rows["demo"]))
            adv = self.advantages(rewards, mask=loss_mask, token_kl=token_kl,
                                  **({"inputs": inputs} if inputs else {}))
        batch["advantages"] = adv
        metrics.update(rollout_metrics.batch_metrics(rounds, adv, loss_mask, filler,
                                                     self.informative_groups))
        for stage in self.stages:
            metrics.update(stage.metrics(rounds, rows))
        if self.selector is not None:
            metrics.update(self.selector.metrics())
        if "versions" in rows:   # in-flight weight updates: each token's own version
            metrics.update(rollout_metrics.staleness_metrics(
                step - rows["versions"][loss_mask]))
            metrics["rollout/weight_swaps"] = sum(r["swaps"] for r in rounds)
        # Padding: real tokens / positions the training forward/backward computes ([R, P+N]),
        # and real prompt tokens / prompt slots the sampler prefilled ([B, P] per round).
        metrics["rollout/seq_len"] = int(batch["mask"].shape[1])
        metrics["rollout/token_efficiency"] = float(batch["mask"].mean())
        metrics["rollout/prompt_efficiency"] = float(np.mean(
            [len(ids) / r["prompt_len"] for r in rounds for ids in r["prompt_ids"]]))
        if self.old_logps:  # otherwise the update step reports them from its own log-probs
            old = dist.to_host(batch["old_logps"])
            sampled = model_mask & ~rows.get("demo", np.zeros(len(old), bool))[:, None]
            diff = np.abs(old - rows["logps"])[sampled]
            metrics["rollout/logp_diff_mean"] = float(diff.mean()) if diff.size else 0.0
            metrics["rollout/logp_diff_max"] = float(diff.max()) if diff.size else 0.0
        metrics["time/logps"] = time.perf_counter() - t0
        if self.rounds is not None:
            metrics.update(self.rounds.metrics(rounds, step))
        return batch, metrics

    def _pick_groups(self, rounds, kept, dropped) -> tuple[list, int, bool]:
        """(groups the batch is built from, (round, group) pairs; how many of them, last, only
        pad it; whether the kept groups fill it): the first ``num_prompts`` kept groups, then
        dropped ones. A round source whose groups have sizes of their own picks them."""
        if "group_sizes" in rounds[0]:
            return self.rounds.pick_groups(rounds, kept, dropped)
        filler = max(0, self.num_prompts - len(kept))
        return kept[:self.num_prompts] + dropped[:filler], filler, not filler

    def _train_rows(self, rounds, groups, filler: int, n: int) -> np.ndarray:
        """bool [n]: the batch rows of the groups that train (not the last ``filler`` groups,
        nor the rows past all groups that pad ragged ones)."""
        sizes = [rounds[r]["group_sizes"][i] if "group_sizes" in rounds[r] else self.g
                 for r, i in groups]
        train = np.repeat(np.arange(len(groups)) < len(groups) - filler, sizes)
        return np.pad(train, (0, n - len(train)))

    def round_groups(self, rnd: dict) -> int:
        """The number of groups (prompts) a sampling round holds (``group_sizes``: a round
        whose groups have sizes of their own, ``methods.allocation``)."""
        return len(rnd["group_sizes"]) if "group_sizes" in rnd else len(rnd["rewards"]) // self.g

    def observe_round(self, rnd: dict) -> None:
        """Prompt selection learns from every sampling round's rewards (each group at its
        size), each group's for its own prompt: a round source that carries groups across
        iterations says which dataset index each came from (``indices``)."""
        if self.selector is not None:
            known = {"indices": rnd["indices"]} if "indices" in rnd else {}
            self.selector.observe(rnd["rewards"], rnd.get("group_sizes", self.g), **known)

    def _check_reward_failures(self, rounds, step: int) -> None:
        """Stops the run (RewardFunctionFailed) when a function failed on every sample of
        ``reward.max_consecutive_error_steps`` steps in a row (same counts on every host).
        Without reward functions (an environment's rewards only) there is nothing to check."""
        if self.reward_fn is None:
            return
        names = rounds[0]["reward_counts"]
        self.monitor.end_step(
            step + 1, {k: sum(r["reward_counts"][k][0] for r in rounds) for k in names},
            {k: sum(r["reward_counts"][k][2] for r in rounds) for k in names})

    def advantages(self, rewards: np.ndarray, mask: np.ndarray | None = None,
                   token_kl: np.ndarray | None = None, inputs: dict | None = None) -> np.ndarray:
        """Advantages with the configured estimator from rewards [R]: [R], or [R, N] for a
        token-level estimator, which also takes ``mask`` [R, N] (the tokens that train), the
        per-token KL [R, N] to put in the reward (``algo.kl_in_reward``, else None) and
        ``inputs``, arrays [R, N] a rollout stage made for it (``grpo_process``: the step
        rewards, ``methods.process_rewards``) or [R] a round source did (``group_ids``: groups
        of their own sizes, ``methods.allocation``; any estimator takes them)."""
        a, g = self.cfg.algo, self.g
        if self._advantages is None:
            opts = ({"scale_rewards": a.scale_rewards}
                    if a.adv_estimator in ("grpo", "grpo_process") else {})
            if a.adv_estimator == "grpo_process":
                opts["process_weight"] = float(a.process_reward.weight)
            estimator = algorithms.get_advantage_estimator(a.adv_estimator)
            if algorithms.uses_tree(a.adv_estimator):  # (the node ids go with each call)
                opts.update({k: v for k, v in self.tree_structure(len(rewards) // g).items()
                             if k != "node_ids"})
            if self.token_level:
                # The KL enters the token rewards only with kl_in_reward (else token_kl = 0).
                opts.update(kl_coef=float(a.beta) if a.kl_in_reward else 0.0,
                            gamma=float(a.gamma))
                self._advantages = jax.jit(
                    lambda r, m, kl, extra: estimator(r, g, mask=m, token_kl=kl, **extra,
                                                      **opts))
            else:
                self._advantages = jax.jit(lambda r, extra: estimator(r, g, **extra, **opts))
        rewards = np.asarray(rewards, np.float32)
        extra = dict(inputs or {})
        if algorithms.uses_tree(a.adv_estimator) and "node_ids" not in extra:
            extra["node_ids"] = self.tree_structure(len(rewards) // g)["node_ids"]
        if not self.token_level:
            return np.asarray(self._advantages(rewards, extra), np.float32)
        if token_kl is None:
            token_kl = np.zeros(mask.shape, np.float32)
        return np.asarray(self._advantages(rewards, np.asarray(mask, bool), token_kl, extra),
                          np.float32)

    def _group_filter(self):
        """``group_filter`` of this rollout (None: keep all)."""
        return group_filter(self.cfg, self.selector, self.g, self.informative_groups)

    def tree_structure(self, num_groups: int) -> dict:
        """Tree estimators' inputs for ``num_groups`` groups: ``node_ids`` int32 [R, D+1] and
        (token level) ``segments`` int32 [N], the tree level of each completion position."""
        t = self.tree
        node_ids, _ = tree_sampling.tree_layout(t["roots"], t["branching"], t["depth"])
        out = {"node_ids": np.tile(node_ids, (num_groups, 1))}
        if self.token_level:
            out["segments"] = tree_sampling.segment_of_position(
                self.cfg.rollout.max_new_tokens, t["segment_tokens"], t["depth"])
        return out

    def informative_groups(self, rewards: np.ndarray, sizes=None) -> np.ndarray:
        """bool [R / G]: groups whose rewards are not all equal (``sizes``: consecutive groups
        of those sizes)."""
        if sizes is not None:
            return allocation.informative_groups(rewards, sizes)
        return np.asarray(self._informative(np.asarray(rewards, np.float32)), bool)

    def _assemble(self, rounds, groups, g: int | None = None):
        """Stacks the selected groups' rows into the batch layout (re-bucketing prompts);
        ``g`` rows per group (default ``algo.num_generations``). A round whose groups have
        sizes of their own is laid out by its source (``assemble``, ``core.parts``)."""
        if "group_sizes" in rounds[0]:
            return self.rounds.assemble(self, rounds, groups)
        g = self.g if g is None else g
        pick = lambda key: np.concatenate(  # noqa: E731
            [rounds[r][key][i * g:(i + 1) * g] for r, i in groups])
        rows = {k: pick(k) for k in ("tokens", "logps", "mask", "lengths", "truncated",
                                     "rewards", "demo", "versions") if k in rounds[0]}
        # Per-row fields a round source adds (episodes: model_mask, turn_rewards, roles, ...).
        rows.update({k: pick(k) for k in rounds[0].get("row_keys", ())})
        prompt_ids = [rounds[r]["prompt_ids"][i] for r, i in groups for _ in range(g)]
        p_tok, p_mask = sampling.pad_to_bucket(
            prompt_ids, pad_id=self.ctx.tokenizer.pad_id,
            buckets=prompt_buckets(self.cfg.data.max_prompt_length))
        tokens, mask = build_sequences(p_tok, p_mask, rows["tokens"], rows["mask"])
        batch = {"tokens": tokens, "mask": mask, "sampler_logps": rows["logps"]}
        if "model_mask" in rows:   # episodes: the model's own tokens (observations are context)
            batch["model_mask"] = rows["model_mask"]
        if "pixels" in rounds[0]:   # each row carries its prompt's images
            batch["pixels"] = np.concatenate([np.repeat(rounds[r]["pixels"][i:i + 1], g, 0)
                                              for r, i in groups])
            rows["image_ok"] = np.concatenate([np.repeat(rounds[r]["image_ok"][i:i + 1], g)
                                               for r, i in groups])
        if "routes" in rounds[0]:   # routing replay: the sampler's routes, on this prompt bucket
            batch["routes"] = np.concatenate(
                [rebucket_routes(rounds[r]["routes"][i * g:(i + 1) * g], rounds[r]["prompt_len"],
                                 p_tok.shape[1]) for r, i in groups])
        if self.temperatures is not None:   # scored at the temperature each was sampled at
            batch["temperatures"] = token_temperatures(self.temperatures, rows["tokens"].shape,
                                                       rows.get("model_mask"))
        return batch, rows

class RewardRollout(Rollout):
    """The GRPO rollout (sampling, rewards, dynamic sampling, old log-probs) returning each
    completion's raw reward as ``batch["rewards"]`` [R] instead of group advantages: PPO
    computes token-level advantages itself and online DPO ranks samples by reward. The
    reference (and any KL) is handled per token by the caller, so the rollout skips it.
    ``stages`` add to the batch (episodes: PPO's turn-end rewards); one that gives advantages
    would replace the raw rewards."""

    def __init__(self, ctx, iterator, rounds=None, stages: Sequence = ()):
        super().__init__(ctx, iterator, rounds=rounds, stages=stages)
        self.needs_ref = False

    def advantages(self, rewards: np.ndarray, mask=None, token_kl=None,
                   inputs=None) -> np.ndarray:
        return np.asarray(rewards, np.float32)

    def __call__(self, state, step: int) -> tuple[dict, dict]:
        batch, metrics = super().__call__(state, step)
        batch["rewards"] = batch.pop("advantages")
        for key in [k for k in metrics if k.startswith("adv/")]:
            del metrics[key]  # these were reward statistics; the caller reports its own
        return batch, metrics
