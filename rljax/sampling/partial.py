"""Partial rollouts: a pool of prompt groups whose unfinished samples carry over to the next
iteration, decoded by the slot engine under whatever parameters the caller passes.

    pool = partial.Pool(cfg, num_samples=G, max_new_tokens=N, groups=2 * B, prompt_len=P,
                        slots=S, chunk_steps=K, eos_id=tok.eos_id, pad_id=tok.pad_id)
    places = pool.admit(prompt_ids, metas)   # new groups take the free places
    taken = pool.run(params, key, version=k, want=B, max_staleness=2)
    # taken.rows: tokens/logps/versions/mask [B*G, N], lengths/truncated [B*G] (group-major),
    # taken.prompts / taken.metas / taken.places: the B groups' prompt ids, the caller's data
    # and the places they held

One ``run`` is one training iteration's sampling. It

1. **drops stale groups**: a group holding a sample whose oldest token is more than
   ``max_staleness`` versions old restarts from its prompt (all G samples: the group's
   advantage compares samples of the same policy window), its discarded samples counted;
2. **re-prefills under the new parameters** (one program): the prompt pages, the first token
   of every sample not begun yet, and the slot caches of the samples that were decoding when
   the last run stopped (their prompt and tokens so far through the model). A carried sample
   therefore continues from key/value entries of the current weights, as AReaL recomputes
   its interrupted requests' caches, and every token it produces here is exactly a draw of
   the policy of version ``version`` given its prefix;
3. **decodes in chunks** (``engine.decode_chunk``) until ``want`` groups are complete (all G
   samples stopped or at ``max_new_tokens``), checked after every chunk; the first ``want``
   to complete (by chunk, then by admission) are taken out, the rest stay in their slots.

Every token keeps the version that drew it and its log-prob under that policy (the behaviour
log-prob the loss corrects against). Randomness depends only on (key, group serial, sample,
token index): token t of sample g of the group admitted s-th reads
``draw_noise(fold_in(fold_in(fold_in(key, s), g), t), 1, V)``, whatever slot, chunk or
iteration it is drawn in; a restarted group reads the same noise under newer weights.

All state is host arrays (``state_dict``, JSON-able): the device caches are rebuilt from the
tokens at every run, so a run restored from a checkpoint continues exactly as one that never
stopped. Several processes (SPMD) each hold the same pool and take the same steps: every
decision reads the programs' global outputs (``engine``'s docstring).

Images in the prompt (a model with a vision tower): ``run(..., image_embeds=E)``, E [C, K, D]
the embeddings of each place's images under ``params`` (the caller keeps the pixels per place,
``admit``'s and ``Taken``'s places say which). The prefill merges them into the prompt pages
and into the resumed samples' rebuilt caches, as the slot engine's prefill does.
"""
from __future__ import annotations

import base64
import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rljax import distributed as dist, models
from rljax.models import paged
from rljax.models import transformer as tfm
from rljax.sampling import engine
from rljax.sampling.core import merge_stop_ids
from rljax.sampling.draw import NOISE_AHEAD_MAX_ELEMENTS, draw_noise, noise_ahead_size


@dataclasses.dataclass
class Taken:
    """The groups one ``Pool.run`` hands out (group-major rows, ``want * G`` of them).

    rows: tokens int32 [R, N], logps f32 [R, N] (behaviour log-probs), versions int32 [R, N]
    (the version that drew each token, -1 past the end), mask bool [R, N], lengths int32 [R],
    truncated bool [R]. prompts: each group's prompt ids; metas: what ``admit`` was given;
    places: the places the groups held (free again now); sizes: each group's rows (groups
    admitted with sizes of their own, ``admit(..., sizes=)``; else all G).
    dropped_stale: samples discarded for staleness in this run; decode_steps / useful_steps:
    the chunks' steps and the tokens they produced (slot utilisation); drawn: every token
    this run drew, first tokens included, in any group (the run's sampling work).
    decoded int [want] (``sampling.tree_partial``): each group's decoded tokens, a tree's
    shared segments once; slot_steps: slots x decode steps of its engine calls (None: the
    pool's slots x ``decode_steps``); swaps: how often in-flight weights changed between the
    run's decode chunks (``run(weights=)``)."""
    rows: dict
    prompts: list
    metas: list
    places: list
    dropped_stale: int
    decode_steps: int
    useful_steps: int
    drawn: int
    sizes: list = dataclasses.field(default_factory=list)
    decoded: np.ndarray | None = None
    slot_steps: int | None = None
    swaps: int = 0


