"""A run's image inputs (a model with a vision tower, docs/vision.md): each example's images
as pixels on the host, and their embeddings for the sampler."""
from __future__ import annotations

import functools
import os

import jax
import numpy as np

from rljax.data import images
from rljax.models import vision


class ImageInputs:
    """Pixels of the examples' ``data.images_field`` column (at most ``data.max_images`` per
    prompt; paths relative to ``data.path``'s folder) and the tower's embeddings of them."""

    def __init__(self, ctx):
        cfg, model_cfg = ctx.cfg, ctx.model_cfg
        self.model_cfg = model_cfg
        path = cfg.model.path if cfg.model.vision.load else None
        self.processor = images.ImageProcessor(model_cfg.vision.image_size, path=path)
        self.max_images = int(cfg.data.max_images)
        self.field = cfg.data.images_field
        self.base_dir = os.path.dirname(os.path.abspath(cfg.data.path)) if cfg.data.path else None
        self.max_pixels = int(cfg.data.get("max_image_pixels", images.DEFAULT_MAX_IMAGE_PIXELS))
        self.skipped = 0   # examples whose images could not be used, in the last call
        self.usable = None

    def pixels(self, examples, locations=None) -> np.ndarray:
        """float32 [B, I, 3, S, S] of a list of examples (zeros where a row has fewer). A row
        whose image is corrupt or over ``data.max_image_pixels`` keeps zero pixels, with one
        warning naming ``locations[i]`` (``file:line``); ``self.skipped`` counts them."""
        skipped: list = []
        out, counts = images.batch_pixels(examples, self.processor, self.max_images,
                                          self.field, self.base_dir, self.max_pixels, skipped,
                                          locations)
        self.skipped = len(skipped)
        # bool [B]: False where a row's images were skipped (its rows then do not train)
        self.usable = np.array([counts[i] > 0 or not images.row_images(ex, self.field)
                                for i, ex in enumerate(examples)], bool)
        return out

    def embeds(self, params, pixels) -> jax.Array:
        """The sampler's ``image_embeds`` [B, I*M, D] of ``pixels`` under ``params``."""
        return embed_fn(self.model_cfg)(params["vision"], pixels)


@functools.cache
def embed_fn(model_cfg):
    """The jitted tower pass ``(params["vision"], pixels [B, I, C, S, S]) -> image_embeds
    [B, I*M, D]`` the sampler's inputs come from (one per model config; ``rljax plan``
    compiles it too)."""
    return jax.jit(lambda tower, pixels: vision.image_embeddings(
        model_cfg, {"vision": tower}, pixels))


def round_fields(pixels: np.ndarray, usable: np.ndarray, sizes=None) -> dict:
    """A sampling round's image fields for ``Rollout._assemble`` and its metrics: ``pixels``
    [B, I, 3, S, S] of its prompts, ``image_ok`` bool [B] (False: the prompt's images were
    skipped, its rows do not train) and ``skipped_images``, the prompts skipped. ``sizes``
    int [B] (groups of their own sizes, knapsack allocation, whose rounds hold one entry per
    row): both repeated for each prompt's rows, ``[sum(sizes), ...]``."""
    fields = {"pixels": pixels, "image_ok": usable, "skipped_images": int((~usable).sum())}
    if sizes is not None:
        fields.update(pixels=np.repeat(pixels, sizes, 0), image_ok=np.repeat(usable, sizes))
    return fields


class PlacePixels:
    """The prompt pixels of a pool's ``c`` places (partial rollouts: groups carried across
    iterations): ``pixels`` float32 [c, I, 3, S, S] and ``ok`` bool [c] (False: the place's
    images were skipped, its rows do not train). A place's pixels are decoded when its
    example is admitted, and again from the examples a checkpoint keeps (``restore``): no
    pixels in the checkpoint."""

    def __init__(self, images: ImageInputs, c: int):
        v = images.model_cfg.vision
        self.images = images
        self.pixels = np.zeros((c, images.max_images, v.num_channels, v.image_size,
                                v.image_size), np.float32)
        self.ok = np.ones(c, bool)

    def admit(self, places, examples, locations=None) -> None:
        """The pixels of ``examples``, admitted into ``places`` (int [n])."""
        self.pixels[places] = self.images.pixels(examples, locations)
        self.ok[places] = self.images.usable

    def restore(self, places, examples) -> None:
        """After loading a checkpoint: only ``places`` hold examples (``examples``)."""
        self.pixels[:], self.ok[:] = 0.0, True
        if len(places):
            self.admit(places, examples)

    def embeds(self, params, places=None) -> jax.Array:
        """The sampler's ``image_embeds`` [n, I*M, D] of ``places`` (None: all c) under
        ``params``."""
        return self.images.embeds(params, self.pixels if places is None
                                  else self.pixels[np.asarray(places, np.int64)])

    def round_fields(self, places, sizes=None) -> dict:
        """``round_fields`` of the groups in ``places`` (a round's groups, in its order;
        ``sizes``: their rows, for a round of one entry per row)."""
        places = np.asarray(places, np.int64)
        return round_fields(self.pixels[places], self.ok[places], sizes)


def place_pixels(ctx, c: int) -> PlacePixels | None:
    """A pool's ``PlacePixels`` for ``c`` places, or None for a text model."""
    images = image_inputs(ctx)
    return None if images is None else PlacePixels(images, c)


def image_inputs(ctx) -> ImageInputs | None:
    """The run's ``ImageInputs``, or None for a text model."""
    return ImageInputs(ctx) if ctx.model_cfg.vision is not None else None
