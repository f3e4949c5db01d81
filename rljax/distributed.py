"""Multi-host (SPMD) support: one ``rljax train`` process per host, all running the same loop.

Every process runs the same controller. Each feeds its own slice of the global prompt batch,
computes rewards for its own completions, and the jitted phases work on *global* arrays built
from the per-process pieces. Nothing here is needed on one host; every helper degrades to the
obvious single-process behaviour, so the trainer calls them unconditionally.

    from rljax import distributed as dist
    dist.initialize()                       # once, before anything touches a jax backend
    rows = dist.local_rows(mesh, global_batch)          # this process's slice of the batch
    x = dist.global_batch(local_np_tree, mesh)          # per-process rows -> global arrays
    local = dist.local_data(global_array)               # this process's rows, as numpy
    everything = dist.gather(local_values)              # concat of every process's values

When is a run multi-host? ``initialize`` looks at the environment, in this order:

1. ``RLJAX_DISTRIBUTED=0`` turns it off.
2. ``RLJAX_COORDINATOR_ADDRESS`` (``host:port``), ``RLJAX_NUM_PROCESSES`` and
   ``RLJAX_PROCESS_ID`` given explicitly (what ``launch/local.py`` sets for local CPU processes;
   also usable on any cluster). Optional ``RLJAX_LOCAL_DEVICE_IDS`` (``0,1``).
3. ``RLJAX_DISTRIBUTED=1`` (or ``auto``): ``jax.distributed.initialize()`` with jax's own cluster
   auto-detection (Cloud TPU VM metadata, GKE, SLURM, Open MPI). ``launch/tpu_pod.sh`` sets it.
4. Environment signals of a multi-process job that jax can auto-detect: several TPU worker
   hostnames (``TPU_WORKER_HOSTNAMES``/``TPU_PROCESS_ADDRESSES``), a multislice coordinator
   (``MEGASCALE_COORDINATOR_ADDRESS``), ``SLURM_NTASKS``/``OMPI_COMM_WORLD_SIZE`` > 1, or a Cloud
   TPU VM whose metadata lists more than one worker (one short metadata query, only when a TPU
   device file exists).

On CPU, cross-process collectives use gloo (jax's default ``jax_cpu_collectives_implementation``).
"""
from __future__ import annotations

import glob
import logging
import os
import urllib.request
from typing import Any, Sequence

import numpy as np

log = logging.getLogger(__name__)

ENV_SWITCH = "RLJAX_DISTRIBUTED"
ENV_COORDINATOR = "RLJAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "RLJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "RLJAX_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "RLJAX_LOCAL_DEVICE_IDS"

_TRUE = ("1", "true", "yes", "auto", "on")
_FALSE = ("0", "false", "no", "off")


# ----------------------------------------------------------------------------- detection

