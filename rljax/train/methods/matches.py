"""Multi-seat games on the host: the turn loop of ``episodes.run_episodes`` for matches whose
seats are played by language models (``rljax.envs.selfplay``: one ``SeatEnv`` per seat, sharing
a ``Match``), in the game's turn order.

    sides = [Side(model_cfg, params, envs, num_samples=G)]            # self-play: every seat
    sides = [Side(policy_cfg, params, mine, G), Side(opp_cfg, frozen, theirs, G,
                                                     temperature=0.0)]  # a frozen opponent
    eps = run_matches(sides, tokenizer, renderer=..., limits=..., max_plies=9, rng=key)

A *side* is a set of seat episodes sampled by one model (its own parameters, its own KV cache
over its rows, its own temperature); each of its rows is one seat of one match, laid out as
``run_episodes`` lays out an episode (prompt-major groups of ``num_samples`` rows with the
same prompt). Ply k (k = 0 .. max_plies - 1) decodes, on each side, the rows whose seat is to
move (the others are inactive in that ply: their cache slots for it stay invalid), then steps
those seats. A row's next chunk is the token its previous turn ended with (not yet in the
cache) followed by its seat's view after the other seats' moves, so every seat keeps its own
cache across its turns and sees only what its seat may see.

Returns one dict per side with ``run_episodes``' fields (``tokens``, ``mask``, ``model_mask``,
``logps``, ``turn_ids``, ``turn_rewards`` over the row's own turns, ``env_rewards``, ``turns``,
``truncated``, ``counters``, ...) plus ``roles`` int32 [R] (``SeatEnv.role_key``) and
``match_turns`` int32 [R, max_plies, N] (the ids of every turn of the row's match, every
seat's, in ply order, -1 after each turn's: what a VinePPO fork replays) and ``turn_plies``
int32 [R, T] (the match's ply of each of the row's turns, -1 after its last). A row's
reward is its seat's: the game's return for that seat on its last turn, a forfeit's penalty on
the forfeiting seat's turn, ``forfeit_reward`` for the others. A seat that runs out of turns,
tokens or chunk width abandons its match: every seat of it ends truncated, reward 0.

Hints (``Side.prefixes``): a hinted row's hint ids follow its seat's first observation (for the
first mover, its prompt) in the chunk of its first turn, so they are context of that turn in
the trajectory, outside ``model_mask``; the game judges the first turn as hint + sampled text.

A seat that does not move first has no turn before its first observation: its prompt ends
with its user message, without the assistant header (``Renderer.prompt(model_turn=False)``),
and its first chunk is the state as a second user message, then the header (in a chat
template; a plain transcript simply continues).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from rljax import distributed as dist, sampling
from rljax.sampling import multiturn
from rljax.train.core.episodes import (EngineWeights, EpisodeLimits, _count,
                                      scheduled_temperatures, set_slot_temperatures)
from rljax.train.core.render import Renderer, cut_after


@dataclasses.dataclass
class Side:
    """The rows one model plays: ``envs`` (``SeatEnv``s, prompt-major groups of
    ``num_samples``), sampled from ``params`` at ``temperature`` (0: greedy)."""
    model_cfg: Any
    params: Any
    envs: Sequence[Any]
    num_samples: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    schedule: Any = None   # a temperature schedule over each row's model tokens, f32 [K]
    record_routes: bool = False   # every fed token's experts (routing replay)
    # Hints: each row's token ids after its seat's first observation (prompt context of its
    # first turn, not sampled: outside ``model_mask``), or None.
    prefixes: Sequence[Sequence[int]] | None = None


class _SideRun:
    """One side's rows during ``run_matches``: their cache, slots and trajectories."""

    def __init__(self, side: Side, tokenizer, renderer: Renderer, limits: EpisodeLimits,
                 max_plies: int, mesh, log: dict | None = None):
        envs, g = list(side.envs), int(side.num_samples)
        r = len(envs)
        if r % g:
            raise ValueError(f"{r} seat environments are not groups of {g}")
        self.side, self.envs, self.tok, self.renderer, self.mesh = side, envs, tokenizer, \
            renderer, mesh
        self.n, self.o, self.t_max, self.m_max = (limits.turn_tokens, limits.chunk_tokens,
                                                  limits.max_turns, limits.max_total_tokens)
        first = [env.reset() for env in envs]
        # A seat that moves first sees the state in its prompt; the others observe it later.
        self.seen = np.array([env.to_move() for env in envs], bool)
        self.prompts = [renderer.prompt(m, model_turn=bool(s)) for m, s in zip(first, self.seen)]
        if any(self.prompts[i] != self.prompts[i - i % g] for i in range(r)):
            raise ValueError("the seat environments of one group reset to different prompts")
        self.prompt_ids = [tokenizer.encode(p) for p in self.prompts]
        p_tok, p_mask = sampling.pad_to_bucket(self.prompt_ids[::g], pad_id=tokenizer.pad_id,
                                               buckets=limits.prompt_buckets)
        self.p_tok, self.p_mask, self.g = p_tok, p_mask, g
        self.layout = multiturn.SlotLayout(prompt_len=p_tok.shape[1], turn_len=self.n,
                                           chunk_len=self.o, max_turns=max_plies)
        self.cache = None   # the static turn batches' cache, started by the first ``decode``
        pm = np.repeat(np.asarray(p_mask, bool), g, axis=0)
        self.slot_mask = np.zeros((r, self.layout.num_slots), bool)
        self.slot_mask[:, :self.layout.prompt_len - 1] = pm[:, :-1]
        # The token each row has not fed to its cache yet: the prompt's last, then each
        # turn's last (it leads the row's next chunk).
        self.carry = np.repeat(np.asarray(p_tok)[:, -1], g).astype(np.int32)
        self.carry_eos = np.zeros(r, bool)
        self.tokens = np.full((r, self.m_max), tokenizer.pad_id, np.int32)
        self.model_mask = np.zeros((r, self.m_max), bool)
        self.turn_ids = np.full((r, self.m_max), -1, np.int32)
        self.logps = np.zeros((r, self.m_max), np.float32)
        self.versions = np.full((r, self.m_max), -1, np.int32)   # in-flight weight updates
        self.length = np.zeros(r, np.int64)
        self.turns = np.zeros(r, np.int32)
        self.active = np.ones(r, bool)
        self.done = np.zeros(r, bool)
        self.env_rewards = np.zeros(r, np.float32)
        self.turn_rewards = np.zeros((r, self.t_max), np.float32)
        self.final_turns = [""] * r
        self.counters: list[dict] = [{} for _ in range(r)]
        self.prefixes = ([list(p) for p in side.prefixes] if side.prefixes is not None
                         else [[]] * r)
        # Each row's match's turns in ply order, every seat's (the ids each kept), in ``log``
        # shared by the sides of one match loop: what a VinePPO fork replays (``vine_matches``).
        log = {} if log is None else log
        self.moves = [log.setdefault(id(env.match), []) for env in envs]
        self.turn_plies = np.full((r, self.t_max), -1, np.int32)   # each turn's ply in it
        # Ids of a row's next turn given ahead of what it samples (a VinePPO fork continues a
        # turn from its middle): fed, not drawn (log-prob 0).
        self.lead_in: list[list[int]] = [[] for _ in range(r)]
        self.options = dict(temperature=side.temperature, top_k=side.top_k, top_p=side.top_p,
                            eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, mesh=mesh,
                            stop_sequences=multiturn.stop_sequences_of(
                                tokenizer, [renderer.call_end] if renderer.call_end else []))

    def turn_temperatures(self, rows, ahead: int = 0) -> np.ndarray | None:
        """f32 [len(rows), N]: the schedule's temperatures of the rows' next turns (a row's
        k-th model token at ``schedule[k]``; ``ahead`` tokens of the turn fed first), or None
        without one."""
        return scheduled_temperatures(self.side.schedule, self.model_mask[np.asarray(rows)],
                                      self.n, ahead)

    def record(self, i: int, result) -> None:
        """A step's or ``finish``'s result on row i (on its last turn)."""
        self.env_rewards[i] += float(result.reward)
        self.turn_rewards[i, max(self.turns[i] - 1, 0)] += float(result.reward)
        _count(result.info, self.counters[i])
        if result.done:
            self.active[i], self.done[i] = False, True

    def settle(self) -> None:
        """Rows whose match is over without their move: collect the result (or, for an
        abandoned match, stop the row truncated)."""
        for i in np.flatnonzero(self.active):
            env = self.envs[i]
            if env.match.over():
                self.record(i, env.finish())
                self.active[i] = False

    def _truncate(self, i: int) -> None:
        self.active[i] = False
        self.envs[i].match.abandoned = True

    def seats_to_move(self, decoding: np.ndarray, max_plies: int) -> list[tuple]:
        """The engine's loop head: settles the matches, then gives every active row not
        ``decoding`` whose seat is to move its observation (a match past ``max_plies`` is
        truncated instead). Returns ``(row, trajectory length before, observation ids)`` of
        each row that now decodes, marked in ``decoding``."""
        self.settle()
        new = []
        for i in np.flatnonzero(self.active & ~decoding):
            env = self.envs[i]
            if not env.to_move():
                continue
            if env.match.plies >= max_plies:
                self._truncate(i)
                continue
            before = int(self.length[i])
            obs = self.next_observation(i)
            if obs is not None:
                decoding[i] = True
                new.append((int(i), before, obs))
        return new

    def next_observation(self, i: int) -> list[int] | None:
        """Row i is to move: its observation's ids (after the other seats' moves; none for
        a first mover's first turn), then before its first turn its hint (``Side.prefixes``),
        appended to its trajectory; None when the row runs out of turns, chunk width or
        tokens (its match is abandoned)."""
        env = self.envs[i]
        obs: list[int] = []
        if self.turns[i] > 0 or not self.seen[i]:
            obs = self.tok.encode(self.renderer.observation(
                env.observe(), bool(self.carry_eos[i]), after_prompt=not self.turns[i]))
        if not self.turns[i]:
            obs = obs + self.prefixes[i]
        room = self.m_max - self.length[i] - len(obs)
        if self.turns[i] >= self.t_max or len(obs) + 1 > self.o or room < 1:
            self._truncate(i)
            return None
        self.tokens[i, self.length[i]:self.length[i] + len(obs)] = obs
        self.length[i] += len(obs)
        return obs

    def turn_ended(self, i: int, ids: list[int], logps, versions=None) -> tuple[int, str]:
        """Records row i's turn (cut after the tool call's closing text; ``versions``: the
        version that drew each token, or None); (kept, text). A ``lead_in`` leads the turn."""
        if self.lead_in[i]:
            lead, self.lead_in[i] = self.lead_in[i], []
            logps = np.concatenate([np.zeros(len(lead), np.float32),
                                    np.asarray(logps, np.float32)[:len(ids)]])
            if versions is not None:
                versions = np.concatenate([np.full(len(lead), -1, np.int32),
                                           np.asarray(versions)[:len(ids)]])
            ids = lead + list(ids)
        k = cut_after(self.tok, ids, self.renderer.call_end)
        self.turn_plies[i, self.turns[i]] = len(self.moves[i])
        self.moves[i].append(list(ids[:k]))
        at = slice(self.length[i], self.length[i] + k)
        self.tokens[i, at], self.model_mask[i, at] = ids[:k], True
        self.turn_ids[i, at], self.logps[i, at] = self.turns[i], logps[:k]
        if versions is not None:
            self.versions[i, at] = versions[:k]
        self.length[i] += k
        self.carry[i] = ids[k - 1]
        self.carry_eos[i] = ids[k - 1] == self.tok.eos_id
        # The game sees a hinted first turn whole: hint + continuation.
        lead = self.prefixes[i] if not self.turns[i] else []
        self.turns[i] += 1
        self.final_turns[i] = self.tok.decode(lead + ids[:k])
        return k, self.final_turns[i]

    def decode(self, ply: int, rng) -> tuple[list[int], list[str]]:
        """Builds the chunks of the rows to move, decodes their turn; (rows, texts)."""
        r, o = len(self.envs), self.o
        if self.cache is None:
            side = self.side
            self.cache = multiturn.start(side.model_cfg, side.params, self.p_tok, self.p_mask,
                                         layout=self.layout, num_samples=self.g,
                                         mesh=self.mesh, record_routes=side.record_routes)
        chunk = np.full((r, o), self.tok.pad_id, np.int32)
        chunk_mask = np.zeros((r, o), bool)
        rows = []
        for i in np.flatnonzero(self.active):
            if not self.envs[i].to_move():
                continue
            obs = self.next_observation(i)
            if obs is None:
                continue
            ids = [int(self.carry[i])] + obs
            chunk[i, o - len(ids):] = ids
            chunk_mask[i, o - len(ids):] = True
            rows.append(int(i))
        if not rows:
            return [], []
        start = self.layout.chunk_start(ply)
        self.slot_mask[:, start:start + o] = chunk_mask
        moving = np.zeros(r, bool)
        moving[rows] = True
        budget = np.where(moving, np.minimum(self.n, self.m_max - self.length), 0)
        side = self.side
        self.cache, out = multiturn.turn(side.model_cfg, side.params, self.cache, self.slot_mask,
                                         chunk, chunk_mask, turn=ply, active=moving,
                                         budget=budget.astype(np.int32), rng=rng,
                                         layout=self.layout,
                                         temperatures=self.turn_temperatures(np.arange(r)),
                                         **self.options)
        out_tok, out_lp, out_len = dist.to_host_tree((out.tokens, out.logps, out.lengths))
        kept = np.zeros(r, np.int64)
        texts = []
        for i in rows:
            kept[i], text = self.turn_ended(i, out_tok[i, :out_len[i]].tolist(), out_lp[i])
            texts.append(text)
        self.slot_mask |= multiturn.kept_slots(self.layout, ply, kept)
        return rows, texts

    def routes(self) -> np.ndarray | None:
        """The static plies' routes (``record_routes``) laid out as the training rows'
        columns (``multiturn.trajectory_routes``), or None."""
        if not self.side.record_routes or self.cache is None:
            return None
        return multiturn.trajectory_routes(
            dist.to_host(self.cache["routes"]), self.slot_mask,
            np.repeat(np.asarray(self.p_mask, bool), self.g, axis=0), self.m_max)

    def result(self, time_env: float, routes=None) -> dict:
        """The side's rows as ``episodes.run_episodes`` gives them (``routes``: the engine's,
        else the static plies' when recorded)."""
        r = len(self.envs)
        mask = np.arange(self.m_max)[None, :] < self.length[:, None]
        info: dict[str, float] = {}
        for c in self.counters:
            _count(c, info)
        routes = self.routes() if routes is None else routes
        out = {} if routes is None else {"routes": routes}
        turns = np.full((r, self.layout.max_turns, self.n), -1, np.int32)   # (a ply's ids)
        for i, plies in enumerate(self.moves):
            for ply, ids in enumerate(plies):
                turns[i, ply, :len(ids)] = ids
        return dict(**out,
            tokens=self.tokens, mask=mask, model_mask=self.model_mask, logps=self.logps,
            lengths=self.length.astype(np.int32),
            model_tokens=self.model_mask.sum(1).astype(np.int32), truncated=~self.done,
            turns=self.turns, env_rewards=self.env_rewards, turn_rewards=self.turn_rewards,
            turn_ids=self.turn_ids, prompt_ids=[list(map(int, p)) for p in self.prompt_ids],
            prompt_len=int(self.layout.prompt_len), prompts=self.prompts,
            final_turns=self.final_turns,
            transcripts=[self.tok.decode(self.tokens[i, :self.length[i]].tolist())
                         for i in range(r)],
            counters=self.counters, info=info, time_env=time_env, match_turns=turns,
            turn_plies=self.turn_plies,
            roles=np.array([env.role_key for env in self.envs], np.int32))


