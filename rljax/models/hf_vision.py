"""Multimodal Gemma 3 checkpoints (``Gemma3ForConditionalGeneration``): the vision tower's
config and weights, next to the text model that ``models.hf`` reads from the same directory.

    cfg, vcfg, params = load_hf_vlm(path)   # params["vision"]: the tower (models.vision)
    save_hf_vlm(cfg, params, out_dir)       # the whole model back, as transformers writes it

Tensor names: transformers 5 writes ``vision_tower.*`` and ``multi_modal_projector.*``;
Google's releases and transformers 4 ``vision_tower.vision_model.*`` (either under
``model.``). All are accepted.
"""
from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from rljax.models.config import ModelConfig, dtype_name
from rljax.models.hf import (_NP_DTYPES, _Reader, _hf_shape, _to_ours, config_to_hf,
                             hf_checkpoint_config, load_params, text_tensor_plan,
                             write_tensors)
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


# The one name table, read by the loader and (reversed) by the export: our tower param ->
# (HF name after the tower's or the projector's prefix, n_in as in ``models.hf``: the number
# of our leading "input" axes of a linear weight HF stores [out, in]; 0 a vector, -1 as is).
_LAYER_NAMES = {
    "ln1": ("layer_norm1.weight", 0), "ln1_bias": ("layer_norm1.bias", 0),
    "ln2": ("layer_norm2.weight", 0), "ln2_bias": ("layer_norm2.bias", 0),
    "q": ("self_attn.q_proj.weight", 1), "q_bias": ("self_attn.q_proj.bias", 0),
    "k": ("self_attn.k_proj.weight", 1), "k_bias": ("self_attn.k_proj.bias", 0),
    "v": ("self_attn.v_proj.weight", 1), "v_bias": ("self_attn.v_proj.bias", 0),
    "o": ("self_attn.out_proj.weight", 2), "o_bias": ("self_attn.out_proj.bias", 0),
    "fc1": ("mlp.fc1.weight", 1), "fc1_bias": ("mlp.fc1.bias", 0),
    "fc2": ("mlp.fc2.weight", 1), "fc2_bias": ("mlp.fc2.bias", 0),
}
_TOWER_NAMES = {
    # The patch convolution [E, C, p, p] is a linear map of the flattened patch (C, p, p).
    "patch": ("embeddings.patch_embedding.weight", 1),
    "patch_bias": ("embeddings.patch_embedding.bias", 0),
    "pos": ("embeddings.position_embedding.weight", -1),
    "post_ln": ("post_layernorm.weight", 0), "post_ln_bias": ("post_layernorm.bias", 0),
}
_PROJECTOR_NAMES = {"mm_norm": ("mm_soft_emb_norm.weight", 0),
                    "mm_proj": ("mm_input_projection_weight", -1)}   # [E, D], used as is


def vision_entries(vcfg: VisionConfig, tower: str, proj: str):
    """Yields ``(tree path, layer index or None, HF name, n_in, HF shape)`` for every tensor
    of the tower and projector, named under the prefixes ``tower`` and ``proj``."""
    shapes = vision_param_shapes(vcfg)
    c, p = vcfg.num_channels, vcfg.patch_size
    for name, (hf_name, n_in) in _TOWER_NAMES.items():
        hf_shape = _hf_shape(shapes[name][0], n_in)
        if name == "patch":
            hf_shape = (vcfg.hidden_size, c, p, p)
        yield (name,), None, tower + hf_name, n_in, hf_shape
    for name, (hf_name, n_in) in _PROJECTOR_NAMES.items():
        yield (name,), None, proj + hf_name, n_in, _hf_shape(shapes[name][0], n_in)
    for name, (hf_name, n_in) in _LAYER_NAMES.items():
        hf_shape = _hf_shape(shapes["layers"][name][0][1:], n_in)
        for i in range(vcfg.num_layers):
            yield ("layers", name), i, f"{tower}encoder.layers.{i}.{hf_name}", n_in, hf_shape


def load_vision_params(vcfg: VisionConfig, reader: _Reader) -> dict:
    """The tower's params tree (``models.vision``) from an open checkpoint ``reader``."""
    tower = _prefix(reader.index, _TOWER_PREFIXES, "embeddings.patch_embedding.weight")
    proj = _prefix(reader.index, _PROJECTOR_PREFIXES, "mm_input_projection_weight")
    shapes = vision_param_shapes(vcfg)
    np_dtype = _NP_DTYPES[vcfg.param_dtype]
    layers: dict = {}
    out: dict = {}
    for path, i, hf_name, n_in, hf_shape in vision_entries(vcfg, tower, proj):
        if hf_name not in reader.index:
            raise HFCheckpointError(f"missing tensor {hf_name!r} in checkpoint")
        w = reader.get(hf_name, None)
        if tuple(w.shape) != hf_shape:
            raise HFCheckpointError(f"vision tensor {hf_name}: expected shape {hf_shape}, got "
                                    f"{tuple(w.shape)}")
        if i is None:
            shape = shapes[path[0]][0]
            out[path[0]] = _to_ours(w.reshape(_hf_shape(shape, n_in)), shape, n_in)
        else:
            shape = shapes["layers"][path[1]][0]
            stack = layers.setdefault(path[1], np.empty(shape, np_dtype))
            stack[i] = _to_ours(w, shape[1:], n_in)
    out = {k: jnp.asarray(np.ascontiguousarray(v).astype(np_dtype)) for k, v in out.items()}
    out["layers"] = {k: jnp.asarray(v) for k, v in layers.items()}
    return out


