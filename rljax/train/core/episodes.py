"""Multi-turn episodes on the host: render messages to text, run the turn loop around the
on-device sampler (static turn batches, ``rljax.sampling.multiturn``, or with ``engine`` each
episode on a slot, ``rljax.sampling.episode_engine``), step the environments, and lay the
trajectories out for training.

    eps = run_episodes(model_cfg, params, tokenizer, envs, renderer=Renderer(tok, chat=False,
                       call_end="</call>"), limits=EpisodeLimits(...), rng=key, num_samples=G)
    eps["tokens"]      int32 [R, M]  the trajectory after the prompt: model turns and
                                     observations, compact, right-padded (M = max_total_tokens)
    eps["mask"]        bool  [R, M]  real tokens (attention)
    eps["model_mask"]  bool  [R, M]  tokens the model generated (the ones that train)
    eps["logps"]       f32   [R, M]  sampler log-probs of model tokens, 0 elsewhere
    eps["turn_ids"]    int32 [R, M]  the model turn (0, 1, ...) each model token belongs to,
                                     -1 elsewhere (observations, padding)
    eps["turn_rewards"] f32  [R, T]  each turn's environment reward (T = max_turns; 0 for
                                     turns not played)
    eps["versions"]    int32 [R, M]  with ``weights`` (in-flight weight updates): the version
                                     that drew each model token, -1 elsewhere; ``eps["swaps"]``
                                     how often the weights changed
    eps["routes"]      int32 [R, P+M, L, k]  with ``record_routes`` (routing replay, a mixture of
                                     experts): the experts of every token fed to the cache
                                     (prompt, model and observation tokens), on the training
                                     row's columns (prompt bucket P, left-padded)

A turn ends on EOS, a tool call's closing text (``renderer.call_end``: stopped on device when it
tokenizes to a fixed id sequence, and always cut on the host after its first occurrence in the
decoded text, the tokens after it dropped), the per-turn cap, or the episode's token budget.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from rljax import distributed as dist, sampling
from rljax.sampling import multiturn
from rljax.train.core.render import Renderer, cut_after

@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
    """turn_tokens: per-turn cap N; chunk_tokens: chunk width O, the observation's tokens
    plus one (a longer observation ends the episode, truncated); max_turns; max_total_tokens: the trajectory's
    length after the prompt (model + observation tokens); prompt_buckets: allowed prompt
    widths."""
    turn_tokens: int
    chunk_tokens: int
    max_turns: int
    max_total_tokens: int
    prompt_buckets: tuple[int, ...] = sampling.DEFAULT_BUCKETS


def _count(info: Any, totals: dict) -> None:
    """Adds a step's numeric ``info`` counters into an episode's totals."""
    for k, v in dict(info or {}).items():
        if isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool):
            totals[k] = totals.get(k, 0) + v


class _Trajectories:
    """The host's record of R episodes while they run: their trajectories (compact, right-
    padded to M), what each turn kept, the environments' rewards and counters. Both samplers
    (the static turn batch and the episode engine) report turns to it and step through it."""

    def __init__(self, tokenizer, envs, renderer: Renderer, limits: EpisodeLimits, step_all,
                 prefixes: Sequence[Sequence[int]] | None = None):
        r, m = len(envs), limits.max_total_tokens
        self.tokenizer, self.envs, self.renderer, self.limits = tokenizer, envs, renderer, limits
        self.step_all = step_all
        # Hints: each row's prefix ids, ahead of its first turn (prompt context, not sampled).
        self.prefixes = [list(p) for p in prefixes] if prefixes is not None else [[]] * r
        self.schedule = None   # f32 [M]: a temperature per model token (``run_episodes``)
        self.tokens = np.full((r, m), tokenizer.pad_id, np.int32)
        self.model_mask = np.zeros((r, m), bool)
        self.turn_ids = np.full((r, m), -1, np.int32)
        self.logps = np.zeros((r, m), np.float32)
        self.versions = np.full((r, m), -1, np.int32)        # with in-flight weight updates
        self.length = np.zeros(r, np.int64)                  # trajectory tokens so far
        self.done = np.zeros(r, bool)                        # the environment ended it
        self.live = np.ones(r, bool)                         # its next turn is to sample
        self.turns = np.zeros(r, np.int32)
        self.env_rewards = np.zeros(r, np.float32)
        self.turn_rewards = np.zeros((r, limits.max_turns), np.float32)
        self.final_turns = [""] * r
        self.counters: list[dict] = [{} for _ in range(r)]
        self.time_env = 0.0

    def turn_temperatures(self, rows, ahead: int = 0) -> np.ndarray | None:
        """f32 [len(rows), N]: the temperature of each token of the rows' next turns under the
        schedule (``run_episodes``' ``temperatures``): an episode's k-th model token is drawn
        at ``schedule[k]``, whatever turn it is in. None without a schedule."""
        return scheduled_temperatures(self.schedule, self.model_mask[np.asarray(rows)],
                                      self.limits.turn_tokens, ahead)

    def budget(self, i: int) -> int:
        """Tokens row ``i``'s next turn may sample."""
        return int(min(self.limits.turn_tokens, self.limits.max_total_tokens - self.length[i]))

    def slots_ended(self, state: dict, drawn=None) -> tuple:
        """After an episode-engine chunk: the slots whose turn ended (int [E]), their rows, and
        ``turn_ended``'s (kept tokens, observation ids or None) for them, recorded.
        ``drawn`` int32 [S, N]: the version that drew each slot's turn token
        (``EngineWeights.drawn``), or None."""
        ended = np.flatnonzero((state["row"] >= 0) & ~state["live"])
        if not ended.size:
            return ended, ended, [], []
        rows = state["row"][ended]
        kept, observations = self.turn_ended(rows, state["turn"][ended], state["tokens"][ended],
                                             state["logps"][ended], state["t"][ended],
                                             None if drawn is None else drawn[ended])
        return ended, rows, kept, observations

    def turn_ended(self, rows, turn_of, tokens, logps, lengths,
                   versions=None) -> tuple[list[int], list[int]]:
        """Records the turn each row of ``rows`` just sampled (``tokens``/``logps`` [.., N],
        ``lengths``: one entry per row of ``rows``; ``versions`` [.., N]: the version that drew
        each token, or None), cut after the tool call's closing text, then steps their
        environments. Returns ``(kept tokens per row, observation ids per row or None where
        the episode ended)``."""
        tok, texts, kept = self.tokenizer, [], []
        for j, i in enumerate(rows):
            ids = [int(x) for x in tokens[j][:lengths[j]]]
            k = cut_after(tok, ids, self.renderer.call_end)
            at = slice(self.length[i], self.length[i] + k)
            self.tokens[i, at], self.model_mask[i, at] = ids[:k], True
            self.turn_ids[i, at], self.logps[i, at] = turn_of[j], logps[j][:k]
            if versions is not None:
                self.versions[i, at] = versions[j][:k]
            # The environment sees a hinted first turn whole: prefix + continuation.
            lead = self.prefixes[i] if turn_of[j] == 0 else []
            texts.append(tok.decode(lead + ids[:k]))
            self.final_turns[i] = texts[-1]
            self.length[i] += k
            self.turns[i] += 1
            kept.append(k)
        t0 = time.perf_counter()
        results = self.step_all([self.envs[i] for i in rows], texts)
        self.time_env += time.perf_counter() - t0
        observations = []
        for j, (i, res) in enumerate(zip(rows, results)):
            self.env_rewards[i] += float(res.reward)
            self.turn_rewards[i, turn_of[j]] = float(res.reward)
            _count(res.info, self.counters[i])
            observations.append(None)
            self.live[i] = False
            if res.done:
                self.done[i] = True
                continue
            last = int(tokens[j][kept[j] - 1])
            ids = tok.encode(self.renderer.observation(res.observation, last == tok.eos_id))
            room = self.limits.max_total_tokens - self.length[i] - len(ids)
            if (turn_of[j] + 1 >= self.limits.max_turns or not ids
                    or len(ids) >= self.limits.chunk_tokens or room < 1):
                continue          # out of turns / chunk width / tokens: truncated
            self.tokens[i, self.length[i]:self.length[i] + len(ids)] = ids
            self.length[i] += len(ids)
            observations[j], self.live[i] = ids, True
        return kept, observations

    def replay(self, history: Sequence[Sequence[dict]]) -> np.ndarray:
        """Replays finished turns through ``turn_ended`` (so the environments step on them),
        turn k of every row that has one at once: ``history`` per row, its turns in order,
        each ``{"ids": token ids, "logps": their log-probs (optional: 0)}``. Returns bool [R]:
        the row's episode is over (the environment ended it, or its limits did)."""
        finished = np.zeros(len(history), bool)
        for turn in range(self.limits.max_turns):
            rows = [i for i, h in enumerate(history) if len(h) > turn]
            if not rows:
                break
            ids = [history[i][turn]["ids"] for i in rows]
            width = max(len(x) for x in ids)
            tokens = np.full((len(rows), width), self.tokenizer.pad_id, np.int32)
            logps = np.zeros((len(rows), width), np.float32)
            for n, i in enumerate(rows):
                tokens[n, :len(ids[n])] = ids[n]
                logps[n, :len(ids[n])] = history[i][turn].get("logps", 0.0)
            _, observations = self.turn_ended(rows, [turn] * len(rows), tokens, logps,
                                              [len(x) for x in ids])
            for i, obs in zip(rows, observations):
                finished[i] = obs is None
        return finished

    def result(self, prompts, prompt_ids, prompt_len: int) -> dict:
        r, m = self.tokens.shape
        mask = np.arange(m)[None, :] < self.length[:, None]
        info: dict[str, float] = {}
        for c in self.counters:
            _count(c, info)
        return dict(tokens=self.tokens, mask=mask, model_mask=self.model_mask, logps=self.logps,
                    lengths=self.length.astype(np.int32),
                    model_tokens=self.model_mask.sum(1).astype(np.int32),
                    truncated=~self.done, turns=self.turns, env_rewards=self.env_rewards,
                    turn_rewards=self.turn_rewards, turn_ids=self.turn_ids,
                    prompt_ids=[list(map(int, ids)) for ids in prompt_ids],
                    prompt_len=int(prompt_len), prompts=prompts, final_turns=self.final_turns,
                    transcripts=[self.tokenizer.decode(self.tokens[i, :self.length[i]].tolist())
                                 for i in range(r)],
                    counters=self.counters, info=info, time_env=self.time_env)


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """Episodes on the slot engine (``sampling.episode_engine``): ``slots`` episodes decode at
    once, the host relaunches the decode program every ``chunk_steps`` steps (and steps the
    environments of the turns that ended in it)."""
    slots: int
    chunk_steps: int = 16


class EngineWeights:
    """The weights the episode engine decodes with, chunk by chunk, and which version drew
    each slot's turn tokens.

    ``weights`` (in-flight weight updates; asynchronous RL sets it): ``() -> (params,
    version)``, asked before the prefill and between decode chunks, as
    ``sampling.engine.generate`` asks it. The next chunk decodes with what it returns; a slot
    keeps the keys and values its episode computed under earlier weights (nothing is
    recomputed), and each token's log-prob is that of the weights that drew it, i.e. the
    behaviour policy's. Without it, ``params`` throughout (version 0)."""

    def __init__(self, params, weights: Callable[[], tuple[Any, int]] | None = None):
        self.poll = weights
        self.params, self.version = (params, 0) if weights is None else weights()
        self.swaps = self.chunks = 0
        self.drawn = None   # int32 [S, N], after the first chunk

    def run_chunk(self, model_cfg, pages, page_mask, page_len, cache, state: dict, rng, **kw):
        """``episode_engine.run_chunk`` with the current weights; records the version that
        drew the tokens each slot sampled in it."""
        from rljax.sampling import episode_engine as ee
        if self.poll is not None and self.chunks:
            self.params, now = self.poll()
            self.swaps, self.version = self.swaps + int(now != self.version), now
        sampled_before = state["t"].copy()   # (a slot resumed since restarts its turn at 0)
        cache, state, steps = ee.run_chunk(model_cfg, self.params, pages, page_mask, page_len,
                                           cache, state, rng, **kw)
        self.chunks += 1
        if self.drawn is None:
            self.drawn = np.zeros(state["tokens"].shape, np.int32)
        pos = np.arange(self.drawn.shape[1])[None, :]
        self.drawn[(pos >= sampled_before[:, None]) & (pos < state["t"][:, None])] = self.version
        return cache, state, steps

    def fields(self, versions: np.ndarray) -> dict:
        """An episodes dict's ``versions`` (each model token's, ``versions`` [R, M]) and
        ``swaps`` with in-flight weight updates; {} without."""
        return {} if self.poll is None else {"versions": versions, "swaps": self.swaps}


def run_episodes(model_cfg, params, tokenizer, envs: Sequence[Any], *, renderer: Renderer,
                 limits: EpisodeLimits, rng: jax.Array, num_samples: int = 1,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, mesh=None,
                 step_all: Callable | None = None, engine: EngineOptions | None = None,
                 weights: Callable[[], tuple[Any, int]] | None = None,
                 prefixes: Sequence[Sequence[int]] | None = None,
                 temperatures: np.ndarray | None = None, record_routes: bool = False,
                 image_embeds: Any = None, first_turn: Callable | None = None) -> dict:
    """Runs ``len(envs)`` episodes together (prompt-major groups of ``num_samples`` rows: the
    G environments of a group must reset to the same messages, their prompt is prefilled once).

    Returns a dict of numpy arrays (R rows): ``tokens``, ``mask``, ``model_mask``, ``logps``
    [R, M] (see the module docstring), ``lengths`` int32 [R] (real trajectory tokens),
    ``model_tokens`` int32 [R], ``truncated`` bool [R] (turns, tokens or chunk width ran out
    before the environment said done), ``turns`` int32 [R], ``env_rewards`` f32 [R] (sum of
    the turns' rewards), ``turn_rewards`` f32 [R, T] and ``turn_ids`` int32 [R, M] (see the
    module docstring),
    ``prompt_ids`` (list of id lists, one per row), ``prompt_len`` (bucket P), ``prompts`` /
    ``final_turns`` / ``transcripts`` (lists of str), ``counters`` (one dict per episode: the
    sum of its steps' ``info`` counters), ``info`` (their totals), ``time_env``; with
    ``engine``, ``slot_steps`` (busy, run) slot-steps.

    ``step_all(envs, turns) -> results`` steps the active episodes (default
    ``rljax.envs.step_all``: concurrently, in threads). ``engine``: decode on slots
    (``EngineOptions``) instead of one static batch per turn; a row draws the same noise
    either way, so where both programs compute equal logits the episodes are equal.
    ``weights`` (with ``engine``): in-flight weight updates (``EngineWeights``); adds
    ``versions`` and ``swaps`` (module docstring). ``prefixes`` (hints, one id list per
    group): appended to the group's prompt ids, so the first turn continues them; they are
    prompt context (not in the trajectory), and the environment and the final answer see the
    first turn as prefix + sampled text. ``temperatures`` (a temperature schedule, f32 [M]):
    an episode's k-th model token (counted over its turns; observations do not count) is
    drawn at ``temperatures[k]`` and its log-prob is the one at that temperature.
    ``record_routes`` (a mixture of experts): adds ``routes`` (module docstring).
    ``image_embeds`` [B, K, D] (a model with a vision tower; B = groups): each group's prompt
    images, prefilled with its prompt once; every turn after attends to those keys/values, so
    each turn's tokens see the images as the training row's forward pass does.
    ``first_turn(p_tok, p_mask) -> (tokens [R, N], logps [R, N], lengths [R])`` (with
    ``engine``; ``tree_episodes``): every row's first turn, sampled elsewhere; each episode
    goes on from there on a slot, its trajectory fed.
    """
    if weights is not None and engine is None:
        raise ValueError("in-flight weights need the episode engine (engine=EngineOptions)")
    if step_all is None:
        from rljax.envs import step_all
    r, g = len(envs), int(num_samples)
    if r % g:
        raise ValueError(f"{r} environments are not groups of {g}")
    prompts = [renderer.prompt(env.reset()) for env in envs]
    if any(prompts[i] != prompts[i - i % g] for i in range(r)):
        raise ValueError("the environments of one group reset to different prompts")
    row_prefixes = None if prefixes is None else [prefixes[i // g] for i in range(r)]
    prompt_ids = [tokenizer.encode(p) + (list(row_prefixes[i]) if row_prefixes else [])
                  for i, p in enumerate(prompts)]
    p_tok, p_mask = sampling.pad_to_bucket(prompt_ids[::g], pad_id=tokenizer.pad_id,
                                           buckets=limits.prompt_buckets)
    options = dict(temperature=temperature, top_k=top_k, top_p=top_p,
                   stop_sequences=multiturn.stop_sequences_of(
                       tokenizer, [renderer.call_end] if renderer.call_end else []))
    record = _Trajectories(tokenizer, envs, renderer, limits, step_all, row_prefixes)
    if temperatures is not None:
        record.schedule = np.asarray(temperatures, np.float32)
    if engine is None:
        routes = _static_turns(model_cfg, params, tokenizer, record, p_tok, p_mask, rng, g,
                               mesh, options, record_routes, image_embeds)
        out = record.result(prompts, prompt_ids, p_tok.shape[1])
        return out if routes is None else dict(out, routes=routes)
    if first_turn is not None:   # (its rows' first turns, recorded and stepped)
        record.replay([[dict(ids=t[:n], logps=lp[:n])] for t, lp, n in zip(*first_turn(
            p_tok, p_mask))])
    chunks = EngineWeights(params, weights)
    slot_steps, routes = _engine_turns(model_cfg, chunks, tokenizer, record, p_tok, p_mask, rng,
                                       g, engine, options, record_routes, image_embeds)
    out = dict(record.result(prompts, prompt_ids, p_tok.shape[1]), slot_steps=slot_steps,
               **chunks.fields(record.versions))
    return out if routes is None else dict(out, routes=routes)


def _static_turns(model_cfg, params, tokenizer, record: _Trajectories, p_tok, p_mask, rng, g,
                  mesh, options, record_routes: bool = False, image_embeds=None):
    """Turn k of every live episode as one batch (``sampling.multiturn``). Returns the
    episodes' routes (``record_routes``; ``multiturn.trajectory_routes``) or None."""
    lim = record.limits
    r, o = len(record.envs), lim.chunk_tokens
    layout = multiturn.SlotLayout(prompt_len=p_tok.shape[1], turn_len=lim.turn_tokens,
                                  chunk_len=o, max_turns=lim.max_turns)
    cache = multiturn.start(model_cfg, params, p_tok, p_mask, layout=layout, num_samples=g,
                            mesh=mesh, record_routes=record_routes, image_embeds=image_embeds)
    chunk, chunk_mask, slot_mask = multiturn.first_chunk(p_tok, p_mask, layout, g)
    active = np.ones(r, bool)
    for turn in range(lim.max_turns):
        budget = np.array([record.budget(i) if active[i] else 0 for i in range(r)], np.int32)
        cache, out = multiturn.turn(model_cfg, params, cache, slot_mask, chunk, chunk_mask,
                                    turn=turn, active=active, budget=budget,
                                    rng=jax.random.fold_in(rng, turn), layout=layout,
                                    eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, mesh=mesh,
                                    temperatures=record.turn_temperatures(np.arange(r)),
                                    **options)
        out_tok, out_lp, out_len = dist.to_host_tree((out.tokens, out.logps, out.lengths))
        rows = np.flatnonzero(active)
        kept, observations = record.turn_ended(rows, [turn] * len(rows), out_tok[rows],
                                               out_lp[rows], out_len[rows])
        kept_all = np.zeros(r, np.int64)
        kept_all[rows] = kept
        slot_mask |= multiturn.kept_slots(layout, turn, kept_all)
        chunk = np.full((r, o), tokenizer.pad_id, np.int32)
        chunk_mask = np.zeros((r, o), bool)
        for j, (i, ids) in enumerate(zip(rows, observations)):
            if ids is None:
                active[i] = False
                continue
            # The turn's last token has no keys/values yet: it leads the chunk.
            chunk[i, o - len(ids) - 1:] = [int(out_tok[i, kept[j] - 1])] + ids
            chunk_mask[i, o - len(ids) - 1:] = True
        if not active.any():
            break
        if turn + 1 < lim.max_turns:
            start = layout.chunk_start(turn + 1)
            slot_mask[:, start:start + o] = chunk_mask
    if not record_routes:
        return None
    return multiturn.trajectory_routes(dist.to_host(cache["routes"]), slot_mask,
                                       np.repeat(np.asarray(p_mask, bool), g, axis=0),
                                       lim.max_total_tokens)


def _engine_turns(model_cfg, chunks: EngineWeights, tokenizer, record: _Trajectories, p_tok,
                  p_mask, rng, g, engine: EngineOptions, options, record_routes: bool = False,
                  image_embeds=None):
    """Each episode on a slot of its own (``sampling.episode_engine``), decoded with
    ``chunks``' weights; free slots take the next episode. Returns ((busy, run) slot-steps,
    the episodes' routes with ``record_routes`` or None)."""
    from rljax.models import paged
    from rljax.sampling import episode_engine as ee

    lim = record.limits
    r = len(record.envs)
    s = max(1, min(int(engine.slots), r))
    pages, page_mask, page_len, *prompt_routes = ee.prefill(
        model_cfg, chunks.params, p_tok, p_mask, record_routes=record_routes,
        image_embeds=image_embeds)
    cache = paged.init_slot_cache(model_cfg, s, lim.max_total_tokens + 1)
    routes = None
    if record_routes:   # columns: the paged prompt tokens [0, P-1), then cache index j at P-1+j
        p = p_tok.shape[1]
        cache = ee.init_routes(model_cfg, cache)
        routes = np.zeros((r, p + lim.max_total_tokens) + cache["routes"].shape[2:], np.int32)
        routes[:, :p - 1] = np.repeat(dist.to_host(prompt_routes[0]), g, axis=0)
    state = ee.empty_state(s, lim.max_total_tokens if record.turns.any() else lim.chunk_tokens,
                           lim.turn_tokens, tokenizer.pad_id)   # (width: a fed trajectory)
    if record.schedule is not None:   # each slot's turn at its own temperatures
        state["temp"] = np.ones((s, lim.turn_tokens), np.float32)
    last_prompt_token = np.repeat(np.asarray(p_tok)[:, -1], g)
    waiting = [i for i in range(r) if record.live[i]][::-1]   # not started, next last
    stop_ids = sampling.merge_stop_ids(tokenizer.eos_id, ())
    busy = run = 0
    while True:
        for slot in np.flatnonzero(state["row"] < 0):
            if not waiting:
                break
            i = waiting.pop()   # (fed its trajectory so far: none, or ``first_turn``'s)
            ee.resume(state, slot, row=i, lead=int(last_prompt_token[i]), cursor=0,
                      observation=record.tokens[i, :record.length[i]],
                      turn=int(record.turns[i]), budget=record.budget(i))
            set_slot_temperatures(state, slot, record.turn_temperatures([i]))
        if not state["live"].any():
            break
        before = state["cursor"].copy()
        cache, state, steps = chunks.run_chunk(
            model_cfg, pages, page_mask, page_len, cache, state, rng, num_samples=g,
            chunk_steps=engine.chunk_steps, stop_ids=stop_ids, **options)
        busy, run = busy + int((state["cursor"] - before).sum()), run + s * steps
        ended, rows, kept, observations = record.slots_ended(state, chunks.drawn)
        for j, slot in enumerate(ended):
            i, ids = int(rows[j]), observations[j]
            if ids is None:
                if routes is not None:   # its fed tokens: cache indexes 0 .. length - 1
                    n = int(record.length[i])
                    routes[i, p - 1:p - 1 + n] = dist.to_host(cache["routes"][slot, :n])
                ee.free(state, slot)
                continue
            cursor = int(record.length[i]) - len(ids)   # the kept turn's last token goes here
            ee.resume(state, slot, row=i, lead=int(state["tokens"][slot, kept[j] - 1]),
                      observation=ids, cursor=cursor, turn=int(state["turn"][slot]) + 1,
                      budget=record.budget(i))
            set_slot_temperatures(state, slot, record.turn_temperatures([i]))
    return (busy, run), routes


def scheduled_temperatures(schedule, model_mask: np.ndarray, turn_tokens: int,
                           ahead: int = 0):
    """f32 [R, turn_tokens]: the temperatures of the next turn of rows whose trajectories
    hold ``model_mask`` bool [R, M] so far (and ``ahead`` model tokens more, fed before the
    turn samples: a VinePPO fork's turn so far): a row's k-th model token is drawn at
    ``schedule[k]`` f32 [K] (past its end, the last), whatever turn it is in. None without a
    schedule."""
    if schedule is None:
        return None
    at = model_mask.sum(1)[:, None] + ahead + np.arange(turn_tokens)[None, :]
    return schedule[np.minimum(at, len(schedule) - 1)]


def set_slot_temperatures(state: dict, slot: int, temps) -> None:
    """With a temperature schedule (the engine state's ``temp``): ``temps`` [1, N], the
    temperatures of the turn starting on ``slot``. A no-op without one (``temps`` None or no
    ``temp`` in ``state``)."""
    if "temp" in state and temps is not None:
        state["temp"][slot] = temps[0]
