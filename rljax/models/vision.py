"""Gemma 3's vision tower as pure functions: a SigLIP image encoder and the multimodal
projector that turns each image into ``mm_tokens_per_image`` embeddings of the text model.

Parameter tree (``vision_param_shapes``; per-layer weights stacked on a leading ``layers``
axis, as in ``rljax.models.transformer``)::

    {"patch": [C*p*p, E], "patch_bias": [E], "pos": [N, E],          # N = (image/p)**2
     "layers": {"ln1", "ln1_bias", "ln2", "ln2_bias": [L, E],
                "q", "k", "v": [L, E, H, Dh], "q_bias", "k_bias", "v_bias": [L, H, Dh],
                "o": [L, H, Dh, E], "o_bias": [L, E],
                "fc1": [L, E, F], "fc1_bias": [L, F], "fc2": [L, F, E], "fc2_bias": [L, E]},
     "post_ln", "post_ln_bias": [E],
     "mm_norm": [E], "mm_proj": [E, D]}                              # D: the text model's width

The encoder attends bidirectionally over the patches (no class token); the projector
average-pools the patch grid down to ``sqrt(mm_tokens_per_image)`` per side, applies Gemma's
RMSNorm (``x * (1 + w)``) and projects to the text width. LayerNorms, RMSNorm and softmax
run in float32; matmuls in ``cfg.dtype``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax.models.attention import attention
# The config lives with ModelConfig, which holds a multimodal model's tower config; the
# parameter shapes and initialisation in vision_params, which models.transformer uses.
from rljax.models.config import VisionConfig  # noqa: F401
from rljax.models.vision_params import init_vision_params, vision_param_shapes  # noqa: F401
from rljax.models.transformer import dense, rms_norm


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis in float32, cast back to ``x.dtype``."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def patchify(pixels: jax.Array, patch: int) -> jax.Array:
    """[N, C, S, S] -> [N, (S/p)**2, C*p*p]: row-major patches, each flattened channel-major
    (the order of a ``[E, C, p, p]`` convolution kernel)."""
    n, c, s, _ = pixels.shape
    g = s // patch
    x = pixels.reshape(n, c, g, patch, g, patch).transpose(0, 2, 4, 1, 3, 5)
    return x.reshape(n, g * g, c * patch * patch)


def _encoder_layer(cfg: VisionConfig, x: jax.Array, p: dict) -> jax.Array:
    """One pre-norm SigLIP layer over x [N, P, E] (bidirectional attention, biased linears)."""
    dt = x.dtype
    w = lambda name: p[name].astype(dt)
    h = layer_norm(x, p["ln1"], p["ln1_bias"], cfg.layer_norm_eps)
    q = dense(h, w("q")) + w("q_bias")
    k = dense(h, w("k")) + w("k_bias")
    v = dense(h, w("v")) + w("v_bias")
    everything = jnp.ones((x.shape[0], x.shape[1], x.shape[1]), bool)
    x = x + dense(attention(q, k, v, everything), w("o"), n_in=2) + w("o_bias")
    h = layer_norm(x, p["ln2"], p["ln2_bias"], cfg.layer_norm_eps)
    h = dense(h, w("fc1")) + w("fc1_bias")
    h = jax.nn.gelu(h, approximate=cfg.activation == "gelu_pytorch_tanh")
    return x + dense(h, w("fc2")) + w("fc2_bias")


def encode_patches(cfg: VisionConfig, params: dict, pixels: jax.Array) -> jax.Array:
    """The SigLIP encoder: pixels float [N, C, S, S] -> last hidden state [N, P, E] in
    ``cfg.dtype`` (after the final LayerNorm)."""
    dt = jnp.dtype(cfg.dtype)
    x = dense(patchify(pixels.astype(dt), cfg.patch_size), params["patch"].astype(dt))
    x = x + params["patch_bias"].astype(dt) + params["pos"].astype(dt)[None]

    def body(x, p):
        return _encoder_layer(cfg, x, p), None

    x, _ = jax.lax.scan(body, x, params["layers"])
    return layer_norm(x, params["post_ln"], params["post_ln_bias"], cfg.layer_norm_eps)


def project(cfg: VisionConfig, params: dict, hidden: jax.Array) -> jax.Array:
    """Gemma 3's multimodal projector: [N, P, E] -> [N, M, D] (M = ``mm_tokens_per_image``):
    average pooling over ``pool x pool`` patch windows, RMSNorm ``(1 + w)``, a linear map."""
    n, _, e = hidden.shape
    g, k = cfg.patches_per_side, cfg.pool
    grid = hidden.astype(jnp.float32).reshape(n, g // k, k, g // k, k, e)
    pooled = grid.mean(axis=(2, 4)).reshape(n, -1, e).astype(hidden.dtype)
    normed = rms_norm(pooled, params["mm_norm"], cfg.layer_norm_eps, plus_one=True)
    return dense(normed, params["mm_proj"].astype(normed.dtype))


def encode_images(cfg: VisionConfig, params: dict, pixels: jax.Array) -> jax.Array:
    """Images float [..., C, S, S] (normalised as the processor does) -> their embeddings in
    the text model's space, [..., M, D] in ``cfg.dtype``. Leading axes (e.g. [B, I] images
    per row) are kept."""
    lead = pixels.shape[:-3]
    flat = pixels.reshape((-1,) + pixels.shape[-3:])
    out = project(cfg, params, encode_patches(cfg, params, flat))
    return out.reshape(lead + out.shape[1:])


def image_embeddings(cfg, params: dict, pixels: jax.Array) -> jax.Array:
    """A multimodal model's image inputs for ``transformer.trunk``: pixels [B, I, C, S, S]
    (row b's images in order; unused slots any value) -> ``image_embeds`` [B, I*M, D], from
    ``params["vision"]`` under ``cfg.vision`` (a ``ModelConfig``). Unless ``cfg.train_vision``
    no gradient reaches the tower (it is frozen)."""
    tower = params["vision"]
    if not cfg.train_vision:
        tower = jax.lax.stop_gradient(tower)
    out = encode_images(cfg.vision, tower, pixels)
    return out.reshape(out.shape[0], -1, out.shape[-1])
