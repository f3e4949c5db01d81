"""Device mesh, logical-axis rules, and sharding of parameters, optimizer state and batches.

Parameters carry *logical* axis names (``models.param_logical_axes(cfg)``: a pytree of tuples
such as ``("layers", "embed", "mlp")``). One rules table maps each logical name to zero or more
*mesh* axes; everything else here is plumbing around that table:

    mesh = make_mesh({"data": -1, "fsdp": 1, "expert": 1, "tensor": 1})
    shardings = logical_to_sharding(models.param_logical_axes(cfg), mesh, shapes=params)
    params = shard_params(params, shardings)
    batch = shard_batch(batch, mesh)

A dimension whose size is not divisible by the product of its mesh axes keeps the longest prefix of
those axes that does divide it (possibly none, i.e. replicated), so odd vocabularies or tiny test
batches never make sharding fail. A mesh axis is used at most once per array: a later dimension
that maps to an axis already taken is replicated (a PartitionSpec may not repeat an axis).
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "expert", "tensor")
"""Mesh axis names, outermost first. ``data``: pure data parallelism (parameters replicated);
``fsdp``: data parallelism with parameters/optimizer state sharded (gathered per layer by XLA);
``expert``: expert parallelism: a mixture of experts' experts split across devices, the batch
too (a dense model treats it as more data parallelism); ``tensor``: heads / MLP / vocab split
across devices (Megatron style)."""

BATCH_AXES = ("data", "fsdp", "expert")
"""Mesh axes the leading batch dimension of activations and batches is split over."""

# Logical axis -> mesh axes. MaxText-style: the table is the only place that knows the layout.
# `embed` over fsdp shards every weight matrix along its model dimension (ZeRO-3 style); the
# head-, mlp- and vocab-parallel dims go over tensor. `layers` stays unsharded: it is the scan
# axis and each step of the scan needs the whole slice.
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", BATCH_AXES),
    ("length", None),
    ("layers", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
    ("expert", "expert"),        # the experts of a mixture-of-experts layer
    ("expert_choice", None),     # the router's output (one logit per expert), kept whole
    # A vision tower (models.vision_params) shares embed/heads/mlp with the text model; its
    # patch and position axes are small and stay whole; the projector's input (the tower's
    # width) goes over tensor, as its output (the text's embed) takes fsdp.
    ("patch", None),
    ("vision_embed", "tensor"),
)


def make_mesh(axes: Mapping[str, int] | None = None, devices: Sequence[Any] | None = None) -> Mesh:
    """Builds a ``Mesh`` with axes ``("data", "fsdp", "expert", "tensor")``.

    Args:
      axes: mapping (dict or ConfigDict) from mesh axis name to size. Missing axes have size 1;
        at most one size may be ``-1``, meaning "all remaining devices". ``None`` means
        ``{"data": -1}``.
      devices: devices to use (default ``jax.devices()``).

    Returns:
      A ``Mesh`` of shape ``(data, fsdp, expert, tensor)`` whose size equals ``len(devices)``.

    Raises:
      ValueError: unknown axis names, several ``-1``, non-positive sizes, or sizes whose product
        does not match the device count (the message names every axis and its size).
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    axes = dict({"data": -1} if axes is None else axes)
    unknown = sorted(set(axes) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"mesh: unknown axis name(s) {unknown}; expected a subset of {list(MESH_AXES)}")
    sizes = {name: int(axes.get(name, 1)) for name in MESH_AXES}
    described = ", ".join(f"{k}={v}" for k, v in sizes.items())
    rest = [k for k, v in sizes.items() if v == -1]
    bad = [k for k, v in sizes.items() if v == 0 or v < -1]
    if bad or len(rest) > 1:
        raise ValueError(
            f"mesh: invalid axis sizes ({described}); sizes must be >= 1, with at most one -1")
    known = math.prod(v for v in sizes.values() if v != -1)
    if rest:
        if n % known:
            raise ValueError(
                f"mesh: {n} devices are not divisible by the fixed axes ({described}, product "
                f"{known}); cannot fill axis '{rest[0]}'")
        sizes[rest[0]] = n // known
    if math.prod(sizes.values()) != n:
        raise ValueError(
            f"mesh: axis sizes ({described}) multiply to {math.prod(sizes.values())}, "
            f"but there are {n} devices")
    shape = tuple(sizes[k] for k in MESH_AXES)
    # jax.make_mesh picks a physically sensible device order on TPU/GPU; Auto axis types keep
    # sharding propagation implicit (XLA's GSPMD), which is what jit in/out_shardings expect.
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)


