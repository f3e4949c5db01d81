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
drawn by one policy version, which each of its tokens records (with in-flight weight updates,
``algo.inflight_updates``, the engine polls for new weights between its decode chunks, and a
turn's tokens record the versions that drew them). Tree rollouts (``rollout.tree``): a place
with no turn yet grows its group's first turns as trees before the engine plays
(``_grow_trees``); they are recorded as any finished turns, so a tree is carried whole.

What is carried is plain data: each place's example (and dataset index, for prompt
selection: a round's ``indices``), and, per episode, its finished turns (the
kept tokens, their behaviour log-probs, the version that drew them). Every iteration rebuilds
the episodes from it: fresh environments (``reset``), the recorded turns replayed through
``env.step``, and on the engine the whole trajectory so far fed again under the current
weights before the next turn samples. The checkpoint holds the same data (``state_dict``), so
a resumed run rebuilds exactly what the straight run rebuilds. This needs environments that
answer the same actions the same way (the tool and game environments do; a tool whose answer
depends on the wall clock, e.g. one that can time out, may answer differently on replay).

Self-play (``env.selfplay.mode='self'``): a place is one game's G matches, a group of G rows
per seat (``seats x G`` rows, the batch's groups in (example, seat) order as
``selfplay.play``'s); it is complete when every match is over. Besides each row's turns the
place records the order its matches stepped in (engine chunk, row, turn), and the rebuild
replays the steps in that order with ``matches._engine_matches``' loop head (settle, observe
the seats to move) before each chunk's steps, so every seat sees what it saw. The games are
deterministic given their deal and moves. Against a checkpoint opponent
(``env.selfplay.mode='checkpoint'``) a place holds every seat's rows too: the opponent's
turns are recorded (with no version: never stale) and replayed like the policy's, its seats
decode on an engine of their own (its parameters and sampling), the two engines taking a
decode chunk each in turn, and only the example's seat's group trains. With tree rollouts
(``rollout.tree``) a place with no turn yet plays its game's opening once and grows the
learner seat's first turns as one tree per group (``tree_matches``), recorded as the
opponent's and the learner's first steps (``partial_matches._grow_trees``), so a tree is
carried whole and rebuilt by replay.

Randomness: token t of turn k of row i of the place admitted s-th reads the engine's row
draw of id ``s * rows + i`` (rows: G, or ``seats x G``) under ``fold_in(state.rng,
EPISODE_STREAM)`` (turn k; self-play: the match's ply, as on the engine), so a turn draws the
same noise whatever slot, chunk or iteration it is played in. A place's trees (and against a
checkpoint opponent its opening) read ``fold_in`` of that key with its admission serial.

Images in the prompt (a model with a vision tower): each place keeps its example's pixels
(``image_inputs.PlacePixels``, decoded at admission and again from the checkpoint's examples
on resume); every iteration the tower embeds them under the current weights and the engine
prefills them with the prompts, so every turn, a carried episode's replayed trajectory
included, attends to them; the round carries the taken groups' ``pixels`` for their training
rows.