def run_matches(sides: Sequence[Side], tokenizer, *, renderer: Renderer, limits: EpisodeLimits,
                max_plies: int, rng: jax.Array, mesh=None,
                step_all: Callable | None = None, engine=None, weights=None) -> list[dict]:
    """Plays every match of ``sides``' seat environments to its end (module docstring).
    ``limits.max_turns`` bounds each seat's turns, ``max_plies`` the plies of a match (the
    cache of each side has a turn's slots per ply). Returns one dict per side.

    ``engine`` (``episodes.EngineOptions``): every seat on a slot of its own, each side on an
    episode engine of its own (``sampling.episode_engine``: its slots, cache and params), a
    seat's turn starting as soon as the seat before it moved, not when the ply's slowest turn
    stopped. Its noise is the static plies' (turn = the match's ply), so where both compute
    equal logits the matches are equal. ``weights`` (with ``engine``): in-flight weight
    updates of the first side, the policy's (``episodes.EngineWeights``; the others are
    frozen); its dict adds ``versions`` and ``swaps`` (``episodes.run_episodes``')."""
    if weights is not None and engine is None:
        raise ValueError("in-flight weights need the episode engine (engine=EngineOptions)")
    if step_all is None:
        from rljax.envs import step_all
    log: dict = {}   # each match's turns, every side's (``_SideRun.moves``)
    runs = [_SideRun(s, tokenizer, renderer, limits, max_plies, mesh, log) for s in sides]
    if engine is not None:
        return _engine_matches(runs, rng, max_plies, step_all, engine, weights)
    time_env = 0.0
    for ply in range(max_plies):
        for run in runs:
            run.settle()
        moved = [(run, *run.decode(ply, jax.random.fold_in(jax.random.fold_in(rng, k), ply)))
                 for k, run in enumerate(runs)]
        envs = [run.envs[i] for run, rows, _ in moved for i in rows]
        if not envs:
            break
        t0 = time.perf_counter()
        results = step_all(envs, [t for _, _, texts in moved for t in texts])
        time_env += time.perf_counter() - t0
        results = iter(results)
        for run, rows, _ in moved:
            for i in rows:
                run.record(i, next(results))
    for run in runs:
        run.settle()
        for i in np.flatnonzero(run.active):   # out of plies: truncated
            run._truncate(i)
    return [run.result(time_env) for run in runs]


