"""Expert-parallel dispatch: each device sends its own tokens' rows to the devices that hold
their experts, runs grouped matmuls on the rows it received, and sends the results back.

Shapes, per device: n tokens (its share of the batch), D ``hidden_size``, k
``num_experts_per_tok``, E ``num_experts``, X the size of the mesh's ``expert`` axis when it
splits the experts (else 1), L = E / X experts held per device, F_t the experts' width on this
device (``moe_intermediate_size`` / ``tensor`` when the tensor axis splits it), C rows per
destination (``capacity``).

One device's work (``local_experts``), the same with or without a mesh:

1. its n*k (token, expert) assignments are sorted by expert, so the rows bound for each expert
   device are contiguous and, within them, grouped by expert;
2. the first C rows for each destination are gathered into a send buffer [X, C, D] (with each
   row's local expert id, L marking an empty slot);
3. one ``all_to_all`` over the ``expert`` axis swaps the buffers: device j receives [X, C, D],
   the rows every device of its expert group sends to j's experts;
4. the received rows are sorted by local expert and run through the experts' SwiGLU as three
   ``jax.lax.ragged_dot`` (group l multiplies its rows by local expert l's weights);
5. a second ``all_to_all`` returns the outputs to the devices the rows came from, which weight
   and sum each token's k outputs.

With X = 1 (data or fsdp parallelism alone, or no mesh) steps 3 and 5 are skipped: each device
computes its own tokens' experts locally, with no collective over token assignments.

Dropless by default: C = n * min(k, L), the most rows one device can send to another (a
token's k experts are distinct, so at most min(k, L) of them live on one device).
``ModelConfig.moe_capacity_factor`` f > 0 caps C at ceil(f * n * k / X), f times a balanced
share; rows past the cap are dropped (that token gets no output from that expert) and counted.

Planning (``balanced``, ``ModelConfig.moe_plan_balanced``, set only by ``rljax plan``): step 4
runs ``bucketed_ffn`` instead, each local expert a dense SwiGLU over a bucket of the rows a
balanced load gives it (``balanced_bucket``: n*k / L). XLA:CPU lowers ``ragged_dot`` to a
masked dense matmul (every local expert against every row), so a plan compiled on fake CPU
devices would count the experts' work L times over and materialise the masked copies; the
stand-in has a grouped matmul's FLOPs and bytes over n*k rows, as a TPU or GPU runs it. Its
outputs are not the model's (rows past a bucket get nothing): only its shapes matter.

Under ``jax.jit`` the dispatch reads the mesh that ``jax.sharding.use_abstract_mesh`` set
while tracing (``sharding.traced_on``): with one, it runs under ``jax.shard_map`` with the
tokens split over the batch axes and the experts over ``expert``; without one, the whole batch
is one device's.
"""
from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

BATCH_AXES = ("data", "fsdp", "expert")   # the mesh axes tokens are split over (sharding.py)


def capacity(n: int, k: int, local: int, x: int, factor: float = 0.0) -> int:
    """Rows one device sends to each of the X expert devices: the dropless worst case
    ``n * min(k, L)``, or with ``factor`` > 0 at most ``ceil(factor * n * k / X)``."""
    worst = n * min(k, local)   # a token's k experts are distinct: <= min(k, L) per device
    return worst if factor <= 0 else max(1, min(worst, math.ceil(factor * n * k / x)))


def expert_ffn(rows: jax.Array, sizes: jax.Array, gate: jax.Array, up: jax.Array,
               down: jax.Array) -> jax.Array:
    """SwiGLU experts on rows [R, D] grouped by expert (``sizes`` int32 [L], rows past their
    sum belong to none) with gate, up [L, D, F_t] and down [L, F_t, D] -> [R, D]."""
    g = jax.lax.ragged_dot(rows, gate, sizes)
    u = jax.lax.ragged_dot(rows, up, sizes)
    return jax.lax.ragged_dot(jax.nn.silu(g) * u, down, sizes)


def balanced_bucket(n: int, k: int, local: int, received: int) -> int:
    """Rows per local expert at a balanced load: every device receives as many rows as it
    sends (n*k; at most the ``received`` buffer's rows), spread evenly over its L experts
    (capacity factor 1 per expert)."""
    return max(1, math.ceil(min(n * k, received) / local))


