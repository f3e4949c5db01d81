"""Multimodal Gemma 3 checkpoints (``Gemma3ForConditionalGeneration``): the vision tower's
config and weights, next to the text model that ``models.hf`` reads from the same directory.

    cfg, vcfg, params = load_hf_vlm(path)   # params["vision"]: the tower (models.vision)

Tensor names: transformers 5 writes ``vision_tower.*`` and ``multi_modal_projector.*``;
Google's releases and transformers 4 ``vision_tower.vision_model.*`` (either under
``model.``). All are accepted.
"""
from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np

from rljax.models.config import ModelConfig, dtype_name
from rljax.models.hf import _NP_DTYPES, _Reader, hf_checkpoint_config, load_params
from rljax.models.hf_config import HFCheckpointError
from rljax.models.vision import VisionConfig, vision_param_shapes

_TOWER_PREFIXES = ("vision_tower.", "vision_tower.vision_model.", "model.vision_tower.",
                   "model.vision_tower.vision_model.")
_PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")


def is_multimodal(hf: dict) -> bool:
    """True for a config.json dict of a Gemma 3 checkpoint with a vision tower."""
    return hf.get("model_type") == "gemma3" and bool(hf.get("vision_config"))


def vision_config_from_hf(hf: dict, dtype=jnp.float32) -> VisionConfig:
    """The ``VisionConfig`` of a multimodal Gemma 3 config.json dict (defaults: transformers')."""
    if not is_multimodal(hf):
        raise HFCheckpointError("config.json has no Gemma 3 vision_config (model_type "
                                f"{hf.get('model_type')!r})")
    v = hf["vision_config"]
    text = hf.get("text_config") or {}
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu"):
        raise HFCheckpointError(f"unsupported vision hidden_act {act!r}")
    name = dtype_name(dtype)
    return VisionConfig(
        hidden_size=v.get("hidden_size", 768), intermediate_size=v.get("intermediate_size", 3072),
        num_layers=v.get("num_hidden_layers", 12), num_heads=v.get("num_attention_heads", 12),
        image_size=v.get("image_size", 224), patch_size=v.get("patch_size", 16),
        num_channels=v.get("num_channels", 3), layer_norm_eps=v.get("layer_norm_eps", 1e-6),
        activation=act, mm_tokens_per_image=hf.get("mm_tokens_per_image", 256),
        text_hidden_size=text.get("hidden_size", 2304), dtype=name, param_dtype=name)


def image_token_id(hf: dict) -> int:
    """The image placeholder id of a multimodal Gemma 3 config.json dict."""
    return int(hf.get("image_token_index", hf.get("image_token_id", 262_144)))


def _prefix(index: dict, prefixes: tuple, probe: str) -> str:
    for prefix in prefixes:
        if prefix + probe in index:
            return prefix
    raise HFCheckpointError(f"missing tensor {prefixes[0] + probe!r} in checkpoint")


def _layer_tensors(w, e: int, h: int, dh: int) -> dict:
    """HF SigLIP layer tensors (``w(name)`` -> np array) -> ours, without the layers axis."""
    lin = lambda name: w(f"{name}.weight").T                    # [out, in] -> [in, out]
    heads = lambda name: lin(name).reshape(e, h, dh)
    out = {"ln1": w("layer_norm1.weight"), "ln1_bias": w("layer_norm1.bias"),
           "ln2": w("layer_norm2.weight"), "ln2_bias": w("layer_norm2.bias"),
           "o": lin("self_attn.out_proj").reshape(h, dh, e), "o_bias": w("self_attn.out_proj.bias"),
           "fc1": lin("mlp.fc1"), "fc1_bias": w("mlp.fc1.bias"),
           "fc2": lin("mlp.fc2"), "fc2_bias": w("mlp.fc2.bias")}
    for name in ("q", "k", "v"):
        out[name] = heads(f"self_attn.{name}_proj")
        out[f"{name}_bias"] = w(f"self_attn.{name}_proj.bias").reshape(h, dh)
    return out


def load_vision_params(vcfg: VisionConfig, reader: _Reader) -> dict:
    """The tower's params tree (``models.vision``) from an open checkpoint ``reader``."""
    tower = _prefix(reader.index, _TOWER_PREFIXES, "embeddings.patch_embedding.weight")
    proj = _prefix(reader.index, _PROJECTOR_PREFIXES, "mm_input_projection_weight")
    shapes = vision_param_shapes(vcfg)
    np_dtype = _NP_DTYPES[vcfg.param_dtype]

    def get(name):
        if name not in reader.index:
            raise HFCheckpointError(f"missing tensor {name!r} in checkpoint")
        return reader.get(name, None)

    e, h, dh = vcfg.hidden_size, vcfg.num_heads, vcfg.head_dim
    layers = [_layer_tensors(lambda n, i=i: get(f"{tower}encoder.layers.{i}.{n}"), e, h, dh)
              for i in range(vcfg.num_layers)]
    tree = {
        "patch": get(f"{tower}embeddings.patch_embedding.weight").reshape(e, -1).T,
        "patch_bias": get(f"{tower}embeddings.patch_embedding.bias"),
        "pos": get(f"{tower}embeddings.position_embedding.weight"),
        "layers": {k: np.stack([layer[k] for layer in layers]) for k in layers[0]},
        "post_ln": get(f"{tower}post_layernorm.weight"),
        "post_ln_bias": get(f"{tower}post_layernorm.bias"),
        "mm_norm": get(f"{proj}mm_soft_emb_norm.weight"),
        "mm_proj": get(f"{proj}mm_input_projection_weight"),
    }

    def check(path, spec, arr):
        if tuple(arr.shape) != spec[0]:
            raise HFCheckpointError(f"vision tensor {path}: expected shape {spec[0]}, got "
                                    f"{tuple(arr.shape)}")
        return jnp.asarray(np.ascontiguousarray(arr).astype(np_dtype))

    out = {k: check(k, shapes[k], v) for k, v in tree.items() if k != "layers"}
    out["layers"] = {k: check(f"layers/{k}", shapes["layers"][k], v)
                     for k, v in tree["layers"].items()}
    return out


def load_hf_vlm(path: str, dtype=jnp.float32, **overrides):
    """A multimodal Gemma 3 checkpoint directory -> ``(cfg, vcfg, params)``: ``cfg`` the text
    model's ``ModelConfig`` with ``image_token_id`` set, ``vcfg`` the tower's ``VisionConfig``,
    ``params`` the text params plus ``params["vision"]``; ``cfg.vision`` is ``vcfg``.
    ``overrides`` go to ``cfg``."""
    config_file = os.path.join(path, "config.json")
    if not os.path.exists(config_file):
        raise HFCheckpointError(f"{path!r} is not a HF checkpoint directory (no config.json)")
    with open(config_file) as f:
        hf = json.load(f)
    vcfg = vision_config_from_hf(hf, dtype)
    cfg = hf_checkpoint_config(path, dtype=dtype, image_token_id=image_token_id(hf),
                               vision=vcfg, **overrides)
    if vcfg.text_hidden_size != cfg.hidden_size:
        raise HFCheckpointError(f"vision projector width {vcfg.text_hidden_size} != text "
                                f"hidden_size {cfg.hidden_size}")
    reader = _Reader(path)
    params = load_params(cfg, reader.get)
    params["vision"] = load_vision_params(vcfg, reader)
    return cfg, vcfg, params
