"""rljax plan: per-device memory of every phase from XLA, the fit check, and plan vs reality."""
import json
import re
import os
import subprocess
import sys

import jax
import pytest

from rljax import cli, config, plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "grpo_arithmetic.py")
TINY = ["--config.sft.steps=0", "--config.rollout.batch_size=16",
        "--config.algo.num_generations=2", "--config.rollout.max_new_tokens=4",
        "--config.model.overrides.num_layers=1", "--config.model.overrides.hidden_size=32",
        "--config.model.overrides.intermediate_size=64"]


def test_cli_plan_reports_every_phase_and_refuses_small_device(capsys):
    # Two mini-batches: the old log-probs are recomputed (a logps pass); the update's
    # micro-batch gradients, then the optimizer step on their sum (apply).
    code = cli.main(["plan", "--config", CONFIG, *TINY, "--config.memory.device_memory_gb=0.0001",
                     "--config.algo.mini_batch_size=8"])
    out, err = capsys.readouterr()
    assert code == 1
    for phase in ("sample", "eval", "logps", "update", "apply"):
        assert f"\n  {phase} " in out
    assert "mesh data=8 fsdp=1 tensor=1 (8 cpu devices" in out
    assert "DOES NOT FIT" in out and "memory.device_memory_gb" in out
    # The peak phase is named (with the tiny config's eval batch, the eval sampler's peak).
    assert re.search(r"rljax: the run does not fit: phase '(update|apply|eval)' needs", err)


def _cfg(*overrides):
    return config.load_config(CONFIG, [*TINY, *overrides])


def test_state_bytes_follow_the_mesh():
    """Resident bytes are per device: fsdp shards params and Adam moments, data replicates."""
    replicated = plan.plan(_cfg("--config.algo.beta=0.04"), compile_phases=False)
    sharded = plan.plan(_cfg("--config.algo.beta=0.04", "--config.mesh.data=1",
                             "--config.mesh.fsdp=8"), compile_phases=False)
    p = replicated.resident_parts
    assert 0 <= p["optimizer"] - 2 * p["params"] < 64     # Adam: mu and nu (+ counts)
    assert set(p) == {"params", "optimizer", "reference"}  # beta > 0 keeps a reference copy
    assert sharded.resident_parts["params"] * 4 < p["params"]
    assert replicated.phases == [] and replicated.capacity > 0
    assert replicated.capacity_source == "host RAM / 8 local CPU devices"
    no_ref = plan.plan(_cfg("--config.algo.beta=0.0"), compile_phases=False)
    assert "reference" not in no_ref.resident_parts


def test_capacity_sources():
    cfg = _cfg("--config.memory.device_memory_gb=2.5")
    assert plan.device_capacity(cfg) == (int(2.5 * (1 << 30)), "memory.device_memory_gb")
    cap, source = plan.device_capacity(_cfg())
    assert cap == plan.host_memory_bytes() // jax.local_device_count() and "host RAM" in source


def test_train_stops_before_a_run_that_cannot_fit(tmp_path, capsys):
    """A 0.5B-parameter model on a '1 GiB' device: train exits 2 with one clear line and never
    allocates the model (the resident-state check needs no compile)."""
    code = cli.main(["train", "--config", CONFIG, *TINY, "--workdir", str(tmp_path / "w"),
                     "--config.model.preset=qwen2.5-0.5b", "--config.model.overrides={}",
                     "--config.algo.beta=0.04", "--config.memory.device_memory_gb=1"])
    err = capsys.readouterr().err
    assert code == 2
    line = err.strip().splitlines()[-1]
    assert line.startswith("rljax: error: the run does not fit: the train state alone "
                           "(params, optimizer, reference) needs")
    assert "but a device has 1 GiB (memory.device_memory_gb)" in line
    assert "mesh.fsdp" in line
    assert not (tmp_path / "w" / "checkpoints").exists()


def test_check_modes():
    assert plan.check(_cfg("--config.memory.check=off")) is None
    p = plan.check(_cfg())   # auto on CPU without device_memory_gb: resident state only
    assert p.fits and p.phases == []


