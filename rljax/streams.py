"""Concurrent streams: independent chunks of one batch run as concurrent programs.

XLA:CPU runs a program's ops one after another, each spread over the cores. A small model's
steps are many small ops that one core runs about as fast as two (a 4L-128 llama's decode
step: 1.2 ms with one core or two), so the second core mostly idles. Chunks of the batch in
separate programs, dispatched from separate threads (executing a program releases the GIL),
keep both busy: the sampler decodes prompt chunks this way (``sampling.generate(streams=)``)
and the host-planned update computes micro-batch gradients this way
(``length_groups.GroupedUpdate``). Numbers: ``bench/RESULTS.md``.
"""
from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import Callable, Sequence

import jax

_POOLS: dict[int, concurrent.futures.ThreadPoolExecutor] = {}   # by worker count
_POOLS_LOCK = threading.Lock()


def auto_streams(mesh: jax.sharding.Mesh | None = None) -> int:
    """The stream count of a setting of 0 (auto): 2 on a CPU backend with at least two cores
    and at most one device in ``mesh``, else 1 (an accelerator, or a multi-device mesh, already
    runs the batch in parallel). Two is what was measured (2 cores); more can be set."""
    if jax.default_backend() != "cpu" or (mesh is not None and mesh.size > 1):
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return 2 if (cores or 1) >= 2 else 1


def resolve(setting: int, mesh: jax.sharding.Mesh | None = None) -> int:
    """A ``streams`` setting (0 = auto, else the count; negative: ValueError) -> a count >= 1;
    1 under a multi-device mesh whatever the setting (the batch is sharded there instead)."""
    if setting < 0:
        raise ValueError(f"streams must be >= 0 (0 = auto), got {setting}")
    if mesh is not None and mesh.size > 1:
        return 1
    return setting or auto_streams(mesh)


def largest_divisor(limit: int, n: int, unit: int = 1) -> int:
    """The largest k <= ``limit`` such that ``n`` splits into k chunks of whole ``unit``s."""
    return max(k for k in range(1, max(limit, 1) + 1) if n % (k * unit) == 0)


def run(fns: Sequence[Callable[[], object]]) -> list:
    """Calls ``fns`` concurrently, one thread each, and returns their results in order. Each
    should block until its device work is done (``jax.block_until_ready``), so that the threads
    overlap the execution rather than only the dispatch."""
    if len(fns) == 1:
        return [fns[0]()]
    with _POOLS_LOCK:
        if len(fns) not in _POOLS:
            _POOLS[len(fns)] = concurrent.futures.ThreadPoolExecutor(len(fns), "rljax-stream")
        pool = _POOLS[len(fns)]
    return [f.result() for f in [pool.submit(fn) for fn in fns]]
