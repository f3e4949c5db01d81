"""A frozen base that stays quantized (QLoRA): matrix weights as ``qwix.QArray`` leaves.

With ``model.quantize`` set, every matrix of the base -- the seven layer projections
(``q k v o gate up down``), the embedding and an untied head -- is replaced in the params tree
by a ``qwix.QArray`` (integer ``qvalue`` of the weight's shape, float ``scale`` per block);
norms and biases stay as loaded. LoRA adapters sit beside it in float32 and are all that
trains (``config`` refuses quantization without LoRA).

Blocks: ``block`` consecutive entries of a weight's input (contraction) axis share a scale --
``[L, D, ...]`` projections along ``D``, ``o`` ``[L, H, Dh, D]`` along ``Dh`` (inside one head),
``down`` along ``F``, the embedding ``[V, D]`` along ``D``, an untied head ``[D, V]`` along
``D`` -- and every other axis, the stacked layer axis included, has its own scales, so a layer
scan slices a QArray like an array. An axis that ``block`` does not divide gets one scale over
its whole length.

Types (``qwix`` quantizes, absmax calibration, symmetric): ``int8``; ``int4`` (uniform 4-bit);
``nf4`` (QLoRA's NormalFloat4 table). With the 4-bit types the embedding and an untied head
are stored in ``int8``: every logit and every input reads them, and 8 bits keep them within
0.4% of their largest entry (llama.cpp's 4-bit files also keep them at 8 bits or more).
4-bit values are packed two per byte by XLA (on CPU too: a 512M-entry int4 array adds 0.3 GB
of RSS against 0.5 GB for int8), though ``jax.Array.nbytes`` counts a byte each; ``nbytes``
here counts what is stored.

Compute: each matmul dequantizes its weight (``qwix.dequantize``) to the compute dtype right
before the dot, one layer at a time -- the whole float tree never exists. In a gradient pass the
dequantize-and-dot is rematerialised (``jax.checkpoint``), so the backward keeps the quantized
weight and its input, not a float copy of every layer.
"""
from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

import jax
import jax.numpy as jnp

from rljax.models.config import ModelConfig

TYPES = ("int8", "int4", "nf4")
# qwix's names for them.
_QWIX = {"int8": jnp.int8, "int4": jnp.int4, "nf4": "nf4"}


def _qwix():
    # Imported on first use: it takes a second, and only quantized runs need it.
    import qwix
    return qwix
# Weights every token reads (the embedding, an untied head): 8 bits under the 4-bit types.
_TABLE_TYPE = {"int8": "int8", "int4": "int8", "nf4": "int8"}
# Layer projection -> its block axis in the stacked weight ([L, ...]).
_LAYER_BLOCK_AXIS = {"q": 1, "k": 1, "v": 1, "gate": 1, "up": 1, "down": 1, "o": 2}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Affine:
    """A weight kept as codes, a scale and a float offset per block: ``dequantize(q) +
    offset`` (``offset`` broadcast over each block). GGUF's Q4_1 and K-quant blocks carry a
    float minimum, which a ``qwix.QArray`` (an integer zero point) cannot hold."""
    q: Any             # qwix.QArray: codes and scales
    offset: jax.Array  # the scale's shape

    shape = property(lambda self: self.q.shape)
    ndim = property(lambda self: self.q.ndim)
    dtype = property(lambda self: self.q.dtype)

    def astype(self, dtype) -> "Affine":
        """The same weight dequantizing to ``dtype`` (as ``QArray.astype``)."""
        return Affine(self.q.astype(dtype), self.offset.astype(dtype))


def is_quantized(w: Any) -> bool:
    """True for a quantized weight (a ``qwix.QArray``, none before qwix is imported, or an
    ``Affine``)."""
    qwix = sys.modules.get("qwix")
    return isinstance(w, Affine) or (qwix is not None and isinstance(w, qwix.QArray))


def quantize_weight(w: jax.Array, qtype: str, block: int, axis: int):
    """``w`` (any float shape) -> QArray with one scale per ``block`` entries along ``axis``
    (the whole axis when ``block`` does not divide it) and per index of every other axis."""
    if qtype not in _QWIX:
        raise ValueError(f"unknown quantization type {qtype!r}; choose from {', '.join(TYPES)}")
    size = w.shape[axis]
    tile = block if block > 0 and size % block == 0 else size
    others = tuple(i for i in range(w.ndim) if i != axis)
    return _qwix().quantize(w, _QWIX[qtype], channelwise_axes=others, tiled_axes={axis: tile})


def leaf_plan(path: tuple[str, ...], qtype: str) -> tuple[str, int] | None:
    """``(type, block axis)`` for the parameter at ``path`` (e.g. ``("layers", "q")``), or
    None for one that stays as loaded (norms, biases, anything unknown)."""
    if len(path) == 2 and path[0] == "layers" and path[1] in _LAYER_BLOCK_AXIS:
        return qtype, _LAYER_BLOCK_AXIS[path[1]]
    if path == ("embed",):
        return _TABLE_TYPE[qtype], 1
    if path == ("lm_head",):
        return _TABLE_TYPE[qtype], 0
    return None


def quantize_leaf(path: tuple[str, ...], w: jax.Array, qtype: str, block: int):
    """The parameter at ``path`` as it is kept in a quantized base (a QArray or ``w``)."""
    plan = leaf_plan(path, qtype)
    return w if plan is None else quantize_weight(w, plan[0], block, plan[1])


