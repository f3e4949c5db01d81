"""Expert-parallel MoE dispatch (``models.moe_dispatch``) on 8 fake CPU devices: the sharded
model computes what the unsharded one does, each device's work is its share of the batch's,
and tokens travel by all-to-all over the expert axis, never as a gathered global assignment."""
import functools
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from rljax import config, cost as cost_lib, models, sharding
from rljax.models import moe, moe_dispatch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _small():
    """tiny-moe narrowed, with a router sharp enough that every expert gets tokens (the
    sharding tests' model)."""
    from test_moe_sharding import _model
    return _model()


def _on_mesh(cfg, params, batch, axes):
    mesh = sharding.make_mesh(axes)
    shardings = sharding.logical_to_sharding(models.param_logical_axes(cfg), mesh, shapes=params)
    return mesh, sharding.shard_params(params, shardings), sharding.shard_batch(batch, mesh)


def _loss(cfg, params, tokens, mask):
    return jnp.sum(models.token_logps(cfg, params, tokens, mask)[0])


def _gathered_assignments(hlo: str, k: int) -> list[str]:
    """The HLO's all-gathers of token assignments: integer arrays [..., k] or flattened [N*k]
    (the embedding lookup's token ids [B, T, 1] may be gathered; they are not assignments)."""
    found = []
    for line in hlo.splitlines():
        m = re.search(r"= [su](?:8|16|32|64)\[([\d,]*)\][^ ]* all-gather", line)
        if m and (m.group(1).endswith(f",{k}") or "," not in m.group(1)):
            found.append(line)
    return found


_GRAD_FN = jax.value_and_grad(_loss, argnums=1)
_REF_GRAD = jax.jit(_GRAD_FN, static_argnums=0)
_REF_FORWARD = jax.jit(models.forward, static_argnums=0)


@pytest.mark.parametrize("axes", [{"data": 2, "expert": 4},
                                  {"fsdp": 2, "expert": 2, "tensor": 2}])
def test_expert_parallel_forward_loss_and_grads_equal_unsharded(axes):
    cfg, params, tokens, mask = _small()
    grad_fn = _GRAD_FN
    # The unsharded reference: one program for both meshes (module-level jit).
    ref_loss, ref_grad = _REF_GRAD(cfg, params, tokens, mask)
    ref_logits = _REF_FORWARD(cfg, params, tokens, mask)

    mesh, sharded, batch = _on_mesh(cfg, params, {"tokens": tokens, "mask": mask}, axes)
    fwd = jax.jit(sharding.traced_on(lambda p, t, m: models.forward(cfg, p, t, m), mesh))
    step = jax.jit(sharding.traced_on(lambda p, t, m: grad_fn(cfg, p, t, m), mesh))
    logits = fwd(sharded, batch["tokens"], batch["mask"])
    loss, grad = step(sharded, batch["tokens"], batch["mask"])
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for name in ("router", "expert_gate", "expert_up", "expert_down", "q"):
        np.testing.assert_allclose(np.asarray(grad["layers"][name]),
                                   np.asarray(ref_grad["layers"][name]), rtol=1e-4, atol=1e-6)
    hlo = step.lower(sharded, batch["tokens"], batch["mask"]).compile().as_text()
    assert "all-to-all" in hlo and not _gathered_assignments(hlo, cfg.num_experts_per_tok)


