"""Hugging Face checkpoints: config.json + safetensors <-> (ModelConfig, params). No PyTorch.

Tensors are read with safetensors' numpy API (bfloat16 through ml_dtypes), converted one
parameter at a time and, when shardings are given, placed straight into their sharding with
``jax.make_array_from_callback`` so a large model is never gathered on one device.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file as _save_file

from rljax.models.config import ModelConfig
# The config.json side lives in hf_config; re-exported, as callers import it from here.
from rljax.models.hf_config import (_ARCHITECTURES, HFCheckpointError,  # noqa: F401
                                    config_from_hf, config_to_hf)
from rljax.models.transformer import param_shapes

_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


# ----------------------------------------------------------------------------- name mapping

# our layer param -> (HF name inside "model.layers.{i}.", number of leading "input" axes in our
# layout). Linear weights are stored [out, in] by HF and [in..., out...] by us; n_in = 0 marks a
# vector that only needs a reshape.
_LAYER_NAMES = {
    "attn_norm": ("input_layernorm.weight", 0),
    "q": ("self_attn.q_proj.weight", 1),
    "k": ("self_attn.k_proj.weight", 1),
    "v": ("self_attn.v_proj.weight", 1),
    "o": ("self_attn.o_proj.weight", 2),
    "q_bias": ("self_attn.q_proj.bias", 0),
    "k_bias": ("self_attn.k_proj.bias", 0),
    "v_bias": ("self_attn.v_proj.bias", 0),
    "q_norm": ("self_attn.q_norm.weight", 0),
    "k_norm": ("self_attn.k_norm.weight", 0),
    "mlp_norm": ("post_attention_layernorm.weight", 0),
    "gate": ("mlp.gate_proj.weight", 1),
    "up": ("mlp.up_proj.weight", 1),
    "down": ("mlp.down_proj.weight", 1),
    # Mixtures of experts: the router, and each expert's three matrices stored one tensor per
    # expert ("{e}" = the expert's index; see EXPERTS).
    "router": ("mlp.gate.weight", 1),
    "expert_gate": ("mlp.experts.{e}.gate_proj.weight", -2),
    "expert_up": ("mlp.experts.{e}.up_proj.weight", -2),
    "expert_down": ("mlp.experts.{e}.down_proj.weight", -2),
}
# n_in of a per-layer stack of experts [E, in, out] (ours) stored by HF as E separate
# [out, in] tensors; converted as one [E, out, in] array whose rows are those tensors.
EXPERTS = -2
# Gemma 2/3 name their four layer norms by position: "post_attention_layernorm" is the norm on
# the attention output there, not the MLP's pre-norm as in the other families.
_POST_NORM_NAMES = {
    "mlp_norm": ("pre_feedforward_layernorm.weight", 0),
    "post_attn_norm": ("post_attention_layernorm.weight", 0),
    "post_mlp_norm": ("post_feedforward_layernorm.weight", 0),
}
_TOP_NAMES = {
    "embed": ("model.embed_tokens.weight", -1),  # -1: same layout as ours ([V, D])
    "final_norm": ("model.norm.weight", 0),
    "lm_head": ("lm_head.weight", 1),
}



def save_file(tensors: dict, path: str, metadata: dict | None = None) -> None:
    """``safetensors.numpy.save_file``, then the mode every other exported file gets (0644
    under the usual umask): safetensors writes through a private temporary file (0600)."""
    _save_file(tensors, path, metadata=metadata)
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (``os.umask`` sets
    one to read it: a file another thread creates meanwhile would get the wrong mode)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask

def _hf_shape(shape: tuple, n_in: int) -> tuple:
    if n_in == EXPERTS:
        return (shape[0], math.prod(shape[2:]), shape[1])
    if n_in == -1:
        return tuple(shape)
    if n_in == 0:
        return (math.prod(shape),)
    return (math.prod(shape[n_in:]), math.prod(shape[:n_in]))


def _to_ours(w: np.ndarray, shape: tuple, n_in: int) -> np.ndarray:
    if n_in == EXPERTS:
        return np.swapaxes(w, 1, 2).reshape(shape)
    return w.reshape(shape) if n_in <= 0 else w.T.reshape(shape)


def _from_ours(w: np.ndarray, n_in: int) -> np.ndarray:
    if n_in == EXPERTS:
        return np.ascontiguousarray(np.swapaxes(w.reshape(w.shape[0], w.shape[1], -1), 1, 2))
    if n_in == -1:
        return w
    if n_in == 0:
        return w.reshape(-1)
    return np.ascontiguousarray(w.reshape(math.prod(w.shape[:n_in]), -1).T)


def _entries(cfg: ModelConfig):
    """Yields (path tuple in our tree, our full shape, HF name fn(layer|None), n_in, stacked)."""
    names = dict(_LAYER_NAMES, **_POST_NORM_NAMES) if cfg.post_norms else _LAYER_NAMES
    for name, (shape, _) in param_shapes(cfg)["layers"].items():
        hf_name, n_in = names[name]
        yield ("layers", name), shape, (lambda i, n=hf_name: f"model.layers.{i}.{n}"), n_in, True
    for name in ("embed", "final_norm", "lm_head"):
        if name in param_shapes(cfg):
            hf_name, n_in = _TOP_NAMES[name]
            yield (name,), param_shapes(cfg)[name][0], (lambda i, n=hf_name: n), n_in, False


def hf_tensor_shapes(cfg: ModelConfig) -> dict:
    """HF tensor name -> HF shape of every tensor a checkpoint of ``cfg`` holds."""
    shapes = {}
    for _, shape, hf_name, n_in, stacked in _entries(cfg):
        for i in (range(shape[0]) if stacked else [None]):
            hf_shape = _hf_shape(shape[1:] if stacked else shape, n_in)
            if n_in == EXPERTS:
                for e in range(hf_shape[0]):
                    shapes[hf_name(i).format(e=e)] = hf_shape[1:]
            else:
                shapes[hf_name(i)] = hf_shape
    return shapes


def _with_experts(get_tensor: Callable) -> Callable:
    """``get_tensor`` that also answers an experts name ("...experts.{e}...", shape
    [E, out, in]) with the E per-expert tensors stacked."""
    def get(name, shape):
        if "{e}" not in name:
            return get_tensor(name, shape)
        return np.stack([get_tensor(name.format(e=e), tuple(shape[1:])) for e in range(shape[0])])
    return get


# ----------------------------------------------------------------------------- load

def _tensor_index(path: str) -> dict:
    """HF tensor name -> safetensors file path (single file, sharded index, or any *.safetensors)."""
    index_file = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index_file):
        with open(index_file) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(path, fname) for name, fname in weight_map.items()}
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise HFCheckpointError(f"no *.safetensors files in {path!r}")
    index = {}
    for fname in files:
        with safe_open(os.path.join(path, fname), framework="numpy") as f:
            for name in f.keys():
                index[name] = os.path.join(path, fname)
    return index


def _text_tower_name(name: str, index: dict) -> str:
    """The name a multimodal Gemma 3 checkpoint gives the text tower's tensor ``name``
    ("model.language_model.*" in transformers 5, "language_model.model.*" before), or
    ``name`` itself when neither is there."""
    if name.startswith("model."):
        rest = name[len("model."):]
        for alt in (f"model.language_model.{rest}", f"language_model.model.{rest}"):
            if alt in index:
                return alt
    elif name == "lm_head.weight" and "language_model.lm_head.weight" in index:
        return "language_model.lm_head.weight"
    return name


class _Reader:
    """Reads named tensors lazily, keeping each safetensors file open once."""

    def __init__(self, path: str):
        self.index = _tensor_index(path)
        self._files = {}

    def get(self, name: str, expected_shape: Optional[tuple]) -> np.ndarray:
        """The tensor ``name``; HFCheckpointError when missing or not ``expected_shape``
        (None: any shape)."""
        if name not in self.index:
            name = _text_tower_name(name, self.index)
        if name not in self.index:
            raise HFCheckpointError(f"missing tensor {name!r} in checkpoint")
        fname = self.index[name]
        if fname not in self._files:
            self._files[fname] = safe_open(fname, framework="numpy")
        w = self._files[fname].get_tensor(name)
        if expected_shape is not None and tuple(w.shape) != tuple(expected_shape):
            raise HFCheckpointError(f"shape mismatch for tensor {name!r}: expected "
                                    f"{tuple(expected_shape)}, got {tuple(w.shape)}")
        return w


def load_hf_checkpoint(path: str, dtype=jnp.float32, shardings=None, transform=None,
                       **overrides):
    """Load a HF checkpoint directory (config.json + *.safetensors) -> ``(cfg, params)``.

    ``models.load_hf`` takes a GGUF file too (``models.loading``). ``dtype``, ``shardings``,
    ``transform``, ``overrides``: as ``models.load_hf``.
    """
    cfg = hf_checkpoint_config(path, dtype=dtype, **overrides)
    return cfg, load_params(cfg, _Reader(path).get, shardings, transform)


def hf_checkpoint_config(path: str, dtype=jnp.float32, **overrides) -> ModelConfig:
    """The ModelConfig of a HF checkpoint directory (its config.json), without reading weights."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isdir(path) or not os.path.exists(config_file):
        raise HFCheckpointError(f"{path!r} is not a HF checkpoint directory (no config.json)")
    with open(config_file) as f:
        return config_from_hf(json.load(f), dtype=dtype, **overrides)