class Pool:
    """``groups`` places of G samples each, on the host; see the module docstring."""

    def __init__(self, cfg: models.ModelConfig, *, num_samples: int, max_new_tokens: int,
                 groups: int, prompt_len: int, slots: int, chunk_steps: int,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 eos_id: int | Sequence[int] | None = None, pad_id: int = 0,
                 stop_ids: Sequence[int] = (), min_new_tokens: int = 0,
                 temperatures: Any = None, cache_dtype: Any = None):
        g, n, c = int(num_samples), int(max_new_tokens), int(groups)
        if min(g, n, c, prompt_len, slots, chunk_steps) < 1:
            raise ValueError("num_samples, max_new_tokens, groups, prompt_len, slots and "
                             "chunk_steps must be >= 1")
        self.cfg, self.g, self.n, self.c, self.p = cfg, g, n, c, int(prompt_len)
        self.s, self.chunk_steps = min(int(slots), c * g), int(chunk_steps)
        self.draw = dict(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                         stop_ids=merge_stop_ids(eos_id, stop_ids), pad_id=int(pad_id),
                         min_new_tokens=int(min_new_tokens))
        self.temperatures = None if temperatures is None else jnp.asarray(temperatures,
                                                                          jnp.float32)
        self.greedy = self.temperatures is None and temperature == 0.0
        if not self.greedy and noise_ahead_size(n, c * g, cfg.vocab_size) > \
                NOISE_AHEAD_MAX_ELEMENTS:
            raise ValueError(f"the partial-rollout pool draws its noise ahead; {n} tokens x "
                             f"{c * g} rows x vocabulary {cfg.vocab_size} exceed "
                             "NOISE_AHEAD_MAX_ELEMENTS")
        self.cache_dtype = None if cache_dtype is None else jnp.dtype(cache_dtype).name
        self.reset()

    # -- host state ----------------------------------------------------------------------------

    def reset(self) -> None:
        r, n = self.c * self.g, self.n
        self.serial = np.full(self.c, -1, np.int64)          # admission order; -1 = free
        self.sizes = np.full(self.c, self.g, np.int64)       # each group's rows (<= G)
        self.completed_at = np.full(self.c, -1, np.int64)    # chunk clock at completion
        self.prompts: list = [None] * self.c
        self.metas: list = [None] * self.c
        self.tokens = np.full((r, n), self.draw["pad_id"], np.int32)
        self.logps = np.zeros((r, n), np.float32)
        self.versions = np.full((r, n), -1, np.int32)
        self.lengths = np.zeros(r, np.int32)
        self.done = np.zeros(r, bool)
        self.next_serial = 0
        self.clock = 0   # decode chunks run so far: orders completions across runs

    @property
    def free(self) -> int:
        """Group places without a group."""
        return int((self.serial < 0).sum())

    def admit(self, prompts: Sequence[Sequence[int]], metas: Sequence[Any],
              sizes: Sequence[int] | None = None) -> list[int]:
        """New groups (prompt ids, at most ``prompt_len`` each; ``metas``: anything the caller
        wants back with the group) in the free places, in order; returns those places.
        ``sizes``: each group's rows, 1 to G (knapsack allocation; default G): the rows past
        a group's size are never drawn."""
        places = np.flatnonzero(self.serial < 0)
        sizes = [self.g] * len(prompts) if sizes is None else [int(k) for k in sizes]
        if len(prompts) > len(places) or not len(prompts) == len(metas) == len(sizes):
            raise ValueError(f"admit: {len(prompts)} groups for {len(places)} free places")
        for j, ids, meta, size in zip(places, prompts, metas, sizes):
            if not 0 < len(ids) <= self.p or not 0 < size <= self.g:
                raise ValueError(f"admit: a prompt of {len(ids)} tokens (1 to {self.p} fit), "
                                 f"{size} rows (1 to {self.g})")
            self.serial[j], self.next_serial = self.next_serial, self.next_serial + 1
            self.prompts[j], self.metas[j], self.sizes[j] = [int(t) for t in ids], meta, size
            self._clear(j)
        return [int(j) for j in places[:len(prompts)]]

    def _rows(self, j) -> slice:
        return slice(j * self.g, (j + 1) * self.g)

    def _clear(self, j) -> None:
        rows = self._rows(j)
        self.tokens[rows], self.logps[rows], self.versions[rows] = self.draw["pad_id"], 0.0, -1
        self.lengths[rows], self.completed_at[j] = 0, -1
        self.done[rows] = np.arange(self.g) >= self.sizes[j]   # rows past its size: never drawn

    def _finished(self) -> np.ndarray:
        return self.done | (self.lengths >= self.n)

    def _complete(self) -> np.ndarray:
        """bool [C]: occupied places whose G samples have all finished."""
        return (self.serial >= 0) & self._finished().reshape(self.c, self.g).all(-1)

    # -- one iteration -------------------------------------------------------------------------

    def run(self, params: Any, key: jax.Array, *, version: int, want: int,
            max_staleness: int | None = None, image_embeds: Any = None,
            weights=None) -> Taken:
        """Decodes under ``params`` (policy ``version``) until ``want`` groups are complete and
        hands those out (see the module docstring). ``key``: the run's pool key, the same at
        every call (randomness is keyed by admission serial, not by iteration).
        ``image_embeds`` [C, K, D]: each place's prompt images (a model with a vision tower).
        ``weights`` (in-flight weight updates): ``() -> (params, version)``, polled between
        decode chunks as ``engine.generate`` polls it; the next chunk decodes with what it
        returns (the slots keep their caches, the pages stay the prefill's) and each token
        keeps the version that drew it."""
        if want > int((self.serial >= 0).sum()):
            raise ValueError(f"run: want={want} groups but {int((self.serial >= 0).sum())} "
                             "are in the pool")
        c, g, n, s = self.c, self.g, self.n, self.s
        dropped = self._drop_stale(version, max_staleness)
        order = self._row_order()
        # Samples that were decoding when the last run stopped (2+ tokens): back into slots,
        # their caches rebuilt. Those with one token rejoin the queue (their first feed writes
        # slot index 0); unbegun ones draw their first token in the prefill.
        fin = self._finished()
        resumed = [r for r in order if self.lengths[r] >= 2 and not fin[r]]
        assert len(resumed) <= s, "more samples mid-decode than slots"
        fed_tokens = np.zeros((s, n), np.int32)
        fed_len = np.zeros(s, np.int32)
        fed_page = np.zeros(s, np.int32)
        for i, r in enumerate(resumed):
            fed_tokens[i], fed_len[i], fed_page[i] = self.tokens[r], self.lengths[r], r // g
        p_tok, p_mask = self._prompt_arrays()
        pages, first, first_logp, first_stop, noise, cache = _pool_prefill(
            self.cfg, params, jnp.asarray(p_tok), jnp.asarray(p_mask), key,
            jnp.asarray(np.repeat(np.maximum(self.serial, 0), g).astype(np.int32)),
            jnp.asarray(np.tile(np.arange(g, dtype=np.int32), c)), jnp.asarray(fed_tokens),
            jnp.asarray(fed_len), jnp.asarray(fed_page), self.temperatures, image_embeds,
            num_samples=g, max_new_tokens=n, greedy=self.greedy, cache_dtype=self.cache_dtype,
            **self.draw)
        first, first_logp, first_stop = dist.to_host_tree((first, first_logp, first_stop))
        new = (self.lengths == 0) & ~self.done & np.repeat(self.serial >= 0, g)
        self.tokens[new, 0], self.logps[new, 0] = first[new], first_logp[new]
        self.versions[new, 0], self.lengths[new], self.done[new] = version, 1, first_stop[new]
        before = self.lengths.copy()
        self._mark_complete()
        fin = self._finished()
        queue = np.asarray([r for r in order if self.lengths[r] == 1 and not fin[r]], np.int32)
        active = np.zeros(s, bool)
        active[:len(resumed)] = True
        slot_state = (jnp.asarray(np.pad(np.asarray(resumed, np.int32), (0, s - len(resumed)))),
                      jnp.asarray(fed_len), jnp.asarray(
                          np.asarray([self.tokens[r, self.lengths[r] - 1] for r in resumed]
                                     + [0] * (s - len(resumed)), np.int32)),
                      jnp.asarray(active), jnp.int32(0))
        out = dict(tokens=jnp.asarray(self.tokens), logps=jnp.asarray(self.logps),
                   lengths=jnp.asarray(self.lengths), done=jnp.asarray(self.done))
        page_mask = jnp.asarray(p_mask)
        page_len = jnp.asarray(p_mask.sum(-1).astype(np.int32))
        first_dev = jnp.asarray(self.tokens[:, 0])
        queue_dev = jnp.asarray(np.pad(queue, (0, c * g - queue.size)))
        steps, busy, swaps = 0, bool(len(resumed) or queue.size), 0
        layers = engine.unstacked(params)   # once per version, not per chunk
        span = np.arange(n)[None, :]
        while busy and int(self._complete().sum()) < want:
            if weights is not None and steps:   # new weights enter between decode chunks
                params, now = weights()
                if now != version:
                    layers, version, swaps = engine.unstacked(params), now, swaps + 1
            was = self.lengths.copy()
            cache, out, slot_state, ran, busy = engine.decode_chunk(
                self.cfg, layers, pages, page_mask, page_len, cache, out, slot_state,
                first_dev, queue_dev, jnp.int32(queue.size), noise, self.temperatures,
                max_new_tokens=n, num_samples=g, chunk_steps=self.chunk_steps, **self.draw)
            self.clock += 1
            lengths, done, ran, busy = dist.to_host_tree((out["lengths"], out["done"], ran,
                                                         busy))
            self.lengths[:], self.done[:] = lengths, done
            steps, busy = steps + int(ran), bool(busy)
            self.versions[(span >= was[:, None]) & (span < lengths[:, None])] = version
            self._mark_complete()
        if steps:
            self.tokens[:], self.logps[:] = dist.to_host_tree((out["tokens"], out["logps"]))
        useful = int((self.lengths - before).sum())
        return dataclasses.replace(
            self._take(want, dropped, steps, useful, useful + int(new.sum())), swaps=swaps)

    def _row_order(self) -> list[int]:
        """Occupied rows, oldest group first (admission serial), then by sample index."""
        places = sorted(np.flatnonzero(self.serial >= 0), key=lambda j: self.serial[j])
        return [int(j) * self.g + k for j in places for k in range(self.g)]

    def _prompt_arrays(self):
        """Left-padded prompts [C, P] and masks; a free place gets a one-token dummy prompt
        (its page is never read: no row of it is queued)."""
        tok = np.full((self.c, self.p), self.draw["pad_id"], np.int32)
        mask = np.zeros((self.c, self.p), bool)
        mask[:, -1] = True
        for j, ids in enumerate(self.prompts):
            if ids is not None and self.serial[j] >= 0:
                tok[j, self.p - len(ids):], mask[j, self.p - len(ids):] = ids, True
        return tok, mask

    def _mark_complete(self) -> None:
        newly = self._complete() & (self.completed_at < 0)
        self.completed_at[newly] = self.clock

    def _drop_stale(self, version: int, max_staleness: int | None) -> int:
        """Restarts every group holding a token older than ``version - max_staleness``;
        returns the samples discarded (those that had tokens)."""
        if max_staleness is None:
            return 0
        oldest = np.where(self.lengths > 0, self.versions[:, 0], version)
        stale = ((version - oldest) > max_staleness).reshape(self.c, self.g).any(-1)
        stale &= self.serial >= 0
        dropped = 0
        for j in np.flatnonzero(stale):
            dropped += int((self.lengths[self._rows(j)] > 0).sum())
            self._clear(j)
        return dropped

    def _take(self, want: int, dropped: int, steps: int, useful: int, drawn: int) -> Taken:
        places = np.flatnonzero(self._complete())
        places = sorted(places, key=lambda j: (self.completed_at[j], self.serial[j]))[:want]
        rows = np.concatenate([np.arange(j * self.g, j * self.g + self.sizes[j])
                               for j in places])
        mask = np.arange(self.n)[None, :] < self.lengths[rows][:, None]
        out = dict(tokens=self.tokens[rows].copy(), logps=self.logps[rows].copy(),
                   versions=self.versions[rows].copy(), mask=mask,
                   lengths=self.lengths[rows].copy(), truncated=~self.done[rows])
        taken = Taken(rows=out, prompts=[self.prompts[j] for j in places],
                      metas=[self.metas[j] for j in places],
                      places=[int(j) for j in places], dropped_stale=dropped,
                      decode_steps=steps, useful_steps=useful, drawn=drawn,
                      sizes=[int(self.sizes[j]) for j in places])
        for j in places:
            self._clear(j)
            self.serial[j], self.prompts[j], self.metas[j] = -1, None, None
        return taken

    # -- checkpoints ---------------------------------------------------------------------------

    _ARRAYS = ("serial", "completed_at", "tokens", "logps", "versions", "lengths", "done",
               "sizes")

    def state_dict(self) -> dict:
        """JSON-able host state (arrays as base64 bytes): everything ``run`` continues from."""
        return pool_state(self)

    def load_state_dict(self, state: dict) -> None:
        if "sizes" not in state:   # (saved before groups had sizes: all G)
            state = {**state, "sizes": encode_array(np.full(self.c, self.g, np.int64))}
        load_pool_state(self, state)