def _as_tuple(mesh_axes: Any) -> tuple[str, ...]:
    if mesh_axes is None:
        return ()
    if isinstance(mesh_axes, str):
        return (mesh_axes,)
    return tuple(mesh_axes)


def logical_to_spec(logical_axes: Sequence[str | None] | None, mesh: Mesh,
                    rules: Sequence[tuple[str, Any]] = DEFAULT_RULES,
                    shape: Sequence[int] | None = None) -> PartitionSpec:
    """Maps one array's logical axis names to a ``PartitionSpec`` on ``mesh``.

    Args:
      logical_axes: one name (or ``None`` = replicated) per array dimension; ``None`` for the
        whole tuple means fully replicated.
      mesh: the target mesh; rules naming mesh axes it lacks are ignored.
      rules: ``(logical_name, mesh_axis | tuple of mesh axes | None)`` pairs; first match wins;
        logical names absent from the table are replicated.
      shape: the array's shape. When given, each dimension keeps only the longest prefix of its
        mesh axes whose size product divides the dimension.

    Returns:
      A PartitionSpec with one entry per dimension (trailing ``None`` entries included).
    """
    if logical_axes is None:
        return PartitionSpec()
    if shape is not None and len(shape) != len(logical_axes):
        raise ValueError(f"logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}")
    table: dict[str, tuple[str, ...]] = {}
    for name, mesh_axes in rules:
        table.setdefault(name, _as_tuple(mesh_axes))
    used: set[str] = set()
    spec = []
    for dim, name in enumerate(logical_axes):
        want = [a for a in table.get(name, ()) if a in mesh.shape] if name is not None else []
        if shape is not None:
            # Longest prefix that divides: batch 2 on data=2,fsdp=2 still splits over data.
            while want and shape[dim] % math.prod(mesh.shape[a] for a in want):
                want.pop()
        if any(a in used for a in want):
            want = []
        used.update(want)
        spec.append(None if not want else want[0] if len(want) == 1 else tuple(want))
    return PartitionSpec(*spec)


def _is_axes_leaf(x: Any) -> bool:
    return x is None or (isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x))


def logical_to_sharding(axes_tree: Any, mesh: Mesh,
                        rules: Sequence[tuple[str, Any]] = DEFAULT_RULES,
                        shapes: Any = None) -> Any:
    """Pytree of logical-axis tuples -> pytree of ``NamedSharding``.

    Args:
      axes_tree: e.g. ``models.param_logical_axes(cfg)``; leaves are tuples of names / None.
      mesh: target mesh.
      rules: logical -> mesh axes table (default ``DEFAULT_RULES``).
      shapes: optional tree with the same structure whose leaves have ``.shape`` (arrays,
        ``jax.ShapeDtypeStruct`` from ``jax.eval_shape``). Needed for the divisibility fallback;
        without it every rule is applied as written.

    Returns:
      A tree with ``axes_tree``'s structure and ``NamedSharding`` leaves.
    """
    if shapes is None:
        return jax.tree.map(lambda ax: NamedSharding(mesh, logical_to_spec(ax, mesh, rules)),
                            axes_tree, is_leaf=_is_axes_leaf)
    # A None in ``shapes`` (an absent optional array, e.g. a quantized weight's zero point)
    # stays None, so the shardings keep the params' tree structure.
    return jax.tree.map(
        lambda ax, x: None if x is None else
        NamedSharding(mesh, logical_to_spec(ax, mesh, rules, np.shape(x))),
        axes_tree, shapes, is_leaf=_is_axes_leaf)


def shard_params(params: Any, shardings: Any) -> Any:
    """Places every leaf of ``params`` on its ``NamedSharding`` (same tree structure)."""
    return jax.device_put(params, shardings)


def batch_sharding(mesh: Mesh, shape: Sequence[int]) -> NamedSharding:
    """Sharding for an array whose leading axis is the batch: split over ``data`` x ``fsdp``
    (or the longest prefix of them that divides it), other dimensions replicated."""
    axes = ("batch",) + (None,) * (len(shape) - 1)
    return NamedSharding(mesh, logical_to_spec(axes, mesh, DEFAULT_RULES, shape))


def shard_batch(batch: Any, mesh: Mesh) -> Any:
    """Places every array of ``batch`` (a pytree, leaves ``[B, ...]``) with its leading axis split
    over the mesh's data-parallel axes. Scalars are replicated."""
    def put(x):
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        return jax.device_put(x, batch_sharding(mesh, x.shape))
    return jax.tree.map(put, batch)