def replay_match(runs, where, n: int, history, turn: int, until_over: bool = False) -> None:
    """Row ``n``'s match replayed up to its seat's model turn ``turn`` (a VinePPO fork's,
    ``vine_matches``; a tree's first turn, ``tree_matches``): each ply's seat (the game's
    turn order) takes its recorded ids ``history`` int [plies, N] (-1 after a turn's), its
    observation rendered first, and steps its environment. ``where``: (``id(match)``, seat)
    -> (side, row) of every seat environment of ``runs`` (``_SideRun``s); the seat is row n
    of side 0. ``until_over``: a history that ends the match replays whole (a tree's
    opening), else that is an error."""
    match = runs[0].envs[n].match
    for ply in range(len(history) + 1):
        if until_over and match.over():
            return
        side, i = where[(id(match), match.to_move())]
        run = runs[side]
        if side == 0 and run.turns[i] == turn:
            return
        if ply == len(history):
            break
        if run.next_observation(i) is None:
            raise ValueError(f"a replayed match ran out of room at ply {ply}")
        ids = [int(x) for x in history[ply] if x >= 0]
        text = run.turn_ended(i, ids, np.zeros(len(ids), np.float32))[1]
        run.record(i, run.envs[i].step(text))
    raise ValueError(f"match {id(match)}: its history ends before the forked turn {turn}")