def test_lora_on_attention_of_an_expert_parallel_moe_updates_as_unsharded():
    """A GRPO update of LoRA adapters (q, v) on the MoE, data 2 x expert 4 (the experts'
    tokens exchanged by the dispatch, the adapters replicated over the expert axis) gives the
    unsharded update's loss and adapters; the base stays frozen."""
    from rljax.models import lora
    from rljax.train.core import optim
    from rljax.train.core.state import create_train_state, eval_state_shape, state_shardings
    from rljax.train.phases import grpo
    from test_train_steps import algo_cfg, make_batch

    cfg, params, _, _ = _small()
    params = jax.tree.map(np.asarray, params)   # the update donates its state: fresh copies
    cfg = cfg.replace(lora_scale=2.0)
    opt_cfg = config.default_config().optimizer
    opt_cfg.name = "sgd"
    opt = optim.make_optimizer(opt_cfg, 100, learning_rate=1.0)

    def fresh():
        adapters = lora.init_lora(cfg, 4, "q|v", jax.random.key(1))
        adapters = jax.tree.map(lambda x: x + 0.05, adapters)   # B != 0: a live adapter
        return create_train_state({**jax.tree.map(jnp.asarray, params), "lora": adapters},
                                  opt, jax.random.key(2))

    algo, batch = algo_cfg(beta=0.0), make_batch(2)
    want_state, want = grpo.build_update(cfg, algo, opt)(fresh(), batch)
    mesh = sharding.make_mesh({"data": 2, "expert": 4})
    state = fresh()
    pshard = sharding.logical_to_sharding(
        {**models.param_logical_axes(cfg), "lora": lora.lora_logical_axes(cfg, 4, "q|v")},
        mesh, shapes=state.params)
    sshard = state_shardings(eval_state_shape(state.params, opt, state.rng), pshard)
    step = grpo.build_update(cfg, algo, opt, state_shardings=sshard, mesh=mesh)
    new_state, got = step(jax.device_put(state, sshard), batch)
    np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-5, atol=1e-7)
    moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()),
                         want_state.params["lora"], fresh().params["lora"])
    assert max(jax.tree.leaves(moved)) > 1e-4
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                         rtol=1e-5, atol=1e-6),
                 new_state.params, want_state.params)
    np.testing.assert_array_equal(np.asarray(new_state.params["layers"]["expert_up"]),
                                  np.asarray(params["layers"]["expert_up"]))


def test_replayed_routes_through_the_dispatch_are_the_recorded_forward():
    cfg, params, tokens, mask = _small()
    mesh, sharded, batch = _on_mesh(cfg, params, {"tokens": tokens, "mask": mask},
                                    {"data": 2, "expert": 4})

    @functools.partial(jax.jit, static_argnames="mesh")
    @sharding.traced_on_mesh_kwarg
    def trunk(p, t, m, routes=None, *, mesh=None):
        return models.trunk(cfg, p, t, m, routes=routes, with_moe_stats=True)

    hidden, _, stats = trunk(sharded, batch["tokens"], batch["mask"], mesh=mesh)
    replayed, _, again = trunk(sharded, batch["tokens"], batch["mask"], stats["ids"], mesh=mesh)
    np.testing.assert_array_equal(np.asarray(replayed), np.asarray(hidden))
    np.testing.assert_array_equal(np.asarray(again["ids"]), np.asarray(stats["ids"]))
    unsharded = trunk(params, tokens, mask, stats["ids"])[0]   # no mesh: one device's dispatch
    np.testing.assert_allclose(np.asarray(unsharded), np.asarray(hidden), rtol=1e-5, atol=1e-5)
    # Other routes go through the same dispatch and change the output.
    other = trunk(sharded, batch["tokens"], batch["mask"], (stats["ids"] + 1) % cfg.num_experts,
                  mesh=mesh)[0]
    assert np.abs(np.asarray(other - hidden)).max() > 1e-3


def test_decode_with_fewer_tokens_than_devices_samples_what_one_device_does():
    """The sampler traced on data 2 x expert 4: each decode step has 3 prompts x 2 samples =
    6 tokens for 8 devices (the dispatch pads them); greedy tokens and the recorded routes
    are one device's."""
    from rljax import sampling
    cfg, params, tokens, mask = _small()
    prompts, prompt_mask = tokens[:3, :6], np.ones((3, 6), bool)
    kw = dict(rng=jax.random.PRNGKey(0), max_new_tokens=4, temperature=0.0, num_samples=2,
              record_routes=True)
    one = sampling.generate(cfg, params, prompts, prompt_mask, **kw)
    mesh, sharded, _ = _on_mesh(cfg, params, {}, {"data": 2, "expert": 4})
    rep = NamedSharding(mesh, P())
    split = sampling.generate(cfg, sharded, jax.device_put(prompts, rep),
                              jax.device_put(prompt_mask, rep), mesh=mesh, **kw)
    np.testing.assert_array_equal(np.asarray(split.tokens), np.asarray(one.tokens))
    np.testing.assert_array_equal(np.asarray(split.routes), np.asarray(one.routes))
    np.testing.assert_allclose(np.asarray(split.logps), np.asarray(one.logps), atol=1e-5)