Staleness: a group holding a turn more than ``rollout.max_staleness`` versions old restarts
from its prompt (counted in ``rollout/dropped_stale``). Metrics as ``core.partial``'s:
``rollout/staleness_mean`` / ``_max`` over the batch's model tokens, ``rollout/dropped_stale``
(episodes), ``rollout/carried_groups`` (self-play: a group per seat),
``rollout/decoded_tokens`` (tokens sampled this iteration, dropped turns included).
"""
from __future__ import annotations

import json
import time

import jax
import numpy as np

from rljax import sampling
from rljax.config.rollout import knapsack_step
from rljax.sampling import multiturn
from rljax.sampling import tree as tree_sampling
from rljax.train.core import episodes as ep, image_inputs
from rljax.train.core.render import cut_after
from rljax.train.core.partial import drawn_indices, from_json_field, json_field
from rljax.train.core.rollout_metrics import carried_metrics
from rljax.train.core.sampler import (engine_slots, rollout_temperatures, sampling_params,
                                      sampling_weights)
from rljax.train.methods import agent
from rljax.train.methods.partial_matches import play_matches

EPISODE_STREAM = 9  # rng stream of the episodes in flight: fold_in(state.rng, 9), every step


class EpisodePartialRounds(agent.EpisodeRounds):
    """Multi-turn episodes with partial rollouts as a rollout's round source (module
    docstring): ``EpisodeRounds``' rounds and metrics, from groups carried across
    iterations. A place holds one example: a group of G episodes, or with self-play the G
    matches of a game (``seats x G`` rows sharing the matches, a group per seat; against a
    checkpoint the example's seat's group trains, the opponent's rows are played and
    carried only). Groups of their own sizes (knapsack allocation): ``sizes_of(rollout,
    indices) -> int [P]`` sizes each admitted batch, a place holding room for ``rows``
    episodes (against a checkpoint: matches, every seat's rows) and playing its first
    ``size``; the round carries ``group_sizes``."""

    def __init__(self, ctx, num_prompts: int, sizes_of=None, rows: int = 0):
        super().__init__(ctx)
        self.g = int(rows or ctx.cfg.algo.num_generations)   # a group's rows at most
        self.sizes_of = sizes_of
        self.seats, self.num_prompts = 1, int(num_prompts)   # examples a round takes
        if self.selfplay:
            from rljax.envs import board_games
            from rljax.train.methods import selfplay
            self.seats = selfplay.num_seats(ctx.cfg)
            self.num_prompts = selfplay.examples_per_round(ctx.cfg, self.num_prompts)
            self._game = board_games.get_game(ctx.cfg.env.name)
        self.rows = self.seats * self.g                       # rows of a place
        self._renderer = agent.make_renderer(ctx.cfg, ctx.tokenizer)
        c = 2 * self.num_prompts
        self.serial = np.full(c, -1, np.int64)        # admission serial (-1: free place)
        self.completed_at = np.full(c, -1, np.int64)  # engine chunk the place completed in
        self.metas: list = [None] * c
        self.indices = np.full(c, -1, np.int64)       # dataset index (prompt selection)
        self.sizes = np.full(c, self.g, np.int64)     # each group's episodes (<= g)
        # Per place, per row: the finished turns, {"ids", "logps", "version"}; with self-play
        # also the order the match steps went in, [chunk, row, turn] per step (replayed in it).
        self.turns: list[list[list[dict]]] = [self._empty() for _ in range(c)]
        # A vision tower: each place's prompt pixels (decoded at admission and on load, from
        # the example the place keeps); None: a text model.
        self.images = image_inputs.place_pixels(ctx, c)
        self.moves: list[list[list[int]]] = [[] for _ in range(c)]
        self.next_serial = self.clock = 0
        # Tree rollouts: a place's first turns are trees of ``unit`` leaves, one root each
        # (``_grow_trees``); the group's size sets its number of roots.
        self.tree = tree_sampling.options_from_config(ctx.cfg.rollout.tree,
                                                      int(ctx.cfg.algo.num_generations))
        self.unit = knapsack_step(ctx.cfg)
        self._step = self._version = 0
        self._key, self._drawn = None, []   # per sampling round of this call (metrics)
        # Asynchronous RL: the version of the parameters it passes (None: ``step``).
        self.params_version: int | None = None

    def _empty(self) -> list:
        return [[] for _ in range(self.rows)]

    def _learners(self, j: int) -> np.ndarray:
        """int [G or rows]: the rows of place ``j`` that train (a checkpoint opponent's
        places: the example's seat's G rows; groups of their own sizes: the first ``size``)."""
        if self.opponent is None:
            return np.arange(self.rows if self.sizes_of is None else self.sizes[j])
        from rljax.train.methods import selfplay
        return selfplay.seat_of(self._game, self.metas[j]) * self.g + np.arange(self.sizes[j])

    def _unused(self, places) -> np.ndarray:
        """bool [len(places) * rows]: the rows past their group's size (never played)."""
        return (np.arange(self.rows)[None, :] % self.g
                >= self.sizes[np.asarray(places, np.int64)][:, None]).reshape(-1)

    def _clear(self, j: int) -> None:
        self.turns[j], self.moves[j], self.completed_at[j] = self._empty(), [], -1

    @property
    def free(self) -> int:
        return int((self.serial < 0).sum())

    def begin(self, state, step: int) -> None:
        self._step = int(step)
        self._version = self._step if self.params_version is None else int(self.params_version)
        self._key = jax.random.fold_in(state.rng, EPISODE_STREAM)
        self._drawn = []

    # -- one iteration -------------------------------------------------------------------------

    def sample_round(self, rollout, params, rng=None) -> dict:
        """The next ``num_prompts`` places to complete, scored. ``rng`` is not used: the noise
        is keyed by each place's admission (module docstring)."""
        while self.free >= self.num_prompts:   # the first iteration fills both batches
            new = next(rollout.iterator)
            indices = drawn_indices(rollout.iterator, len(new))
            sizes = ([self.g] * len(new) if self.sizes_of is None
                     else self.sizes_of(rollout, indices))
            admitted = np.flatnonzero(self.serial < 0)[:len(new)]
            for j, ex, index, size in zip(admitted, new, indices, sizes):
                self.serial[j], self.next_serial = self.next_serial, self.next_serial + 1
                self.metas[j], self.indices[j], self.sizes[j] = ex, index, size
                self._clear(j)
            if self.images is not None:
                self.images.admit(admitted, new, rollout._locations(new))
        t0 = time.perf_counter()
        dropped = self._drop_stale()
        places = sorted(np.flatnonzero(self.serial >= 0), key=lambda j: self.serial[j])
        params = sampling_params(self.ctx, params)
        # In-flight weight updates (asynchronous RL): polled between the engine's chunks.
        weights = (None if rollout.weights is None
                   else sampling_weights(self.ctx, rollout.weights))
        if self.selfplay:
            eps, groups, slot_steps, drawn, swaps = play_matches(self, params, places, weights)
        else:
            eps, groups, slot_steps, drawn, swaps = self._play_episodes(params, places, weights)
        taken = sorted((j for j in places if self.completed_at[j] >= 0),
                       key=lambda j: (self.completed_at[j], self.serial[j]))[:self.num_prompts]
        at = {j: k for k, j in enumerate(places)}
        learners = {j: self._learners(j) for j in taken}
        rows = np.concatenate([at[j] * self.rows + learners[j] for j in taken])
        eps = dict(_subset(eps, rows), slot_steps=slot_steps)
        if self.images is not None:   # the taken groups' pixels, for their training rows
            eps.update(self.images.round_fields(taken, None if self.sizes_of is None else [
                len(learners[j]) for j in taken]))
        versions = np.full(eps["tokens"].shape, -1, np.int64)
        for r, (j, k) in enumerate((j, k) for j in taken for k in learners[j]):
            for turn, t in enumerate(self.turns[j][k]):   # a token's own version (in flight)
                versions[r, eps["turn_ids"][r] == turn] = t.get("versions", t["version"])
        examples = [x for j in taken for x in groups[at[j]]]
        indices = [int(self.indices[j]) for j in taken for _ in groups[at[j]]]   # per group
        for j in taken:
            self.serial[j], self.metas[j] = -1, None
            self._clear(j)
        self._drawn.append(dict(versions=versions[eps["model_mask"]], dropped=dropped,
                                drawn=drawn, swaps=swaps))
        if self.sizes_of is None:
            return dict(self.scored_round(rollout, eps, examples, time.perf_counter() - t0),
                        indices=indices)
        # Groups of their own sizes (one a place): every row with its example, as the
        # knapsack's rounds are scored.
        sizes = np.asarray([len(learners[j]) for j in taken], np.int64)
        rows_examples = [ex for ex, k in zip(examples, sizes) for _ in range(k)]
        return dict(self.scored_round(rollout, eps, rows_examples, time.perf_counter() - t0,
                                      g=1), indices=indices, group_sizes=sizes)

    def _drop_stale(self) -> int:
        """Restarts every place holding a turn of its learner rows more than the bound older
        than this version; returns the episodes discarded (learner rows that had turns). A
        frozen opponent's turns are never stale."""
        bound = int(self.ctx.cfg.rollout.max_staleness) - (self._step - self._version)
        dropped = 0
        for j in np.flatnonzero(self.serial >= 0):
            own = [self.turns[j][k] for k in self._learners(j)]
            oldest = min((t["version"] for s in own for t in s), default=self._version)
            if self._version - oldest > bound:
                dropped += sum(1 for s in own if s)
                self._clear(j)
        return dropped

    def _record_turn(self, j: int, row: int, ids, logps, frozen: bool = False,
                     versions=None) -> None:
        """A finished turn of place j's row: its ids, log-probs, version (frozen: None; with
        in-flight weights ``versions``, each token's, the first its ``version``)."""
        turn = dict(ids=[int(x) for x in ids], logps=[float(x) for x in logps],
                    version=None if frozen else self._version)
        if versions is not None and not frozen and len(turn["ids"]):
            turn["versions"] = [int(v) for v in versions[:len(turn["ids"])]]
            turn["version"] = turn["versions"][0]
        self.turns[j][row].append(turn)

    def _engine_setup(self, lim, p_tok, p_mask, params, slots: int, side=None, weights=None,
                      image_places=None):
        """The engine's slot cache, state, chunk function and weights
        (``episodes.EngineWeights``: with in-flight ``weights``, polled between chunks) for
        this iteration; the feed holds a carried episode's whole trajectory so far (fed again
        under the current weights). ``side`` (``matches.Side``): the model, parameters and
        sampling of the engine (None: the policy's ``params`` at the rollout's sampling).
        ``image_places`` (a vision tower): the places of ``p_tok``'s prompts, whose images
        are embedded under the prefill's weights and prefilled with them, so every turn
        (carried ones' replayed trajectories included) attends to them."""
        from rljax.models import paged
        from rljax.sampling import episode_engine as ee
        from rljax.train.methods.matches import Side
        r, tok = self.ctx.cfg.rollout, self.ctx.tokenizer
        if side is None:
            side = Side(self.ctx.model_cfg, params, (), self.g, r.temperature, r.top_k, r.top_p,
                        schedule=rollout_temperatures(self.ctx.cfg))
        model_cfg, chunks = side.model_cfg, ep.EngineWeights(side.params, weights)
        embeds = (None if image_places is None
                  else self.images.embeds(chunks.params, image_places))
        pages = ee.prefill(model_cfg, chunks.params, p_tok, p_mask, image_embeds=embeds)
        cache = paged.init_slot_cache(model_cfg, slots, lim.max_total_tokens + 1)
        state = ee.empty_state(slots, max(lim.chunk_tokens, lim.max_total_tokens),
                               lim.turn_tokens, tok.pad_id)
        if side.schedule is not None:   # each slot's turn at its own temperatures
            state["temp"] = np.ones((slots, lim.turn_tokens), np.float32)
        calls = [self._renderer.call_end] if self._renderer.call_end else []
        options = dict(temperature=side.temperature, top_k=side.top_k, top_p=side.top_p,
                       stop_ids=sampling.merge_stop_ids(tok.eos_id, ()),
                       stop_sequences=multiturn.stop_sequences_of(tok, calls))

        def run_chunk(cache, state):
            return chunks.run_chunk(model_cfg, *pages, cache, state, self._key,
                                    num_samples=self.g, chunk_steps=int(r.chunk_steps),
                                    **options)
        return cache, state, run_chunk, chunks

    def _draw_ids(self, places) -> np.ndarray:
        return (np.repeat(self.serial[places], self.rows) * self.rows
                + np.tile(np.arange(self.rows), len(places)))

    # -- tool episodes -------------------------------------------------------------------------

    def _play_episodes(self, params, places, weights=None):
        """Tool episodes: rebuild (``_rebuild``), then turns on the engine until enough groups
        are complete. Returns (all rows' episodes, each place's group examples, (busy, run)
        slot-steps, tokens sampled, weight swaps). ``weights``: in-flight updates, or None."""
        from rljax.sampling import episode_engine as ee
        cfg, g = self.ctx.cfg, self.g
        envs = agent.make_envs(cfg, [self.metas[j] for j in places], g)
        record, finished, prompts, prompt_ids, p_tok, p_mask = self._rebuild(envs, places)
        grown = swapped = 0
        if self.tree is not None:   # fresh places' first turns: their trees, then replayed
            grown, swapped, first_turns = self._grow_trees(params, places, p_tok, p_mask,
                                                           weights)
            finished |= record.replay(first_turns)
        finished |= self._unused(places)   # (rows past a group's size: never played)
        eps = lambda: dict(record.result(prompts, prompt_ids, p_tok.shape[1]),  # noqa: E731
                           roles=np.array([getattr(e, "role_key", -1) for e in envs], np.int32))
        groups = [[self.metas[j]] for j in places]
        lim, r = record.limits, len(envs)
        done_places = lambda: sum(self.completed_at[j] >= 0 for j in places)  # noqa: E731
        for n, j in enumerate(places):   # complete already (replayed): keeps its place in line
            if finished[n * g:(n + 1) * g].all() and self.completed_at[j] < 0:
                self.completed_at[j] = self.clock
        waiting = [i for i in range(r) if not finished[i]][::-1]   # oldest group next
        if done_places() >= self.num_prompts or not waiting:
            return eps(), groups, (0, 0), grown, swapped
        s = max(1, min(engine_slots(cfg, self.num_prompts * g), r))
        first = np.repeat(np.asarray(p_tok)[:, -1], g)
        draw = self._draw_ids(places)
        cache, state, run_chunk, chunks = self._engine_setup(
            lim, p_tok, p_mask, params, s, weights=weights,
            image_places=None if self.images is None else places)
        in_flight = weights is not None
        busy, run, drawn = 0, 0, grown
        while done_places() < self.num_prompts:
            for slot in np.flatnonzero(state["row"] < 0):
                if not waiting:
                    break
                i = waiting.pop()
                ee.resume(state, slot, row=i, lead=int(first[i]),
                          observation=record.tokens[i, :record.length[i]], cursor=0,
                          turn=int(record.turns[i]), budget=record.budget(i), draw=int(draw[i]))
                ep.set_slot_temperatures(state, slot, record.turn_temperatures([i]))
            if not state["live"].any():
                break
            before = state["cursor"].copy()
            cache, state, steps = run_chunk(cache, state)
            self.clock += 1
            busy, run = busy + int((state["cursor"] - before).sum()), run + s * steps
            ended, rows, kept, observations = record.slots_ended(state)
            drawn += int(state["t"][ended].sum())
            for n, slot in enumerate(ended):
                i, obs, k = int(rows[n]), observations[n], kept[n]
                j = places[i // g]
                self._record_turn(j, i % g, state["tokens"][slot, :k], state["logps"][slot, :k],
                                  versions=chunks.drawn[slot] if in_flight else None)
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
                ep.set_slot_temperatures(state, slot, record.turn_temperatures([i]))
        live = (state["row"] >= 0) & state["live"]   # turns dropped: drawn again next time
        return (eps(), groups, (busy, run), drawn + int(state["t"][live].sum()),
                chunks.swaps + swapped)

    def _grow_trees(self, params, places, p_tok, p_mask,
                    weights=None) -> tuple[int, int, list]:
        """Tree rollouts of episodes (``tree_episodes``): every place of ``places`` with no
        turn yet (admitted, or restarted as stale) grows its group's first turns as trees of
        ``unit`` leaves, one root per ``unit`` rows of its size (``p_tok``/``p_mask``: the
        places' prompts [len(places), P]), its noise keyed by its admission; the leaves are
        recorded as its rows' first turns, so a tree is carried whole, at the first-turn
        boundary. Returns (tokens decoded, weight swaps, the new first turns per row of
        ``places``, for ``record.replay``). ``weights``: in-flight updates (each token records
        its version)."""
        from rljax.train.methods import tree_episodes
        cfg = self.ctx.cfg
        decoded, swaps, first_turns = 0, 0, [[] for _ in range(len(places) * self.rows)]
        for n, j in enumerate(places):
            if any(self.turns[j]):
                continue
            tree = dict(self.tree, roots=int(self.sizes[j]) // self.unit)
            grow = tree_episodes.FirstTurns(
                self.ctx, params, jax.random.fold_in(self._key, int(self.serial[j])), tree,
                agent.turn_tokens(cfg), weights=weights,
                pixels=None if self.images is None else self.images.pixels[j:j + 1],
                images=None if self.images is None else self.images.images,
                temperature=cfg.rollout.temperature,
                top_k=cfg.rollout.top_k, top_p=cfg.rollout.top_p,
                temperatures=rollout_temperatures(cfg))
            tokens, logps, lengths = grow(p_tok[n:n + 1], p_mask[n:n + 1])
            versions = grow.out.get("versions")
            for k, m in enumerate(lengths):   # (kept as the engine's turns are: cut)
                m = cut_after(self.ctx.tokenizer, tokens[k, :m].tolist(),
                                  self._renderer.call_end)
                self._record_turn(j, k, tokens[k, :m], logps[k, :m],
                                  versions=None if versions is None else versions[k])
                first_turns[n * self.rows + k] = self.turns[j][k][-1:]
            decoded += int(np.sum(grow.out["decoded"]))
            swaps += int(grow.out.get("swaps", 0))
        return decoded, swaps, first_turns

    def _rebuild(self, envs, places):
        """The episodes of ``places`` as their recorded turns left them: fresh environments,
        the turns replayed through ``env.step``. Returns ``(record, finished bool [R], prompts,
        prompt ids, prompt tokens [B, P], prompt mask)``."""
        cfg, tok, g = self.ctx.cfg, self.ctx.tokenizer, self.g
        renderer, limits = self._renderer, agent.limits(cfg)
        from rljax.envs import step_all
        prompts = [renderer.prompt(env.reset()) for env in envs]
        prompt_ids = [tok.encode(p) for p in prompts]
        p_tok, p_mask = sampling.pad_to_bucket(prompt_ids[::g], pad_id=tok.pad_id,
                                               buckets=limits.prompt_buckets)
        record = ep._Trajectories(tok, envs, renderer, limits, step_all)
        record.schedule = rollout_temperatures(cfg)   # (None: rollout.temperature)
        finished = record.replay([self.turns[j][k] for j in places for k in range(g)])
        return record, finished, prompts, prompt_ids, p_tok, p_mask

    def metrics(self, rounds, step: int) -> dict:
        swaps = {"rollout/weight_swaps": sum(d["swaps"] for d in self._drawn)} \
            if self.ctx.cfg.algo.get("inflight_updates") else {}
        return {**super().metrics(rounds, step), **swaps,
                **carried_metrics(self._drawn, step, sum(   # (a group of its own size: one)
                    -(-len(self._learners(j)) // self.g)
                    for j in np.flatnonzero(self.serial >= 0)))}

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Plain JSON: the places' admission serials, examples, finished turns (log-probs as
        float32 values, exact through JSON's float64) and, with self-play, their order."""
        return json.loads(json.dumps(dict(
            serial=self.serial.tolist(), completed_at=self.completed_at.tolist(),
            metas=self.metas, indices=self.indices.tolist(), sizes=self.sizes.tolist(),
            turns=self.turns, moves=self.moves,
            next_serial=self.next_serial, clock=self.clock), default=json_field))

    def load_state_dict(self, state: dict) -> None:
        if len(state["serial"]) != len(self.serial):
            raise ValueError(f"the saved episodes in flight have {len(state['serial'])} "
                             f"places, this config makes {len(self.serial)}")
        self.serial = np.asarray(state["serial"], np.int64)
        self.completed_at = np.asarray(state["completed_at"], np.int64)
        self.metas = list(from_json_field(state["metas"]))
        self.indices[:] = state.get("indices", -1)   # (a checkpoint from before they were kept)
        self.sizes[:] = state.get("sizes", self.g)   # (saved before groups had sizes: all G)
        self.turns, self.moves = state["turns"], state["moves"]
        self.next_serial, self.clock = int(state["next_serial"]), int(state["clock"])
        if self.images is not None:   # decoded again from the examples in flight
            places = [int(j) for j in np.flatnonzero(self.serial >= 0)]
            self.images.restore(places, [self.metas[j] for j in places])


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