def bucketed_ffn(rows: jax.Array, sizes: jax.Array, gate: jax.Array, up: jax.Array,
                 down: jax.Array, bucket: int) -> jax.Array:
    """Planning stand-in for ``expert_ffn`` (same arguments and result, rows [R, D] grouped
    by expert): expert l's first ``bucket`` (B) rows are gathered into [L, B, D] and run as
    one batched matmul per weight ([L, B, D] x [L, D, F_t]), the FLOPs and bytes of a grouped
    matmul over L*B rows; rows past a bucket, and empty slots, get 0."""
    r = rows.shape[0]
    starts = jnp.cumsum(sizes) - sizes
    slot = jnp.arange(bucket, dtype=jnp.int32)
    full = slot[None, :] < sizes[:, None]                                     # [L, B]
    src = jnp.where(full, starts[:, None] + slot[None, :], r)                 # r = no row
    x = jnp.where(full[..., None], rows[jnp.minimum(src, r - 1)], 0).astype(rows.dtype)
    g = jnp.einsum("lbd,ldf->lbf", x, gate)
    u = jnp.einsum("lbd,ldf->lbf", x, up)
    y = jnp.einsum("lbf,lfd->lbd", jax.nn.silu(g) * u, down)
    return jnp.zeros_like(rows).at[src.reshape(-1)].set(y.reshape(-1, y.shape[-1]),
                                                        mode="drop")


def _send_plan(ids: jax.Array, valid: jax.Array, local: int, x: int, cap: int) -> dict:
    """Where each assignment goes. ids int32 [n, k], valid bool [n] -> a dict of
    ``order`` [n*k] (assignments sorted by expert, invalid ones last), ``dest`` [n*k] (the
    sorted assignments' expert devices; X = nowhere), ``pos`` [n*k] (their slot there),
    ``keep`` bool [n*k] (sent: valid and within capacity), ``slot_src`` [X, C] (the sorted
    assignment each send slot holds), ``slot_full`` bool [X, C] (whether it holds one),
    ``experts`` [n*k] (the sorted assignments' global experts; E for invalid ones)."""
    n, k = ids.shape
    flat = jnp.where(valid[:, None], ids, local * x).reshape(-1)
    order = jnp.argsort(flat, stable=True)
    dest = flat[order] // local                               # X for invalid assignments
    per_dest = jnp.bincount(dest, length=x + 1).astype(jnp.int32)
    starts = jnp.cumsum(per_dest) - per_dest                  # first sorted index per dest
    pos = jnp.arange(n * k, dtype=jnp.int32) - starts[dest]
    keep = (dest < x) & (pos < cap)
    slot = jnp.arange(cap, dtype=jnp.int32)
    slot_full = slot[None, :] < jnp.minimum(per_dest[:x], cap)[:, None]          # [X, C]
    slot_src = jnp.minimum(starts[:x, None] + slot[None, :], n * k - 1)
    return {"order": order, "dest": dest, "pos": pos, "keep": keep, "slot_src": slot_src,
            "slot_full": slot_full, "experts": flat[order]}


