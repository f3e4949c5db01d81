"""llama.cpp GGUF files as a model source: ``(ModelConfig, params)`` without PyTorch.

The config comes from the file's metadata (``<arch>.block_count``, ``<arch>.embedding_length``,
...), the tensors are read from the file (``rljax.models.gguf_file``), dequantized to float32
with the ``gguf`` package's numpy code, renamed to their Hugging Face names and handed to
``hf.load_params``, which stacks the layers and places each parameter into its sharding exactly
as for a safetensors checkpoint.

Supported: architectures ``SUPPORTED_ARCHITECTURES`` (dense llama, qwen2, qwen3, gemma2, gemma3
-- the text model -- and the mixtures of experts qwen3moe and olmoe) and tensor
types ``SUPPORTED_TENSOR_TYPES`` (float, the legacy block quants and the K-quants). Quantized
weights become plain float32 (or ``dtype``) parameters: rljax trains the dequantized model.
Everything else (another architecture, another mixture of experts, an i-quant, llama3-style
``rope_freqs`` factors, a truncated file) raises :class:`GGUFError` with one line naming the
problem, from ``inspect_gguf`` before any tensor is read.

llama.cpp's converter permutes the rows of llama's q and k projections so that GGML's rope,
which rotates interleaved pairs, computes what HF's rotate-half rope computes; loading undoes
that permutation (``_unpermute_rope``). qwen2/qwen3 use GGML's rotate-half ("neox") rope and are
stored unpermuted.

A qwen3moe or olmoe file stores each layer's experts stacked: ``ffn_gate_exps``/``ffn_up_exps`` [E, F, D] and
``ffn_down_exps`` [E, D, F] (numpy order; HF's per-expert [out, in] matrices, expert first), the
router as ``ffn_gate_inp`` [E, D]. Its metadata has no top-k normalisation flag: llama.cpp's
qwen3moe graph always renormalises the k weights (and transformers' GGUF loader sets
``norm_topk_prob=True`` for it), so the loaded config does too. llama.cpp's olmoe uses the k
probabilities as they are (as HF's OLMoE does), normalises q and k over the whole projection
(``attn_q_norm`` [D]) and its converter writes no ``expert_feed_forward_length``: the experts
are ``feed_forward_length`` wide. Gemma's converter stores every RMSNorm scale as ``1 + w`` (GGML multiplies
by the scale itself); loading subtracts the 1 again, as transformers' GGUF loader does.

Gemma 2/3 files do not say everything the model computes; what they leave out is taken from
llama.cpp and transformers, which agree on it: gemma2 alternates local and global layers
(local first), gemma3 makes every sixth layer global, the local layers' RoPE base is 10,000
(gemma3, unscaled), and queries are scaled by ``key_length ** -0.5``.
"""
from __future__ import annotations

import functools
import os
import re

import jax.numpy as jnp
import numpy as np

from rljax.errors import UserError
from rljax.models.config import (COUNT_LIMITS, ModelConfig, check_count, check_positive,
                                 dtype_name)
from rljax.models.gguf_file import GGUFFile
from rljax.models.hf import hf_tensor_shapes, load_params
from rljax.models.transformer import param_shapes

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "qwen3moe", "olmoe")
# GGUF architecture -> rljax model_type, where they differ.
_MODEL_TYPES = {"qwen3moe": "qwen3_moe"}
# Architectures whose layers are mixtures of experts (every layer; no shared experts).
_MOE_ARCHITECTURES = ("qwen3moe", "olmoe")
_GEMMA_SWA_PERIOD = {"gemma2": 2, "gemma3": 6}   # one global layer per period, last in it
# Types gguf's numpy code dequantizes exactly and that llama.cpp's common quantizations use.
# The i-quants (IQ*), ternary (TQ*) and FP4 types are left out: no test file of ours has them.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                          "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# HF name (inside "model.layers.{i}." for layers) -> GGUF name (inside "blk.{i}.").
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",   # the MoE router
}
# One expert's matrix in HF ("mlp.experts.{e}.<w>_proj.weight") -> the GGUF tensor that stacks
# all the layer's experts on its first numpy axis.
_EXPERT_RE = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
# Gemma 2/3 norm names (their HF "post_attention_layernorm" is the attention output's norm).
_POST_NORM_NAMES = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
_TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
class GGUFError(UserError):
    """A GGUF file rljax cannot load (reported as one line by the CLI, exit code 2)."""


