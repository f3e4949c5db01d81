"""Checkpoints and TrainState: sharded round trip on 8 fake devices, keep-last-N, atomicity."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from rljax.train.core import state as state_lib
from rljax.train.core.checkpoint import CheckpointManager, checkpoint_dir, has_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_params():
    return {"embed": jnp.arange(64.0).reshape(8, 8),
            "layers": {"w": jnp.ones((2, 8, 4)), "norm": jnp.full((2, 8), 0.5)}}


def param_shardings(mesh):
    return {"embed": NamedSharding(mesh, P("data", "model")),
            "layers": {"w": NamedSharding(mesh, P(None, "data", "model")),
                       "norm": NamedSharding(mesh, P())}}


def sharded_state(mesh, optimizer):
    params = jax.device_put(make_params(), param_shardings(mesh))
    state = state_lib.create_train_state(params, optimizer, jax.random.PRNGKey(3),
                                         ref_params=params)
    return state.replace(step=jnp.int32(11))


def test_state_shardings_mirror_params_in_opt_state():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    shapes = state_lib.eval_state_shape(make_params(), optimizer, jax.random.PRNGKey(0))
    shardings = state_lib.state_shardings(shapes, param_shardings(mesh))
    adam = shardings.opt_state[1][0]
    assert adam.mu["embed"].spec == P("data", "model")
    assert adam.nu["layers"]["w"].spec == P(None, "data", "model")
    assert adam.count.spec == P() and shardings.step.spec == P()
    assert shardings.critic_params is None and shardings.ref_params is None
    abstract = state_lib.abstract_train_state(shapes, shardings)
    assert abstract.opt_state[1][0].mu["embed"].shape == (8, 8)
    assert abstract.opt_state[1][0].mu["embed"].sharding.spec == P("data", "model")


def test_round_trip_sharded_with_iterator_state_and_reshard(tmp_path):
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    optimizer = optax.adamw(1e-3)
    state = sharded_state(mesh, optimizer)
    meta = {"data": {"epoch": 1, "index": 37}, "config": {"steps": 5}}
    with CheckpointManager(tmp_path / "ckpt", max_to_keep=2) as manager:
        assert manager.latest_step() is None
        assert manager.save(11, state, meta)
        manager.wait_until_finished()
        assert manager.latest_step() == 11

    # Restore into a different mesh layout: values equal, shardings as requested.
    mesh2 = jax.make_mesh((2, 4), ("data", "model"))
    shapes = state_lib.eval_state_shape(make_params(), optimizer, jax.random.PRNGKey(0),
                                        ref_params=make_params())
    target = state_lib.abstract_train_state(
        shapes, state_lib.state_shardings(shapes, param_shardings(mesh2)))
    with CheckpointManager(tmp_path / "ckpt") as manager:
        restored = manager.restore(abstract_state=target)
        assert manager.restore_meta(11)["data"] == {"epoch": 1, "index": 37}
    assert restored.step == 11
    assert restored.meta["data"] == {"epoch": 1, "index": 37}
    assert restored.meta["config"] == {"steps": 5}
    assert restored.meta["host"]["device_count"] == 8
    new = restored.state
    assert int(new.step) == 11
    np.testing.assert_array_equal(new.rng, jax.random.PRNGKey(3))
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert new.params["embed"].sharding == NamedSharding(mesh2, P("data", "model"))
    assert new.opt_state[0].mu["embed"].sharding == NamedSharding(mesh2, P("data", "model"))


def test_keep_last_n_and_duplicate_step(tmp_path):
    state = {"w": jnp.zeros((4,))}
    with CheckpointManager(tmp_path, max_to_keep=2) as manager:
        for step in (1, 2, 3, 4):
            assert manager.save(step, jax.tree.map(lambda x: x + step, state), {"i": step})
        assert manager.save(4, state) is False  # final save landing on a periodic one
        manager.wait_until_finished()
        assert manager.all_steps() == [3, 4]
        restored = manager.restore(3)
        assert float(restored.state["w"][0]) == 3.0 and restored.meta["i"] == 3
    assert sorted(p for p in os.listdir(tmp_path) if p.isdigit()) == ["3", "4"]


def test_leftover_tmp_dir_is_never_latest(tmp_path):
    workdir = tmp_path / "run"
    with CheckpointManager(checkpoint_dir(workdir)) as manager:
        manager.save(1, {"w": jnp.ones(3)}, wait=True)
    # What a crash between "start writing" and "rename" leaves behind.
    partial = os.path.join(checkpoint_dir(workdir), "2.orbax-checkpoint-tmp-1700000000")
    os.makedirs(os.path.join(partial, "state"))
    with open(os.path.join(partial, "state", "garbage"), "w") as f:
        f.write("half written")
    assert has_checkpoint(workdir)
    with CheckpointManager(checkpoint_dir(workdir)) as manager:
        assert manager.latest_step() == 1
        assert manager.all_steps() == [1]
        assert float(manager.restore().state["w"][1]) == 1.0
    # orbax deletes leftovers in a thread started with the manager, and close() does not wait
    # for it (only a save does), so wait here; the bound only catches "never deleted".
    deadline = time.monotonic() + 120
    while os.path.exists(partial) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(partial)


def test_has_checkpoint_false_for_empty_or_missing(tmp_path):
    assert not has_checkpoint(tmp_path / "nope")
    os.makedirs(checkpoint_dir(tmp_path))
    assert not has_checkpoint(tmp_path)


def test_sigkill_during_async_save_keeps_previous_latest(tmp_path):
    """A process killed while an async save is in flight leaves step 1 as the latest."""
    directory = tmp_path / "checkpoints"
    # The child holds step 2's save at its commit point (the rename of the temporary directory
    # to "2"), says so, and waits: the parent then kills a step that is fully written but not
    # committed, however long the child took to get there. Listing the directory right after
    # starting the save instead raced the save on a busy machine.
    script = textwrap.dedent(f"""
        import json, os, sys, threading
        sys.path.insert(0, {ROOT!r})
        import jax.numpy as jnp
        from rljax.train.core.checkpoint import CheckpointManager

        rename = os.rename
        def held_rename(src, dst, *args, **kwargs):
            if os.path.basename(os.fspath(dst)) == "2":
                print(json.dumps({{"held": os.fspath(src)}}), flush=True)
                threading.Event().wait()  # until the parent's SIGKILL
            return rename(src, dst, *args, **kwargs)
        os.rename = held_rename

        m = CheckpointManager(sys.argv[1], async_save=True)
        m.save(1, {{"w": jnp.ones((4,))}}, wait=True)
        m.save(2, {{"w": jnp.full((4,), 2.0)}})
        m.wait_until_finished()
        print(json.dumps({{"committed": True}}), flush=True)
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=os.environ.get("RLJAX_TEST_COMPILER_FLAGS", ""))
    stderr_path = tmp_path / "stderr.txt"
    with open(stderr_path, "w") as stderr:  # a file: an unread pipe could fill and block it
        proc = subprocess.Popen([sys.executable, "-c", script, str(directory)],
                                stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    # Only a hang trips this: it kills the child, so readline() returns instead of blocking.
    watchdog = threading.Timer(600, proc.kill)
    watchdog.start()
    try:
        line = proc.stdout.readline()
        assert line, ("the child ended before step 2 reached its commit:\n"
                      + stderr_path.read_text()[-3000:])
        report = json.loads(line)
        assert "held" in report, "step 2 was committed without passing the hold on os.rename"
        assert ".orbax-checkpoint-tmp" in report["held"] and os.path.isdir(report["held"])
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait(timeout=60)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL, stderr_path.read_text()[-3000:]
    assert os.path.isdir(report["held"]) and not (directory / "2").exists()
    with CheckpointManager(directory) as manager:
        assert manager.all_steps() == [1]
        assert manager.latest_step() == 1
        assert float(manager.restore().state["w"][0]) == 1.0
