"""Host-planned micro-batches of the GRPO update: it computes on what is real.

Every GRPO update runs here (``phases.grpo.build_update``). Two options, alone or together:
``algo.group_by_length`` (below) and ``algo.shared_prompt`` (``Planner``, ``shared_layout``:
micro-batches of whole groups of G rows, each group's prompt computed once by
``models.shared_prompt``); with neither, the micro-batches are the batch's rows in order.

The rollout lays every row of a batch out alike: the prompt left-padded to one bucket P, then
the completion slot N, right-padded after the stop token (``rollout.build_sequences``). Each
micro-batch of the update then computes all P+N positions of its rows, however short they are.

``plan`` sorts the rows by real length on the host (stable: deterministic) and cuts them into
micro-batches of similar rows; each keeps only the columns that hold a real token of one of its
rows, rounded out to a bucket (``buckets.prompt_buckets`` of P for the prompt side, of N for the
completion side), so the number of shapes -- compiled programs -- stays bounded (at most
``len(prompt_buckets(P)) * len(prompt_buckets(N))``, each compiled once and kept in the
persistent compilation cache).

``GroupedUpdate`` runs one exact update over such micro-batches. A ``lax.scan`` cannot carry
micro-batches of different shapes, so a jitted micro-step per shape adds each micro-batch's
numerator gradients, numerators, weights and metric pairs (``steps.micro_grads``) into a
carried total (donated; a stream with one micro-batch takes its gradients as its total), and
one apply step divides by the total weight and steps the optimizer
(``steps.apply_accumulated``); the controller dispatches them asynchronously. These
are the same sums as ``steps.update``'s, taken in another order: equal up to float32 summation
order. Dropped columns are padding (attention mask False, loss mask False): a real token never
attends to them, so its log-prob does not change.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from rljax import compilation_cache, distributed as dist, streams as streams_lib
from rljax import sharding as shd
from rljax.models import lora as lora_lib
from rljax.train.core import steps
from rljax.train.core.buckets import prompt_buckets

# [R, P+N, ...] (routes: [R, P+N, L, k], routing replay); other 2-D fields of width N are per
# completion position.
SEQUENCE_KEYS = ("tokens", "mask", "routes")
PER_ROW_KEYS = ("pixels",)           # [R, ...] whatever their width: one prompt's images per row


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """Rows ``rows`` (int [m], indices into the batch) keeping the last ``prompt_cols`` prompt
    columns and the first ``completion_cols`` completion columns."""
    rows: np.ndarray
    prompt_cols: int
    completion_cols: int


def real_extents(mask: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """mask bool [R, P+N] -> (int [R] columns from a row's first real prompt token to the end
    of the prompt, int [R] completion columns up to and including its last real token)."""
    mask = np.asarray(mask, bool)
    p = mask.shape[1] - n
    prompt, completion = mask[:, :p], mask[:, p:]
    first = np.where(prompt.any(1), prompt.argmax(1), p)
    last = np.where(completion.any(1), n - completion[:, ::-1].argmax(1), 0)
    return (p - first).astype(np.int64), last.astype(np.int64)


def bucket(length: int, limit: int) -> int:
    """The smallest of ``prompt_buckets(limit)`` holding ``length`` columns (at least one)."""
    return next(b for b in prompt_buckets(limit) if b >= max(int(length), 1))


def plan(mask: np.ndarray, n: int, num_micro: int, group_size: int = 1,
         by_length: bool = True) -> list[MicroBatch]:
    """``num_micro`` micro-batches of the rows of a batch (mask bool [R, P+N], N completion
    columns).

    ``by_length``: rows of similar real length together, shortest first, each micro-batch
    trimmed to the buckets of its longest prompt and completion; rows ordered by total real
    length, then prompt length, then index. Otherwise in batch order, untrimmed.
    ``group_size`` G > 1 (whole micro-batches of G-row groups possible): groups of G
    consecutive rows stay together and are ordered by their longest row, so that a
    micro-batch can compute each group's shared prompt once (``shared_layout``)."""
    r = mask.shape[0]
    if r % num_micro:
        raise ValueError(f"batch of {r} is not divisible into {num_micro} micro-batches")
    micro_size = r // num_micro
    g = group_size if group_size > 1 and micro_size % group_size == 0 else 1
    p = mask.shape[1] - n
    prompt_len, completion_len = real_extents(mask, n)
    unit_prompt = prompt_len.reshape(-1, g).max(1)
    unit_completion = completion_len.reshape(-1, g).max(1)
    units = np.arange(r // g)
    if by_length:   # last key is primary
        units = np.lexsort((unit_prompt, unit_prompt + unit_completion))
    order = (units[:, None] * g + np.arange(g)[None]).reshape(-1)
    out = []
    for start in range(0, r, micro_size):
        rows = order[start:start + micro_size]
        if not by_length:
            out.append(MicroBatch(rows, p, n))
            continue
        out.append(MicroBatch(rows, bucket(prompt_len[rows].max(), p) if p else 0,
                              bucket(completion_len[rows].max(), n)))
    return out


def take(batch: dict, mb: MicroBatch, n: int) -> dict:
    """The micro-batch's rows and columns of a host batch (numpy leaves, rows on axis 0;
    ``tokens``/``mask`` [R, P+N], 2-D fields of width N per completion position, the rest
    per row)."""
    p, r = batch["tokens"].shape[1] - n, batch["tokens"].shape[0]
    out = {}
    for key, value in batch.items():
        if np.ndim(value) == 0 or value.shape[0] != r:
            raise ValueError(f"length_groups: batch field {key!r} of shape {np.shape(value)} "
                             f"has no row axis of {r}")
        value = value[mb.rows]
        if key in SEQUENCE_KEYS:
            value = value[:, p - mb.prompt_cols:p + mb.completion_cols]
        elif key not in PER_ROW_KEYS and value.ndim >= 2 and value.shape[1] == n:
            value = value[:, :mb.completion_cols]
        out[key] = value
    return out


def shared_layout(part: dict, completion_cols: int, group_size: int) -> dict | None:
    """A micro-batch (``take``'s output, rows group-contiguous) in the shared-prompt layout --
    ``prompt_tokens``/``prompt_mask`` [R/G, P'] once per group of G rows, ``tokens``/``mask``
    [R, N'] the completion columns, other fields as they are (``steps.completion_logps`` then
    runs ``models.shared_prompt``) -- or None when some group's rows differ in their prompt
    columns (then each row computes its own prompt)."""
    tokens, mask = part["tokens"], np.asarray(part["mask"], bool)
    r, width = tokens.shape
    p = width - completion_cols
    if group_size < 2 or p == 0 or r % group_size:
        return None
    prompt = tokens[:, :p].reshape(-1, group_size, p)
    prompt_mask = mask[:, :p].reshape(-1, group_size, p)
    if not ((prompt == prompt[:, :1]).all() and (prompt_mask == prompt_mask[:, :1]).all()):
        return None
    if not prompt_mask[:, 0, -1].all():   # a prompt must end in its last column (left padding)
        return None
    out = {**part, "prompt_tokens": prompt[:, 0], "prompt_mask": prompt_mask[:, 0],
           "tokens": tokens[:, p:], "mask": mask[:, p:]}
    if "pixels" in part:   # a group's rows share their prompt's images
        out["pixels"] = part["pixels"][::group_size]
    if "routes" in part:   # routing replay: the prompt's routes once per group (the sampler
        #                    prefilled it once, so a group's rows recorded the same ones)
        routes = np.asarray(part["routes"])
        prompt_routes = routes[:, :p].reshape((-1, group_size, p) + routes.shape[2:])
        prompt_routes = np.where(prompt_mask[..., None, None], prompt_routes, 0)
        if not (prompt_routes == prompt_routes[:, :1]).all():
            return None
        out["prompt_routes"] = prompt_routes[:, 0]
        out["routes"] = routes[:, p:]
    return out


def ragged_layout(part: dict, completion_cols: int, prompts: int) -> dict | None:
    """A micro-batch whose rows come from at most ``prompts`` distinct prompts, in any order
    and groups of any sizes (knapsack allocation), in the shared-prompt layout:
    ``prompt_tokens``/``prompt_mask`` [prompts, P'] (each distinct prompt once, the last one
    repeated to fill), ``prompt_index`` int32 [R] (each row's prompt), ``tokens``/``mask`` [R,
    N']; None when there are more distinct prompts or a prompt does not end in its last
    column."""
    tokens, mask = part["tokens"], np.asarray(part["mask"], bool)
    p = tokens.shape[1] - completion_cols
    if p == 0 or "pixels" in part or "routes" in part or not mask[:, p - 1].all():
        return None
    key = np.concatenate([np.where(mask[:, :p], tokens[:, :p], -1), mask[:, :p]], axis=1)
    _, first, index = np.unique(key, axis=0, return_index=True, return_inverse=True)
    if first.size > prompts:
        return None
    first = np.concatenate([first, np.full(prompts - first.size, first[-1])])
    return {**part, "prompt_tokens": tokens[first, :p], "prompt_mask": mask[first, :p],
            "prompt_index": index.reshape(-1).astype(np.int32),
            "tokens": tokens[:, p:], "mask": mask[:, p:]}


def computed_positions(part: dict) -> tuple[int, int]:
    """(real tokens, positions) the forward over one micro-batch computes."""
    real = int(np.asarray(part["mask"], bool).sum())
    positions = int(np.size(part["mask"]))
    if "prompt_mask" in part:
        real += int(np.asarray(part["prompt_mask"], bool).sum())
        positions += int(np.size(part["prompt_mask"]))
    return real, positions


def token_efficiency(parts: list[dict]) -> float:
    """Real tokens / positions the grouped update computes (a shared prompt counts once)."""
    real, positions = np.sum([computed_positions(p) for p in parts], axis=0)
    return float(real / max(positions, 1))


@dataclasses.dataclass(frozen=True)
class Planner:
    """How a host batch is cut into micro-batches: ``num_micro`` of them; ``by_length``
    (``algo.group_by_length``: sorted and trimmed, see ``plan``); ``group_size`` G > 1
    (``algo.shared_prompt``): groups of G rows kept together and, where their prompt columns
    are equal, each group's prompt computed once (``shared_layout``). ``prompts`` P > 0
    (knapsack allocation's groups of any sizes, with ``algo.shared_prompt``): the batch
    holds P prompts, and each micro-batch computes each of its distinct prompts once
    (``ragged_layout``; on one batch shard). ``mesh``: a shared micro-batch's prompt rows
    must split over the batch axes too."""
    num_micro: int = 1
    by_length: bool = True
    group_size: int = 1
    mesh: object = None
    prompts: int = 0

    def parts(self, batch: dict, n: int) -> list[tuple[MicroBatch, dict]]:
        """[(micro-batch, its host arrays in the layout the step computes)] of a host batch
        with N completion columns."""
        out = []
        for mb in plan(batch["mask"], n, self.num_micro, self.group_size, self.by_length):
            part = take(batch, mb, n)
            shared = shared_layout(part, mb.completion_cols, self.group_size)
            if shared is not None and len(mb.rows) // self.group_size % self._shards() == 0:
                part = shared
            elif self._ragged_prompts(len(mb.rows)):
                part = ragged_layout(part, mb.completion_cols,
                                     self._ragged_prompts(len(mb.rows))) or part
            out.append((mb, part))
        return out

    def _ragged_prompts(self, rows: int) -> int:
        """The prompt rows of a ``rows``-row micro-batch in the ragged layout; 0 = not used
        (no ``prompts``, or several batch shards: a row's prompt may live on another)."""
        if not self.prompts or self._shards() != 1:
            return 0
        return min(self.prompts, rows)

    def abstract_part(self, rows: int, p: int, n: int, fields: dict) -> dict:
        """The inputs (``jax.ShapeDtypeStruct``; with a mesh split over its batch axes, as the
        steps take them) of the largest micro-batch ``parts`` makes of a ``rows``-row batch with
        prompt bucket P and N completion columns: rows whose real tokens fill all P + N columns
        (nothing to trim), in the shared-prompt layout wherever ``parts`` uses it (prompts
        [m/G, P], completion columns [m, N]). ``fields``: the batch's other fields,
        {name: (shape after the row axis, dtype)}."""
        m, g = rows // self.num_micro, self.group_size
        shapes = {k: ((m, p + n, *tail[1:]) if k in SEQUENCE_KEYS else (m, *tail), dtype)
                  for k, (tail, dtype) in fields.items()}
        if g > 1 and p > 0 and m % g == 0 and (m // g) % self._shards() == 0:
            shapes.update(prompt_tokens=((m // g, p), jnp.int32), prompt_mask=((m // g, p), bool),
                          tokens=((m, n), jnp.int32), mask=((m, n), bool))
            if "pixels" in shapes:
                shapes["pixels"] = ((m // g, *shapes["pixels"][0][1:]), shapes["pixels"][1])
            if "routes" in shapes:
                (_, _, *tail), dtype = shapes["routes"]
                shapes.update(prompt_routes=((m // g, p, *tail), dtype),
                              routes=((m, n, *tail), dtype))
        elif (p > 0 and self._ragged_prompts(m) and "pixels" not in shapes
              and "routes" not in shapes):
            u = self._ragged_prompts(m)
            shapes.update(prompt_tokens=((u, p), jnp.int32), prompt_mask=((u, p), bool),
                          prompt_index=((m,), jnp.int32), tokens=((m, n), jnp.int32),
                          mask=((m, n), bool))
        else:
            shapes.update(tokens=((m, p + n), jnp.int32), mask=((m, p + n), bool))
        sharding = steps.batch_sharding(self.mesh)
        return {k: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)
                for k, (shape, dtype) in shapes.items()}

    def _shards(self) -> int:
        if self.mesh is None:
            return 1
        return math.prod(self.mesh.shape[a] for a in steps.BATCH_AXES if a in self.mesh.shape)


def _apply_totals(optimizer, state, totals: tuple):
    """``steps.apply_accumulated`` of the sum of the streams' totals, added in stream order
    (in the apply's program: no program of its own to compile)."""
    return steps.apply_accumulated(optimizer, state, functools.reduce(steps.add_micro, totals))


def stream_count(planner: Planner, streams: int, rows: int) -> int:
    """Streams for a batch of ``rows`` (``streams`` resolved, >= 1): the most, up to
    ``streams``, that cut each micro-batch into equal parts of whole groups (whole rows
    without shared prompts, or when a micro-batch holds no whole group: see ``plan``)."""
    micro = rows // planner.num_micro
    unit = planner.group_size if micro % planner.group_size == 0 else 1
    return streams_lib.largest_divisor(streams, micro, unit)


def stream_parts(planner: Planner, streams: int, batch: dict, n: int):
    """``(k, planner.parts(...))`` with every micro-batch cut into k = ``stream_count`` parts;
    stream j computes parts j, j + k, ..."""
    k = stream_count(planner, streams, batch["loss_mask"].shape[0])
    return k, dataclasses.replace(planner, num_micro=planner.num_micro * k).parts(batch, n)


class GroupedUpdate:
    """``update(state, batch) -> (state, metrics)``: one exact optimizer update of ``loss_fn``
    over the micro-batches of ``planner`` (see the module docstring).

    ``batch``: host arrays (or device arrays, fetched once) in the rollout layout, with
    ``loss_mask`` [R, N]. The loss sees the full completion width N as
    ``mb[steps.COMPLETION_SLOTS]`` (the constant normaliser of
    ``seq-mean-token-sum-norm``). With a mesh, each micro-batch's rows split over the batch
    axes like any batch (their size must divide over them, as for the scanned update).
    Metrics add ``update/token_efficiency`` (real / computed positions) and
    ``update/shared_prompt`` (fraction of micro-batches computing each prompt once).

    ``streams`` k > 1 (``rljax.streams``; resolved, not 0): every micro-batch is cut into k
    (``update_streams``: fewer where its rows or groups do not divide), and k threads each
    sum the gradients of every k-th of them into a total of their own, concurrently; the
    totals are added in stream order, so the result does not depend on timing."""

    def __init__(self, optimizer, loss_fn, planner: Planner, state_shardings=None,
                 streams: int = 1):
        self.loss_fn, self.planner, mesh = loss_fn, planner, planner.mesh
        self.streams = streams
        self._zeros_fns = {}   # batch layout -> jitted zero total (gradients, sums, metrics)
        self._apply_fns = {}   # stream count -> jitted apply of that many totals
        self._apply_totals = functools.partial(_apply_totals, optimizer)
        self._options = compilation_cache.training_compiler_options()
        self._shardings = None   # mesh: (state, total, replicated) shardings
        grads_shardings, micro_shardings = {}, {}
        if mesh is not None:
            rep = NamedSharding(mesh, PartitionSpec())
            total = (lora_lib.trainable(state_shardings.params), rep, rep, rep)
            self._shardings = (state_shardings, total, rep)
            batch = steps.batch_sharding(mesh)
            grads_shardings = dict(in_shardings=(state_shardings, batch, rep),
                                   out_shardings=total)
            micro_shardings = dict(in_shardings=(state_shardings, total, batch, rep),
                                   out_shardings=total)
        # One micro-batch's gradients, sums and metrics: a stream's total when it computes one
        # micro-batch (no zero total to make, no adds to compile). Also jitted bare to be
        # called inside ``_micro_step``, whose trace then reuses the one ``_zeros`` took for
        # its shapes (a second trace of the forward and backward cost ~0.3 s at the toy).
        # Traced on the mesh: the MoE dispatch splits the experts' work over it.
        grads, micro = shd.traced_on(self._micro_grads, mesh), shd.traced_on(self._micro_step, mesh)
        self._grads = jax.jit(grads, static_argnums=3,
                              compiler_options=self._options, **grads_shardings)
        self._grads_inner = jax.jit(grads, static_argnums=3)
        self._micro = jax.jit(micro, donate_argnums=1, static_argnums=4,
                              compiler_options=self._options, **micro_shardings)

    def _apply(self, state, totals: tuple):
        """The optimizer step on the sum of ``totals`` (one program per stream count)."""
        return self._apply_fn(len(totals))(state, totals)

    def _apply_fn(self, k: int):
        if k not in self._apply_fns:
            shardings = {}
            if self._shardings is not None:
                state_shardings, total, rep = self._shardings
                shardings = dict(in_shardings=(state_shardings, (total,) * k),
                                 out_shardings=(state_shardings, rep))
            self._apply_fns[k] = jax.jit(self._apply_totals, donate_argnums=0,
                                         compiler_options=self._options, **shardings)
        return self._apply_fns[k]

    def programs(self, state, rows: int, p: int, n: int, fields: dict) -> list[tuple]:
        """The programs one update of a ``rows``-row batch (prompt bucket P, N completion
        columns; ``fields`` as ``Planner.abstract_part``) runs, at the largest micro-batch
        layout: ``[(name, jitted, abstract args, copies running at once)]``. ``update``: a
        stream's gradients of one micro-batch (its total when each of the k streams computes
        one micro-batch, else added into its donated total), k streams at once; ``apply``: the
        optimizer step on the k totals. ``state``: abstract, with the run's shardings."""
        k = stream_count(self.planner, self.streams, rows)
        planner = dataclasses.replace(self.planner, num_micro=self.planner.num_micro * k)
        mb = planner.abstract_part(rows, p, n, fields)
        rep = None if self._shardings is None else self._shardings[2]
        index = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
        total = jax.eval_shape(self._grads_inner, state, mb, index, n)
        if self._shardings is not None:
            grads = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                 total[0], lora_lib.trainable(self._shardings[0].params))
            total = (grads, *jax.tree.map(
                lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep), total[1:]))
        if planner.num_micro == k:   # one micro-batch per stream (``__call__``'s ``single``)
            update = ("update", self._grads, (state, mb, index, n), k)
        else:
            update = ("update", self._micro, (state, total, mb, index, n), k)
        return [update, ("apply", self._apply_fn(k), (state, (total,) * k), 1)]

    def _micro_grads(self, state, mb, index, slots: int):
        return steps.micro_grads(self.loss_fn, state, {**mb, steps.COMPLETION_SLOTS: slots},
                                 index)

    def _micro_step(self, state, total, mb, index, slots: int):
        return steps.add_micro(total, self._grads_inner(state, mb, index, slots))

    def _zeros(self, state, mb: dict, slots: int):
        """A zero total: gradients like the trainable params, scalar sums, metric pairs."""
        key = tuple(sorted((k, np.ndim(v)) for k, v in mb.items()))
        if key not in self._zeros_fns:   # one abstract trace per batch layout
            mb_abstract = {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype)
                           for k, v in mb.items()}
            index = jax.ShapeDtypeStruct((), jnp.int32)
            sum_shapes = jax.eval_shape(self._grads_inner, state, mb_abstract, index,
                                        slots)[1:]

            # One program (eager zeros_like per parameter leaf compiled one XLA program each).
            @jax.jit
            def zeros(trainable):
                grads = jax.tree.map(jnp.zeros_like, trainable)
                return (grads, *jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sum_shapes))
            self._zeros_fns[key] = zeros
        return self._zeros_fns[key](lora_lib.trainable(state.params))

    def update_streams(self, rows: int) -> int:
        return stream_count(self.planner, self.streams, rows)

    def __call__(self, state, batch: dict):
        batch = {k: dist.to_host(v) for k, v in batch.items()}
        n = batch["loss_mask"].shape[1]
        k, parts = stream_parts(self.planner, self.streams, batch, n)
        parts = [part for _, part in parts]
        mesh = self.planner.mesh
        single = len(parts) == k   # one micro-batch per stream: its gradients are its total
        totals = [None if single else self._zeros(state, parts[j], n) for j in range(k)]

        def stream(j):   # micro-batches j, j + k, ... into totals[j]
            def run():
                def args(i):
                    return dist.device_batch(parts[i], mesh), jnp.asarray(i, jnp.int32), n
                if single:
                    total = self._grads(state, *args(j))
                else:
                    total = totals[j]
                    for i in range(j, len(parts), k):
                        total = self._micro(state, total, *args(i))
                # One stream is left to dispatch asynchronously; concurrent ones must block.
                return total if k == 1 else jax.block_until_ready(total)
            return run

        state, metrics = self._apply(state, tuple(streams_lib.run([stream(j)
                                                                   for j in range(k)])))
        metrics["update/token_efficiency"] = token_efficiency(parts)
        metrics["update/shared_prompt"] = float(np.mean(["prompt_tokens" in p for p in parts]))
        return state, metrics


class GroupedLogps:
    """``fn(params, batch) -> float32 [R, N]`` (numpy): the completion log-probs of the
    old/reference passes (``steps.build_logps_fn``) over the micro-batches of ``planner``,
    ``logps_fn`` (jitted, one micro-batch) run once per micro-batch, all dispatched before any
    is fetched. Columns past a micro-batch's trimmed completion width hold no real token of
    its rows: 0, as the full computation gives. ``streams`` k > 1: micro-batches cut into k
    parts, computed by k concurrent streams (as ``GroupedUpdate``)."""

    def __init__(self, logps_fn, planner: Planner, streams: int = 1):
        self.logps_fn, self.planner, self.streams = logps_fn, planner, streams

    def copies(self, rows: int) -> int:
        """Streams computing at once on a ``rows``-row batch."""
        return stream_count(self.planner, self.streams, rows)

    def program(self, rows: int, p: int, n: int, fields: dict) -> tuple:
        """``(jitted, abstract batch)``: the one-micro-batch program at the largest layout of a
        ``rows``-row batch (as ``GroupedUpdate.programs``; ``fields`` besides the sequence
        layout, e.g. ``temperatures``)."""
        k = self.copies(rows)
        planner = dataclasses.replace(self.planner, num_micro=self.planner.num_micro * k)
        fields = {"loss_mask": ((n,), bool), **fields}
        return self.logps_fn, planner.abstract_part(rows, p, n, fields)

    def __call__(self, params, batch: dict) -> np.ndarray:
        batch = {k: dist.to_host(batch[k]) for k in steps.LOGPS_KEYS if k in batch}
        rows, n = batch["loss_mask"].shape
        k, parts = stream_parts(self.planner, self.streams, batch, n)

        def one(part):
            out = self.logps_fn(params, dist.device_batch(part, self.planner.mesh))
            return out if k == 1 else jax.block_until_ready(out)   # as GroupedUpdate
        outs = [None] * len(parts)
        for j, stream_outs in enumerate(streams_lib.run(
                [lambda j=j: [one(parts[i][1]) for i in range(j, len(parts), k)]
                 for j in range(k)])):
            outs[j::k] = stream_outs
        logps = np.zeros((rows, n), np.float32)
        for (mb, _), out in zip(parts, outs):
            logps[mb.rows, :mb.completion_cols] = dist.to_host(out)
        return logps


def host_planned(algo_cfg) -> bool:
    """Whether the old/ref log-prob passes run over host-planned micro-batches (the GRPO
    update always does: ``planner``; without either option its plan is the batch in order)."""
    return bool(algo_cfg.group_by_length or algo_cfg.get("shared_prompt", False))


def planner(algo_cfg=None, num_micro: int = 1, mesh=None, prompts: int = 0) -> Planner:
    """The ``Planner`` of the configured ``algo.group_by_length`` / ``algo.shared_prompt``
    (``algo_cfg`` None: grouped by length, no shared prompts). With neither, micro-batches
    are the batch's rows in order, untrimmed. ``prompts``: the batch's prompt count when its
    groups have different sizes (knapsack allocation; used with ``algo.shared_prompt``)."""
    if algo_cfg is None:
        return Planner(int(num_micro), True, 1, mesh)
    shared = bool(algo_cfg.get("shared_prompt", False))
    g = int(algo_cfg.num_generations) if shared else 1
    # Ragged groups try the G-row layout first: where a micro-batch's rows happen to form
    # G-row groups (the knapsack gave every prompt G), it needs no gather.
    return Planner(int(num_micro), bool(algo_cfg.group_by_length), g, mesh,
                   int(prompts) if shared else 0)


def build_logps_fn(model_cfg, *, algo_cfg=None, num_micro: int = 1, mesh=None,
                   **opts) -> GroupedLogps:
    """``steps.build_logps_fn`` over host-planned micro-batches (returns host arrays);
    ``algo_cfg`` as ``planner``; ``opts``: its ``temperature``, ``param_shardings``,
    ``base_only``; ``algo.update_streams`` concurrent streams."""
    one = steps.build_logps_fn(model_cfg, num_micro=1, mesh=mesh, **opts)
    setting = int(algo_cfg.get("update_streams", 1)) if algo_cfg is not None else 1
    return GroupedLogps(one, planner(algo_cfg, num_micro, mesh),
                        streams=streams_lib.resolve(setting, mesh))
