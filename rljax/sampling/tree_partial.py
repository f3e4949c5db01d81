"""Tree rollouts carried across iterations: a pool of prompt trees, each grown level by level on
the slot engine (``sampling.tree_engine``), whose unfinished trees continue in the next run.

    pool = tree_partial.TreePool(cfg, max_new_tokens=N, segment_tokens=L, branching=k, depth=D,
                                 roots=R, groups=2 * B, prompt_len=P, slots=S, chunk_steps=K,
                                 eos_id=tok.eos_id, pad_id=tok.pad_id)
    places = pool.admit(prompt_ids, metas)   # new trees take the free places
    taken = pool.run(params, key, version=v, want=B, max_staleness=2)
    # a sampling.partial.Taken: rows [B*M, N] (M = R * k**D leaves per tree, tree-major, in
    # sampling.tree's layout), taken.decoded [B]: each tree's decoded tokens
    pool.admit(prompt_ids, metas, sizes=[2 * k**D, ...])   # trees of their own sizes: 2 roots
    # (taken.sizes: each tree's leaves; its rows are those of its first roots' subtrees)

Each place holds one tree and its level cursor (the levels grown so far). One ``run`` is one
training iteration's sampling. It drops stale trees (a tree holding a token more than
``max_staleness`` versions old restarts from its prompt, as ``sampling.partial.Pool`` restarts a
group), then runs *level steps* until ``want`` trees are complete: a step grows every
unfinished tree in the pool by one level, one engine call per level that some tree is at (all
of a level's requests share it, whatever tree they belong to). A tree is complete after its
leaves' level, or as soon as every path stopped (its remaining levels would decode nothing:
its leaves are copies, as the tree samplers make them). The first ``want`` to complete (by
step, then by admission) are taken; the others keep their cursor, and their next level's
requests re-prefill prompt ++ path under the next run's weights. A tree is carried at level
boundaries: a level, once started, runs to its end within the run.

What is decoded stays: every token keeps the version that drew it and its log-prob under that
policy (a shared segment's on every leaf that descends from it).

Randomness: tree s (the s-th admitted) reads the draws ``sampling.tree_engine.generate`` makes
for a single prompt with ``rng = fold_in(key, s)``: token t of path r at level j reads
``draw_noise(fold_in(fold_in(key, s), t), R * k**j, V)[r]``, whatever run, step or engine row
it is drawn in. So under unchanged weights a carried tree is the tree an uncarried run grows.

Shapes are static: level j's call has ``C * R * k**j`` requests (places not at level j are
prefilled, never decoded: ``live``) of ``P + j * L`` prompt columns.

All state is host arrays (``state_dict``, JSON-able): a run restored from a checkpoint continues
exactly as one that never stopped.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rljax import distributed as dist, models
from rljax.sampling import engine
from rljax.sampling.core import merge_stop_ids
from rljax.sampling.draw import NOISE_AHEAD_MAX_ELEMENTS, noise_ahead_size
from rljax.sampling.partial import Pool, Taken, pool_state
from rljax.sampling.tree import check_tree, num_leaves
from rljax.sampling.tree_engine import fork, level_bounds, level_noise, write_segment


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def pool_noise(key, serials, start, end, width, vocab):
    """float32 [end - start, C * width, W]: place c's rows read tree ``serials[c]``'s draws,
    ``draw_noise(fold_in(fold_in(key, serials[c]), t), width, vocab)``."""
    noise = jax.vmap(lambda s: level_noise(jax.random.fold_in(key, s), start, end, width,
                                           vocab))(serials)   # [C, T, width, W]
    return jnp.moveaxis(noise, 0, 1).reshape(end - start, -1, noise.shape[-1])


class TreePool:
    """Prompt trees in flight across runs (module docstring)."""

    def __init__(self, cfg: models.ModelConfig, *, max_new_tokens: int, segment_tokens: int,
                 branching: int, depth: int, roots: int, groups: int, prompt_len: int,
                 slots: int, chunk_steps: int, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, eos_id: int | Sequence[int] | None = None,
                 pad_id: int = 0, stop_ids: Sequence[int] = (), cache_dtype: Any = None,
                 temperatures: Any = None):
        """``temperatures``: optional float32 [N] schedule; each level's requests decode
        positions [start, end) at ``temperatures[start:end]`` (``sampling.tree_engine``)."""
        check_tree(max_new_tokens, segment_tokens, branching, depth, roots)
        if min(groups, prompt_len, slots, chunk_steps) < 1:
            raise ValueError("groups, prompt_len, slots and chunk_steps must be >= 1")
        self.cfg, self.n, self.c, self.p = cfg, int(max_new_tokens), int(groups), int(prompt_len)
        self.k, self.roots, self.depth = int(branching), int(roots), int(depth)
        self.g = num_leaves(self.roots, self.k, self.depth)   # a tree's leaves: its group
        self.bounds = level_bounds(self.n, int(segment_tokens), self.depth)
        self.s, self.chunk_steps = int(slots), int(chunk_steps)
        self.draw = dict(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                         eos_id=merge_stop_ids(eos_id, stop_ids), pad_id=int(pad_id))
        self.temperatures = (None if temperatures is None else
                             np.asarray(temperatures, np.float32).reshape(self.n))
        self.greedy = self.temperatures is None and temperature == 0.0
        if not self.greedy and noise_ahead_size(self.n, self.c * self.g, cfg.vocab_size) > \
                NOISE_AHEAD_MAX_ELEMENTS:
            raise ValueError(f"the tree pool draws its noise ahead; {self.n} tokens x "
                             f"{self.c * self.g} rows x vocabulary {cfg.vocab_size} exceed "
                             "NOISE_AHEAD_MAX_ELEMENTS")
        self.cache_dtype = cache_dtype
        self.reset()

    # -- host state ----------------------------------------------------------------------------

    def reset(self) -> None:
        c, m, n = self.c, self.g, self.n
        self.serial = np.full(c, -1, np.int64)          # admission order; -1 = free
        self.sizes = np.full(c, m, np.int64)            # each tree's leaves (``admit``'s)
        self.completed_at = np.full(c, -1, np.int64)    # step clock at completion
        self.level = np.zeros(c, np.int32)              # levels grown; depth + 1: complete
        self.decoded = np.zeros(c, np.int32)            # tokens decoded, shared segments once
        self.prompts: list = [None] * c
        self.metas: list = [None] * c
        # Each tree's paths, the first ``width(level)`` rows meaningful ([C, M, N] / [C, M]).
        self.tokens = np.full((c, m, n), self.draw["pad_id"], np.int32)
        self.logps = np.zeros((c, m, n), np.float32)
        self.versions = np.full((c, m, n), -1, np.int32)
        self.lengths = np.zeros((c, m), np.int32)
        self.done = np.zeros((c, m), bool)
        self.next_serial = 0
        self.clock = 0   # level steps run so far: orders completions across runs

    @property
    def free(self) -> int:
        """Places without a tree."""
        return int((self.serial < 0).sum())

    def width(self, level: int) -> int:
        """Paths of a tree that has grown ``level`` levels (1 before the first: the prompt)."""
        return 1 if level == 0 else self.roots * self.k ** (level - 1)

    # New trees (prompt ids, at most ``prompt_len`` each; ``metas``: anything the caller wants
    # back with the tree) in the free places, in order; returns those places. (A tree is a
    # group of M leaves: the same host bookkeeping as the group pool's.) ``sizes``: each
    # group's leaves, whole subtrees of one root (knapsack allocation, a multiple of
    # ``M / roots``; default M): the roots past a group's size are never grown.
    def admit(self, prompts, metas, sizes=None) -> list[int]:
        per_root = self.g // self.roots
        if sizes is not None and any(int(k) % per_root for k in sizes):
            raise ValueError(f"admit: group sizes {list(sizes)} must be whole trees of "
                             f"{per_root} leaves")
        return Pool.admit(self, prompts, metas, sizes)

    def _dead_rows(self, width: int) -> np.ndarray:
        """bool [C * width]: the rows (of a level ``width`` paths wide, >= roots) under roots
        past their group's size, never grown."""
        root = np.arange(width) // (width // self.roots)
        alive = self.sizes // (self.g // self.roots)   # [C] roots in use
        return (root[None, :] >= alive[:, None]).reshape(-1)

    def _clear(self, j) -> None:
        self.tokens[j], self.logps[j], self.versions[j] = self.draw["pad_id"], 0.0, -1
        self.lengths[j], self.done[j] = 0, False
        self.level[j], self.decoded[j], self.completed_at[j] = 0, 0, -1

    def _complete(self) -> np.ndarray:
        """bool [C]: occupied places whose tree has all its leaves."""
        return (self.serial >= 0) & (self.level > self.depth)

    # -- one iteration -------------------------------------------------------------------------

    def run(self, params: Any, key: jax.Array, *, version: int, want: int,
            max_staleness: int | None = None, image_embeds: Any = None,
            weights: Any = None) -> Taken:
        """Grows the pool's trees under ``params`` (policy ``version``) until ``want`` are
        complete and hands those out (module docstring). ``key``: the run's pool key, the same
        at every call (randomness is keyed by admission serial, not by iteration).
        ``image_embeds`` [C, K, D]: each place's prompt images, prefilled with its paths.
        ``weights`` (in-flight weight updates, ``engine.VersionPolls``, as
        ``partial.Pool.run`` takes them): polled before each level's engine call and between
        its decode chunks (``params`` then unused); each token keeps the version that drew it,
        and the ``Taken`` counts the swaps."""
        if want > int((self.serial >= 0).sum()):
            raise ValueError(f"run: want={want} trees but {int((self.serial >= 0).sum())} "
                             "are in the pool")
        dropped = self._drop_stale(version, max_staleness)
        drawn, useful, steps, slot_steps = 0, 0, 0, 0
        while int(self._complete().sum()) < want:
            # Each tree grows one level this step (a free place holds none).
            at = np.where(self.serial >= 0, self.level, self.depth + 1)
            for lvl in sorted(set(at[at <= self.depth].tolist())):
                st, new = self._grow(params, key, lvl, at == lvl, version, image_embeds,
                                     weights)
                drawn, useful = drawn + new, useful + st.useful_steps
                steps, slot_steps = steps + st.decode_steps, slot_steps + st.slots * st.decode_steps
            self.clock += 1
            self._finish_stopped()
        taken = self._take(want, dropped, (steps, useful, slot_steps), drawn)
        return taken if weights is None else dataclasses.replace(taken, swaps=weights.swaps)

    def _grow(self, params, key, lvl: int, places: np.ndarray, version: int,
              image_embeds: Any = None, weights=None):
        """Level ``lvl`` of the trees in ``places`` (bool [C]), one engine call for all of
        them (``weights``: in-flight, polled by it); returns its EngineStats and the tokens it
        drew."""
        c, width = self.c, self.width(lvl + 1)
        start, end = self.bounds[lvl]
        paths = fork({name: getattr(self, name)[:, :self.width(lvl)].reshape(
            (-1,) + getattr(self, name).shape[2:]) for name in ("tokens", "logps", "versions",
                                                                 "lengths", "done")},
            width // self.width(lvl))   # [C * width, ...], place-major
        mine = np.repeat(places, width)
        dead = mine & self._dead_rows(width)   # (roots past a group's size: stopped at once)
        paths["done"] |= dead
        live = mine & ~paths["done"]   # a stopped path's children decode nothing
        tok, mask = self._requests(paths["tokens"], start, places)
        noise = None if self.greedy else pool_noise(
            key, jnp.asarray(np.maximum(self.serial, 0), jnp.int32), start, end, width,
            self.cfg.vocab_size)
        out, st = engine.generate(self.cfg, params, tok, mask, rng=key,
                                  max_new_tokens=end - start, slots=self.s,
                                  chunk_steps=self.chunk_steps, cache_dtype=self.cache_dtype,
                                  noise=noise, live=live, **self.draw,
                                  image_embeds=None if image_embeds is None else
                                  np.repeat(dist.to_host(image_embeds), width, axis=0),
                                  temperatures=None if self.temperatures is None else
                                  self.temperatures[start:end], weights=weights)
        before = paths["lengths"].copy()
        paths = write_segment(paths, out, live, start, st.versions)
        if weights is None:   # every token of the level drawn by ``version``
            span = np.arange(self.n)[None, :]
            fresh = live[:, None] & (span >= before[:, None]) & (span < paths["lengths"][:, None])
            paths["versions"][fresh] = version
        new = (paths["lengths"] - before).reshape(c, width)
        for name, x in paths.items():
            x = x.reshape((c, width) + x.shape[1:])
            getattr(self, name)[places, :width] = x[places]
        self.decoded[places] += new.sum(axis=1)[places].astype(np.int32)
        self.level[places] = lvl + 1
        return st, int(new[places].sum())

    def _requests(self, tokens: np.ndarray, start: int, places: np.ndarray):
        """Each path's prompt (left-padded to ``prompt_len``) followed by its ``start`` tokens:
        int32 / bool [C * width, P + start]. A place not growing gets a one-token dummy
        prompt (its rows are not live)."""
        width = tokens.shape[0] // self.c
        tok = np.full((self.c, self.p), self.draw["pad_id"], np.int32)
        mask = np.zeros((self.c, self.p), bool)
        mask[:, -1] = True
        for j in np.flatnonzero(places):
            ids = self.prompts[j]
            tok[j, self.p - len(ids):], mask[j, self.p - len(ids):] = ids, True
        tok, mask = np.repeat(tok, width, axis=0), np.repeat(mask, width, axis=0)
        return (np.concatenate([tok, tokens[:, :start]], axis=1).astype(np.int32),
                np.concatenate([mask, np.ones((len(mask), start), bool)], axis=1))

    def _finish_stopped(self) -> None:
        """Trees complete now: all levels grown, or every path stopped (the remaining levels
        would only copy them): their leaves laid out (each path repeated, as forks copy a
        stopped path) and their completion step recorded."""
        occupied = (self.serial >= 0) & (self.completed_at < 0)
        for j in np.flatnonzero(occupied & (self.level > 0)):
            w = self.width(min(int(self.level[j]), self.depth + 1))
            if self.level[j] <= self.depth and not self.done[j, :w].all():
                continue
            for name in ("tokens", "logps", "versions", "lengths", "done"):
                x = getattr(self, name)
                x[j] = np.repeat(x[j, :w], self.g // w, axis=0)
            self.level[j], self.completed_at[j] = self.depth + 1, self.clock

    def _drop_stale(self, version: int, max_staleness: int | None) -> int:
        """Restarts every tree holding a token older than ``version - max_staleness``; returns
        the paths discarded (those that had tokens)."""
        if max_staleness is None:
            return 0
        dropped = 0
        for j in np.flatnonzero(self.serial >= 0):
            drawn = self.versions[j][self.versions[j] >= 0]
            if drawn.size and version - int(drawn.min()) > max_staleness:
                w = self.width(min(int(self.level[j]), self.depth + 1))
                dropped += int((self.lengths[j, :w] > 0).sum())
                self._clear(j)
        return dropped

    def _take(self, want: int, dropped: int, work: tuple, drawn: int) -> Taken:
        """The first ``want`` complete trees, out of the pool; ``work``: the run's decode
        steps, useful steps and slot steps."""
        places = np.flatnonzero(self._complete())
        places = sorted(places, key=lambda j: (self.completed_at[j], self.serial[j]))[:want]
        # Each tree's first ``sizes`` leaves (its live roots' subtrees, root-major).
        rows = {name: np.concatenate([getattr(self, name)[j, :self.sizes[j]] for j in places])
                for name in ("tokens", "logps", "versions", "lengths", "done")}
        rows.update(mask=np.arange(self.n)[None, :] < rows["lengths"][:, None],
                    truncated=~rows.pop("done"))
        taken = Taken(rows=rows, prompts=[self.prompts[j] for j in places],
                      metas=[self.metas[j] for j in places], places=[int(j) for j in places],
                      dropped_stale=dropped, decode_steps=work[0], useful_steps=work[1],
                      drawn=drawn, decoded=self.decoded[places].copy(), slot_steps=work[2],
                      sizes=[int(self.sizes[j]) for j in places])
        for j in places:
            self._clear(j)
            self.serial[j], self.prompts[j], self.metas[j] = -1, None, None
        return taken

    # -- checkpoints ---------------------------------------------------------------------------

    _ARRAYS = ("serial", "completed_at", "level", "decoded", "tokens", "logps", "versions",
               "lengths", "done", "sizes")

    def state_dict(self) -> dict:
        """JSON-able host state (arrays as base64 bytes): everything ``run`` continues from."""
        return pool_state(self)

    load_state_dict = Pool.load_state_dict   # (saved before trees had sizes: all M)