def load_params(cfg: ModelConfig, get_tensor: Callable, shardings=None,
                transform: Callable | None = None) -> dict:
    """The params tree of ``cfg`` from a tensor source in the HF layout.

    ``get_tensor(hf_name, hf_shape) -> np.ndarray`` returns the HF tensor ``hf_name`` (e.g.
    ``model.layers.3.self_attn.q_proj.weight``, shape ``[out, in]``) and raises when it is
    missing or has another shape. Stacked layer tensors are converted one layer at a time and,
    with ``shardings``, placed straight into their shards (see ``_build_array``).
    ``transform(tree_path, array)``, when given, replaces each parameter as soon as it is
    built (e.g. quantizes it), so the whole float tree never exists at once.
    """
    np_dtype = _NP_DTYPES[cfg.param_dtype]
    get_tensor = _with_experts(get_tensor)
    params: dict = {}
    for tree_path, shape, hf_name, n_in, stacked in _entries(cfg):
        if stacked:
            layer_shape = shape[1:]

            def load_layer(i, hf_name=hf_name, layer_shape=layer_shape, n_in=n_in):
                w = get_tensor(hf_name(i), _hf_shape(layer_shape, n_in))
                return _to_ours(w, layer_shape, n_in).astype(np_dtype)
        else:
            def load_layer(i, hf_name=hf_name, shape=shape, n_in=n_in):
                w = get_tensor(hf_name(None), _hf_shape(shape, n_in))
                return _to_ours(w, shape, n_in).astype(np_dtype)
        sharding = None
        if shardings is not None:
            sharding = shardings[tree_path[0]] if len(tree_path) == 1 else \
                shardings[tree_path[0]][tree_path[1]]
        arr = _build_array(shape, stacked, load_layer, sharding, np_dtype)
        if transform is not None:
            arr = transform(tuple(tree_path), arr)
        node = params
        for key in tree_path[:-1]:
            node = node.setdefault(key, {})
        node[tree_path[-1]] = arr
    return params


