"""Hugging Face config.json <-> ModelConfig, for every supported family.

transformers 5 and older files spell some fields differently (``rope_parameters`` vs
``rope_theta``/``rope_scaling``, gemma3's ``rope_local_base_freq``); both are read, and the
legacy spelling is written, which transformers 4 and 5 both understand.
"""
from __future__ import annotations

import jax.numpy as jnp

from rljax.models.config import (COUNT_LIMITS, SUPPORTED_MODEL_TYPES, ModelConfig, check_count,
                                 check_positive, dtype_name)

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM",
                  "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}
# Per-family defaults of HF config fields that checkpoints may omit.
_TIE_DEFAULT = {"llama": False, "qwen2": False, "qwen3": False, "gemma": True, "gemma2": True,
                "gemma3": True, "qwen3_moe": False, "olmoe": False}
_GEMMAS = ("gemma", "gemma2", "gemma3")
_MOES = ("qwen3_moe", "olmoe")
_QK_NORMED = ("qwen3", "gemma3", "qwen3_moe", "olmoe")
# The HF model_type each of ours is written as (gemma3: the text-only model).
_HF_MODEL_TYPE = {"gemma3": "gemma3_text"}


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint that cannot be loaded (or a config that cannot be exported)."""


def config_from_hf(hf: dict, dtype=jnp.float32, **overrides) -> ModelConfig:
    """ModelConfig from a parsed HF config.json dict (for a multimodal "gemma3" config, its
    text model: ``text_config``)."""
    mt = hf.get("model_type")
    if mt == "gemma3" and "text_config" in hf:
        top = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id",
                                  "tie_word_embeddings") if hf.get(k) is not None}
        hf = dict(top, **{k: v for k, v in hf["text_config"].items() if v is not None})
        mt = "gemma3_text"
    if mt == "gemma3_text":
        mt = "gemma3"
    if mt not in SUPPORTED_MODEL_TYPES:
        raise HFCheckpointError(
            f"unsupported model_type {mt!r} in config.json; supported: {SUPPORTED_MODEL_TYPES}")
    # Rope settings: transformers>=5 writes `rope_parameters` (gemma3: one dict per layer
    # type); older files `rope_theta` and `rope_scaling` (whose type key is `rope_type`, or
    # `type` in very old files), gemma3 `rope_local_base_freq`.
    params = dict(hf.get("rope_parameters") or {})
    local_theta = None
    if mt == "gemma3":
        local_theta = (params.get("sliding_attention") or {}).get(
            "rope_theta", hf.get("rope_local_base_freq", 10000.0))
        params = params.get("full_attention", params)
    rope = dict(hf.get("rope_scaling") or {})
    rope.update(params)
    theta = rope.get("rope_theta", hf.get("rope_theta", 1e6 if mt == "gemma3" else 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise HFCheckpointError(f"unsupported rope scaling type {rope_type!r} "
                                "(supported: default, linear, llama3)")
    if hf.get("mlp_bias"):
        raise HFCheckpointError("mlp_bias=True is not supported")
    if mt in ("llama", "qwen3") + _MOES and hf.get("attention_bias"):
        # These families then also carry an o_proj bias, which this model does not have.
        raise HFCheckpointError(f"attention_bias=True is not supported for {mt}")
    if hf.get("use_sliding_window"):
        raise HFCheckpointError("use_sliding_window=True is not supported")
    if mt in _GEMMAS:
        activation = "gelu_tanh"  # Gemmas use the tanh-approximate GELU whatever the config says
    else:
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise HFCheckpointError(f"unsupported hidden_act {act!r} for {mt} (expected 'silu')")
        activation = "silu"
    _check_numbers(hf, mt)
    heads = hf["num_attention_heads"]
    fields = dict(
        model_type=mt,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=hf.get("tie_word_embeddings", _TIE_DEFAULT[mt]),
        attention_bias=mt == "qwen2",
        qk_norm=mt in _QK_NORMED,
        activation=activation,
        scale_embeddings=mt in _GEMMAS,
        norm_plus_one=mt in _GEMMAS,
        dtype=dtype_name(dtype),
        param_dtype=dtype_name(dtype),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
        pad_token_id=hf.get("pad_token_id"),
    )
    if mt in ("gemma2", "gemma3"):
        fields.update(_gemma_fields(hf, mt, local_theta))
    if mt in _MOES:
        fields.update(_moe_fields(hf, mt))
    if rope_type != "default":
        fields.update(rope_scaling_type=rope_type, rope_factor=float(rope.get("factor", 1.0)))
    if rope_type == "llama3":
        fields.update(rope_low_freq_factor=float(rope["low_freq_factor"]),
                      rope_high_freq_factor=float(rope["high_freq_factor"]),
                      rope_original_max_position=int(rope["original_max_position_embeddings"]))
    fields.update(overrides)
    try:
        return ModelConfig(**fields)
    except (TypeError, ValueError) as e:   # an impossible combination (heads vs kv heads)
        raise HFCheckpointError(f"config.json: {' '.join(str(e).split())}") from None


# config.json key -> the ModelConfig field whose bounds it takes (config.COUNT_LIMITS).
_HF_COUNTS = {"vocab_size": "vocab_size", "hidden_size": "hidden_size",
              "intermediate_size": "intermediate_size", "num_hidden_layers": "num_layers",
              "num_attention_heads": "num_heads"}
_HF_OPTIONAL_COUNTS = {"num_key_value_heads": "num_kv_heads", "head_dim": "head_dim",
                       "max_position_embeddings": "max_position_embeddings",
                       "sliding_window": "sliding_window", "num_experts": "num_experts",
                       "num_local_experts": "num_experts",
                       "moe_intermediate_size": "moe_intermediate_size",
                       "sliding_window_pattern": "num_layers"}
_HF_FLOATS = ("rms_norm_eps", "rope_theta", "rope_local_base_freq", "query_pre_attn_scalar",
              "attn_logit_softcapping", "final_logit_softcapping")


def _check_numbers(hf: dict, mt: str) -> None:
    """Every count of ``hf`` an integer in range and every float finite and positive, before
    anything is built from them (a per-layer list, a division by the head count); one
    HFCheckpointError naming the key."""
    for key, field in {**_HF_COUNTS, **_HF_OPTIONAL_COUNTS}.items():
        if key not in hf and key in _HF_COUNTS:
            raise HFCheckpointError(f"config.json has no {key!r}")
        value = hf.get(key)
        if value is None or (key in ("num_key_value_heads", "head_dim") and value == 0):
            continue   # 0 there means "the default" (num_attention_heads, hidden // heads)
        try:
            check_count(field, value)
        except ValueError:
            raise HFCheckpointError(f"config.json: {key}={_short(value)} must be an integer "
                                    f"in [1, {COUNT_LIMITS.get(field, 1 << 31)}]") from None
    for key in _HF_FLOATS:
        value = hf.get(key)
        if value is None:
            continue
        try:
            check_positive(key, value, below=1.0 if key == "rms_norm_eps" else None)
        except ValueError as e:
            raise HFCheckpointError(f"config.json: {_short_message(e)}") from None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _short_message(e: Exception) -> str:
    return " ".join(str(e).split())[:200]


def _gemma_fields(hf: dict, mt: str, local_theta) -> dict:
    """The gemma2/gemma3 ModelConfig fields of an HF config (defaults: transformers')."""
    layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types")
    if layer_types is None:   # older files: gemma2 alternates, gemma3 has a local:global period
        period = 2 if mt == "gemma2" else hf.get("sliding_window_pattern", 6)
        layer_types = ["sliding_attention" if (i + 1) % period else "full_attention"
                       for i in range(layers)]
    if hf.get("use_bidirectional_attention"):
        raise HFCheckpointError("use_bidirectional_attention=True is not supported")
    return dict(post_norms=True, sliding_window=hf.get("sliding_window", 4096),
                layer_types=tuple(layer_types),
                rope_local_theta=None if mt == "gemma2" else float(local_theta),
                query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
                attn_logit_softcapping=hf.get("attn_logit_softcapping",
                                              50.0 if mt == "gemma2" else None),
                final_logit_softcapping=hf.get("final_logit_softcapping",
                                               30.0 if mt == "gemma2" else None))


def _moe_fields(hf: dict, mt: str) -> dict:
    """The mixture-of-experts ModelConfig fields of a qwen3_moe / olmoe HF config."""
    if mt == "qwen3_moe":
        step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
        if step != 1 or dense:
            raise HFCheckpointError(
                f"qwen3_moe with dense layers (decoder_sparse_step={step}, mlp_only_layers="
                f"{dense}) is not supported: every layer must be a mixture of experts")
    if mt == "olmoe":
        if hf.get("clip_qkv") is not None:
            raise HFCheckpointError("olmoe clip_qkv is not supported")
        heads = hf["num_attention_heads"]
        if hf.get("head_dim") not in (None, hf["hidden_size"] // heads):
            raise HFCheckpointError("olmoe's head_dim must be hidden_size // num_attention_heads")
    num_experts = hf.get("num_experts", hf.get("num_local_experts"))
    if not num_experts:
        raise HFCheckpointError(f"{mt} config.json gives no num_experts")
    return dict(num_experts=int(num_experts),
                num_experts_per_tok=int(hf.get("num_experts_per_tok", 8)),
                # OLMoE's experts are `intermediate_size` wide (it has no dense MLP).
                moe_intermediate_size=int(hf["intermediate_size"] if mt == "olmoe"
                                          else hf.get("moe_intermediate_size", 768)),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef",
                                                  0.001 if mt == "qwen3_moe" else 0.01)),
                qk_norm_scope="projection" if mt == "olmoe" else "head")


