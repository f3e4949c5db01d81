"""Partial rollouts of multi-turn episodes (``rollout.partial`` with ``env.name``): groups of
episodes carried across iterations at turn boundaries, as a rollout's round source.

    rollout = Rollout(ctx, iterator, rounds=EpisodePartialRounds(ctx, num_prompts))

Two batches of prompts stay in flight (2 x ``num_prompts`` places, each a group of G
episodes). Each iteration admits the iterator's next batch into the places the last one freed,
then plays turns on the episode engine (``sampling.episode_engine``) under the current
parameters, oldest group first, until ``num_prompts`` groups have all their episodes ended
(by the environment, or out of turns or tokens); those groups are the round, in the order they
completed. The others keep the turns they finished and continue next iteration under the new
weights; a turn still decoding when the round is complete is dropped and drawn again (same
noise, new weights) next iteration: episodes are carried at turn boundaries, so every turn is
drawn by one policy version, which each of its tokens records.

What is carried is plain data: each place's example and, per episode, its finished turns (the
kept tokens, their behaviour log-probs, the version that drew them). Every iteration rebuilds
the episodes from it: fresh environments (``reset``), the recorded turns replayed through
``env.step``, and on the engine the whole trajectory so far fed again under the current
weights before the next turn samples. The checkpoint holds the same data (``state_dict``), so
a resumed run rebuilds exactly what the straight run rebuilds. This needs environments that
answer the same actions the same way (the tool and game environments do; a tool whose answer
depends on the wall clock, e.g. one that can time out, may answer differently on replay).

Randomness: token t of turn k of sample i of the group admitted s-th reads the engine's row
draw of id ``s * G + i`` under ``fold_in(state.rng, EPISODE_STREAM)`` (turn k, token t), so a
turn draws the same noise whatever slot, chunk or iteration it is played in.

Staleness: a group holding a turn more than ``rollout.max_staleness`` versions old restarts
from its prompt (counted in ``rollout/dropped_stale``). Metrics as ``core.partial``'s:
``rollout/staleness_mean`` / ``_max`` over the batch's model tokens, ``rollout/dropped_stale``,
``rollout/carried_groups``, ``rollout/decoded_tokens`` (tokens sampled this iteration, dropped
turns included).
"""
from __future__ import annotations

import json
import time

import jax
import numpy as np

from rljax import distributed as dist, sampling
from rljax.errors import UserError
from rljax.sampling import multiturn
from rljax.train.core import episodes as ep
from rljax.train.core.partial import _plain, _restored
from rljax.train.core.rollout_metrics import staleness_metrics
from rljax.train.core.sampler import engine_slots, sampling_params
from rljax.train.methods import agent

EPISODE_STREAM = 9  # rng stream of the episodes in flight: fold_in(state.rng, 9), every step