def vlm_config(path: str, dtype=jnp.float32, **overrides):
    """``(cfg, vcfg)`` of a multimodal Gemma 3 checkpoint directory, without reading weights
    (as ``load_hf_vlm``)."""
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
    return cfg, vcfg


def load_hf_vlm(path: str, dtype=jnp.float32, shardings=None, **overrides):
    """A multimodal Gemma 3 checkpoint directory -> ``(cfg, vcfg, params)``: ``cfg`` the text
    model's ``ModelConfig`` with ``image_token_id`` set, ``vcfg`` the tower's ``VisionConfig``,
    ``params`` the text params plus ``params["vision"]``; ``cfg.vision`` is ``vcfg``.
    ``shardings`` (a tree like ``params``): the text model's tensors go straight into their
    shards as ``models.load_hf`` places them, then the (small) tower into its own.
    ``overrides`` go to ``cfg``."""
    cfg, vcfg = vlm_config(path, dtype, **overrides)
    reader = _Reader(path)
    params = load_params(cfg, reader.get, shardings)
    params["vision"] = load_vision_params(vcfg, reader)
    if shardings is not None:
        params["vision"] = jax.device_put(params["vision"], shardings["vision"])
    return cfg, vcfg, params


# ----------------------------------------------------------------------------- export

# Where transformers' ``save_pretrained`` puts a Gemma3ForConditionalGeneration's tensors.
_SAVE_TOWER, _SAVE_PROJECTOR = "vision_tower.", "multi_modal_projector."


def _text_name(name: str) -> str:
    """Our text model's HF name -> its name inside the multimodal checkpoint."""
    return "language_model." + name


def config_to_hf_vlm(cfg: ModelConfig, extra: dict | None = None) -> dict:
    """The config.json dict of a ``Gemma3ForConditionalGeneration`` for ``cfg`` (a gemma3
    ``ModelConfig`` with ``vision``); ``extra`` adds top-level keys (e.g. the checkpoint's
    ``boi_token_index``/``eoi_token_index``)."""
    v = cfg.vision
    if cfg.model_type != "gemma3" or v is None:
        raise HFCheckpointError("a multimodal export needs a gemma3 model with a vision tower")
    text = config_to_hf(cfg)
    text.pop("architectures")
    hf = {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": text,
        "vision_config": {
            "model_type": "siglip_vision_model", "hidden_size": v.hidden_size,
            "intermediate_size": v.intermediate_size, "num_hidden_layers": v.num_layers,
            "num_attention_heads": v.num_heads, "image_size": v.image_size,
            "patch_size": v.patch_size, "num_channels": v.num_channels,
            "layer_norm_eps": v.layer_norm_eps, "hidden_act": v.activation,
            "vision_use_head": False},   # Gemma 3 reads the encoder's last hidden state
        "mm_tokens_per_image": v.mm_tokens_per_image,
        "image_token_index": cfg.image_token_id,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "torch_dtype": cfg.param_dtype,
    }
    hf.update({k: text[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    hf.update(extra or {})
    return hf


def image_marker_ids(path: str | None) -> dict:
    """The ``boi_token_index``/``eoi_token_index`` (the processor's image markers) of the
    multimodal checkpoint directory ``path``, to carry into an export; {} without one (a
    tower trained from scratch)."""
    if not path or not os.path.isdir(path):
        return {}
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    return {k: hf[k] for k in ("boi_token_index", "eoi_token_index") if k in hf}


def save_hf_vlm(cfg: ModelConfig, params: dict, out_dir: str, max_shard_bytes: int = 2 << 30,
                extra_config: dict | None = None) -> None:
    """Write the whole multimodal model (text model, tower, projector) as a HF
    ``Gemma3ForConditionalGeneration`` directory: config.json and safetensors under the names
    transformers writes, loadable by ``from_pretrained`` and by ``load_hf_vlm``. ``params``:
    the text params plus ``params["vision"]``; ``extra_config`` as in ``config_to_hf_vlm``."""
    hf_config = config_to_hf_vlm(cfg, extra_config)
    plan = text_tensor_plan(cfg, params, rename=_text_name)
    itemsize = np.dtype(_NP_DTYPES[cfg.param_dtype]).itemsize
    shapes = vision_param_shapes(cfg.vision)
    for path, i, hf_name, n_in, hf_shape in vision_entries(cfg.vision, _SAVE_TOWER,
                                                          _SAVE_PROJECTOR):
        node = params["vision"]
        spec = shapes
        for key in path:
            node, spec = node[key], spec[key]
        if tuple(node.shape) != spec[0]:
            raise HFCheckpointError(f"vision parameter {'/'.join(path)}: expected shape "
                                    f"{spec[0]}, got {tuple(node.shape)}")
        plan.append((hf_name, ("vision",) + path, i, n_in, hf_shape,
                     math.prod(hf_shape) * itemsize))
    write_tensors(plan, params, out_dir, cfg.param_dtype, max_shard_bytes)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
