"""QLoRA: LoRA adapters over a base kept quantized (``model.quantize``, ``models.quant``).

The quantized forward equals the forward of its dequantized float32 copy; gradients reach the
adapters only; 4-bit storage is counted two entries a byte; a run trains, checkpoints adapters
only and resumes exactly; 8 devices == 1; export and refusals."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import models
from rljax.models import lora, quant
from rljax.train import run
from rljax.train.core.metrics import read_metrics

from test_lora import CFG, lora_cfg, lora_params, perturbed, saved_state, tokens
from test_train_loop import DEVICES, RL_STEPS, SFT_STEPS, StopAfter, comparable, tiny_cfg

QUANT = ("int8", "int4", "nf4")


@pytest.mark.parametrize("qtype", QUANT)
def test_quantized_forward_and_gradients_equal_the_dequantized_copy(qtype):
    cfg = CFG.replace(lora_scale=2.0, tie_word_embeddings=False)
    p = perturbed(lora_params(cfg, rank=4))
    q = {**quant.quantize_params(lora.base_params(p), qtype, block=16), "lora": p["lora"]}
    assert quant.is_quantized(q["layers"]["down"]) and quant.is_quantized(q["lm_head"])
    assert not quant.is_quantized(q["layers"]["attn_norm"])
    assert q["layers"]["q"].scale.shape == (2, 32 // 16, 4, 8)   # one scale per 16 inputs
    dq = quant.dequantize_params(q)
    t = tokens()
    want = models.forward(cfg, dq, t)
    np.testing.assert_allclose(models.forward(cfg, q, t), want, rtol=1e-6, atol=1e-6)
    # The quantization itself: within a bound of the float model (measured, not exact).
    err = float(jnp.abs(want - models.forward(cfg, p, t)).max())
    assert 0 < err < {"int8": 0.02, "int4": 0.2, "nf4": 0.2}[qtype]

    def loss(adapters, base):
        return models.forward(cfg, {**base, "lora": adapters}, t).astype(jnp.float32).std()

    g_q = jax.grad(loss)(q["lora"], lora.base_params(q))
    g_dq = jax.grad(loss)(dq["lora"], lora.base_params(dq))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g_q, g_dq)


def test_storage_bytes_and_the_table_types():
    w = jnp.zeros((2, 64, 32), jnp.float32)
    q4 = quant.quantize_weight(w, "int4", 32, 1)
    assert q4.qvalue.dtype == jnp.int4 and q4.scale.shape == (2, 2, 32)
    assert quant.nbytes(q4.qvalue.shape, q4.qvalue.dtype) == 2 * 64 * 32 // 2
    assert quant.nbytes((3,), jnp.uint4) == 2 and quant.nbytes((3,), jnp.bfloat16) == 6
    # An axis the block does not divide: one scale over the whole axis.
    assert quant.quantize_weight(w, "int8", 48, 1).scale.shape == (2, 1, 32)
    # The embedding and an untied head stay 8-bit under the 4-bit types.
    assert quant.leaf_plan(("embed",), "nf4") == ("int8", 1)
    assert quant.leaf_plan(("layers", "o"), "nf4") == ("nf4", 2)
    assert quant.leaf_plan(("layers", "mlp_norm"), "nf4") is None


def test_gather_of_quantized_embedding_rows_equals_dequantized_table():
    table = jax.random.normal(jax.random.key(0), (50, 32))
    q = quant.quantize_weight(table, "int8", 16, 1)
    ids = jnp.array([[3, 0, 49], [7, 7, 1]])
    np.testing.assert_array_equal(quant.take_rows(q, ids),
                                  jnp.take(quant.dequantize(q), ids, axis=0))


def test_sampler_and_slot_engine_read_the_quantized_base(qtype="nf4"):
    """The static sampler and the slot engine (with adapters, unmerged) sample from a
    quantized base what they sample from its dequantized copy."""
    from rljax import sampling
    from rljax.sampling import engine

    cfg = CFG.replace(lora_scale=2.0)
    p = perturbed(lora_params(cfg, rank=4))
    q = {**quant.quantize_params(lora.base_params(p), qtype, block=16), "lora": p["lora"]}
    prompt, pmask = sampling.pad_to_bucket([[1, 2, 3], [4, 5, 6, 7, 8]], pad_id=0)
    kw = dict(rng=jax.random.key(4), max_new_tokens=6, temperature=1.0, pad_id=0,
              num_samples=3, eos_id=3)
    ref = sampling.generate(cfg, quant.dequantize_params(q), prompt, pmask, **kw)
    for out in (sampling.generate(cfg, q, prompt, pmask, **kw),
                engine.generate(cfg, q, prompt, pmask, slots=4, chunk_steps=2, **kw)[0]):
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
        np.testing.assert_allclose(np.asarray(out.logps), np.asarray(ref.logps), atol=1e-5)


def qlora_cfg(**overrides):
    return lora_cfg(**{"model.quantize": "int4", "model.quantize_block": 16, **overrides})


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("qlora_straight"))
    assert run.train(qlora_cfg(), workdir, devices=DEVICES) == 0
    return workdir


def test_qlora_run_trains_adapters_only_and_resumes_exactly(straight, tmp_path):
    records = read_metrics(straight)
    rl = [r for r in records if "reward/mean" in r]
    assert len(rl) == RL_STEPS and all(np.isfinite(r["loss"]) for r in rl)
    assert rl[0]["rollout/logp_diff_max"] < 1e-4   # the sampler reads the same quantized base
    saved = saved_state(straight)
    assert set(saved["params"]) == {"lora"} and saved.get("ref_params") is None
    workdir = str(tmp_path)
    assert run.train(qlora_cfg(), workdir, devices=DEVICES,
                     stop=StopAfter(SFT_STEPS + RL_STEPS // 2)) == 0
    assert run.train(qlora_cfg(), workdir, devices=DEVICES) == 0
    assert comparable(read_metrics(workdir)) == comparable(records)


def test_qlora_context_holds_the_quantized_base_sharded_on_8_devices(tmp_path):
    """The base as built by the trainer: quantized leaves on their shardings; the same
    forward on 8 devices (data x fsdp x tensor) as on one."""
    from rljax.train.core import setup

    assert jax.device_count() == 8
    cfg = qlora_cfg(**{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2})
    cfg.model.overrides = dict(cfg.model.overrides, hidden_size=64, num_heads=4,
                               num_kv_heads=2)
    ctx8 = setup.build_context(cfg, str(tmp_path / "a"), devices=jax.devices())
    one = qlora_cfg()
    one.model.overrides = dict(cfg.model.overrides)
    ctx1 = setup.build_context(one, str(tmp_path / "b"), devices=DEVICES)
    q8 = ctx8.params["layers"]["gate"]
    assert quant.is_quantized(q8) and q8.qvalue.dtype == jnp.int4
    assert len(q8.qvalue.sharding.device_set) == 8
    assert q8.qvalue.sharding.spec != jax.sharding.PartitionSpec()
    t = tokens(4, 7) % ctx1.model_cfg.vocab_size
    np.testing.assert_allclose(models.forward(ctx8.model_cfg, ctx8.params, t),
                               models.forward(ctx1.model_cfg, ctx1.params, t),
                               rtol=1e-5, atol=1e-5)


def test_export_dequantizes_the_merge_and_adapters_export_alone(straight, tmp_path):
    from rljax.train import inference

    cfg = qlora_cfg()
    out = str(tmp_path / "merged")
    assert run.export(cfg, straight, out, devices=DEVICES) == 0
    ctx, state, _ = inference.load_for_inference(cfg, straight, devices=DEVICES)
    assert quant.is_quantized(state.params["layers"]["q"])
    t = tokens(2, 6) % ctx.model_cfg.vocab_size
    _, merged = models.load_hf(out)
    np.testing.assert_allclose(models.forward(ctx.model_cfg, merged, t),
                               models.forward(ctx.model_cfg, state.params, t), atol=1e-5)
    assert run.export(cfg, straight, str(tmp_path / "ad"), devices=DEVICES, adapter=True) == 0
    assert sorted(os.listdir(tmp_path / "ad")) == ["adapter_config.json",
                                                    "adapter_model.safetensors"]


def test_plan_shows_the_quantized_base():
    from rljax import plan as plan_lib

    full = plan_lib.plan(lora_cfg(), DEVICES, compile_phases=False)
    q4 = plan_lib.plan(qlora_cfg(), DEVICES, compile_phases=False)
    q8 = plan_lib.plan(qlora_cfg(**{"model.quantize": "int8"}), DEVICES, compile_phases=False)
    assert q4.resident < q8.resident < full.resident


def test_quantization_without_lora_is_refused_in_one_line():
    from rljax import config as config_lib
    from rljax.errors import ConfigError

    with pytest.raises(ConfigError, match="model.quantize='int4' keeps the base frozen"):
        tiny_cfg(**{"model.quantize": "int4"})
    with pytest.raises(ConfigError, match="model.quantize_block=3 must be a positive even"):
        qlora_cfg(**{"model.quantize_block": 3})
    with pytest.raises(ConfigError, match="model.quantize"):
        config_lib.load_config(None, ["model.quantize=fp3", "model.lora.rank=4"])


# ----------------------------------------------------------------------------- a GGUF's own blocks

def _random_blocks(type_name, rows, cols, rng):
    """Raw blocks of ``type_name``: the library's quantizer where it has one, else random
    bytes with finite float16 scale fields (every byte pattern is a valid K-quant block)."""
    from gguf import GGMLQuantizationType, quants
    from rljax.models import gguf_blocks

    qtype = GGMLQuantizationType[type_name]
    try:
        return quants.quantize(rng.normal(size=(rows, cols)).astype(np.float32), qtype)
    except NotImplementedError:
        fmt = gguf_blocks.FORMATS[type_name]
        per_block = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[type_name]
        raw = rng.integers(0, 256, size=(rows, cols // 256, per_block), dtype=np.uint8)
        for field in (fmt.d, fmt.dmin):
            if field is not None:
                f16 = rng.uniform(1e-3, 1e-2, size=raw.shape[:2]).astype(np.float16)
                raw[..., field[0]:field[1]] = f16.view(np.uint8).reshape(*raw.shape[:2], 2)
        return raw.reshape(rows, -1)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q5_0", "Q4_1", "Q5_1", "Q4_K", "Q5_K",
                                       "Q6_K"])
def test_gguf_blocks_decode_to_the_librarys_dequantization_bit_for_bit(type_name):
    from gguf import GGMLQuantizationType, quants
    from rljax.models import gguf_blocks

    raw = _random_blocks(type_name, 3, 512, np.random.default_rng(0))
    want = np.asarray(quants.dequantize(raw, GGMLQuantizationType[type_name]), np.float32)
    b = gguf_blocks.decode(raw, type_name, 512)
    assert b.q.min() >= b.lo and b.q.max() <= b.hi
    assert b.scale.shape == (3, 512 // b.block)
    np.testing.assert_array_equal(b.dequantize(), want.reshape(3, 512))
    # ... and as a kept weight on the device (codes in 4 bits where they fit).
    kept = quant.from_blocks(b.q, b.scale, b.offset, lo=b.lo, hi=b.hi)
    assert isinstance(kept, quant.Affine) == (b.offset is not None)   # Q4_1, K-quants
    qa = kept.q if isinstance(kept, quant.Affine) else kept
    assert qa.qvalue.dtype == quant.code_dtype(b.lo, b.hi)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(kept)), want.reshape(3, 512))