def pool_state(pool) -> dict:
    """A pool's host state, JSON-able: its ``_ARRAYS`` (base64 bytes), prompts, metas, the
    next admission serial and its clock (``Pool``, ``tree_partial.TreePool``)."""
    out = {k: encode_array(getattr(pool, k)) for k in pool._ARRAYS}
    out.update(prompts=pool.prompts, metas=pool.metas, next_serial=pool.next_serial,
               clock=pool.clock)
    return out


def load_pool_state(pool, state: dict) -> None:
    """Sets ``pool``'s host state from ``pool_state``'s dict; ValueError when an array's shape
    is not the one this pool's config makes."""
    for k in pool._ARRAYS:
        value = decode_array(state[k])
        if value.shape != getattr(pool, k).shape:
            raise ValueError(f"the saved partial-rollout pool has {k} of shape {value.shape}, "
                             f"this config makes {getattr(pool, k).shape}")
        setattr(pool, k, value)
    pool.prompts, pool.metas = list(state["prompts"]), list(state["metas"])
    pool.next_serial, pool.clock = int(state["next_serial"]), int(state["clock"])


def encode_array(x: np.ndarray) -> dict:
    """A numpy array as JSON-able ``{dtype, shape, data (base64 bytes)}``, exact."""
    x = np.ascontiguousarray(x)
    return {"dtype": x.dtype.str, "shape": list(x.shape),
            "data": base64.b64encode(x.tobytes()).decode("ascii")}


