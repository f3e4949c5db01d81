"""Images in the data: decoding a row's image values and turning them into the pixel arrays
a vision tower reads, on the host.

A row names its images in one column (``images_field``, default ``"images"``; a single
value or a list): a file path (relative paths resolve against ``base_dir``, the data file's
folder), raw encoded bytes, a ``{"bytes": ..., "path": ...}`` dict (Hugging Face datasets'
Parquet image column), a PIL image, or an ``[H, W, 3]`` uint8 array (synthetic tasks).

Pixels come from transformers' own Gemma 3 image processor, its PIL/numpy backend
(``Gemma3ImageProcessorPil``; no PyTorch): RGB conversion, a bilinear resize to the tower's
square size, ``x / 255``, then ``(x - mean) / std`` per channel; pan-and-scan crops are off,
as in the processor's defaults. A checkpoint directory's ``preprocessor_config.json`` sets
its size, mean and std.

In the prompt text each image is one ``<start_of_image>`` marker, which
``expand_image_markers`` widens as Gemma 3's processor does: ``"\\n\\n" + boi + image_token *
mm_tokens_per_image + eoi + "\\n\\n"``.
"""
from __future__ import annotations

import io
import os
import stat
import sys
from typing import Any, Sequence

import numpy as np

from rljax.data.sources import DataError


# Most pixels (width x height) of one image, read from its header before it is decoded
# (``data.max_image_pixels``): 50M is a 7000x7000 photo, far above what a vision tower's
# resize keeps; a 140 KB PNG claiming 12000x12000 decoded to ~1.9 GB.
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000


def _checked_size(image, what: str, max_pixels: int):
    """``image`` (opened, not decoded) unless its header claims more than ``max_pixels``."""
    w, h = image.size
    if max_pixels and w * h > max_pixels:
        raise DataError(f"{what} is {w}x{h} = {w * h:,} pixels, more than "
                        f"data.max_image_pixels={max_pixels:,}")
    return image