# The plan against reality, on one CPU device: run the GRPO update once and compare the peak
# RSS growth while it runs (malloc_trim + /proc/self/clear_refs reset the high-water mark)
# with what the plan says its programs allocate beyond the state: a micro-batch's gradient
# total and temporaries (``update``), then, the total still held, the optimizer step's
# outputs - aliased + temporaries (``apply``). Exact per-program figures, on every algorithm:
# test_plan_programs.py.
MEASURE = r"""
import ctypes, json, sys
import jax, numpy as np
from rljax import config, models, plan, sharding as shd
from rljax.train.core import optim
from rljax.train.phases import grpo
from rljax.train.core.state import create_train_state, eval_state_shape, state_shardings

cfg = config.load_config(sys.argv[1], sys.argv[2:])
p = plan.plan(cfg)
libc = ctypes.CDLL("libc.so.6")
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
mesh = shd.make_mesh(config.mesh.axis_sizes(cfg.mesh))
tok = plan._tokenizer(cfg)
mcfg = plan.model_config(cfg, tok)
shapes = jax.eval_shape(lambda: models.init_params(mcfg, jax.random.key(0)))
psh = shd.logical_to_sharding(models.param_logical_axes(mcfg), mesh, shapes=shapes)
params = jax.jit(lambda r: models.init_params(mcfg, r), out_shardings=psh)(jax.random.key(1))
opt = optim.make_optimizer(cfg.optimizer, 10)
ssh = state_shardings(eval_state_shape(params, opt, jax.random.PRNGKey(0)), psh)
state = jax.jit(lambda q, r: create_train_state(q, opt, r), out_shardings=ssh)(
    params, jax.random.PRNGKey(0))
del params
R, P, N = cfg.rollout.batch_size, cfg.data.max_prompt_length, cfg.rollout.max_new_tokens
G = cfg.algo.num_generations
rng = np.random.default_rng(0)
prompt = rng.integers(3, tok.vocab_size, (R // G, P)).astype(np.int32)
batch = {   # G completions of each prompt: the shared-prompt layout applies
    "tokens": np.concatenate([np.repeat(prompt, G, axis=0),
                              rng.integers(3, tok.vocab_size, (R, N)).astype(np.int32)], 1),
    "mask": np.ones((R, P + N), bool), "loss_mask": np.ones((R, N), bool),
    "advantages": rng.normal(size=(R,)).astype(np.float32),
    "sampler_logps": np.full((R, N), -3.0, np.float32)}
update = grpo.build_update(mcfg, cfg.algo, opt, state_shardings=ssh, mesh=mesh)
# One warm-up call first: the first execution also pays one-time costs (thread pools, their
# stacks and arenas) that are not the step's memory. The update donates the state, so the
# measured call runs on the warm-up's output state, which has the same shapes.
state = jax.block_until_ready(update(state, batch)[0])
live = plan.measure_live_bytes()
libc.malloc_trim(0)
open("/proc/self/clear_refs", "w").write("5")
before = status("VmRSS")
out = update(state, batch)
jax.block_until_ready(out)
measured = status("VmHWM") - before
u, a = (next(x for x in p.phases if x.name == name) for name in ("update", "apply"))
total = u.outputs - u.aliased
planned = max(total + u.temps, total + a.outputs - a.aliased + a.temps)
print(json.dumps({"fits": p.fits, "phases": [x.name for x in p.phases],
                  "resident": p.resident, "live_before": live,
                  "state_arguments": u.resident_arguments, "planned": planned,
                  "measured": measured, "update": [u.outputs, u.aliased, u.temps],
                  "apply": [a.outputs, a.aliased, a.temps]}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_plan_matches_measured_memory_on_cpu():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
               XLA_FLAGS="--xla_force_host_platform_device_count=1")
    overrides = ["--config.sft.steps=0", "--config.model.preset=small",
                 "--config.model.overrides={'num_layers': 2}", "--config.algo.beta=0.0",
                 "--config.rollout.batch_size=32", "--config.algo.num_generations=4",
                 "--config.data.max_prompt_length=32", "--config.rollout.max_new_tokens=32",
                 "--config.algo.update_streams=1"]
    r = subprocess.run([sys.executable, "-c", MEASURE, CONFIG, *overrides], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    print("plan vs measured (bytes):", m)
    assert m["fits"] and m["phases"] == ["sample", "eval", "update", "apply"]
    # Inputs: the plan's resident state is exactly the live arrays (the batch is on the host).
    assert m["live_before"] == m["state_arguments"] == m["resident"], m
    # What the update allocates: XLA's temporaries are an upper bound (the buffer assignment's
    # arena, whose pages RSS counts only once touched), against allocator slack, per-thread
    # arenas and the executables' own buffers; measured 80-110% of the plan in runs here.
    assert 0.7 * m["planned"] < m["measured"] < 1.4 * m["planned"], m
    assert m["planned"] > 50 * (1 << 20), m  # large enough that RSS noise does not matter


def test_episode_runs_are_planned_at_their_trajectory_length():
    """With an environment the update trains on prompt + env.max_total_tokens positions and the
    sampler's cache holds the multi-turn slots, whatever rollout.max_new_tokens says."""
    def update_args(total):
        p = plan.plan(config.load_config(os.path.join(ROOT, "configs", "grpo_tool_arithmetic.py"), [
            *TINY, "--config.rollout.micro_batch_size=0", f"--config.env.max_total_tokens={total}"]))
        return next(x.arguments - x.resident_arguments for x in p.phases if x.name == "update"), p

    short, _ = update_args(16)
    long, p = update_args(64)
    assert long > short
    assert any("env.max_total_tokens" in n and "slots after the prompt" in n for n in p.notes)