def decode_array(d: dict) -> np.ndarray:
    """The array ``encode_array`` encoded."""
    raw = base64.b64decode(d["data"])
    return np.frombuffer(raw, np.dtype(d["dtype"])).reshape(d["shape"]).copy()


# ----------------------------------------------------------------------------- programs

def row_noise(key: jax.Array, serial: jax.Array, sample: jax.Array, n: int, vocab: int):
    """float32 [n, R, W]: token t of row r reads
    ``draw_noise(fold_in(fold_in(fold_in(key, serial[r]), sample[r]), t), 1, vocab)``."""
    def row(s, g):
        k = jax.random.fold_in(jax.random.fold_in(key, s), g)
        return jax.vmap(lambda t: draw_noise(jax.random.fold_in(k, t), 1, vocab)[0])(
            jnp.arange(n))
    return jnp.swapaxes(jax.vmap(row)(serial, sample), 0, 1)


@functools.partial(jax.jit, static_argnames=("cfg", "num_samples", "max_new_tokens", "greedy",
                                             "cache_dtype") + engine.DRAW_ARGS)
def _pool_prefill(cfg, params, prompt_tokens, prompt_mask, key, serial, sample, fed_tokens,
                  fed_len, fed_page, temperatures, image_embeds=None, *, num_samples,
                  max_new_tokens, greedy, cache_dtype, temperature, top_k, top_p, stop_ids,
                  pad_id, min_new_tokens):
    """The pool's pages [C], every row's first-token draw [R], the rows' noise and the slot
    caches of the resumed samples (``fed_*`` [S]: tokens so far, their count, their page);
    ``image_embeds`` [C, K, D] (or None): each page's prompt images."""
    n, p = max_new_tokens, prompt_tokens.shape[1]
    noise = None if greedy else row_noise(key, serial, sample, n, cfg.vocab_size)
    pages, logits = paged.prefill_pages(cfg, params, prompt_tokens, prompt_mask, cache_dtype,
                                        image_embeds)
    logits = jnp.repeat(logits, num_samples, axis=0)
    rows = logits.shape[0]
    pick, is_stop = engine.picker(temperature, top_k, top_p, stop_ids, min_new_tokens, noise,
                                  temperatures, None)
    tok, logp = pick(logits, jnp.zeros((rows,), jnp.int32), jnp.arange(rows))
    # A resumed sample's prompt and tokens so far, through the model once: its slot cache is
    # the completion part (index j = token j, as the decode step writes it).
    seq = jnp.concatenate([prompt_tokens[fed_page], fed_tokens], axis=1)
    mask = jnp.concatenate([prompt_mask[fed_page],
                            jnp.arange(n)[None, :] < fed_len[:, None]], axis=1)
    cache = tfm.init_cache(cfg, seq.shape[0], p + n, dtype=cache_dtype)
    _, cache = tfm.trunk(cfg, params, seq, attention_mask=mask,
                         positions=tfm.default_positions(mask), cache=cache, cache_index=0,
                         image_embeds=None if image_embeds is None else image_embeds[fed_page])
    cache = {k: tuple(x[:, :, p:] for x in c) for k, c in tfm.unstack_cache(cache).items()}
    return pages, tok, logp, is_stop(tok), noise, cache