def _int_if_whole(x: float):
    return int(x) if float(x).is_integer() else x


def config_to_hf(cfg: ModelConfig) -> dict:
    """HF config.json dict for ``cfg`` (legacy rope keys, understood by transformers 4 and 5)."""
    mt = cfg.model_type
    gemma = mt in _GEMMAS
    if gemma and not (cfg.scale_embeddings and cfg.norm_plus_one
                      and cfg.activation == "gelu_tanh"):
        raise HFCheckpointError(f"{mt} export needs scale_embeddings, norm_plus_one and "
                                "activation='gelu_tanh'")
    if not gemma and (cfg.scale_embeddings or cfg.norm_plus_one or cfg.activation != "silu"):
        raise HFCheckpointError(f"{mt} export cannot express gemma-style options")
    if cfg.attention_bias != (mt == "qwen2"):
        raise HFCheckpointError("q/k/v biases are expressible only (and always) for qwen2")
    if cfg.qk_norm != (mt in _QK_NORMED):
        raise HFCheckpointError(f"qk_norm is expressible only (and always) for {_QK_NORMED}")
    if cfg.qk_norm and (cfg.qk_norm_scope == "projection") != (mt == "olmoe"):
        raise HFCheckpointError("qk_norm over the whole projection is expressible only (and "
                                "always) for olmoe")
    if cfg.is_moe != (mt in _MOES):
        raise HFCheckpointError(f"mixtures of experts are expressible only (and always) for "
                                f"{_MOES}")
    if mt == "olmoe" and cfg.head_dim * cfg.num_heads != cfg.hidden_size:
        raise HFCheckpointError("olmoe export needs head_dim * num_heads == hidden_size")
    new_gemma = mt in ("gemma2", "gemma3")
    if cfg.post_norms != new_gemma:
        raise HFCheckpointError("post_norms are expressible only (and always) for gemma2/3")
    if not new_gemma and (cfg.local_layers or cfg.query_pre_attn_scalar is not None
                          or cfg.attn_logit_softcapping or cfg.final_logit_softcapping):
        raise HFCheckpointError(f"{mt} export cannot express sliding windows, "
                                "query_pre_attn_scalar or soft-capping")
    if mt == "gemma2" and cfg.rope_local_theta is not None:
        raise HFCheckpointError("gemma2 export cannot express a separate local rope base")
    rope_scaling = None
    if cfg.rope_scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": cfg.rope_factor}
    elif cfg.rope_scaling_type == "llama3":
        rope_scaling = {"rope_type": "llama3", "factor": cfg.rope_factor,
                        "low_freq_factor": cfg.rope_low_freq_factor,
                        "high_freq_factor": cfg.rope_high_freq_factor,
                        "original_max_position_embeddings": cfg.rope_original_max_position}
    eos = list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id
    hf = {
        "architectures": [_ARCHITECTURES[mt]],
        "model_type": _HF_MODEL_TYPE.get(mt, mt),
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "gelu_pytorch_tanh" if gemma else "silu",
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos,
        "pad_token_id": cfg.pad_token_id,
        "torch_dtype": cfg.param_dtype,
        "initializer_range": cfg.init_std,
    }
    if cfg.model_type in ("llama", "qwen3") + _MOES:
        hf["attention_bias"] = False
    if cfg.is_moe:
        hf.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                  moe_intermediate_size=cfg.moe_intermediate_size,
                  norm_topk_prob=cfg.norm_topk_prob,
                  router_aux_loss_coef=cfg.router_aux_loss_coef)
    if mt == "qwen3_moe":
        hf.update(decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False)
    if mt == "olmoe":
        hf.update(clip_qkv=None, intermediate_size=cfg.moe_intermediate_size)
    if gemma:
        hf["hidden_activation"] = "gelu_pytorch_tanh"
    if new_gemma:
        hf.update(
            # transformers' config validation wants an int here
            query_pre_attn_scalar=(cfg.head_dim if cfg.query_pre_attn_scalar is None
                                   else _int_if_whole(cfg.query_pre_attn_scalar)),
            sliding_window=cfg.sliding_window or cfg.max_position_embeddings,
            layer_types=list(cfg.layer_types or ("full_attention",) * cfg.num_layers),
            attn_logit_softcapping=cfg.attn_logit_softcapping,
            final_logit_softcapping=cfg.final_logit_softcapping, attention_bias=False)
    if mt == "gemma3":
        hf["rope_local_base_freq"] = (cfg.rope_theta if cfg.rope_local_theta is None
                                      else cfg.rope_local_theta)
    if cfg.model_type in ("qwen2", "qwen3"):
        hf["use_sliding_window"] = False
    return hf