def _build_array(shape, stacked: bool, load_layer: Callable, sharding, np_dtype):
    """One parameter as a jax.Array; per-layer tensors are converted once and reused by shards."""
    converted: dict = {}  # host cache for this parameter only, dropped when it is built

    def layer(i):
        if i not in converted:
            converted[i] = load_layer(i)
        return converted[i]

    if sharding is None:
        if not stacked:
            return jnp.asarray(layer(None))
        out = np.empty(shape, np_dtype)
        for i in range(shape[0]):
            out[i] = layer(i)
        return jnp.asarray(out)

    def callback(index):
        if not stacked:
            return layer(None)[index]
        layers = range(shape[0])[index[0]]
        return np.stack([layer(i)[index[1:]] for i in layers])

    return jax.make_array_from_callback(shape, sharding, callback)


# ----------------------------------------------------------------------------- save

def _host(x) -> np.ndarray:
    """Host numpy copy of a (possibly multi-host sharded) array."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def save_hf(cfg: ModelConfig, params: dict, out_dir: str, max_shard_bytes: int = 2 << 30):
    """Write ``config.json`` + ``model.safetensors`` (or an index + shards of at most about
    ``max_shard_bytes``) in the HF layout and ``cfg.param_dtype``, loadable by
    ``transformers.AutoModelForCausalLM.from_pretrained``.

    Shards are converted and written one at a time, so host memory holds about one shard plus
    one parameter, not the whole model.
    """
    write_tensors(text_tensor_plan(cfg, params), params, out_dir, cfg.param_dtype,
                  max_shard_bytes)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config_to_hf(cfg), f, indent=2)


def text_tensor_plan(cfg: ModelConfig, params: dict, rename: Callable = lambda n: n) -> list:
    """The text model's tensors to write: ``(HF name, tree path, layer index | (layer,
    expert) | None, n_in, HF shape or None, bytes)`` items (HF names passed through
    ``rename``); checks each parameter's shape against ``cfg``."""
    itemsize = np.dtype(_NP_DTYPES[cfg.param_dtype]).itemsize
    config_to_hf(cfg)   # refuse what the HF layout cannot express before writing anything
    plan = []
    for tree_path, shape, hf_name, n_in, stacked in _entries(cfg):
        node = params
        for key in tree_path:
            node = node[key]
        if tuple(node.shape) != tuple(shape):
            raise HFCheckpointError(f"shape mismatch for parameter {'/'.join(tree_path)}: "
                                    f"expected {tuple(shape)}, got {tuple(node.shape)}")
        layer_shape = shape[1:] if stacked else shape
        nbytes = math.prod(layer_shape) * itemsize
        for i in (range(shape[0]) if stacked else [None]):
            if n_in == EXPERTS:   # one tensor per expert: (name, tree path, (layer, expert))
                plan += [(rename(hf_name(i).format(e=e)), tree_path, (i, e), n_in, None,
                          nbytes // layer_shape[0]) for e in range(layer_shape[0])]
            else:
                plan.append((rename(hf_name(i)), tree_path, i, n_in, None, nbytes))
    return plan


def write_tensors(plan: list, params: dict, out_dir: str, param_dtype: str,
                  max_shard_bytes: int = 2 << 30) -> None:
    """Write the ``plan``'s tensors (``text_tensor_plan`` items) of ``params`` to ``out_dir``
    as ``model.safetensors`` or an index and shards of at most about ``max_shard_bytes``."""
    os.makedirs(out_dir, exist_ok=True)
    np_dtype = _NP_DTYPES[param_dtype]
    shards, size = [[]], 0
    for item in plan:
        if shards[-1] and size + item[-1] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item[-1]

    cached = {"path": None, "value": None}  # host copy of the parameter being written

    def fetch(tree_path):
        if cached["path"] != tree_path:
            node = params
            for key in tree_path:
                node = node[key]
            cached.update(path=tree_path, value=_host(node).astype(np_dtype))
        return cached["value"]

    meta = {"format": "pt"}  # transformers refuses safetensors files without this
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors" for n in range(len(shards))])
    weight_map = {}
    for fname, shard in zip(names, shards):
        tensors = {}
        for hf_name, tree_path, i, n_in, hf_shape, _ in shard:
            w = fetch(tree_path)
            if n_in == EXPERTS:   # this expert's [in, out] -> HF's [out, in]
                w, n_in = w[i[0]][i[1]], 1
            elif i is not None:
                w = w[i]
            w = _from_ours(w, n_in)
            tensors[hf_name] = np.ascontiguousarray(w if hf_shape is None else
                                                    w.reshape(hf_shape))
            weight_map[hf_name] = fname
        save_file(tensors, os.path.join(out_dir, fname), metadata=meta)
    if len(shards) > 1:
        total = sum(item[-1] for item in plan)
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def save_hf_value(cfg: ModelConfig, value_params: dict, out_dir: str,
                  max_shard_bytes: int = 2 << 30, token_classification: bool = False) -> float:
    """Write a value-head model (a reward model, a critic) in the HF sequence-classification
    layout with one label, loadable by ``transformers.AutoModelForSequenceClassification``:
    the trunk as ``model.*``, the head's kernel as ``score.weight [1, D]``. HF scores a
    sequence at its last non-pad token, which is where rljax reads a reward model's value.

    HF's ``score`` layer has no bias; the head's bias (a constant that cancels in
    Bradley-Terry pairs, so reward-model training leaves it at its initial 0) is stored in
    ``config.json`` as ``rljax_value_head_bias`` and returned.

    ``token_classification`` (a process reward model): the two-label token-classification
    layout of ``transformers.AutoModelForTokenClassification`` instead, which scores every
    token: ``score.weight [2, D] = [0; kernel]`` and ``score.bias [2] = [0, bias]``, so the
    class-1 probability ``softmax(logits)[..., 1]`` is ``sigmoid(value)`` exactly (the bias
    is in the layer; 0.0 is returned).
    """
    trunk_cfg = dataclasses.replace(cfg, tie_word_embeddings=True)  # no lm_head to write
    save_hf(trunk_cfg, value_params["trunk"], out_dir, max_shard_bytes)
    head = value_params["head"]
    kernel = _host(head["kernel"]).astype(_NP_DTYPES[cfg.param_dtype])
    bias = float(_host(head["bias"]))
    meta = {"format": "pt"}
    index_path = os.path.join(out_dir, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            index = json.load(f)
        score_file = "score.safetensors"
    else:  # one file: becomes shard 1 of 2 (transformers reads model.safetensors without index)
        first, score_file = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
        os.replace(os.path.join(out_dir, "model.safetensors"), os.path.join(out_dir, first))
        with safe_open(os.path.join(out_dir, first), framework="numpy") as f:
            index = {"metadata": {}, "weight_map": {k: first for k in f.keys()}}
    if token_classification:  # class logits (0, value): class 1's probability = sigmoid(value)
        score = {"score.weight": np.stack([np.zeros_like(kernel), kernel]),
                 "score.bias": np.asarray([0.0, bias], kernel.dtype)}
    else:
        score = {"score.weight": np.ascontiguousarray(kernel[None, :])}
    save_file(score, os.path.join(out_dir, score_file), metadata=meta)
    for name, array in score.items():
        index["weight_map"][name] = score_file
        index["metadata"]["total_size"] = index["metadata"].get("total_size", 0) + array.nbytes
    with open(index_path, "w") as f:
        json.dump(index, f, indent=2)
    config_path = os.path.join(out_dir, "config.json")
    with open(config_path) as f:
        hf = json.load(f)
    if token_classification:
        hf.update(architectures=[_ARCHITECTURES[cfg.model_type].replace(
            "ForCausalLM", "ForTokenClassification")], id2label={"0": "bad", "1": "good"},
            label2id={"bad": 0, "good": 1}, tie_word_embeddings=cfg.tie_word_embeddings,
            classifier_dropout=0.0)
        bias = 0.0
    else:
        hf.update(architectures=[_ARCHITECTURES[cfg.model_type].replace(
            "ForCausalLM", "ForSequenceClassification")], id2label={"0": "LABEL_0"},
            label2id={"LABEL_0": 0}, tie_word_embeddings=cfg.tie_word_embeddings,
            rljax_value_head_bias=bias)
    with open(config_path, "w") as f:
        json.dump(hf, f, indent=2)
    return bias
