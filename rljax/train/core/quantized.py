"""A frozen base kept quantized on device (QLoRA's base, a distillation teacher): the shapes
and logical axes of the quantized tree, and the transform that quantizes each parameter as the
loader builds it, so the whole float tree never exists at once. The formats are
``models.quant``'s (int8, int4, nf4) and ``models.gguf_keep``'s (a GGUF file's own blocks).
"""
from __future__ import annotations

import jax

from rljax import models
from rljax import sharding as shd


def quantized_shapes(model_cfg, qtype: str, block: int, path: str = ""):
    """``(shapes, logical_axes, keep_plan)`` of ``model_cfg``'s parameters quantized to
    ``qtype`` (int8 | int4 | nf4, one scale per ``block`` inputs; ``keep``: the GGUF file
    ``path``'s own blocks, whose plan is returned, else None)."""
    shapes = jax.eval_shape(lambda: models.init_params(model_cfg, jax.random.key(0)))
    axes = models.param_logical_axes(model_cfg)
    if qtype == "keep":
        from rljax.models import gguf_keep
        plan = gguf_keep.keep_plan(path, model_cfg)
        shapes = gguf_keep.kept_shapes(model_cfg, plan)
        return shapes, models.quant.logical_axes(axes, shapes), plan
    return (*models.quant.quantized_shapes(shapes, axes, qtype, block), None)


def make_quantizer(model_cfg, mesh, shardings, qtype: str, block: int = 64, path: str = ""):
    """``(transform, shardings)`` for a base kept quantized to ``qtype`` (``quantized_shapes``):
    ``transform(tree_path, w)`` turns one loaded parameter into its quantized form on its
    shardings (``models.quant``; for ``keep``, the GGUF file's own blocks,
    ``models.gguf_keep``), and the shardings are the quantized tree's; ``(None, shardings)``
    when ``qtype`` is ``""``."""
    if not qtype:
        return None, shardings
    quant = models.quant
    shapes, axes, keep = quantized_shapes(model_cfg, qtype, block, path)
    q_shardings = shd.logical_to_sharding(axes, mesh, shapes=shapes)

    def transform(tree_path, w):
        target = (q_shardings[tree_path[0]] if len(tree_path) == 1
                  else q_shardings[tree_path[0]][tree_path[1]])
        if not quant.is_quantized(target):
            return w
        if keep is not None:
            from rljax.models import gguf_keep
            return jax.device_put(gguf_keep.kept_weight(path, model_cfg, tree_path,
                                                        keep[tree_path]), target)
        return jax.jit(lambda w: quant.quantize_leaf(tree_path, w, qtype, block),
                       out_shardings=target)(w)
    return transform, q_shardings


def quantize_tree(transform, params: dict) -> dict:
    """``params`` (a loaded float tree) with ``transform`` (``make_quantizer``'s) applied leaf by
    leaf (tree paths ``(key,)`` for top-level entries, ``("layers", name)`` for layer stacks)."""
    return {key: ({name: transform(("layers", name), w) for name, w in value.items()}
                  if key == "layers" else transform((key,), value))
            for key, value in params.items()}