def _int_env(env, name: str) -> int | None:
    value = env.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def _gce_tpu_worker_count(timeout_s: float = 2.0) -> int:
    """Workers of this Cloud TPU VM slice from the metadata server (0 when not a TPU VM)."""
    if not (glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")):
        return 0
    host = os.environ.get("GCE_METADATA_IP", "metadata.google.internal")
    request = urllib.request.Request(
        f"http://{host}/computeMetadata/v1/instance/attributes/worker-network-endpoints",
        headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            text = response.read().decode()
    except Exception:  # noqa: BLE001 - no metadata server: not a Cloud TPU VM
        return 0
    return len([w for w in text.split(",") if w.strip()])


def detect(env: Any = None, *, query_metadata: bool = True) -> dict | None:
    """How to initialise ``jax.distributed`` in this environment.

    Returns ``None`` for a single-process run, otherwise the keyword arguments for
    ``jax.distributed.initialize`` (an empty dict means "let jax auto-detect the cluster").
    Raises ``ValueError`` for a half-specified explicit setup (names the missing variable).
    """
    env = os.environ if env is None else env
    switch = str(env.get(ENV_SWITCH, "")).strip().lower()
    if switch in _FALSE:
        return None
    explicit = {name: env.get(name) for name in (ENV_COORDINATOR, ENV_NUM_PROCESSES,
                                                 ENV_PROCESS_ID)}
    if any(explicit.values()):
        missing = [name for name, value in explicit.items() if not value]
        if missing:
            raise ValueError(f"multi-host setup: {', '.join(missing)} must be set together with "
                             f"{', '.join(n for n, v in explicit.items() if v)}")
        num, pid = _int_env(env, ENV_NUM_PROCESSES), _int_env(env, ENV_PROCESS_ID)
        if num < 1 or not 0 <= pid < num:
            raise ValueError(f"multi-host setup: {ENV_PROCESS_ID}={pid} must be in "
                             f"[0, {ENV_NUM_PROCESSES}={num})")
        if num == 1:
            return None
        kwargs = dict(coordinator_address=explicit[ENV_COORDINATOR], num_processes=num,
                      process_id=pid)
        ids = env.get(ENV_LOCAL_DEVICE_IDS)
        if ids:
            kwargs["local_device_ids"] = [int(i) for i in ids.split(",")]
        return kwargs
    if switch in _TRUE:
        return {}
    workers = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES") or ""
    if len([w for w in workers.split(",") if w.strip()]) > 1 or env.get(
            "MEGASCALE_COORDINATOR_ADDRESS"):
        return {}
    for name in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if (_int_env(env, name) or 0) > 1:
            return {}
    if query_metadata and _gce_tpu_worker_count() > 1:
        return {}
    return None


def initialize(env: Any = None) -> bool:
    """Initialises ``jax.distributed`` once if the environment is multi-host.

    Must run before anything creates a jax backend (``jax.devices()``, the first array).
    Idempotent: later calls (or a process where the user already called
    ``jax.distributed.initialize``) are no-ops. Returns True when running multi-process.
    """
    import jax

    if jax.distributed.is_initialized():
        return jax.process_count() > 1
    kwargs = detect(env)
    if kwargs is None:
        return False
    log.info("rljax: initialising jax.distributed %s", kwargs or "(auto-detected cluster)")
    jax.distributed.initialize(**kwargs)
    return jax.process_count() > 1


# ----------------------------------------------------------------------------- queries

def process_index() -> int:
    import jax
    return jax.process_index()


def process_count() -> int:
    import jax
    return jax.process_count()


def is_main() -> bool:
    """True on process 0 (the one that writes logs, config and plots)."""
    return process_index() == 0


def is_multiprocess() -> bool:
    return process_count() > 1


# ----------------------------------------------------------------------------- batches

def _batch_sharding(mesh, shape: Sequence[int]):
    from rljax import sharding as shd
    return shd.batch_sharding(mesh, tuple(shape))


def local_rows(mesh, global_size: int) -> slice:
    """The rows ``[start, stop)`` of a global batch of ``global_size`` rows whose leading axis is
    split over the mesh's data axes (``sharding.batch_sharding``) that live on this process.

    Each process feeds exactly these rows (prompts, their fields, rewards). Raises ValueError if
    this process's rows are not one contiguous block (a mesh whose device order interleaves
    processes along the batch axes).
    """
    sharding = _batch_sharding(mesh, (global_size,))
    index_map = sharding.addressable_devices_indices_map((global_size,))
    spans = sorted({(idx[0].start or 0, global_size if idx[0].stop is None else idx[0].stop)
                    for idx in index_map.values()})
    start, stop = spans[0][0], spans[0][1]
    for a, b in spans[1:]:
        if a > stop:
            raise ValueError(f"process {process_index()} holds non-contiguous batch rows {spans}")
        stop = max(stop, b)
    return slice(start, stop)


def global_batch(local_tree: Any, mesh, global_size: int | None = None) -> Any:
    """Per-process rows -> global ``jax.Array``s split over the batch axes (every leaf ``[b, ...]``).

    Each process passes the rows ``local_rows(mesh, B)`` of every leaf (numpy or lists);
    ``global_size`` is B (default: ``b * process_count()``, i.e. equal slices). On one process
    this is ``sharding.shard_batch``.
    """
    import jax

    def put(x):
        x = np.asarray(x)
        n = global_size if global_size is not None else x.shape[0] * process_count()
        shape = (n,) + x.shape[1:]
        sharding = _batch_sharding(mesh, shape)
        rows = local_rows(mesh, n) if x.ndim else None
        if rows is not None and x.shape[0] != rows.stop - rows.start:
            raise ValueError(f"process {process_index()} passed {x.shape[0]} rows; its slice of "
                             f"the global batch of {n} is rows {rows.start}:{rows.stop}")
        return jax.make_array_from_process_local_data(sharding, x, shape)

    return jax.tree.map(put, local_tree)


def device_batch(tree: Any, mesh) -> Any:
    """A host batch that is identical on every process -> global arrays split over the batch
    axes (each process transfers only its own devices' rows). One process: unchanged (jit
    places numpy inputs itself)."""
    if not is_multiprocess():
        return tree
    import jax

    def put(x):
        if isinstance(x, jax.Array):
            return x
        x = np.asarray(x)
        return jax.device_put(x, _batch_sharding(mesh, x.shape) if x.ndim else
                              jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))

    return jax.tree.map(put, tree)


def rows_to_global(local_tree: Any, mesh, global_size: int) -> Any:
    """Host values computed for this process's rows (``local_rows(mesh, global_size)``) ->
    the values of all rows, as numpy, on every process (e.g. rewards of own completions).
    Correct also when the batch is replicated over processes (too small to split)."""
    if not is_multiprocess():
        return local_tree
    return to_host_tree(global_batch(local_tree, mesh, global_size))


def row_replication(mesh, global_size: int) -> int:
    """How many processes hold each row of a batch of ``global_size`` (1 when split evenly)."""
    rows = local_rows(mesh, global_size)
    return max(1, process_count() * (rows.stop - rows.start) // global_size)


def to_host_tree(tree: Any) -> Any:
    """:func:`to_host` on every leaf."""
    import jax
    return jax.tree.map(to_host, tree)


def local_data(x: Any) -> np.ndarray:
    """This process's rows of a global array sharded on its leading axis, as numpy.

    Shards are deduplicated (replicas on several local devices) and concatenated in row order.
    Fully addressable arrays (one process, or replicated) come back whole.
    """
    import jax

    if not isinstance(x, jax.Array):
        return np.asarray(x)
    if x.is_fully_addressable:
        return np.asarray(x)
    if x.ndim == 0:
        return np.asarray(x.addressable_data(0))
    pieces = {}
    for shard in x.addressable_shards:
        start = (shard.index[0].start or 0) if shard.index else 0
        pieces.setdefault(start, shard)
    return np.concatenate([np.asarray(pieces[k].data) for k in sorted(pieces)], axis=0)


def gather(tree: Any, *, tiled: bool = True) -> Any:
    """Every process's host values, on every process (e.g. per-process rewards for logging).

    Leaves are numpy-able arrays of the same shape on every process; ``tiled=True`` concatenates
    along axis 0 in process order, ``tiled=False`` stacks a new leading process axis. Global jax
    arrays are gathered whole. A collective: every process must call it. One process: identity
    (stacked with a leading 1 when not tiled).
    """
    import jax

    if not is_multiprocess():
        return jax.tree.map(lambda v: np.asarray(v) if tiled else np.asarray(v)[None], tree)
    from jax.experimental import multihost_utils

    def one(v):
        if isinstance(v, jax.Array) and not v.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(v, tiled=True))
        return np.asarray(multihost_utils.process_allgather(np.asarray(v), tiled=tiled))

    return jax.tree.map(one, tree)


def to_host(x: Any) -> np.ndarray:
    """A (possibly non-fully-addressable) global array as one numpy array on every process.
    A collective for an array split over processes (every process must call it); a replicated
    one is read from this process's own copy."""
    import jax

    if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def broadcast(tree: Any) -> Any:
    """Process 0's host values on every process (e.g. a decision taken on process 0)."""
    if not is_multiprocess():
        return tree
    from jax.experimental import multihost_utils
    return multihost_utils.broadcast_one_to_all(tree)


def barrier(name: str) -> None:
    """Blocks until every process reaches the barrier ``name``; no-op on one process."""
    if is_multiprocess():
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


_agreements = [0]   # every_process calls so far: each process makes the same ones


def every_process(flag: bool, timeout_s: float = 600.0) -> bool:
    """True if ``flag`` is True on every process (e.g. an update every host has seen finish).
    Every process must call it, in the same order. Through the coordination service's
    key-value store, not a device collective: it may run while programs with collectives of
    their own are in flight (on CPU, gloo would interleave the two differently per process)."""
    if not is_multiprocess():
        return bool(flag)
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    n, _agreements[0] = _agreements[0], _agreements[0] + 1
    client.key_value_set(f"rljax/every/{n}/{process_index()}", "1" if flag else "0")
    flags = [client.blocking_key_value_get(f"rljax/every/{n}/{p}", int(timeout_s * 1000))
             for p in range(process_count())]
    if n:   # every process has set round n, so all have read round n - 1: drop our key of it
        client.key_value_delete(f"rljax/every/{n - 1}/{process_index()}")
    return all(f == "1" for f in flags)


def any_process(flag: bool) -> bool:
    """True if ``flag`` is True on any process (e.g. a stop signal seen by one host)."""
    if not is_multiprocess():
        return bool(flag)
    return bool(np.any(gather(np.asarray([bool(flag)]))))