def test_the_slot_engine_decodes_a_sharded_moe_as_the_static_sampler_does():
    """The slot engine (3 slots: 3 tokens a decode step) on parameters split over data 2 x
    expert 4, traced on their mesh (the dispatch pads the 3 tokens to the 8 devices): greedy
    tokens are the static sampler's on one device."""
    from rljax import sampling
    from rljax.sampling import engine
    cfg, params, tokens, _ = _small()
    prompts, prompt_mask = tokens[:2, :6], np.ones((2, 6), bool)
    kw = dict(rng=jax.random.PRNGKey(0), max_new_tokens=5, temperature=0.0, num_samples=2)
    ref = sampling.generate(cfg, params, prompts, prompt_mask, **kw)
    mesh, sharded, _ = _on_mesh(cfg, params, {}, {"data": 2, "expert": 4})
    assert engine.params_mesh(sharded) is mesh and engine.params_mesh(params) is None
    out, _ = engine.generate(cfg, sharded, prompts, prompt_mask, slots=3, chunk_steps=2, **kw)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))


def test_capacity_factor_drops_and_counts_what_does_not_fit():
    """Dropless by default; a capacity factor caps each device's rows per expert device, the
    dropped assignments contribute nothing and are counted."""
    cfg = models.get_preset("tiny", model_type="qwen3_moe", num_experts=8,
                            num_experts_per_tok=2, moe_intermediate_size=8)
    layers = models.init_params(cfg, jax.random.PRNGKey(1))["layers"]
    p = {k: layers[k][0] for k in ("router", "expert_gate", "expert_up", "expert_down")}
    x = jax.random.normal(jax.random.PRNGKey(2), (64, cfg.hidden_size))
    ids, w, _ = moe.route(cfg, p["router"] * 50, x)
    mesh = sharding.make_mesh({"data": 2, "expert": 4})
    rep = NamedSharding(mesh, P())
    run = lambda f: jax.jit(sharding.traced_on(lambda *a: moe_dispatch.dispatch(*a[:4], None, f),
                                               mesh), in_shardings=rep)(p, x, ids, w)
    full, none_dropped = run(0.0)
    local, _ = moe_dispatch.dispatch(p, x, ids, w)   # no mesh
    np.testing.assert_allclose(np.asarray(full), np.asarray(local), rtol=1e-5, atol=1e-6)
    assert float(none_dropped) == 0
    capped, dropped = run(0.5)
    assert 0 < float(dropped) < ids.size
    # Each token's output is its kept experts' share of the dropless one: rows of tokens that
    # lost nothing are unchanged, and at least one row changed.
    same = np.all(np.isclose(np.asarray(capped), np.asarray(full), atol=1e-6), axis=1)
    assert same.any() and not same.all()
    assert moe_dispatch.capacity(16, 2, 2, 4) == 32 and moe_dispatch.capacity(16, 2, 2, 4, 1.25) == 10


# ------------------------------------------------------------------ work per device

def _cost_model():
    """The experts' FFN dwarfs attention and the vocabulary: 16 experts of width 256 on a
    32-wide model, 2 per token."""
    return models.get_preset("tiny-moe", hidden_size=32, num_heads=2, num_kv_heads=1,
                             head_dim=16, num_experts=16, num_experts_per_tok=2,
                             moe_intermediate_size=256, vocab_size=64)


