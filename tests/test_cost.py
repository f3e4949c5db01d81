"""rljax plan --cost: per-device costs come from the compiled programs (XLA's cost analysis
and the HLO's collectives), and the roofline names the bound that decides the time."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rljax import cost as cost_lib
from rljax.errors import UserError


def _matmul_cost(b, k=128, n=32, mesh=None):
    """Cost of [b, k] @ [k, n] in float32, with ``mesh``: k split over its 8 devices (each
    device multiplies its slice, then the partial products are summed across devices)."""
    if mesh is None:
        a, w, out = (jax.ShapeDtypeStruct((b, k), jnp.float32),
                     jax.ShapeDtypeStruct((k, n), jnp.float32), None)
    else:
        a = jax.ShapeDtypeStruct((b, k), jnp.float32, sharding=NamedSharding(mesh, P(None, "t")))
        w = jax.ShapeDtypeStruct((k, n), jnp.float32, sharding=NamedSharding(mesh, P("t", None)))
        out = NamedSharding(mesh, P())
    compiled = jax.jit(lambda x, y: x @ y, out_shardings=out).lower(a, w).compile()
    return cost_lib.program_cost(compiled)


def test_flops_are_the_compiled_programs_and_double_with_the_batch():
    one, two = _matmul_cost(64), _matmul_cost(128)
    assert one.flops == 2 * 64 * 128 * 32          # a multiply and an add per term
    assert two.flops == 2 * one.flops
    assert one.collective_bytes == 0                # one device: nothing to exchange


def test_a_tensor_parallel_split_divides_the_flops_and_adds_its_all_reduce():
    mesh = Mesh(np.array(jax.devices()[:8]), ("t",))
    whole, split = _matmul_cost(64), _matmul_cost(64, mesh=mesh)
    # Each device computes 1/8 of the products; the all-reduce's own adds come on top.
    assert whole.flops / 8 <= split.flops <= 1.1 * whole.flops / 8
    assert split.collective_bytes == 64 * 32 * 4    # the f32 [64, 32] partial sums, summed


def test_a_scan_over_layers_costs_what_the_unrolled_layers_cost():
    """XLA's cost analysis counts a while loop's body once; the known trip count puts the other
    layers back: FLOPs as the unrolled program's, bytes within 10% (XLA fuses them otherwise)."""
    x = jax.ShapeDtypeStruct((64, 128), jnp.float32)
    ws = jax.ShapeDtypeStruct((6, 128, 128), jnp.float32)

    def scanned(x, ws):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]

    def unrolled(x, ws):
        for i in range(6):
            x = jnp.tanh(x @ ws[i])
        return x
    loop = cost_lib.program_cost(jax.jit(scanned).lower(x, ws).compile())
    flat = cost_lib.program_cost(jax.jit(unrolled).lower(x, ws).compile())
    assert flat.flops == 6 * 2 * 64 * 128 * 128
    assert flat.flops <= loop.flops <= flat.flops + 16     # (+ the loop counter's adds)
    assert abs(loop.bytes_accessed - flat.bytes_accessed) <= 0.1 * flat.bytes_accessed


def test_collectives_are_read_from_the_hlo_once_each():
    hlo = "\n".join([
        "%a = f32[64,32]{1,0} all-reduce(%x), replica_groups={}",
        "%b = (bf16[8,16]{1,0}, bf16[8,16]{1,0}) all-gather-start(%y), dimensions={0}",
        "%c = bf16[8,16]{1,0} all-gather-done(%b)",
        "%d = f32[4]{0} add(%e, %f)"])
    assert cost_lib.collective_bytes(hlo) == 64 * 32 * 4 + 2 * 8 * 16 * 2


def test_the_roofline_names_its_bound():
    chip = cost_lib.CHIPS["v5e"]
    compute = cost_lib.ProgramCost(flops=chip["flops"], bytes_accessed=1.0, collective_bytes=0)
    assert cost_lib.roofline(compute, "v5e") == (pytest.approx(1.0), "compute")
    memory = cost_lib.ProgramCost(flops=1.0, bytes_accessed=2 * chip["hbm"], collective_bytes=0)
    assert cost_lib.roofline(memory, "v5e") == (pytest.approx(2.0), "memory")
    talk = cost_lib.ProgramCost(flops=1.0, bytes_accessed=1.0, collective_bytes=chip["link"])
    assert cost_lib.roofline(talk, "v5e")[1] == "communication"
    with pytest.raises(ValueError, match="unknown chip 'v9'"):
        cost_lib.roofline(compute, "v9")


def test_plan_reports_each_programs_cost_on_a_chip():
    from rljax import plan as plan_lib

    from test_train_loop import tiny_cfg

    cfg = tiny_cfg(**{"sft.steps": 0})
    with pytest.raises(UserError, match="--cost v9: unknown chip"):
        plan_lib.plan(cfg, jax.devices()[:1], chip="v9")
    planned = plan_lib.plan(cfg, jax.devices()[:1], chip="h200")
    assert planned.phases and all(p.cost is not None and p.cost.flops > 0
                                  for p in planned.phases)
    text = planned.format()
    assert "roofline on h200" in text and "bound" in text
    rows = planned.to_dict()["phases"]
    assert all(r["bound"] in ("compute", "memory", "communication") and r["roofline_s"] > 0
               for r in rows)
    assert "MFU at the bound" in text
    for p in planned.phases:   # the FLOPs' time at peak over the roofline time
        t = cost_lib.roofline_times(p.cost, "h200")
        assert cost_lib.mfu_at_bound(p.cost, "h200") == pytest.approx(
            t["compute"] / max(t.values()))