def opt_state_shardings(opt_state: Any, param_axes: Any, mesh: Mesh,
                        rules: Sequence[tuple[str, Any]] = DEFAULT_RULES) -> Any:
    """Shardings for an optax state: every subtree with the params' structure (Adam's ``mu``,
    ``nu``, ...) is sharded like the params; every other leaf (step counts, scalars) replicated.

    Args:
      opt_state: an optax state or its ``jax.eval_shape`` (leaves with ``.shape``).
      param_axes: the params' logical-axis tree (``models.param_logical_axes(cfg)``).
      mesh, rules: as in ``logical_to_sharding``.

    Returns:
      A tree of ``NamedSharding`` with ``opt_state``'s structure.
    """
    params_def = jax.tree.structure(param_axes, is_leaf=_is_axes_leaf)
    replicated = NamedSharding(mesh, PartitionSpec())

    def mirrors_params(node):
        return jax.tree.structure(node) == params_def

    def resolve(node):
        if not mirrors_params(node):
            return replicated  # a plain leaf outside any param-shaped subtree
        def one(ax, x):
            # A param-shaped subtree can still hold per-param scalars (e.g. factored stats):
            # only shard leaves whose rank matches their parameter's.
            if ax is not None and len(ax) != np.ndim(x):
                return replicated
            return NamedSharding(mesh, logical_to_spec(ax, mesh, rules, np.shape(x)))
        return jax.tree.map(one, param_axes, node, is_leaf=_is_axes_leaf)

    return jax.tree.map(resolve, opt_state, is_leaf=mirrors_params)


def shard_opt_state(opt_state: Any, param_axes: Any, mesh: Mesh,
                    rules: Sequence[tuple[str, Any]] = DEFAULT_RULES) -> Any:
    """Places an optax state with ``opt_state_shardings``."""
    return jax.device_put(opt_state, opt_state_shardings(opt_state, param_axes, mesh, rules))


def constrain(x: jax.Array, logical_axes: Sequence[str | None], mesh: Mesh | None,
              rules: Sequence[tuple[str, Any]] = DEFAULT_RULES) -> jax.Array:
    """``with_sharding_constraint`` by logical names inside jit; a no-op when ``mesh`` is None."""
    if mesh is None:
        return x
    spec = logical_to_spec(logical_axes, mesh, rules, x.shape)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def tracing_mesh(mesh: Mesh | None):
    """A context in which code traced under ``jax.jit`` sees ``mesh`` as
    ``jax.sharding.get_abstract_mesh()`` (how the mixture-of-experts dispatch,
    ``models.moe_dispatch``, learns the mesh it runs on); a no-op for None. The jit must place
    its arguments on ``mesh`` (in_shardings or sharded arguments)."""
    if mesh is None:
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def traced_on(fn, mesh: Mesh | None):
    """``fn`` traced inside ``tracing_mesh(mesh)`` (``fn`` itself when ``mesh`` is None)."""
    if mesh is None:
        return fn

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with tracing_mesh(mesh):
            return fn(*args, **kwargs)
    return wrapped


def traced_on_mesh_kwarg(fn):
    """``fn`` traced inside ``tracing_mesh(mesh)`` for its keyword argument ``mesh``."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with tracing_mesh(kwargs.get("mesh")):
            return fn(*args, **kwargs)
    return wrapped


def split_devices(devices: Sequence[Any], rollout: int) -> tuple[list, list]:
    """``(training devices, rollout devices)``: the last ``rollout`` of ``devices`` sample
    (asynchronous RL, ``mesh.rollout_devices``), the others train; ``rollout=0``: all train.

    Devices of several processes split host by host: each process gives its last
    ``rollout / processes`` devices to the sampler, so both meshes span every process (each
    runs the same programs on both) and a host's rows of a batch stay on that host."""
    devices = list(devices)
    if not 0 <= rollout < len(devices):
        raise ValueError(f"mesh.rollout_devices={rollout} must leave at least one of the "
                         f"{len(devices)} devices to train")
    hosts: dict[int, list] = {}
    for d in devices:
        hosts.setdefault(getattr(d, "process_index", 0), []).append(d)
    if rollout % len(hosts):
        raise ValueError(f"mesh.rollout_devices={rollout} does not split evenly over the "
                         f"{len(hosts)} processes (each gives the sampler the same number)")
    per_host = rollout // len(hosts)
    if per_host and any(len(h) <= per_host for h in hosts.values()):
        raise ValueError(f"mesh.rollout_devices={rollout} leaves a process with "
                         f"{min(len(h) for h in hosts.values())} device(s) none to train")
    cut = {p: len(h) - per_host for p, h in hosts.items()}
    train = [d for p, h in hosts.items() for d in h[:cut[p]]]
    return train, [d for p, h in hosts.items() for d in h[cut[p]:]]