def _abstract(tree, shardings=None):
    if shardings is None:
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), tree)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        tree, shardings)


_FORWARD_PROGRAMS = {}


def _forward_program(cfg, axes, rows=32, length=32):
    """The compiled forward of ``rows`` x ``length`` tokens on ``axes`` (None: one device),
    compiled once per module for each (config, mesh, shape)."""
    key = (cfg, None if axes is None else tuple(axes.items()), rows, length)
    if key not in _FORWARD_PROGRAMS:
        _FORWARD_PROGRAMS[key] = _compile_forward(cfg, axes, rows, length)
    return _FORWARD_PROGRAMS[key]


def _compile_forward(cfg, axes, rows, length):
    shapes = jax.eval_shape(lambda: models.init_params(cfg, jax.random.PRNGKey(0)))
    tok = jax.ShapeDtypeStruct((rows, length), jnp.int32)
    msk = jax.ShapeDtypeStruct((rows, length), bool)
    fn = lambda p, t, m: models.forward(cfg, p, t, m)
    if axes is None:
        return jax.jit(fn).lower(_abstract(shapes), tok, msk).compile()
    mesh = sharding.make_mesh(axes)
    psh = sharding.logical_to_sharding(models.param_logical_axes(cfg), mesh, shapes=shapes)
    bsh = sharding.batch_sharding(mesh, (rows, length))
    return jax.jit(sharding.traced_on(fn, mesh)).lower(
        _abstract(shapes, psh), jax.ShapeDtypeStruct(tok.shape, tok.dtype, sharding=bsh),
        jax.ShapeDtypeStruct(msk.shape, msk.dtype, sharding=bsh)).compile()


def _update_programs(cfg, axes, rows=32):
    """The compiled GRPO update (gradients of ``rows`` rows of 16 prompt + 16 completion
    tokens, and the optimizer step) on ``axes`` (None: one device): ``[(compiled, copies)]``,
    copies = how many calls one update makes (concurrent streams each take a share)."""
    from rljax.train.core import optim
    from rljax.train.core.state import eval_state_shape, state_shardings
    from rljax.train.phases import grpo
    run_cfg = config.load_config(os.path.join(ROOT, "configs", "grpo_arithmetic.py"),
                                 ["--config.sft.steps=0", f"--config.rollout.batch_size={rows}",
                                  "--config.algo.num_generations=4",
                                  "--config.algo.shared_prompt=False",
                                  "--config.rollout.max_new_tokens=16",
                                  "--config.data.max_prompt_length=16"])
    opt = optim.make_optimizer(run_cfg.optimizer, 10)
    shapes = jax.eval_shape(lambda: models.init_params(cfg, jax.random.PRNGKey(0)))
    mesh = None if axes is None else sharding.make_mesh(axes, jax.devices()[:8])
    if mesh is None:
        mesh1 = sharding.make_mesh({"data": 1}, jax.devices()[:1])
        psh = sharding.logical_to_sharding(models.param_logical_axes(cfg), mesh1, shapes=shapes)
    else:
        psh = sharding.logical_to_sharding(models.param_logical_axes(cfg), mesh, shapes=shapes)
    state = eval_state_shape(_abstract(shapes, psh), opt, jax.random.PRNGKey(0))
    ssh = state_shardings(state, psh)
    update = grpo.build_update(cfg, run_cfg.algo, opt, state_shardings=ssh, mesh=mesh)
    fields = grpo.batch_fields(run_cfg, cfg)
    return [(fn.lower(*args).compile(), copies) for _, fn, args, copies in
            update.programs(_abstract(state, ssh), rows, 16, 16, fields)]


def _flops(compiled) -> float:
    return cost_lib.program_cost(compiled).flops


def _update_flops(programs) -> float:
    return sum(_flops(compiled) * copies for compiled, copies in programs)


MESHES = [{"data": 8}, {"fsdp": 8}, {"data": 2, "expert": 4}, {"expert": 8}]