def _paths(params: dict):
    for key, value in params.items():
        if key == "layers":
            for name in value:
                yield ("layers", name)
        elif key != "lora":
            yield (key,)


def quantize_params(params: dict, qtype: str, block: int = 64) -> dict:
    """The base tree with its matrices quantized (see the module docstring); ``"lora"`` and
    the norms untouched. Works under ``jax.eval_shape`` (for plans)."""
    out = dict(params)
    out["layers"] = dict(params["layers"])
    for path in _paths(params):
        node = out if len(path) == 1 else out["layers"]
        node[path[-1]] = quantize_leaf(path, node[path[-1]], qtype, block)
    return out


def dequantize(w: Any, dtype=None) -> jax.Array:
    """A float weight: ``w`` dequantized when quantized; cast to ``dtype`` when given."""
    if isinstance(w, Affine):
        base = _qwix().dequantize(w.q)
        offset = w.offset.astype(base.dtype)
        for axis, (n, m) in enumerate(zip(base.shape, offset.shape)):
            if n != m:
                offset = jnp.repeat(offset, n // m, axis=axis)
        w = base + offset
    elif is_quantized(w):
        w = _qwix().dequantize(w)
    return w if dtype is None else w.astype(dtype)


def dequantize_params(params: Any, dtype=None) -> Any:
    """Every quantized leaf of ``params`` dequantized (to ``dtype`` when given)."""
    return jax.tree.map(lambda w: dequantize(w, dtype) if is_quantized(w) else w, params,
                        is_leaf=is_quantized)


def take_rows(w: Any, ids: jax.Array) -> jax.Array:
    """``w[ids]`` along axis 0 (an embedding lookup); a quantized table is gathered before it
    is dequantized, so only the looked-up rows are ever float."""
    if not is_quantized(w):
        return jnp.take(w, ids, axis=0)
    return dequantize(jax.tree.map(lambda x: jnp.take(x, ids, axis=0), w))


def rematerialised_matmul(matmul):
    """``matmul(x, w_float)`` -> ``f(x, w)`` taking a quantized ``w``: the dequantize and the
    dot are recomputed in a gradient pass instead of a float weight being saved for it."""
    return jax.checkpoint(lambda x, w: matmul(x, dequantize(w, x.dtype)), prevent_cse=False)


# ----------------------------------------------------------------------------- kept blocks

def block_axis(path: tuple[str, ...]) -> int:
    """The block (input) axis of the matrix at ``path`` in our layout."""
    return leaf_plan(path, "int8")[1]


def code_dtype(lo: int, hi: int):
    """The narrowest storage for integer codes in ``[lo, hi]``: int4, uint4 or int8."""
    if -8 <= lo and hi <= 7:
        return jnp.int4
    if 0 <= lo and hi <= 15:
        return jnp.uint4
    return jnp.int8


def from_blocks(q, scale, offset=None, *, lo: int, hi: int):
    """A kept weight from a file's own blocks: codes ``q`` (ints in ``[lo, hi]``, the
    weight's shape), ``scale`` (and ``offset``, or None) with the block axis divided by the
    block size. QArray when there is no offset, else ``Affine``."""
    dtype = code_dtype(lo, hi)
    qa = _qwix().QArray(qvalue=jnp.asarray(q).astype(dtype), scale=jnp.asarray(scale),
                        zero_point=None, qtype=dtype)
    return qa if offset is None else Affine(qa, jnp.asarray(offset))


def kept_shape(shape, axis: int, block: int, *, lo: int, hi: int, offset: bool, dtype):
    """``from_blocks``'s result for a weight of ``shape`` as ``jax.ShapeDtypeStruct``s."""
    scale_shape = tuple(n // block if i == axis else n for i, n in enumerate(shape))
    return jax.eval_shape(lambda: from_blocks(
        jnp.zeros(shape, jnp.int8), jnp.zeros(scale_shape, dtype),
        jnp.zeros(scale_shape, dtype) if offset else None, lo=lo, hi=hi))


# ----------------------------------------------------------------------------- sizes and axes

def _bits(dtype) -> int:
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.iinfo(dtype).bits
    return 8 * dtype.itemsize


def nbytes(shape, dtype) -> int:
    """Bytes an array of ``shape`` and ``dtype`` occupies (4-bit types: two per byte)."""
    try:
        bits = _bits(dtype)
    except TypeError:  # PRNG key dtypes
        bits = 64
    return math.ceil(math.prod(shape) * bits / 8)


def quantized_shapes(shapes: dict, axes: dict, qtype: str, block: int) -> tuple[dict, dict]:
    """``(shapes, logical_axes)`` of the quantized tree of a base with ``shapes``
    (``jax.ShapeDtypeStruct`` leaves) and logical ``axes``; abstract, nothing is allocated."""
    shapes = jax.eval_shape(lambda: quantize_params(
        jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), qtype, block))
    return shapes, logical_axes(axes, shapes)


def logical_axes(axes: dict, params: dict) -> dict:
    """``axes`` (``models.param_logical_axes``) with each quantized leaf's tuple repeated for
    its QArray's arrays: ``qvalue`` and ``scale`` keep the weight's axis names (a scale axis
    the mesh does not divide is replicated by ``sharding.logical_to_sharding``)."""
    def one(ax, w):
        return jax.tree.map(lambda _: ax, w) if is_quantized(w) else ax
    return {key: ({name: one(a, params[key][name]) for name, a in value.items()}
                  if isinstance(value, dict) else one(value, params[key]))
            for key, value in axes.items()}