class _EngineSide:
    """One side's rows on the episode engine (``sampling.episode_engine``): a slot per row for
    its whole match (all seats at once, so a seat waiting for another's move never waits for
    a free slot), with the side's own prompt pages, KV cache and weights (``chunks``: the
    policy's may swap in flight, an opponent's are frozen). Its noise key is ``rng``."""

    def __init__(self, run: _SideRun, rng, chunks: EngineWeights, chunk_steps: int,
                 width: int | None = None):
        from rljax.models import paged
        from rljax.sampling import episode_engine as ee

        side, r = run.side, len(run.envs)
        self.run, self.rng, self.chunks, self.chunk_steps = run, rng, chunks, int(chunk_steps)
        self.pages = ee.prefill(side.model_cfg, chunks.params, run.p_tok, run.p_mask,
                                record_routes=side.record_routes)
        self.cache = paged.init_slot_cache(side.model_cfg, r, run.m_max + 1)
        if side.record_routes:   # the paged prompt's experts; the cache records the rest
            *self.pages, self.prompt_routes = self.pages
            self.cache = ee.init_routes(side.model_cfg, self.cache)
        # ``width``: a feed's tokens, wider than a chunk where rows were replayed before the
        # engine (their first feed is the trajectory so far).
        self.state = ee.empty_state(r, width or run.o, run.n, run.tok.pad_id)
        self.fed = np.zeros(r, bool)   # the slot's cache holds the row's trajectory
        self.state["row"][:] = np.arange(r)          # slot i holds row i for its whole match
        self.decoding = np.zeros(r, bool)
        if side.schedule is not None:   # each slot's turn at its own temperatures
            self.state["temp"] = np.ones((r, run.n), np.float32)
        self.opts = dict(temperature=side.temperature, top_k=side.top_k, top_p=side.top_p,
                         stop_ids=sampling.merge_stop_ids(run.tok.eos_id, ()),
                         stop_sequences=run.options["stop_sequences"])

    def feed(self, max_plies: int) -> None:
        """The loop head: settles this side's matches, then feeds each of its seats now to
        move its observation (cursor: the trajectory before it, the carried token first; a
        row's first feed: its trajectory so far after the prompt's last token, which for a
        fresh match is its observation), then its ``lead_in``. The noise key's turn is the
        match's ply, as the static plies key it."""
        from rljax.sampling import episode_engine as ee

        run = self.run
        for i, before, obs in run.seats_to_move(self.decoding, max_plies):
            lead, cursor = int(run.carry[i]), before
            if not self.fed[i]:
                lead, cursor = int(np.asarray(run.p_tok)[i // run.g, -1]), 0
                obs = run.tokens[i, :run.length[i]].tolist()
            self.fed[i] = True
            ahead = len(run.lead_in[i])
            ee.resume(self.state, i, row=i, lead=lead, observation=list(obs) + run.lead_in[i],
                      cursor=cursor, turn=run.envs[i].match.plies,
                      budget=min(run.n, run.m_max - int(run.length[i])) - ahead)
            set_slot_temperatures(self.state, i, run.turn_temperatures([i], ahead))

    def decode(self) -> tuple[np.ndarray, list[str]]:
        """One decode chunk: (rows whose turn ended int [E], their turns' kept texts)."""
        run = self.run
        self.cache, self.state, _ = self.chunks.run_chunk(
            run.side.model_cfg, *self.pages, self.cache, self.state, self.rng,
            num_samples=run.g, chunk_steps=self.chunk_steps, **self.opts)
        ended = np.flatnonzero(self.decoding & ~self.state["live"])
        self.decoding[ended] = False
        st = self.state
        texts = [run.turn_ended(i, st["tokens"][i, :st["t"][i]].tolist(), st["logps"][i],
                                self.chunks.drawn[i])[1] for i in ended]
        return ended, texts

    def routes(self) -> np.ndarray | None:
        """Every row's fed tokens' experts (``record_routes``), laid out as the training
        rows' columns: the paged prompt at [0, P - 1), cache index j at P - 1 + j (slot i
        held row i for its whole match)."""
        if not self.run.side.record_routes:
            return None
        run, p = self.run, self.run.p_tok.shape[1]
        cache = dist.to_host(self.cache["routes"])
        out = np.zeros((len(run.envs), p + run.m_max) + cache.shape[2:], np.int32)
        out[:, :p - 1] = np.repeat(dist.to_host(self.prompt_routes), run.g, 0)
        for i, n in enumerate(run.length):
            out[i, p - 1:p - 1 + n] = cache[i, :n]
        return out


def _engine_matches(runs: list[_SideRun], rng, max_plies: int, step_all, engine,
                    weights, width: int | None = None) -> list[dict]:
    """The matches on the episode engine, each side on an engine of its own
    (``_EngineSide``); one dict per side. The sides decode chunk after chunk in turn; after
    each chunk the seats whose turn ended step their match, and before the next every side
    settles and feeds the seats now to move, so a seat's turn starts as soon as the other
    seat moved. Side k's noise key is ``fold_in(rng, k)``, the static plies'. ``weights``:
    the policy's (side 0) in-flight weight updates, or None; the other sides are frozen.
    ``width``: the engines' feed width (``_EngineSide``; runs replayed before it)."""
    sides = [_EngineSide(run, jax.random.fold_in(rng, k),
                         EngineWeights(run.side.params, weights if k == 0 else None),
                         engine.chunk_steps, width) for k, run in enumerate(runs)]
    time_env, moved = 0.0, True
    while moved:   # until a round of the sides in which none had a seat to decode
        moved = False
        for side in sides:
            for other in sides:
                other.feed(max_plies)
            if not side.decoding.any():
                continue
            moved = True
            ended, texts = side.decode()
            if len(ended):
                t0 = time.perf_counter()
                results = step_all([side.run.envs[i] for i in ended], texts)
                time_env += time.perf_counter() - t0
                for i, res in zip(ended, results):
                    side.run.record(i, res)
    for run in runs:
        for i in np.flatnonzero(run.active):   # out of plies: truncated
            run._truncate(i)
    return [dict(s.run.result(time_env, s.routes()), **s.chunks.fields(s.run.versions))
            for s in sides]