def test_each_device_does_an_eighth_of_the_forward_and_the_update():
    """XLA's cost analysis of the compiled programs: FLOPs per device within 1.3x of 1/8 of
    the one-device program's, forward and GRPO update, for data, fsdp and expert parallelism.
    (XLA:CPU runs ``ragged_dot`` as a masked dense matmul over its groups, so these counts are
    rows x local experts on every mesh alike; see docs/scaling.md.)"""
    cfg = _cost_model()
    whole_fwd = _flops(_forward_program(cfg, None))
    whole_upd = _update_flops(_update_programs(cfg, None))
    ratios = {}
    for axes in MESHES:
        fwd = _forward_program(cfg, axes)
        hlo = fwd.as_text()
        assert not _gathered_assignments(hlo, cfg.num_experts_per_tok), axes
        assert ("all-to-all" in hlo) == ("expert" in axes), axes
        ratios[str(axes)] = (_flops(fwd) / whole_fwd,
                             _update_flops(_update_programs(cfg, axes)) / whole_upd)
    print(ratios)
    for name, (fwd, upd) in ratios.items():
        assert 1 / 8 / 1.3 <= fwd <= 1.3 / 8, (name, fwd)
        assert 1 / 8 / 1.3 <= upd <= 1.3 / 8, (name, upd)


_BIG = r"""
import json, sys, time
import jax, jax.numpy as jnp
from rljax import models, sharding
cfg = models.get_preset("qwen3-30b-a3b", dtype="bfloat16", param_dtype="bfloat16")
mesh = sharding.make_mesh({"data": 8, "expert": 8})
shapes = jax.eval_shape(lambda: models.init_params(cfg, jax.random.PRNGKey(0)))
psh = sharding.logical_to_sharding(models.param_logical_axes(cfg), mesh, shapes=shapes)
params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      shapes, psh)
bsh = sharding.batch_sharding(mesh, (64, 256))
tok = jax.ShapeDtypeStruct((64, 256), jnp.int32, sharding=bsh)
msk = jax.ShapeDtypeStruct((64, 256), bool, sharding=bsh)
t0 = time.perf_counter()
loss = lambda p, t, m: jnp.sum(models.token_logps(cfg, p, t, m)[0])
fn = sharding.traced_on(jax.value_and_grad(loss), mesh)
hlo = jax.jit(fn).lower(params, tok, msk).compile().as_text()
print(json.dumps({"s": time.perf_counter() - t0, "all_to_all": "all-to-all" in hlo,
                  "int_gathers": [l for l in hlo.splitlines()
                                  if " all-gather(" in l and "= s32" in l]}))
"""


