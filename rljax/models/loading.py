"""A model on disk by its path: a HF checkpoint directory (``hf``) or a llama.cpp GGUF file
(``gguf``, which builds on ``hf``'s parameter loader).

    cfg, params = models.load_hf(path, dtype=jnp.bfloat16)   # either format
    cfg = models.load_config(path)                            # no weights read

The format dispatch sits here, above both readers, so that ``hf`` never imports ``gguf``.
"""
from __future__ import annotations

import os

import jax.numpy as jnp

from rljax.models.config import ModelConfig
from rljax.models.gguf import inspect_gguf, load_gguf
from rljax.models.hf import hf_checkpoint_config, load_hf_checkpoint


def is_gguf_path(path) -> bool:
    """True for a path naming a GGUF file (by its extension; the file is checked on load)."""
    return os.fspath(path).lower().endswith(".gguf")


def load_hf(path: str, dtype=jnp.float32, shardings=None, transform=None, **overrides):
    """Load a HF checkpoint directory (config.json + *.safetensors) -> ``(cfg, params)``.

    A path ending in ``.gguf`` is a llama.cpp GGUF file and goes to ``models.gguf.load_gguf``.
    ``dtype`` sets both the parameter storage dtype and the compute dtype (for float32 storage
    with bfloat16 compute, load float32 and use ``cfg.replace(dtype="bfloat16")``).
    ``shardings``: optional pytree of ``jax.sharding.Sharding`` matching the params tree; each
    parameter is then built shard by shard on its devices. ``transform(tree_path, array)``:
    optional, replaces each parameter as soon as it is built (``models.quant`` quantizes the
    base this way, one matrix at a time). Other ``overrides`` (e.g.
    ``remat=True``) are applied to the config.
    """
    if is_gguf_path(path):
        return load_gguf(path, dtype=dtype, shardings=shardings, transform=transform,
                         **overrides)
    return load_hf_checkpoint(path, dtype=dtype, shardings=shardings, transform=transform,
                              **overrides)


def load_config(path: str, dtype=jnp.float32, **overrides) -> ModelConfig:
    """The ModelConfig of a HF checkpoint directory or a GGUF file, without reading weights
    (a GGUF file's tensor headers are checked too: ``gguf.inspect_gguf``)."""
    if is_gguf_path(path):
        return inspect_gguf(path, dtype=dtype, **overrides)
    return hf_checkpoint_config(path, dtype=dtype, **overrides)
