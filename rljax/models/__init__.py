"""Decoder-only transformer families (llama, qwen2, qwen3, gemma, gemma2, gemma3; the mixtures of
experts qwen3_moe and olmoe) as pure functions over
parameter pytrees, a value head, Hugging Face safetensors import/export and llama.cpp GGUF
import (``load_hf`` of a ``.gguf`` path).

See docs/internals.md ("rljax.models") for the interface.
"""
from rljax.models.config import PRESETS, SUPPORTED_MODEL_TYPES, ModelConfig, get_preset
from rljax.models.gguf import (SUPPORTED_ARCHITECTURES as GGUF_ARCHITECTURES,
                               SUPPORTED_TENSOR_TYPES as GGUF_TENSOR_TYPES, GGUFError,
                               inspect_gguf, load_gguf)
from rljax.models.hf import (HFCheckpointError, config_from_hf, config_to_hf, save_hf,
                             save_hf_value)
from rljax.models.loading import is_gguf_path, load_config, load_hf
from rljax.models.packaged import (chunked_model_path, gemma3_270m_path, packaged_model_path,
                                   smollm2_path)
from rljax.models.head import forward, logits_from_hidden, scoring_temperature, token_logps
from rljax.models.transformer import (apply_rope, attention, default_positions, embed_tokens,
                                      init_cache, init_params, param_logical_axes, param_shapes,
                                      rms_norm, rope_inv_freq, stack_cache, trunk, unstack_cache,
                                      unstack_layers)
from rljax.models import head, kv_ring, lora, moe, peft, quant, shared_prompt
from rljax.models.kv_ring import init_layer_cache, kv_cache_bytes
from rljax.models.value import init_value_params, value_forward, value_param_logical_axes

__all__ = [
    "ModelConfig", "PRESETS", "SUPPORTED_MODEL_TYPES", "get_preset",
    "init_params", "param_logical_axes", "param_shapes",
    "forward", "trunk", "logits_from_hidden", "init_cache", "init_layer_cache", "kv_cache_bytes",
    "kv_ring", "token_logps",
    "scoring_temperature",
    "unstack_layers", "unstack_cache", "stack_cache",
    "embed_tokens", "default_positions", "rms_norm", "apply_rope", "rope_inv_freq", "attention",
    "init_value_params", "value_forward", "value_param_logical_axes",
    "head", "lora", "moe", "peft", "quant", "shared_prompt", "load_hf", "save_hf", "save_hf_value", "config_from_hf", "config_to_hf",
    "HFCheckpointError",
    "load_config", "is_gguf_path", "load_gguf", "inspect_gguf", "GGUFError",
    "GGUF_ARCHITECTURES", "GGUF_TENSOR_TYPES", "packaged_model_path", "smollm2_path",
    "chunked_model_path", "gemma3_270m_path",
]