@pytest.mark.slow
def test_qwen3_30b_a3b_compiles_on_64_devices_expert_parallel():
    """The loss and its gradients at the qwen3-30b-a3b shape (abstract bf16 parameters,
    64 x 256 tokens) on data 8 x expert 8 fake devices compile, with all-to-all and no
    gathered assignments (compile only: about 10-30 s on a 2-core CPU)."""
    flags = " ".join(["--xla_force_host_platform_device_count=64",
                      os.environ.get("RLJAX_TEST_COMPILER_FLAGS", "")])
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, XLA_FLAGS=flags.strip())
    out = subprocess.run([sys.executable, "-c", _BIG], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    import json
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["all_to_all"], result
    gathered = [g for g in result["int_gathers"] if re.search(r"s32\[[\d,]*,8\]|s32\[\d+\]", g)]
    assert not gathered, gathered   # no token assignments [..., k=8] gathered


# ------------------------------------------------------------------ the plan's stand-in

def test_the_plans_stand_in_counts_a_grouped_matmul_by_its_rows():
    """``bucketed_ffn`` (``rljax plan``'s stand-in) computes ``expert_ffn`` when every group
    fits its bucket, and XLA counts its FLOPs as 2 x 3 x rows x D x F (rows = L x bucket),
    where XLA:CPU's ragged_dot counts every row against every local expert: L times that."""
    num, d, f, r, bucket = 16, 32, 256, 512, 32
    rng = np.random.default_rng(0)
    sizes = jnp.asarray(rng.multinomial(r - 40, [1 / num] * num), jnp.int32)   # 40 empty
    rows = jnp.asarray(rng.normal(size=(r, d)), jnp.float32)
    gate, up, down = (jnp.asarray(rng.normal(size=s) * 0.1, jnp.float32)
                      for s in [(num, d, f), (num, d, f), (num, f, d)])
    want = moe_dispatch.expert_ffn(rows, sizes, gate, up, down)
    got = moe_dispatch.bucketed_ffn(rows, sizes, gate, up, down, int(sizes.max()))
    np.testing.assert_allclose(np.asarray(got[:r - 40]), np.asarray(want[:r - 40]),
                               rtol=1e-5, atol=1e-5)
    assert not np.asarray(got[r - 40:]).any()
    grouped = 2 * 3 * num * bucket * d * f
    stand_in = _flops(jax.jit(lambda *a: moe_dispatch.bucketed_ffn(*a, bucket)).lower(
        rows, sizes, gate, up, down).compile())
    ragged = _flops(jax.jit(moe_dispatch.expert_ffn).lower(rows, sizes, gate, up, down)
                    .compile())
    assert 1.0 <= stand_in / grouped < 1.05, stand_in / grouped   # + silu and the product
    assert ragged / grouped > num / 2, ragged / grouped


def test_a_planned_moe_forward_does_an_eighth_per_device_at_a_balanced_load():
    """With the stand-in (``moe_plan_balanced``), the forward's FLOPs per device are 1/8 of
    one device's on expert=8 and on data=8, and on one device its expert matmuls count the
    n x k rows once: far below the ragged lowering's count."""
    cfg = _cost_model().replace(moe_plan_balanced=True)
    whole = _flops(_forward_program(cfg, None))
    ragged = _flops(_forward_program(_cost_model(), None))
    n, k = 32 * 32, cfg.num_experts_per_tok
    experts = 2 * 3 * n * k * cfg.hidden_size * cfg.moe_intermediate_size * cfg.num_layers
    assert experts < whole < 1.5 * experts and ragged > 4 * whole, (experts, whole, ragged)
    for axes in ({"expert": 8}, {"data": 8}):
        ratio = _flops(_forward_program(cfg, axes)) / whole
        assert 1 / 8 / 1.3 <= ratio <= 1.3 / 8, (axes, ratio)


def test_only_the_plan_uses_the_stand_in(monkeypatch):
    """Model configs leave it off; ``rljax plan`` compiles with it (and says so), the
    training pre-flight check (``plan.check``) without; a run that asks for it is refused."""
    from rljax import plan
    from rljax.errors import ConfigError
    from rljax.train import phases
    from rljax.train.core import inputs
    assert not _cost_model().moe_plan_balanced
    assert not any(models.get_preset(name).moe_plan_balanced for name in models.PRESETS)
    seen = []
    monkeypatch.setattr(phases, "phase_programs",
                        lambda ctx: seen.append(ctx.model_cfg.moe_plan_balanced) or [])
    base = ["--config.sft.steps=0", "--config.rollout.batch_size=8",
            "--config.algo.num_generations=2", "--config.model.preset=tiny-moe",
            "--config.memory.check=full", "--config.mesh.data=1"]
    cfg = config.load_config(os.path.join(ROOT, "configs", "grpo_arithmetic.py"), base)
    planned = plan.plan(cfg, jax.devices()[:1])
    assert seen == [True] and "planned at a balanced load" in " ".join(planned.notes)
    seen.clear()
    plan.check(cfg, jax.devices()[:1])
    assert seen and not any(seen)
    asked = config.load_config(os.path.join(ROOT, "configs", "grpo_arithmetic.py"),
                               [*base, "--config.model.overrides.moe_plan_balanced=true"])
    with pytest.raises(ConfigError, match="moe_plan_balanced: set by `rljax plan`"):
        inputs.check_inputs(asked, 1)
