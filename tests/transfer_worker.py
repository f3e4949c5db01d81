"""Run by ``test_multihost.py`` as each of 2 local processes of 4 CPU devices: copies arrays
from a training mesh to a rollout mesh (``sharding.split_devices``, host by host) with
``sharding.transfer`` in layouts that need each path (shards held on their own process, and
shards that are not) and checks every copy against the source bit for bit."""
import numpy as np

import jax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rljax import distributed
from rljax import sharding as shd

CASES = [  # (rollout mesh axes, source spec on data=2 x fsdp=2, target spec)
    ({"data": -1}, P("fsdp", None), P("fsdp")),          # each host holds the whole array
    ({"data": -1}, P("data", None), P()),                # host 0 holds rows 0-3 only
    ({"fsdp": 4}, P("fsdp", None), P(None, "fsdp")),
    ({"data": 2, "fsdp": 2}, P(("data", "fsdp")), P("fsdp")),
    ({"fsdp": 2, "data": 2}, P(), P(("fsdp", "data"))),
]


def main():
    assert distributed.initialize() and jax.process_count() == 2
    train, rollout = shd.split_devices(jax.devices(), 4)
    for devices in (train, rollout):   # two of each process's four
        assert sorted(d.process_index for d in devices) == [0, 0, 1, 1]
    mesh = shd.make_mesh({"data": 2, "fsdp": 2}, train)
    full = np.random.default_rng(0).standard_normal((8, 12)).astype(np.float32)
    for axes, src, dst in CASES:
        x = jax.make_array_from_callback(full.shape, NamedSharding(mesh, src), lambda i: full[i])
        target = NamedSharding(shd.make_mesh(axes, rollout), dst)
        y = shd.transfer({"w": x}, {"w": target})["w"]
        assert y.sharding == target and y.sharding.device_set == set(rollout)
        np.testing.assert_array_equal(multihost_utils.process_allgather(y, tiled=True), full)
    print("transfer ok", flush=True)


if __name__ == "__main__":
    main()