def on_mesh(shardings: Any, shapes: Any, mesh: Mesh) -> Any:
    """The same partition on another mesh: each ``NamedSharding`` of ``shardings`` keeps its
    mesh axes by name on ``mesh``, each dimension the longest prefix of them whose sizes there
    divide it (``shapes``: a tree of the same structure with ``.shape`` leaves; None leaves
    stay None). How the sampler's copy of the policy is laid out on the rollout mesh."""
    def one(s, x):
        if s is None or x is None:
            return None
        spec, used = [], set()
        for dim, axes in enumerate(tuple(s.spec) + (None,) * (np.ndim(x) - len(s.spec))):
            want = [a for a in _as_tuple(axes) if a in mesh.shape and a not in used]
            while want and np.shape(x)[dim] % math.prod(mesh.shape[a] for a in want):
                want.pop()
            used.update(want)
            spec.append(None if not want else want[0] if len(want) == 1 else tuple(want))
        return NamedSharding(mesh, PartitionSpec(*spec))
    return jax.tree.map(one, shardings, shapes, is_leaf=lambda x: x is None)


def transfer(tree: Any, shardings: Any) -> Any:
    """``tree``'s arrays placed as ``shardings``, which may be on other devices (the copy of
    the policy the sampler reads, asynchronous RL).

    One process: ``jax.device_put``. Several: jax reshards across processes only within one
    set of devices, so each process assembles its own devices' shards from the source shards
    it holds (device-to-device copies); an array whose target shards are not all held on their
    own process is first replicated over its source devices (a collective among them, one leaf
    at a time: the transient cost is one replicated leaf)."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)
    return jax.tree.map(_transfer_leaf, tree, shardings)


def _boxes(sharding, shape) -> dict:
    """device -> its shard's box, a tuple of (start, stop) per dimension."""
    return {d: tuple(s.indices(n)[:2] for s, n in zip(idx, shape))
            for d, idx in sharding.devices_indices_map(tuple(shape)).items()}


def _overlap(a: tuple, b: tuple) -> tuple | None:
    box = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return box if all(lo < hi for lo, hi in box) else None


def _volume(box: tuple) -> int:
    return math.prod(hi - lo for lo, hi in box)


def _within(box: tuple, outer: tuple) -> tuple:
    """``box`` as slices of the shard ``outer``."""
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, outer))


def _held_on_own_process(src: dict, dst: dict) -> bool:
    """Whether every target box is tiled by the source boxes of its device's process (source
    replicas have equal boxes: each box counted once). The same answer on every process."""
    by_process: dict[int, set] = {}
    for d, box in src.items():
        by_process.setdefault(d.process_index, set()).add(box)
    for d, box in dst.items():
        covered = 0
        for b in by_process.get(d.process_index, ()):
            o = _overlap(box, b)
            covered += 0 if o is None else _volume(o)
        if covered != _volume(box):
            return False
    return True


def _transfer_leaf(x: jax.Array, dst: Any) -> jax.Array:
    shape = tuple(x.shape)
    dst_boxes = _boxes(dst, shape)
    if not _held_on_own_process(_boxes(x.sharding, shape), dst_boxes):
        devices = sorted(x.sharding.device_set, key=lambda d: d.id)
        everywhere = NamedSharding(Mesh(np.array(devices), ("all",)), PartitionSpec())
        x = jax.device_put(x, everywhere)
    local = {}   # box -> one local shard holding it
    for s in x.addressable_shards:
        local.setdefault(tuple(i.indices(n)[:2] for i, n in zip(s.index, shape)), s.data)
    pieces = []
    for d in dst.addressable_devices:
        box, piece = dst_boxes[d], None
        for src_box, data in local.items():
            o = _overlap(box, src_box)
            if o is None:
                continue
            part = jax.device_put(data[_within(o, src_box)], d)
            if o == box:
                piece = part
                break
            if piece is None:
                piece = jnp.zeros(tuple(hi - lo for lo, hi in box), x.dtype, device=d)
            piece = piece.at[_within(o, box)].set(part)
        pieces.append(piece)
    return jax.make_array_from_single_device_arrays(shape, dst, pieces)
