"""PEFT-compatible LoRA adapter directories: ``adapter_config.json`` + ``adapter_model.safetensors``.

``save_adapter`` writes what ``peft.PeftModel.from_pretrained(base_hf_model, out_dir)`` loads;
``load_adapter`` reads such a directory back into ``rljax.models.lora``'s stacked layout.

Tensor names (llama-family HF layout) are PEFT's::

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   [out, r]

Ours are ``a [L, in..., r]`` and ``b [L, r, out...]`` with the same flattening of the
multi-axis inputs/outputs as the base weights in ``hf.py``; PEFT's scaling is
``lora_alpha / r``, ours ``cfg.lora_scale``, so ``lora_alpha = lora_scale * r``.
"""
from __future__ import annotations

import json
import math
import os
import re

import jax
import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file

from rljax.models.config import ModelConfig
from rljax.models.hf import save_file
from rljax.models.lora import ALL_TARGETS, lora_shapes, rank_of

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model.model.layers"
# our projection name -> HF module path inside a decoder layer
MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
           "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
           "down": "mlp.down_proj"}
_BY_SHORT = {path.split(".")[-1]: name for name, path in MODULES.items()}


def save_adapter(cfg: ModelConfig, adapters: dict, out_dir: str,
                 base_model_name_or_path: str = "") -> None:
    """Writes ``adapters`` (``params["lora"]``) as a PEFT LoRA adapter directory (float32)."""
    os.makedirs(out_dir, exist_ok=True)
    rank = rank_of(adapters)
    tensors = {}
    for name, ad in adapters["layers"].items():
        a = np.asarray(jax.device_get(ad["a"]), np.float32)
        b = np.asarray(jax.device_get(ad["b"]), np.float32)
        for i in range(cfg.num_layers):
            base = f"{PREFIX}.{i}.{MODULES[name]}"
            tensors[f"{base}.lora_A.weight"] = np.ascontiguousarray(a[i].reshape(-1, rank).T)
            tensors[f"{base}.lora_B.weight"] = np.ascontiguousarray(b[i].reshape(rank, -1).T)
    # The base model's family rides in the safetensors metadata (PEFT's config would warn
    # about an unknown key); load_adapter checks it against the base.
    save_file(tensors, os.path.join(out_dir, ADAPTER_WEIGHTS),
              metadata={"format": "pt", "model_type": cfg.model_type})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path or None,
        "r": rank, "lora_alpha": float(cfg.lora_scale) * rank,
        "lora_dropout": float(cfg.lora_dropout),
        "target_modules": sorted(MODULES[n].split(".")[-1] for n in adapters["layers"]),
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "inference_mode": True, "modules_to_save": None, "init_lora_weights": True,
    }
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)


def adapter_dropout(path: str) -> float:
    """The ``lora_dropout`` rate of a PEFT LoRA directory (0 when the config has none).
    Raises ValueError (one line) when it is not a number in [0, 1)."""
    with open(os.path.join(path, ADAPTER_CONFIG)) as f:
        value = json.load(f).get("lora_dropout") or 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"lora_dropout={value!r} in {ADAPTER_CONFIG} must be a number in [0, 1)")
    return float(value)


def load_adapter(path: str, cfg: ModelConfig) -> tuple[dict, int, float]:
    """``(adapters, rank, alpha)`` from a PEFT LoRA directory, checked against ``cfg`` (the
    base model). Raises ValueError (one line) when the adapter does not fit the base."""
    with open(os.path.join(path, ADAPTER_CONFIG)) as f:
        config = json.load(f)
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"peft_type {config.get('peft_type')!r} is not LORA")
    for flag in ("use_rslora", "use_dora", "fan_in_fan_out"):
        if config.get(flag):
            raise ValueError(f"{flag}=true adapters are not supported")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    if rank <= 0:
        raise ValueError(f"adapter rank r={rank} must be > 0")
    weights_path = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(weights_path):
        raise ValueError(f"no {ADAPTER_WEIGHTS}")
    with safe_open(weights_path, "np") as f:
        mt = (f.metadata() or {}).get("model_type")
    if mt is None and config.get("base_model_name_or_path"):
        base_cfg = os.path.join(config["base_model_name_or_path"], "config.json")
        if os.path.isfile(base_cfg):
            with open(base_cfg) as f:
                mt = json.load(f).get("model_type")
    if mt is not None and mt != cfg.model_type:
        raise ValueError(f"adapter was trained on a {mt!r} model, the base is {cfg.model_type!r}")
    tensors = load_file(weights_path)
    pattern = re.compile(rf"{re.escape(PREFIX)}\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
                         rf"\.lora_([AB])(?:\.default)?\.weight")
    found: dict = {}
    for key, value in tensors.items():
        m = pattern.fullmatch(key)
        if m is None or m.group(2) not in _BY_SHORT:
            raise ValueError(f"unexpected tensor {key!r} (only LoRA on "
                             f"{', '.join(sorted(_BY_SHORT))} is supported)")
        layer = int(m.group(1))
        if layer >= cfg.num_layers:
            raise ValueError(f"tensor {key!r}: the base model has only {cfg.num_layers} layers")
        found.setdefault(_BY_SHORT[m.group(2)], {}).setdefault(m.group(3), {})[layer] = value
    if not found:
        raise ValueError("the adapter holds no LoRA tensors")
    targets = tuple(n for n in ALL_TARGETS if n in found)
    specs = lora_shapes(cfg, rank, targets)["layers"]
    out = {}
    for name in targets:
        a_shape, b_shape = specs[name]["a"][0], specs[name]["b"][0]
        want_a = (rank, math.prod(a_shape[1:-1]))
        want_b = (math.prod(b_shape[2:]), rank)
        per = found[name]
        layers_a, layers_b = [], []
        for i in range(cfg.num_layers):
            if i not in per.get("A", {}) or i not in per.get("B", {}):
                raise ValueError(f"{MODULES[name]} of layer {i} has no lora_A/lora_B pair")
            a, b = per["A"][i], per["B"][i]
            if a.shape != want_a or b.shape != want_b:
                raise ValueError(f"layer {i} {MODULES[name]}: adapter shapes {a.shape}/{b.shape} "
                                 f"do not match the base model (expected {want_a}/{want_b})")
            layers_a.append(a.astype(np.float32).T.reshape(a_shape[1:]))
            layers_b.append(b.astype(np.float32).T.reshape(b_shape[1:]))
        out[name] = {"a": np.stack(layers_a), "b": np.stack(layers_b)}
    return {"layers": out}, rank, alpha