def _read_regular_file(path: str) -> bytes:
    """The bytes of ``path`` if it is a regular file: opened without blocking (a FIFO would
    wait forever for a writer), checked with fstat, then read."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise DataError(f"image file {path!r} cannot be opened ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise DataError(f"image path {path!r} is not a regular file")
        return f.read()


def load_image(value: Any, base_dir: str | None = None,
               max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):
    """One image value of a row (see the module docstring) -> an RGB ``PIL.Image``. A file
    that is not a regular one, or an image whose header claims more than ``max_pixels``
    (0: no cap), is a DataError before anything is decoded."""
    from PIL import Image

    if isinstance(value, Image.Image):
        _checked_size(value, "an image", max_pixels)
        image = value
    elif isinstance(value, np.ndarray):
        if value.dtype != np.uint8 or value.ndim != 3 or value.shape[-1] != 3:
            raise DataError(f"an image array must be uint8 [H, W, 3], got {value.dtype} "
                            f"{list(value.shape)}")
        image = _checked_size(Image.fromarray(value), "an image array", max_pixels)
    elif isinstance(value, dict):
        if value.get("bytes"):
            return load_image(bytes(value["bytes"]), base_dir, max_pixels)
        if value.get("path"):
            return load_image(value["path"], base_dir, max_pixels)
        raise DataError(f"an image dict needs 'bytes' or 'path', got keys {sorted(value)}")
    elif isinstance(value, (bytes, bytearray)):
        image = _decode(value, "image bytes", max_pixels)
    elif isinstance(value, str):
        path = value if os.path.isabs(value) or base_dir is None else \
            os.path.join(base_dir, value)
        if not os.path.exists(path):
            raise DataError(f"image file does not exist: {path!r}")
        image = _decode(_read_regular_file(path), f"image file {path!r}", max_pixels)
    else:
        raise DataError(f"unsupported image value of type {type(value).__name__}; use a "
                        "path, bytes, a {'bytes', 'path'} dict or a uint8 [H, W, 3] array")
    return image.convert("RGB")


def _decode(data: bytes, what: str, max_pixels: int):
    """Encoded ``data`` -> a decoded PIL image; its size is checked from the header first."""
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data))
    except Exception as e:   # PIL raises several kinds on a bad file
        raise DataError(f"{what} could not be decoded ({e})") from None
    _checked_size(image, what, max_pixels)
    try:
        image.load()
    except Exception as e:
        raise DataError(f"{what} could not be decoded ({e})") from None
    return image


def row_images(example: dict, field: str = "images") -> list:
    """The image values of one example (a list; [] when the field is absent or None)."""
    value = example.get(field)
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


class ImageProcessor:
    """Gemma 3's image preprocessing at a tower's ``image_size`` (or a checkpoint's own
    ``preprocessor_config.json`` with ``path``)."""

    def __init__(self, image_size: int, path: str | None = None):
        from transformers.models.gemma3.image_processing_pil_gemma3 import \
            Gemma3ImageProcessorPil

        if path is not None and os.path.exists(os.path.join(path, "preprocessor_config.json")):
            self.processor = Gemma3ImageProcessorPil.from_pretrained(path)
        else:
            self.processor = Gemma3ImageProcessorPil(
                size={"height": image_size, "width": image_size})
        self.image_size = int(image_size)
        size = self.processor.size
        if (size["height"], size["width"]) != (image_size, image_size):
            raise ValueError(f"the image processor resizes to {size['height']}x{size['width']}; "
                             f"the vision tower reads {image_size}x{image_size}")

    def __call__(self, images: Sequence) -> np.ndarray:
        """PIL images -> float32 [N, 3, S, S]."""
        if not images:
            return np.zeros((0, 3, self.image_size, self.image_size), np.float32)
        out = self.processor(images=list(images), return_tensors="np", do_pan_and_scan=False)
        return np.asarray(out["pixel_values"], np.float32)


def batch_pixels(batch: Sequence[dict], processor: ImageProcessor, max_images: int,
                 field: str = "images", base_dir: str | None = None,
                 max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, skipped: list | None = None,
                 locations: Sequence[str] | None = None, stream=None) -> tuple:
    """The images of a batch of examples, per row: ``(pixels float32 [B, I, 3, S, S],
    counts int32 [B])`` with I = ``max_images`` (unused slots are zeros). DataError for a row
    with more images than ``max_images``.

    ``skipped`` (a list): an image that cannot be used (corrupt, not a regular file, over
    ``max_pixels``) costs its row's images instead of raising: the row keeps zero pixels
    and count 0, its location (``locations[i]``, e.g. ``data.jsonl:7``) is appended to
    ``skipped``, and one warning line naming it goes to ``stream`` (stderr). Without it, the
    DataError is raised."""
    s = processor.image_size
    pixels = np.zeros((len(batch), max_images, 3, s, s), np.float32)
    counts = np.zeros((len(batch),), np.int32)
    for i, example in enumerate(batch):
        values = row_images(example, field)
        if len(values) > max_images:
            raise DataError(f"an example has {len(values)} images, more than "
                            f"max_images={max_images}")
        if not values:
            continue
        try:
            loaded = [load_image(v, base_dir, max_pixels) for v in values]
        except DataError as e:
            if skipped is None:
                raise
            where = locations[i] if locations is not None else f"example {i} of the batch"
            skipped.append(where)
            print(f"rljax: warning: {where}: {e}; its images are skipped (counted in "
                  "data/skipped_images)", file=stream or sys.stderr, flush=True)
            continue
        pixels[i, :len(values)] = processor(loaded)
        counts[i] = len(values)
    return pixels, counts


def expand_image_markers(text: str, boi: str, image_token: str, eoi: str,
                         tokens_per_image: int) -> str:
    """``text`` with every ``boi`` marker widened to Gemma 3's image sequence
    (``"\\n\\n" + boi + image_token * n + eoi + "\\n\\n"``), as its processor does."""
    return text.replace(boi, f"\n\n{boi}{image_token * tokens_per_image}{eoi}\n\n")