def gguf_name(hf_name: str, post_norms: bool = False) -> str:
    """The GGUF tensor name of HF tensor ``hf_name`` (``model.layers.3.mlp.up_proj.weight`` ->
    ``blk.3.ffn_up.weight``); ``post_norms``: Gemma 2/3's layer-norm names."""
    m = _EXPERT_RE.fullmatch(hf_name)
    if m:
        return f"blk.{m.group(1)}.ffn_{m.group(3)}_exps.weight"
    m = _LAYER_RE.fullmatch(hf_name)
    if m:
        names = dict(_LAYER_NAMES, **_POST_NORM_NAMES) if post_norms else _LAYER_NAMES
        return f"blk.{m.group(1)}.{names[m.group(2)]}"
    return _TOP_NAMES[hf_name]


# ----------------------------------------------------------------------------- reading

@functools.lru_cache(maxsize=2)
def _reader(path: str, mtime_ns: int, size: int) -> GGUFFile:
    """The file's parsed header, cached so that checking and loading one file read it once.
    The key changes when the file does."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        return GGUFFile(path)
    except (ValueError, OverflowError, MemoryError) as e:   # GGUFFormatError is a ValueError
        raise GGUFError(f"{path}: truncated or corrupt GGUF file "
                        f"({type(e).__name__}: {one_line(e)})") from None


def open_gguf(path: str) -> GGUFFile:
    """The parsed header of GGUF file ``path``; GGUFError if it is missing or unreadable."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isfile(path):
        raise GGUFError(f"{path}: GGUF file does not exist")
    st = os.stat(path)
    try:
        return _reader(path, st.st_mtime_ns, st.st_size)
    except OSError as e:  # e.g. no read permission
        raise GGUFError(f"{path}: cannot read the GGUF file: {e.strerror or e}") from None


def one_line(e: Exception) -> str:
    """An exception's message on one line (the CLI prints errors as a single line)."""
    return " ".join(str(e).split())


def _meta(reader: GGUFFile, key: str, default=KeyError):
    """Metadata value ``key`` (str, int, float, bool or list); ``default`` when absent."""
    if key not in reader.fields and default is KeyError:
        raise GGUFError(f"{reader.path}: GGUF metadata has no {key!r}")
    return reader.value(key, default)


def _count(reader: GGUFFile, key: str, field: str, default=KeyError, low: int = 1,
           high: int | None = None) -> int:
    """Metadata ``key`` as a count for ModelConfig ``field``, checked (an integer, in range:
    ``config.check_count``) before anything is built from it; GGUFError naming the key."""
    value = _meta(reader, key, default)
    try:
        return check_count(field, value, low, high)
    except ValueError:
        bound = COUNT_LIMITS.get(field, 1 << 31) if high is None else high
        raise GGUFError(f"{reader.path}: unusable GGUF metadata: {key}={_short(value)} must "
                        f"be an integer in [{low}, {bound}]") from None


def _positive(reader: GGUFFile, key: str, default=KeyError, optional: bool = False,
              below: float | None = None):
    """Metadata ``key`` as a finite float > 0 (None passes when ``optional``); GGUFError
    naming the key for NaN, inf, 0 or a negative."""
    value = _meta(reader, key, default)
    try:
        return check_positive(key, value, optional=optional, below=below)
    except ValueError:
        bound = f"in (0, {below:g})" if below is not None else "> 0"
        raise GGUFError(f"{reader.path}: unusable GGUF metadata: {key}={_short(value)} must "
                        f"be a finite number {bound}") from None


