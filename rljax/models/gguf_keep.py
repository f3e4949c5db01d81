"""``model.quantize='keep'``: a GGUF file's matrices kept in the file's own blocks.

Instead of dequantizing a block-quantized tensor and quantizing it again, its codes, scales
and offsets (``gguf_blocks``) become the quantized weight as they are (``quant.from_blocks``):
the model computes with exactly the weights of the file's dequantized float32 copy. A stacked
projection whose layers use different block types (Q4_K_M files mix Q4_K, Q5_0, Q6_K, Q8_0)
takes the smallest block (larger blocks' scales are repeated), the widest code range (int8
storage unless every layer fits 4 bits) and an offset wherever any layer has one (zero
elsewhere), so each layer still reads exactly its file values. A matrix with a layer stored
in a float type or a block type not listed in ``gguf_blocks`` stays float, as loaded.

    plan = keep_plan(path, cfg)            # tree path -> Kept, from the tensor headers
    shapes = kept_shapes(cfg, plan)        # the base tree, abstract (for shardings, plans)
    w = kept_weight(path, cfg, ("layers", "q"), plan[("layers", "q")])
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from rljax.models import gguf_blocks, quant
from rljax.models.config import ModelConfig
from rljax.models.gguf import GGUFError, _unpermute_rope, gguf_name, open_gguf
from rljax.models.hf import _entries, _hf_shape, _to_ours
from rljax.models.transformer import init_params


@dataclasses.dataclass(frozen=True)
class Kept:
    """How one matrix is kept: entries per scale, the codes' range, whether it has offsets."""
    block: int
    lo: int
    hi: int
    offset: bool


def _matrices(cfg: ModelConfig):
    """(tree path, our full shape, GGUF names per layer, n_in) of every matrix of ``cfg``."""
    for path, shape, hf_name, n_in, stacked in _entries(cfg):
        if quant.leaf_plan(path, "int8") is None:
            continue
        layers = range(shape[0]) if stacked else [None]
        yield path, shape, [gguf_name(hf_name(i), cfg.post_norms) for i in layers], n_in


def keep_plan(path: str, cfg: ModelConfig) -> dict:
    """tree path -> ``Kept`` for each matrix whose every layer is stored in a block type
    ``gguf_blocks`` reads and whose block axis the block divides (headers only)."""
    if cfg.is_moe:
        # Experts are [E, in, out] stacks that models.quant has no block layout for; loading
        # them dequantized would silently hold the largest tensors in float.
        raise GGUFError(f"{path}: model.quantize='keep' cannot keep a mixture of experts' "
                        "expert tensors in their GGUF blocks; load it with model.quantize='' "
                        "(dequantized)")
    tensors = {t.name: t for t in open_gguf(path).tensors}
    plan = {}
    for tree_path, shape, names, _ in _matrices(cfg):
        types = [tensors[n].tensor_type.name for n in names]
        if not all(gguf_blocks.supported(t) for t in types):
            continue
        fmts = [gguf_blocks.FORMATS[t] for t in types]
        block = min(f.block for f in fmts)
        axis_len = shape[quant.block_axis(tree_path)]
        if axis_len % block:
            continue
        plan[tree_path] = Kept(block, min(f.lo for f in fmts), max(f.hi for f in fmts),
                               any(f.m is not None or f.dmin is not None for f in fmts))
    return plan


def kept_shapes(cfg: ModelConfig, plan: dict) -> dict:
    """The base tree of ``cfg`` with the ``plan``'s matrices kept, as ShapeDtypeStructs."""
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    out = dict(shapes, layers=dict(shapes["layers"]))
    for tree_path, kept in plan.items():
        node = out if len(tree_path) == 1 else out["layers"]
        w = node[tree_path[-1]]
        node[tree_path[-1]] = quant.kept_shape(
            w.shape, quant.block_axis(tree_path), kept.block, lo=kept.lo, hi=kept.hi,
            offset=kept.offset, dtype=np.float32)
    return out


def kept_weight(path: str, cfg: ModelConfig, tree_path: tuple, kept: Kept):
    """The matrix at ``tree_path`` from the file's blocks (``quant.from_blocks``), stacked
    over layers, in our layout."""
    tensors = {t.name: t for t in open_gguf(path).tensors}
    shape, names, n_in = next((s, n, k) for p, s, n, k in _matrices(cfg) if p == tree_path)
    stacked = len(tree_path) == 2
    layer_shape = shape[1:] if stacked else shape
    axis = quant.block_axis(tree_path) - (1 if stacked else 0)
    scale_shape = tuple(n // kept.block if i == axis else n for i, n in enumerate(layer_shape))
    rows_hf, cols_hf = _hf_shape(layer_shape, n_in) if n_in >= 0 else layer_shape
    heads = {"attn_q.weight": cfg.num_heads, "attn_k.weight": cfg.num_kv_heads}
    q, scale, offset = [], [], []
    for name in names:
        t = tensors[name]
        b = gguf_blocks.decode(t.data.view(np.ndarray), t.tensor_type.name, cols_hf)
        s, o = b.scale, b.offset
        if b.block != kept.block:   # a larger block: its scale (and offset) repeated
            s = np.repeat(s, b.block // kept.block, axis=-1)
            o = None if o is None else np.repeat(o, b.block // kept.block, axis=-1)
        if kept.offset and o is None:
            o = np.zeros_like(s)
        arrays = [b.q, s] + ([o] if kept.offset else [])
        n_heads = heads.get(name.split(".", 2)[-1]) if cfg.model_type == "llama" else None
        if n_heads:   # llama.cpp's q/k row order (rows move whole, with their blocks)
            arrays = [_unpermute_rope(a, n_heads) for a in arrays]
        assert arrays[0].shape == (rows_hf, cols_hf), (name, arrays[0].shape)
        q.append(_to_ours(arrays[0], layer_shape, n_in))
        scale.append(_to_ours(arrays[1], scale_shape, n_in))
        if kept.offset:
            offset.append(_to_ours(arrays[2], scale_shape, n_in))
    stack = (lambda xs: np.stack(xs)) if stacked else (lambda xs: xs[0])
    return quant.from_blocks(stack(q), stack(scale), stack(offset) if kept.offset else None,
                             lo=kept.lo, hi=kept.hi)
