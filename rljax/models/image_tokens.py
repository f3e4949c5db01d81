"""Image placeholders in a token sequence: where image embeddings go and how they attend.

A multimodal Gemma 3 prompt holds, per image, a run of ``mm_tokens_per_image`` copies of the
image token (``ModelConfig.image_token_id``) between ``<start_of_image>`` and
``<end_of_image>``. The run's embeddings are replaced by the vision tower's output, in order,
and its positions attend to each other in both directions: transformers' Gemma 3 masks
``(causal OR same_image) AND not_padding`` in the global layers and additionally ``AND
key > query - sliding_window`` in the sliding ones (``create_masks_for_vision_model``). Text
tokens stay causal; a later image never sees an earlier one's future, nor the reverse.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def image_blocks(tokens: jax.Array, image_token_id: int) -> jax.Array:
    """int32 [B, T]: for each image token the index of its image within the row (0, 1, ...:
    one per run of consecutive image tokens), -1 elsewhere."""
    is_image = tokens == image_token_id
    before = jnp.pad(is_image, ((0, 0), (1, 0)))[:, :-1]
    starts = (is_image & ~before).astype(jnp.int32)
    return jnp.where(is_image, jnp.cumsum(starts, axis=1) - 1, -1)


def same_image(q_blocks: jax.Array, k_blocks: jax.Array) -> jax.Array:
    """bool [B, T, S]: query t and key s are tokens of the same image (q_blocks [B, T], k_blocks
    [B, S] from ``image_blocks``)."""
    return (q_blocks[:, :, None] == k_blocks[:, None, :]) & (q_blocks[:, :, None] >= 0)


def cache_blocks(q_blocks: jax.Array, slots: int, cache_index) -> jax.Array:
    """int32 [B, S]: the blocks of the tokens being written to cache slots ``[cache_index,
    cache_index + T)``, -1 in every other slot (an image is prefilled in one call)."""
    b = q_blocks.shape[0]
    out = jnp.full((b, slots), -1, jnp.int32)
    zero = jnp.zeros((), jnp.int32)
    return jax.lax.dynamic_update_slice(out, q_blocks.astype(jnp.int32),
                                        (zero, jnp.asarray(cache_index, jnp.int32)))


def merge_images(x: jax.Array, tokens: jax.Array, image_embeds: jax.Array,
                 image_token_id: int) -> jax.Array:
    """Token embeddings x [B, T, D] with the image tokens' rows replaced: the k-th image token
    of row b takes ``image_embeds[b, k]`` (image_embeds [B, K, D], K >= that row's count; its
    images one after another, ``mm_tokens_per_image`` rows each)."""
    is_image = tokens == image_token_id
    index = jnp.clip(jnp.cumsum(is_image.astype(jnp.int32), axis=1) - 1, 0,
                     image_embeds.shape[1] - 1)
    picked = jnp.take_along_axis(image_embeds.astype(x.dtype), index[..., None], axis=1)
    return jnp.where(is_image[..., None], picked, x)


def count_images(tokens, image_token_id: int, tokens_per_image: int):
    """Per row, how many images the host tokens [B, T] hold; ValueError when a row's image
    tokens are not whole runs of ``tokens_per_image``."""
    import numpy as np
    tokens = np.asarray(tokens)
    blocks = np.asarray(image_blocks(jnp.asarray(tokens), image_token_id))
    out = []
    for row, b in enumerate(blocks):
        n = int(b.max()) + 1 if (b >= 0).any() else 0
        sizes = np.bincount(b[b >= 0], minlength=n)
        if n and (sizes != tokens_per_image).any():
            raise ValueError(f"row {row}: image token runs of {sizes.tolist()} tokens; each "
                             f"image takes exactly {tokens_per_image}")
        out.append(n)
    return out
