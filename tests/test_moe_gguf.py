"""qwen3moe and olmoe GGUF files: a tiny random Qwen3MoeForCausalLM / OlmoeForCausalLM written
as a float32 GGUF the way llama.cpp's converter lays it out (experts stacked per layer) loads
to the logits transformers computes; other mixture-of-experts GGUFs, and keeping expert blocks,
are refused in one line."""
import os

import jax.numpy as jnp
import numpy as np
import pytest

from rljax import models
from rljax.models import gguf_keep
from rljax.models.gguf import GGUFError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

from test_moe import _batch, _hf_config, _hf_logits, _randomise  # noqa: E402

ARCH = "qwen3moe"
ARCHS = {"qwen3_moe": "qwen3moe", "olmoe": "olmoe"}


def _write_moe_gguf(path, hf_cfg, tensors, arch=ARCH, expert_count=None, expert_types=None):
    """``tensors`` (HF names, one per expert) as a float32 GGUF of ``arch`` with the keys
    llama.cpp's converter writes, experts stacked [E, out, in] into
    ``blk.N.ffn_{gate,up,down}_exps`` (olmoe: no expert_feed_forward_length, no key_length).
    ``expert_types``: {"gate"|"up"|"down": K-quant type} writes those stacks as random blocks
    of that type instead (gguf has no numpy K-quantizer). Returns {GGUF name: the float32
    array the file stores} of the expert stacks."""
    from test_gguf import random_kquant_bytes
    olmoe = arch == "olmoe"
    head_dim = hf_cfg.hidden_size // hf_cfg.num_attention_heads if olmoe else hf_cfg.head_dim
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", hf_cfg.num_hidden_layers)
    w.add_uint32(f"{arch}.context_length", hf_cfg.max_position_embeddings)
    w.add_uint32(f"{arch}.embedding_length", hf_cfg.hidden_size)
    w.add_uint32(f"{arch}.vocab_size", hf_cfg.vocab_size)
    w.add_uint32(f"{arch}.feed_forward_length", hf_cfg.intermediate_size)
    w.add_uint32(f"{arch}.attention.head_count", hf_cfg.num_attention_heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", hf_cfg.num_key_value_heads)
    if not olmoe:
        w.add_uint32(f"{arch}.attention.key_length", head_dim)
        w.add_uint32(f"{arch}.attention.value_length", head_dim)
    w.add_float32(f"{arch}.rope.freq_base", hf_cfg.rope_parameters["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", hf_cfg.rms_norm_eps)
    w.add_uint32(f"{arch}.expert_count",
                 hf_cfg.num_experts if expert_count is None else expert_count)
    w.add_uint32(f"{arch}.expert_used_count", hf_cfg.num_experts_per_tok)
    if not olmoe:
        w.add_uint32(f"{arch}.expert_feed_forward_length", hf_cfg.moe_intermediate_size)
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
             "mlp.gate": "ffn_gate_inp"}
    rng, stored = np.random.default_rng(0), {}
    w.add_tensor("token_embd.weight", tensors["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", tensors["model.norm.weight"])
    w.add_tensor("output.weight", tensors["lm_head.weight"])
    for i in range(hf_cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        for hf, name in names.items():
            w.add_tensor(f"blk.{i}.{name}.weight", tensors[f"{pre}{hf}.weight"])
        for proj in ("gate", "up", "down"):
            name = f"blk.{i}.ffn_{proj}_exps.weight"
            stack = np.stack([tensors[f"{pre}mlp.experts.{e}.{proj}_proj.weight"]
                              for e in range(hf_cfg.num_experts)])
            qtype = (expert_types or {}).get(proj)
            if qtype is None:
                w.add_tensor(name, stack)
                stored[name] = stack
                continue
            e, rows, cols = stack.shape
            data = random_kquant_bytes(qtype, (e * rows, cols), rng).reshape(e, rows, -1)
            w.add_tensor(name, data, raw_dtype=qtype)
            stored[name] = gguf.quants.dequantize(data, qtype).reshape(stack.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


@pytest.fixture(scope="module", params=list(ARCHS))
def moe_gguf(request, tmp_path_factory):
    """(GGUF path, HF config, HF per-expert tensors, HF model) of a tiny random qwen3_moe /
    olmoe."""
    family = request.param
    root = tmp_path_factory.mktemp(f"moe_gguf_{family}")
    hf_cfg = _hf_config(family)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    _randomise(model)
    model.save_pretrained(str(root / "hf"))
    tensors = safetensors_numpy.load_file(str(root / "hf" / "model.safetensors"))
    path = root / f"tiny-{ARCHS[family]}.gguf"
    _write_moe_gguf(path, hf_cfg, tensors, arch=ARCHS[family])
    return str(path), hf_cfg, tensors, model


@pytest.fixture(scope="module")
def qwen3moe(tmp_path_factory):
    """``moe_gguf``'s qwen3_moe file alone (for the refusals)."""
    root = tmp_path_factory.mktemp("moe_gguf_refusals")
    hf_cfg = _hf_config("qwen3_moe")
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    model.save_pretrained(str(root / "hf"))
    tensors = safetensors_numpy.load_file(str(root / "hf" / "model.safetensors"))
    path = root / "tiny-qwen3moe.gguf"
    _write_moe_gguf(path, hf_cfg, tensors)
    return str(path), hf_cfg, tensors, model


def test_config_from_metadata(moe_gguf):
    path, hf_cfg, _, _ = moe_gguf
    cfg = models.gguf.inspect_gguf(path)
    qwen = hf_cfg.model_type == "qwen3_moe"
    assert cfg.model_type == hf_cfg.model_type
    width = hf_cfg.moe_intermediate_size if qwen else hf_cfg.intermediate_size
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (
        hf_cfg.num_experts, hf_cfg.num_experts_per_tok, width)
    assert cfg.norm_topk_prob == qwen and cfg.qk_norm
    assert cfg.qk_norm_scope == ("head" if qwen else "projection")
    if qwen:
        assert cfg.head_dim == hf_cfg.head_dim != cfg.hidden_size // cfg.num_heads


def test_gguf_logits_match_transformers(moe_gguf):
    """rljax's GGUF load vs the model the file was written from and, for qwen3moe,
    transformers' own GGUF loader on the same file (it has no olmoe GGUF support).
    transformers' GGUF metadata map has no expert_feed_forward_length (it would build
    768-wide experts), so that one value is passed to it; its qwen3moe default
    norm_topk_prob=True (llama.cpp's) is what rljax assumes too."""
    path, hf_cfg, _, model = moe_gguf
    tokens, mask = _batch()
    cfg, params = models.gguf.load_gguf(path)
    ours = np.asarray(models.forward(cfg, params, jnp.asarray(tokens), jnp.asarray(mask)))
    refs = [_hf_logits(model, tokens, mask)]
    if hf_cfg.model_type == "qwen3_moe":
        from_gguf = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32,
            attn_implementation="eager",
            moe_intermediate_size=hf_cfg.moe_intermediate_size).eval()
        assert from_gguf.config.norm_topk_prob is True
        refs.append(_hf_logits(from_gguf, tokens, mask))
    for ref in refs:
        scale = np.abs(ref[mask]).max()
        assert scale > 0.5
        err = np.abs(ours - ref)[mask].max() / scale
        assert err <= 1e-5, err
    # Whether the top-k weights are renormalised matters at this tolerance.
    plain = np.asarray(models.forward(cfg.replace(norm_topk_prob=not cfg.norm_topk_prob), params,
                                      jnp.asarray(tokens), jnp.asarray(mask)))
    assert np.abs(plain - ref)[mask].max() / scale > 1e-3


def test_gguf_params_are_hf_params(moe_gguf):
    """The stacked expert tensors land where the per-expert HF tensors do."""
    path = moe_gguf[0]
    _, from_gguf = models.gguf.load_gguf(path)
    _, from_hf = models.load_hf(os.path.join(os.path.dirname(path), "hf"))
    for name in ("router", "expert_gate", "expert_up", "expert_down"):
        np.testing.assert_array_equal(np.asarray(from_gguf["layers"][name]),
                                      np.asarray(from_hf["layers"][name]))


@pytest.mark.parametrize("arch,expert_count,match", [
    ("llama", 8, r"mixture-of-experts GGUF \(llama.expert_count=8\) is not supported"),
    ("qwen2moe", 8, r"unsupported GGUF architecture 'qwen2moe'"),
    (ARCH, 0, r"qwen3moe GGUF without experts"),
])
def test_unsupported_moe_gguf_refused_in_one_line(qwen3moe, tmp_path, arch, expert_count,
                                                   match):
    _, hf_cfg, tensors, _ = qwen3moe
    path = tmp_path / "other.gguf"
    _write_moe_gguf(path, hf_cfg, tensors, arch=arch, expert_count=expert_count)
    with pytest.raises(GGUFError, match=match) as e:
        models.gguf.inspect_gguf(str(path))
    assert "\n" not in str(e.value)


def test_keep_refuses_moe_experts(qwen3moe):
    path = qwen3moe[0]
    cfg = models.gguf.inspect_gguf(path)
    with pytest.raises(GGUFError, match=r"cannot keep a mixture of experts' expert tensors"):
        gguf_keep.keep_plan(path, cfg)


def test_k_quant_expert_stacks_load_as_gguf_dequantizes_them(tmp_path):
    """Expert stacks in llama.cpp's Q4_K_M types (Q4_K gate/up, Q6_K down; K-quant rows of
    256) load to the values gguf dequantizes, in the layout of the float32 file holding those
    values, and to transformers' logits of the quantized file."""
    Q = gguf.GGMLQuantizationType
    hf_cfg = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=256, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True,
        rms_norm_eps=1e-6, attn_implementation="eager", tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    _randomise(model)
    model.save_pretrained(str(tmp_path / "hf"))   # per-expert tensors, as the converter reads
    tensors = safetensors_numpy.load_file(str(tmp_path / "hf" / "model.safetensors"))
    quantized = tmp_path / "q4_k_m.gguf"
    stored = _write_moe_gguf(quantized, hf_cfg, tensors,
                             expert_types={"gate": Q.Q4_K, "up": Q.Q4_K, "down": Q.Q6_K})
    # The same values as float32 stacks (HF per-expert tensors are [out, in]).
    as_float = dict(tensors)
    for name, stack in stored.items():
        i, proj = name.split(".")[1], name.split("_")[1]
        for e in range(hf_cfg.num_experts):
            as_float[f"model.layers.{i}.mlp.experts.{e}.{proj}_proj.weight"] = stack[e]
    floats = tmp_path / "f32.gguf"
    _write_moe_gguf(floats, hf_cfg, as_float)
    cfg, params = models.gguf.load_gguf(str(quantized))
    _, reference = models.gguf.load_gguf(str(floats))
    for name in ("expert_gate", "expert_up", "expert_down"):
        got = np.asarray(params["layers"][name])
        assert np.abs(got).max() > 0
        np.testing.assert_array_equal(got, np.asarray(reference["layers"][name]))
    tokens, mask = _batch()
    ours = np.asarray(models.forward(cfg, params, jnp.asarray(tokens), jnp.asarray(mask)))
    from_gguf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=quantized.name, dtype=torch.float32,
        attn_implementation="eager", moe_intermediate_size=256).eval()
    ref = _hf_logits(from_gguf, tokens, mask)
    scale = np.abs(ref[mask]).max()
    assert np.abs(ours - ref)[mask].max() / scale <= 1e-5