def local_experts(x: jax.Array, ids: jax.Array, weights: jax.Array, valid: jax.Array,
                  gate: jax.Array, up: jax.Array, down: jax.Array, *, expert_axis: Optional[str],
                  capacity_factor: float = 0.0, balanced: bool = False) -> tuple:
    """One device's part of the dispatch (see the module docstring).

    x [n, D], ids int32 [n, k] (global expert ids), weights [n, k], valid bool [n] (False:
    padding that is neither sent nor counted), gate/up [L, D, F_t], down [L, F_t, D];
    ``expert_axis``: the mesh axis the experts are split over (None: all E = L are here);
    ``balanced``: the experts run as ``bucketed_ffn`` (planning only). Returns ``(out [n, D]``
    (partial sums over the tensor axis when F is split), ``kept`` bool [n, k] (the
    assignments that were computed)).
    """
    n, k = ids.shape
    local = gate.shape[0]
    xs = 1 if expert_axis is None else jax.lax.axis_size(expert_axis)
    cap = capacity(n, k, local, xs, capacity_factor)
    plan = _send_plan(ids, valid, local, xs, cap)
    src = plan["order"][plan["slot_src"]]                     # [X, C] assignment a = t*k + j
    full = plan["slot_full"]
    send = jnp.where(full[..., None], x[src // k], 0).astype(x.dtype)          # [X, C, D]
    send_ids = jnp.where(full, plan["experts"][plan["slot_src"]] % local, local)   # [X, C]
    if xs > 1:
        send = jax.lax.all_to_all(send, expert_axis, 0, 0)
        send_ids = jax.lax.all_to_all(send_ids, expert_axis, 0, 0)
    rows, row_ids = send.reshape(xs * cap, -1), send_ids.reshape(-1)
    sizes = jnp.bincount(row_ids, length=local).astype(jnp.int32)
    bucket = balanced_bucket(n, k, local, xs * cap)
    ffn = (lambda *a: bucketed_ffn(*a, bucket)) if balanced else expert_ffn
    if xs > 1:   # rows from X sources interleave their experts: group them
        regroup = jnp.argsort(row_ids, stable=True)
        y = ffn(rows[regroup], sizes, gate, up, down)
        y = jnp.zeros_like(y).at[regroup].set(y)
    else:        # one source: already grouped, empty slots last
        y = ffn(rows, sizes, gate, up, down)
    # Empty slots' rows are in no group; zero them rather than trust a backend's filler.
    y = jnp.where((row_ids < local)[:, None], y, 0).reshape(xs, cap, -1)
    if xs > 1:
        y = jax.lax.all_to_all(y, expert_axis, 0, 0)
    # Back to assignment order: sorted assignment i's output sits at (dest, pos) if kept.
    keep = plan["keep"]
    back = y.reshape(xs * cap, -1)[jnp.where(keep, plan["dest"] * cap + plan["pos"], 0)]
    back = jnp.where(keep[:, None], back, 0)
    out = jnp.zeros_like(back).at[plan["order"]].set(back).reshape(n, k, -1)
    kept = jnp.zeros(n * k, bool).at[plan["order"]].set(keep).reshape(n, k)
    return jnp.sum(out * weights.astype(x.dtype)[..., None], axis=1), kept


def _mesh_layout(mesh, num_experts: int, width: int) -> Optional[dict]:
    """How the mesh splits the dispatch, or None without a mesh (or with one device):
    ``batch`` (mesh axes the tokens are split over), ``devices`` (their size product),
    ``expert`` (the axis the experts are split over, or None when it is 1 or does not divide
    E), ``tensor`` (the axis the experts' width is split over, or None)."""
    if mesh is None or mesh.empty or math.prod(mesh.shape.values()) == 1:
        return None
    size = lambda a: mesh.shape.get(a, 1)
    batch = tuple(a for a in BATCH_AXES if size(a) > 1)
    expert = "expert" if size("expert") > 1 and num_experts % size("expert") == 0 else None
    tensor = "tensor" if size("tensor") > 1 and width % size("tensor") == 0 else None
    return {"batch": batch, "devices": math.prod(size(a) for a in batch), "expert": expert,
            "tensor": tensor}


def dispatch(p: dict, x: jax.Array, ids: jax.Array, weights: jax.Array,
             real: Optional[jax.Array] = None, capacity_factor: float = 0.0,
             balanced: bool = False) -> tuple:
    """The experts' output for x [N, D] routed to ids int32 [N, k] with weights [N, k]
    (``p``: the layer's ``expert_gate``/``expert_up`` [E, D, F], ``expert_down`` [E, F, D]);
    ``real`` [N] (None = all): which tokens count as dropped when they are; ``balanced``:
    the planning stand-in for the expert matmuls (``bucketed_ffn``; never in training).

    Returns ``(out [N, D], dropped f32 [])``, dropped = real tokens' assignments past the
    capacity (0 when dropless). Expert-parallel under a traced mesh (module docstring)."""
    n = x.shape[0]
    real = jnp.ones(n, jnp.float32) if real is None else real.astype(jnp.float32)
    gate, up, down = p["expert_gate"], p["expert_up"], p["expert_down"]
    layout = _mesh_layout(jax.sharding.get_abstract_mesh(), gate.shape[0], gate.shape[2])

    def dropped_of(kept, real):
        return jnp.sum(jnp.where(kept, 0.0, real[:, None]))

    if layout is None:
        out, kept = local_experts(x, ids, weights, jnp.ones(n, bool), gate, up, down,
                                  expert_axis=None, capacity_factor=capacity_factor,
                                  balanced=balanced)
        return out, dropped_of(kept, real)
    # Pad the tokens to a multiple of the batch devices (a decode step may have fewer).
    pad = -n % layout["devices"]
    grow = lambda a: jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))
    valid = grow(jnp.ones(n, bool))
    tok = P(layout["batch"] or None)
    e, t = layout["expert"], layout["tensor"]

    def body(x, ids, weights, valid, real, gate, up, down):
        out, kept = local_experts(x, ids, weights, valid, gate, up, down, expert_axis=e,
                                  capacity_factor=capacity_factor, balanced=balanced)
        if t is not None:   # each tensor device summed over its slice of F
            out = jax.lax.psum(out, t)
        dropped = dropped_of(kept, real)
        return out, (jax.lax.psum(dropped, layout["batch"]) if layout["batch"] else dropped)

    out, dropped = jax.shard_map(
        body, out_specs=(tok, P()),
        in_specs=(tok, tok, tok, tok, tok, P(e, None, t), P(e, None, t), P(e, t, None)),
    )(grow(x), grow(ids), grow(weights), valid, grow(real), gate, up, down)
    return out[:n], dropped