def test_episodes_on_the_slot_engine_are_planned_as_the_episode_engines_programs():
    """Tool episodes with rollout.engine=slots: the plan compiles the episode engine's prefill
    and decode chunk (S slots of env.max_total_tokens + 1 entries), not the single-turn
    engine's; with fewer slots than rows the decode program holds less than the static
    sampler's."""
    path = os.path.join(ROOT, "configs", "grpo_tool_arithmetic.py")
    base = [*TINY, "--config.rollout.micro_batch_size=0", "--config.mesh.data=1"]
    one = jax.devices()[:1]
    static = plan.plan(config.load_config(path, base), devices=one)
    slots = plan.plan(config.load_config(path, [*base, "--config.rollout.engine=slots",
                                                "--config.rollout.slots=2"]), devices=one)
    names = {ph.name: ph.peak(slots.resident) for ph in slots.phases}
    assert {"sample/episode_prefill", "sample/episode_decode"} <= set(names)
    assert "sample/decode" not in names
    assert names["sample/episode_decode"] < {ph.name: ph.peak(static.resident)
                                             for ph in static.phases}["sample"]


@pytest.mark.parametrize("engine, tree_programs", [
    ("static", {"sample"}), ("slots", {"sample/prefill", "sample/decode"}),
    ("slots --config.rollout.partial=true", {"sample/prefill", "sample/decode"})])
def test_trees_of_episodes_are_planned_as_the_tree_then_the_episode_engine(engine,
                                                                        tree_programs):
    """rollout.tree with env.name: the tree sampler's programs over the first turn (static, or
    the slot engine's two) and the episode engine's, whose feed holds a leaf's trajectory
    (partial rollouts: over the two batches' places)."""
    path = os.path.join(ROOT, "configs", "grpo_tool_arithmetic.py")
    tree = ["--config.rollout.tree.enabled=true", "--config.rollout.tree.segment_tokens=2",
            "--config.rollout.tree.branching=2", "--config.algo.num_generations=4",
            "--config.algo.adv_estimator=treepo"]
    cfg = config.load_config(path, [*TINY, "--config.rollout.micro_batch_size=0",
                                    "--config.mesh.data=1", *tree,
                                    *f"--config.rollout.engine={engine}".split()])
    p = plan.plan(cfg, devices=jax.devices()[:1])
    names = {ph.name for ph in p.phases}
    assert tree_programs | {"sample/episode_prefill", "sample/episode_decode"} <= names


def test_the_slot_engine_is_planned_as_its_two_programs():
    long = ["--config.rollout.max_new_tokens=64", "--config.algo.num_generations=8"]
    one = jax.devices()[:1]   # the engine does not split its slots over a mesh (a note says so)
    mesh = ["--config.mesh.data=1"]
    static_plan = plan.plan(_cfg(*long, *mesh), devices=one)
    slots_plan = plan.plan(_cfg(*long, *mesh, "--config.rollout.engine=slots",
                                "--config.rollout.slots=4"), devices=one)
    static = {ph.name: ph.peak(static_plan.resident) for ph in static_plan.phases}
    slots = {ph.name: ph.peak(slots_plan.resident) for ph in slots_plan.phases}
    assert "sample" in static and "sample" not in slots
    assert {"sample/prefill", "sample/decode"} <= set(slots)
    # 16 rows of (prompt + 64) cache slots against 2 prompt pages + 4 slots of 64: the engine's
    # decode program holds less than the static sampler's whole program
    assert slots["sample/decode"] < static["sample"]
    eight = plan.plan(_cfg(*long, "--config.rollout.engine=slots"))
    assert any("does not split them over the mesh" in n for n in eight.notes)
    # Trees on the engine: its two programs at the widest level (8 leaves x 2 prompts, pages
    # of prompt + 3 forks x 2 tokens), not the static tree sampler's one.
    tree = ["--config.rollout.tree.enabled=true", "--config.rollout.tree.segment_tokens=2"]
    tree_plan = plan.plan(_cfg(*long, *mesh, *tree, "--config.rollout.engine=slots",
                               "--config.rollout.slots=4"), devices=one)
    names = {ph.name for ph in tree_plan.phases}
    assert {"sample/prefill", "sample/decode"} <= names and "sample" not in names


def test_the_plan_states_the_kv_cache_and_what_rings_save():
    """Sliding-window layers keep rings of ``sliding_window`` slots while sampling; the plan's
    note gives the run's KV cache with and without them (``models.kv_cache_bytes``)."""
    gemma = ["--config.model.overrides.model_type=gemma3", "--config.model.overrides.num_layers=3",
             "--config.model.overrides.sliding_window=8", "--config.rollout.max_new_tokens=64"]
    cfg = _cfg(*gemma)
    cfg.model.overrides.layer_types = ("sliding_attention", "sliding_attention", "full_attention")
    p = plan.plan(cfg, compile_phases=False)
    note = next(n for n in p.notes if n.startswith("KV cache while sampling"))
    assert "16 rows x 72 slots" in note and "rings of 8 slots" in note
    llama = plan.plan(_cfg("--config.rollout.max_new_tokens=64"), compile_phases=False)
    note = next(n for n in llama.notes if n.startswith("KV cache while sampling"))
    assert "rings" not in note
