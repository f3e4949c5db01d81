"""rljax.streams: settings, divisibility, and concurrent calls returned in order."""
import threading
import time

import jax
import pytest

from rljax import sharding, streams


def test_auto_is_two_on_a_multi_core_cpu_else_one(monkeypatch):
    assert jax.default_backend() == "cpu"
    monkeypatch.setattr(streams.os, "sched_getaffinity", lambda _: {0, 1, 2, 3}, raising=False)
    assert streams.auto_streams() == streams.resolve(0) == 2
    assert streams.resolve(5) == 5
    monkeypatch.setattr(streams.os, "sched_getaffinity", lambda _: {0}, raising=False)
    assert streams.auto_streams() == 1
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    assert streams.resolve(4, mesh) == streams.auto_streams(mesh) == 1
    monkeypatch.setattr(streams.jax, "default_backend", lambda: "gpu")
    assert streams.auto_streams() == 1
    with pytest.raises(ValueError, match="streams must be >= 0"):
        streams.resolve(-1)


def test_largest_divisor_keeps_whole_units():
    assert streams.largest_divisor(2, 64, 8) == 2
    assert streams.largest_divisor(8, 64, 8) == 8
    assert streams.largest_divisor(16, 64, 8) == 8     # parts of at least one unit
    assert streams.largest_divisor(4, 12, 4) == 3
    assert streams.largest_divisor(2, 8, 8) == 1       # one group: no split
    assert streams.largest_divisor(4, 6) == 3


def test_run_is_concurrent_and_keeps_order():
    barrier = threading.Barrier(3, timeout=10)   # passes only if all three run at once

    def task(i):
        def go():
            barrier.wait()
            time.sleep(0.01 * (3 - i))   # finish in reverse order
            return i
        return go

    assert streams.run([task(i) for i in range(3)]) == [0, 1, 2]
    assert streams.run([lambda: "alone"]) == ["alone"]