def _short(value) -> str:
    """``repr(value)``, cut to 40 characters (a hostile string may be megabytes long)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _decimal(x: float) -> float:
    """The shortest decimal that rounds to the same float32: the converter stored e.g.
    ``rms_norm_eps=1e-5`` as float32, and config.json should say 1e-05 again, not 9.99e-06."""
    return float(str(np.float32(x)))


# ----------------------------------------------------------------------------- config

def _config(reader, path: str, dtype) -> ModelConfig:
    """ModelConfig from the metadata (and the presence/shape of a few tensors)."""
    arch = _architecture(reader, path)
    dtype = dtype_name(dtype)
    try:
        return ModelConfig(**_config_fields(reader, path, arch), dtype=dtype, param_dtype=dtype)
    except (TypeError, ValueError) as e:  # a value of the wrong type, or an impossible config
        raise GGUFError(f"{path}: unusable GGUF metadata: {one_line(e)}") from None


def _architecture(reader, path: str) -> str:
    """``general.architecture`` if rljax supports it (dense models of those families)."""
    arch = _meta(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{path}: unsupported GGUF architecture {arch!r} "
                        f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    experts = _meta(reader, f"{arch}.expert_count", 0)
    if experts and arch not in _MOE_ARCHITECTURES:
        raise GGUFError(f"{path}: mixture-of-experts GGUF ({arch}.expert_count={experts}) "
                        f"is not supported (supported: {', '.join(_MOE_ARCHITECTURES)})")
    if not experts and arch in _MOE_ARCHITECTURES:
        raise GGUFError(f"{path}: {arch} GGUF without experts ({arch}.expert_count missing "
                        "or 0)")
    return arch


def _config_fields(reader, path: str, arch: str) -> dict:
    """ModelConfig fields (all but the dtypes) from ``<arch>.*`` and ``tokenizer.ggml.*``."""
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{path}: GGUF file has no token_embd.weight tensor")
    hidden = _count(reader, f"{arch}.embedding_length", "hidden_size")
    heads = _count(reader, f"{arch}.attention.head_count", "num_heads")
    head_dim = _count(reader, f"{arch}.attention.key_length", "head_dim", max(hidden // heads, 1))
    value_dim = _count(reader, f"{arch}.attention.value_length", "head_dim", head_dim)
    rope_dim = _count(reader, f"{arch}.rope.dimension_count", "head_dim", head_dim)
    if value_dim != head_dim or rope_dim != head_dim:
        raise GGUFError(f"{path}: key_length={head_dim}, value_length={value_dim}, "
                        f"rope.dimension_count={rope_dim} differ (partial rope is not supported)")
    fields = dict(
        model_type=_MODEL_TYPES.get(arch, arch),
        # The embedding's rows are the model's vocabulary (the token list may be shorter).
        vocab_size=int(np.asarray(tensors["token_embd.weight"].shape)[-1]),
        hidden_size=hidden,
        intermediate_size=_count(reader, f"{arch}.feed_forward_length", "intermediate_size",
                                 _meta(reader, f"{arch}.expert_feed_forward_length", None)),
        num_layers=_count(reader, f"{arch}.block_count", "num_layers"),
        num_heads=heads,
        num_kv_heads=_count(reader, f"{arch}.attention.head_count_kv", "num_kv_heads", heads,
                            high=heads),
        head_dim=head_dim,
        rms_norm_eps=_decimal(_positive(reader, f"{arch}.attention.layer_norm_rms_epsilon",
                                        below=1.0)),
        rope_theta=_decimal(_positive(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=_count(reader, f"{arch}.context_length",
                                       "max_position_embeddings", 2048),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=arch == "qwen2",
        qk_norm=arch in ("qwen3", "qwen3moe", "olmoe"),
        bos_token_id=_meta(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_id=_meta(reader, "tokenizer.ggml.eos_token_id", None),
        pad_token_id=_meta(reader, "tokenizer.ggml.padding_token_id", None),
    )
    fields.update(_rope_scaling(reader, path, arch))
    if arch in _GEMMA_SWA_PERIOD:
        fields.update(_gemma_fields(reader, arch, fields, head_dim))
    if arch in _MOE_ARCHITECTURES:
        fields.update(_moe_fields(reader, path, arch))
    return fields


def _moe_fields(reader, path: str, arch: str) -> dict:
    """Mixture-of-experts ModelConfig fields from ``<arch>.expert_*`` (qwen3moe: top-k weights
    renormalised, olmoe: not, as llama.cpp computes them; see the module docstring)."""
    if arch == "olmoe" and _meta(reader, f"{arch}.attention.clamp_kqv", None) is not None:
        raise GGUFError(f"{path}: olmoe clamp_kqv (clip_qkv) is not supported")
    width_key = f"{arch}.expert_feed_forward_length"
    if arch == "olmoe" and width_key not in reader.fields:
        width_key = f"{arch}.feed_forward_length"
    experts = _count(reader, f"{arch}.expert_count", "num_experts")
    return dict(num_experts=experts,
                num_experts_per_tok=_count(reader, f"{arch}.expert_used_count",
                                           "num_experts_per_tok", high=experts),
                moe_intermediate_size=_count(reader, width_key, "moe_intermediate_size"),
                norm_topk_prob=arch == "qwen3moe",
                # HF's defaults (the GGUF does not say; only an export writes it back).
                router_aux_loss_coef=0.001 if arch == "qwen3moe" else 0.01,
                qk_norm_scope="projection" if arch == "olmoe" else "head")


def _gemma_fields(reader, arch: str, fields: dict, head_dim: int) -> dict:
    """Gemma 2/3 ModelConfig fields: the family's constants, the file's window and caps."""
    layers = fields["num_layers"]
    period = _GEMMA_SWA_PERIOD[arch]
    kinds = ["sliding_attention" if (i + 1) % period else "full_attention"
             for i in range(layers)]
    out = dict(activation="gelu_tanh", scale_embeddings=True, norm_plus_one=True,
               post_norms=True, qk_norm=arch == "gemma3",
               sliding_window=_count(reader, f"{arch}.attention.sliding_window",
                                     "sliding_window"),
               layer_types=tuple(kinds), query_pre_attn_scalar=float(head_dim),
               attn_logit_softcapping=_positive(reader, f"{arch}.attn_logit_softcapping", None,
                                                optional=True),
               final_logit_softcapping=_positive(reader, f"{arch}.final_logit_softcapping",
                                                 None, optional=True))
    if arch == "gemma3":
        out["rope_local_theta"] = _decimal(_positive(reader, f"{arch}.rope.freq_base_swa",
                                                     10000.0))
    return out


def _rope_scaling(reader, path: str, arch: str) -> dict:
    """ModelConfig rope-scaling fields: none or linear (the rest is refused)."""
    kind = _meta(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return {}
    if kind == "linear":
        return dict(rope_scaling_type="linear",
                    rope_factor=_decimal(_positive(reader, f"{arch}.rope.scaling.factor")))
    raise GGUFError(f"{path}: unsupported rope scaling type {kind!r} (supported: none, linear)")


def _check_tensors(reader, path: str, cfg: ModelConfig) -> None:
    """Every tensor the model needs is there, with its shape and a supported type; no others."""
    expected = gguf_tensor_shapes(cfg)
    found = {t.name: t for t in reader.tensors}
    missing = sorted(set(expected) - set(found))
    if missing:
        raise GGUFError(f"{path}: missing tensor(s) {', '.join(missing[:3])}"
                        f"{' ...' if len(missing) > 3 else ''} for a {cfg.model_type} model")
    extra = sorted(set(found) - set(expected))
    if extra:
        raise GGUFError(f"{path}: tensor(s) {', '.join(extra[:3])}"
                        f"{' ...' if len(extra) > 3 else ''} are not supported for "
                        f"{cfg.model_type} (rljax has no parameter for them)")
    for name, shape in expected.items():
        t = found[name]
        kind = t.tensor_type.name
        if kind not in SUPPORTED_TENSOR_TYPES:
            raise GGUFError(f"{path}: tensor {name} has unsupported type {kind} "
                            f"(supported: {', '.join(SUPPORTED_TENSOR_TYPES)})")
        # GGUF lists dimensions fastest-first (ggml's ne); numpy/HF order is the reverse.
        shape_in_file = tuple(int(d) for d in reversed(np.asarray(t.shape).tolist()))
        if shape_in_file != tuple(shape):
            raise GGUFError(f"{path}: tensor {name} has shape {shape_in_file}, expected "
                            f"{tuple(shape)} from the metadata")


def gguf_tensor_shapes(cfg: ModelConfig) -> dict:
    """GGUF tensor name -> numpy shape (HF's) of every tensor a file of ``cfg`` holds; a
    layer's experts are one tensor [E, ...] (``hf_tensor_shapes`` lists one per expert)."""
    shapes = {}
    for name, shape in hf_tensor_shapes(cfg).items():
        if _EXPERT_RE.fullmatch(name):
            shape = (cfg.num_experts, *shape)
        shapes[gguf_name(name, cfg.post_norms)] = tuple(shape)
    return shapes


def inspect_gguf(path: str, dtype=jnp.float32, **overrides) -> ModelConfig:
    """The ModelConfig of GGUF file ``path`` after checking that rljax can load it.

    Reads metadata and tensor headers only (no dequantization). Raises GGUFError for an
    unsupported architecture or tensor type, a missing/extra/misshapen tensor, a truncated or
    corrupt file, or ``overrides`` (ModelConfig fields) that would change a tensor's shape.
    """
    reader = open_gguf(path)
    cfg = _config(reader, os.fspath(path), dtype)
    _check_tensors(reader, os.fspath(path), cfg)
    if not overrides:
        return cfg
    try:
        changed = cfg.replace(**overrides)
    except (TypeError, ValueError) as e:
        raise GGUFError(f"{path}: model overrides: {one_line(e)}") from None
    # Overrides may change how the model computes (dtype, remat, ...), not what the file holds.
    if param_shapes(changed) != param_shapes(cfg):
        keys = sorted(k for k, v in overrides.items()
                      if param_shapes(cfg.replace(**{k: v})) != param_shapes(cfg))
        raise GGUFError(f"{path}: model overrides {', '.join(keys)} change the shapes of the "
                        "file's tensors; a GGUF model's shapes come from its metadata")
    return changed


# ----------------------------------------------------------------------------- load

def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo the llama q/k row permutation of llama.cpp's converter.

    The converter regroups each head's rows from (two halves, half_dim) to (half_dim, pairs) so
    GGML's interleaved rope rotates the same pairs that HF's rotate-half rope does; this is the
    inverse (the same reverse permute transformers applies when it loads a llama GGUF).
    """
    rows = w.shape[0]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _tensor_source(reader, path: str, cfg: ModelConfig):
    """``get(hf_name, hf_shape) -> float32 np.ndarray`` over the file, for ``hf.load_params``."""
    from gguf import quants  # local: only GGUF users pay for the import

    tensors = {t.name: t for t in reader.tensors}
    permute_heads = {}
    if cfg.model_type == "llama":
        permute_heads = {"attn_q.weight": cfg.num_heads, "attn_k.weight": cfg.num_kv_heads}

    gemma = cfg.norm_plus_one
    stacked = {}   # the last experts tensor read: its E per-expert requests come in a row

    def get(hf_name: str, hf_shape: tuple) -> np.ndarray:
        name = gguf_name(hf_name, cfg.post_norms)
        expert = _EXPERT_RE.fullmatch(hf_name)
        if expert:
            if name not in stacked:
                stacked.clear()
                stacked[name] = read(name, (cfg.num_experts, *hf_shape))
            return stacked[name][int(expert.group(2))]
        return read(name, hf_shape)

    def read(name: str, hf_shape: tuple) -> np.ndarray:
        t = tensors[name]  # presence, shape and type were checked by inspect_gguf
        try:
            # A plain-ndarray view of the memmap: numpy's memmap subclass hooks would otherwise
            # run on every block slice dequantize makes (a third of the load time).
            data = t.data.view(np.ndarray)
            w = np.asarray(quants.dequantize(data, t.tensor_type), dtype=np.float32)
        except (ValueError, NotImplementedError) as e:
            raise GGUFError(f"{path}: cannot dequantize {name} ({t.tensor_type.name}): "
                            f"{one_line(e)}") from None
        w = w.reshape(hf_shape)
        if gemma and name.endswith("norm.weight"):
            w = w - np.float32(1.0)   # stored as 1 + w (see the module docstring)
        heads = permute_heads.get(name.split(".", 2)[-1])
        return _unpermute_rope(w, heads) if heads else w

    return get


def load_gguf(path: str, dtype=jnp.float32, shardings=None, transform=None, **overrides):
    """Load a GGUF file -> ``(cfg, params)``, like ``models.load_hf`` for a HF directory.

    Tensors are dequantized to float32 one at a time and cast to ``dtype``; with ``shardings``
    each parameter is built shard by shard on its devices (``hf.load_params``);
    ``transform``: as ``models.load_hf``.
    """
    cfg = inspect_gguf(path, dtype=dtype, **overrides)
    reader = open_gguf(path)
    params = load_params(cfg, _tensor_source(reader, os.fspath(path), cfg), shardings,
                         transform)
    # The header was cached for the checks before loading; loading is its last use in a run,
    # and the cache holds the file mapped.
    _reader.cache_clear()
    return cfg, params