class EpisodePartialRounds(agent.EpisodeRounds):
    """Multi-turn episodes with partial rollouts as a rollout's round source (module
    docstring): ``EpisodeRounds``' rounds and metrics, from groups carried across
    iterations."""

    def __init__(self, ctx, num_prompts: int):
        super().__init__(ctx)
        if self.selfplay:
            raise UserError("rollout.partial=true cannot be combined with env.selfplay yet")
        if dist.is_multiprocess():
            raise UserError("rollout.partial=true runs in a single process for now; use "
                            "rollout.partial=false on several hosts")
        self.num_prompts = int(num_prompts)
        self.g = int(ctx.cfg.algo.num_generations)
        c = 2 * self.num_prompts
        self.serial = np.full(c, -1, np.int64)        # admission serial (-1: free place)
        self.completed_at = np.full(c, -1, np.int64)  # engine chunk the group completed in
        self.metas: list = [None] * c
        # Per place, per sample: the finished turns, {"ids", "logps", "version"}.
        self.turns: list[list[list[dict]]] = [[[] for _ in range(self.g)] for _ in range(c)]
        self.next_serial = self.clock = 0
        self._step = self._version = 0
        self._key, self._last = None, None
        # Asynchronous RL: the version of the parameters it passes (None: ``step``).
        self.params_version: int | None = None

    @property
    def free(self) -> int:
        return int((self.serial < 0).sum())

    def begin(self, state, step: int) -> None:
        self._step = int(step)
        self._version = self._step if self.params_version is None else int(self.params_version)
        self._key = jax.random.fold_in(state.rng, EPISODE_STREAM)

    # -- one iteration -------------------------------------------------------------------------

    def sample_round(self, rollout, params, rng=None) -> dict:
        """The next ``num_prompts`` groups to complete, scored. ``rng`` is not used: the noise
        is keyed by each group's admission (module docstring)."""
        g = self.g
        while self.free >= self.num_prompts:   # the first iteration fills both batches
            for j, ex in zip(np.flatnonzero(self.serial < 0), next(rollout.iterator)):
                self.serial[j], self.next_serial = self.next_serial, self.next_serial + 1
                self.metas[j], self.completed_at[j] = ex, -1
                self.turns[j] = [[] for _ in range(g)]
        t0 = time.perf_counter()
        dropped = self._drop_stale()
        places = sorted(np.flatnonzero(self.serial >= 0), key=lambda j: self.serial[j])
        envs = agent.make_envs(self.ctx.cfg, [self.metas[j] for j in places], g)
        record, finished, prompts, prompt_ids, p_tok, p_mask = self._rebuild(envs, places)
        params = sampling_params(self.ctx, params)
        slot_steps, drawn = self._decode(params, record, places, finished, p_tok, p_mask)
        taken = sorted((j for j in places if self.completed_at[j] >= 0),
                       key=lambda j: (self.completed_at[j], self.serial[j]))[:self.num_prompts]
        at = {j: k for k, j in enumerate(places)}
        rows = np.concatenate([np.arange(at[j] * g, (at[j] + 1) * g) for j in taken])
        eps = _subset(record.result(prompts, prompt_ids, p_tok.shape[1]), rows)
        eps["roles"] = np.array([getattr(envs[i], "role_key", -1) for i in rows], np.int32)
        eps["slot_steps"] = slot_steps
        versions = np.full(eps["tokens"].shape, -1, np.int64)
        for r, (j, k) in enumerate((j, k) for j in taken for k in range(g)):
            turn_versions = np.array([t["version"] for t in self.turns[j][k]] + [-1])
            versions[r] = np.where(eps["turn_ids"][r] >= 0, turn_versions[eps["turn_ids"][r]],
                                   -1)
        examples = [self.metas[j] for j in taken]
        for j in taken:
            self.serial[j], self.metas[j], self.completed_at[j] = -1, None, -1
            self.turns[j] = [[] for _ in range(g)]
        self._last = dict(versions=versions[eps["model_mask"]], dropped=dropped, drawn=drawn)
        return self.scored_round(rollout, eps, examples, time.perf_counter() - t0)

    def _drop_stale(self) -> int:
        """Restarts every group holding a turn more than the bound older than this version;
        returns the episodes discarded (those that had turns)."""
        bound = int(self.ctx.cfg.rollout.max_staleness) - (self._step - self._version)
        dropped = 0
        for j in np.flatnonzero(self.serial >= 0):
            oldest = min((t["version"] for s in self.turns[j] for t in s), default=self._version)
            if self._version - oldest > bound:
                dropped += sum(1 for s in self.turns[j] if s)
                self.turns[j] = [[] for _ in range(self.g)]
                self.completed_at[j] = -1
        return dropped

    def _rebuild(self, envs, places):
        """The episodes of ``places`` as their recorded turns left them: fresh environments,
        the turns replayed through ``env.step``. Returns ``(record, finished bool [R], prompts,
        prompt ids, prompt tokens [B, P], prompt mask)``."""
        cfg, tok, g = self.ctx.cfg, self.ctx.tokenizer, self.g
        renderer, limits = agent.make_renderer(cfg, tok), agent.limits(cfg)
        from rljax.envs import step_all
        prompts = [renderer.prompt(env.reset()) for env in envs]
        prompt_ids = [tok.encode(p) for p in prompts]
        p_tok, p_mask = sampling.pad_to_bucket(prompt_ids[::g], pad_id=tok.pad_id,
                                               buckets=limits.prompt_buckets)
        record = ep._Trajectories(tok, envs, renderer, limits, step_all)
        history = [self.turns[j][k] for j in places for k in range(g)]
        finished = np.zeros(len(envs), bool)
        for turn in range(limits.max_turns):
            rows = [i for i, h in enumerate(history) if len(h) > turn]
            if not rows:
                break
            ids = [history[i][turn]["ids"] for i in rows]
            width = max(len(x) for x in ids)
            tokens = np.full((len(rows), width), tok.pad_id, np.int32)
            logps = np.zeros((len(rows), width), np.float32)
            for n, i in enumerate(rows):
                tokens[n, :len(ids[n])] = ids[n]
                logps[n, :len(ids[n])] = history[i][turn]["logps"]
            _, observations = record.turn_ended(rows, [turn] * len(rows), tokens, logps,
                                                [len(x) for x in ids])
            for i, obs in zip(rows, observations):
                finished[i] = obs is None
        return record, finished, prompts, prompt_ids, p_tok, p_mask

    def _decode(self, params, record, places, finished, p_tok, p_mask):
        """Turns on the engine until ``num_prompts`` groups are complete; each finished turn
        is recorded with this version. Returns ((busy, run) slot-steps, tokens sampled)."""
        from rljax.models import paged
        from rljax.sampling import episode_engine as ee

        cfg, tok, g = self.ctx.cfg, self.ctx.tokenizer, self.g
        model_cfg, lim = self.ctx.model_cfg, record.limits
        r = len(record.envs)
        done_groups = lambda: sum(self.completed_at[j] >= 0 for j in places)  # noqa: E731
        for n, j in enumerate(places):   # complete already (replayed): keeps its place in line
            if finished[n * g:(n + 1) * g].all() and self.completed_at[j] < 0:
                self.completed_at[j] = self.clock
        waiting = [i for i in range(r) if not finished[i]][::-1]   # oldest group next
        if done_groups() >= self.num_prompts or not waiting:
            return (0, 0), 0
        s = max(1, min(engine_slots(cfg, self.num_prompts * g), r))
        pages, page_mask, page_len = ee.prefill(model_cfg, params, p_tok, p_mask)
        cache = paged.init_slot_cache(model_cfg, s, lim.max_total_tokens + 1)
        # The feed holds a carried episode's whole trajectory so far (teacher-forced again).
        state = ee.empty_state(s, max(lim.chunk_tokens, lim.max_total_tokens), lim.turn_tokens,
                               tok.pad_id)
        first = np.repeat(np.asarray(p_tok)[:, -1], g)
        draw = np.repeat(self.serial[places], g) * g + np.tile(np.arange(g), len(places))
        r_opts = cfg.rollout
        options = dict(temperature=r_opts.temperature, top_k=r_opts.top_k, top_p=r_opts.top_p,
                       stop_sequences=multiturn.stop_sequences_of(
                           tok, [record.renderer.call_end] if record.renderer.call_end else []))
        stop_ids = sampling.merge_stop_ids(tok.eos_id, ())
        busy = run = drawn = 0
        while done_groups() < self.num_prompts:
            for slot in np.flatnonzero(state["row"] < 0):
                if not waiting:
                    break
                i = waiting.pop()
                ee.resume(state, slot, row=i, lead=int(first[i]),
                          observation=record.tokens[i, :record.length[i]], cursor=0,
                          turn=int(record.turns[i]), budget=record.budget(i), draw=int(draw[i]))
            if not state["live"].any():
                break
            before = state["cursor"].copy()
            cache, state, steps = ee.run_chunk(
                model_cfg, params, pages, page_mask, page_len, cache, state, self._key,
                num_samples=g, chunk_steps=int(r_opts.chunk_steps), stop_ids=stop_ids,
                **options)
            self.clock += 1
            busy, run = busy + int((state["cursor"] - before).sum()), run + s * steps
            ended = np.flatnonzero((state["row"] >= 0) & ~state["live"])
            if not ended.size:
                continue
            rows = state["row"][ended]
            kept, observations = record.turn_ended(rows, state["turn"][ended],
                                                   state["tokens"][ended],
                                                   state["logps"][ended], state["t"][ended])
            drawn += int(state["t"][ended].sum())
            for n, slot in enumerate(ended):
                i, obs, k = int(rows[n]), observations[n], kept[n]
                j = places[i // g]
                self.turns[j][i % g].append(dict(
                    ids=[int(x) for x in state["tokens"][slot, :k]],
                    logps=[float(x) for x in state["logps"][slot, :k]], version=self._version))
                if obs is None:
                    finished[i] = True
                    ee.free(state, slot)
                    if finished[i - i % g:i - i % g + g].all():
                        self.completed_at[j] = self.clock
                    continue
                ee.resume(state, slot, row=i, lead=int(state["tokens"][slot, k - 1]),
                          observation=obs, cursor=int(record.length[i]) - len(obs),
                          turn=int(state["turn"][slot]) + 1, budget=record.budget(i),
                          draw=int(draw[i]))
        live = (state["row"] >= 0) & state["live"]   # turns dropped: drawn again next time
        return (busy, run), drawn + int(state["t"][live].sum())

    def metrics(self, rounds, step: int) -> dict:
        m = super().metrics(rounds, step)
        last = self._last
        stale = int(step) - last["versions"] if last["versions"].size else np.zeros(1, np.int64)
        m.update(staleness_metrics(stale))
        m.update({"rollout/dropped_stale": int(last["dropped"]),
                  "rollout/carried_groups": int((self.serial >= 0).sum()),
                  "rollout/decoded_tokens": int(last["drawn"])})
        return m

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Plain JSON: the places' admission serials, examples and finished turns (log-probs
        as float32 values, exact through JSON's float64)."""
        return json.loads(json.dumps(dict(
            serial=self.serial.tolist(), completed_at=self.completed_at.tolist(),
            metas=self.metas, turns=self.turns, next_serial=self.next_serial,
            clock=self.clock), default=_plain))

    def load_state_dict(self, state: dict) -> None:
        if len(state["serial"]) != len(self.serial):
            raise ValueError(f"the saved episodes in flight have {len(state['serial'])} "
                             f"places, this config makes {len(self.serial)}")
        self.serial = np.asarray(state["serial"], np.int64)
        self.completed_at = np.asarray(state["completed_at"], np.int64)
        self.metas = list(_restored(state["metas"]))
        self.turns = state["turns"]
        self.next_serial, self.clock = int(state["next_serial"]), int(state["clock"])


def _subset(eps: dict, rows: np.ndarray) -> dict:
    """``run_episodes``' result for ``rows`` only (the totals of ``info`` recounted)."""
    out = dict(eps)
    for k, v in eps.items():
        if isinstance(v, np.ndarray) and v.ndim and v.shape[0] == len(eps["prompts"]):
            out[k] = v[rows]
        elif isinstance(v, list) and len(v) == len(eps["prompts"]):
            out[k] = [v[i] for i in rows]
    info: dict[str, float] = {}
    for c in out["counters"]:
        ep._count(c, info)
    out["info"] = info
    return out


def episode_rounds(ctx, num_prompts: int) -> agent.EpisodeRounds:
    """The round source of an ``env.name`` config: with ``rollout.partial``, groups carried
    across iterations (``EpisodePartialRounds``), else ``agent.EpisodeRounds``."""
    if ctx.cfg.rollout.partial:
        return EpisodePartialRounds(ctx, num_prompts)
    return agent.EpisodeRounds(ctx)