def programs(pool: Pool, params: Any, key: Any,
             image_embeds: Any = None) -> list[tuple[str, Any, tuple]]:
    """The pool's two programs for a memory plan, ``[(name, jitted fn, abstract args)]``:
    ``prefill`` (pages, first tokens, noise, resumed slot caches) and ``decode`` (one chunk
    over the pool's rows). ``params``/``key`` (and ``image_embeds`` [C, K, D], a model with a
    vision tower) may be ``jax.ShapeDtypeStruct``s."""
    c, g, n, s, p = pool.c, pool.g, pool.n, pool.s, pool.p
    r = c * g
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    b1 = lambda *shape: jax.ShapeDtypeStruct(shape, bool)
    temps = (None if pool.temperatures is None else
             jax.ShapeDtypeStruct(pool.temperatures.shape, jnp.float32))
    static = dict(num_samples=g, max_new_tokens=n, greedy=pool.greedy,
                  cache_dtype=pool.cache_dtype, **pool.draw)

    def prefill(params, tok, mask, key, serial, sample, fed_tokens, fed_len, fed_page, temps,
                image_embeds=None):
        return _pool_prefill(pool.cfg, params, tok, mask, key, serial, sample, fed_tokens,
                             fed_len, fed_page, temps, image_embeds, **static)

    pre_args = (params, i32(c, p), b1(c, p), key, i32(r), i32(r), i32(s, n), i32(s), i32(s),
                temps) + (() if image_embeds is None else (image_embeds,))
    pages, first, _, _, noise, cache = jax.eval_shape(prefill, *pre_args)
    out = dict(tokens=i32(r, n), logps=jax.ShapeDtypeStruct((r, n), jnp.float32),
               lengths=i32(r), done=b1(r))
    slot_state = (i32(s), i32(s), i32(s), b1(s), i32())

    def decode(params, pages, page_mask, page_len, cache, out, slot_state, first, queue,
               queued, noise, temps):
        return engine.decode_chunk(pool.cfg, params, pages, page_mask, page_len, cache, out,
                                   slot_state, first, queue, queued, noise, temps,
                                   max_new_tokens=n, num_samples=g,
                                   chunk_steps=pool.chunk_steps, **pool.draw)

    return [("prefill", jax.jit(prefill), pre_args),
            ("decode", jax.jit(decode, donate_argnums=(4, 5)),
             (params, pages, b1(c, p), i32(c), cache, out, slot_state, first, i32(r), i32(),
              noise, temps))]
