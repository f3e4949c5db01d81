"""A GGUF tensor's own quantized blocks as integer codes, per-block scales and offsets.

Every block format below stores, per run of ``block`` consecutive entries of a row, one scale
``a`` and (some formats) one offset ``c``, and for each entry a small integer code ``q``; the
value is ``a * q + c``, in float32, exactly as the ``gguf`` library's dequantization computes
it (the operations and their order are the same, so the two agree bit for bit):

| type | block | codes | value |
|---|---|---|---|
| Q8_0 | 32 | -128..127 | ``d * q`` |
| Q4_0 / Q5_0 | 32 | -8..7 / -16..15 | ``d * q`` |
| Q4_1 / Q5_1 | 32 | 0..15 / 0..31 | ``d * q + m`` |
| Q4_K / Q5_K | 32 (of a 256 super-block) | 0..15 / 0..31 | ``(d * sc) * q - dmin * mn`` |
| Q6_K | 16 (of a 256 super-block) | -32..31 | ``(d * sc) * q`` |

The codes, scales and offsets are read through the ``gguf`` library's own dequantization, run
on copies of the raw blocks whose header fields are set so that it returns the codes (scale 1,
offset 0), the scales (codes 1, offset 0) or the offsets (scale 0): the bit layouts stay the
library's; only the byte offsets of the header fields are written here.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

_F16_ONE = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
_F16_ZERO = np.zeros(2, np.uint8)
# Q4_K / Q5_K packed 6-bit sub-block scales and minimums with every scale 1, every minimum 0.
_K_SCALES_ONE = np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], np.uint8)


@dataclasses.dataclass(frozen=True)
class Format:
    """Byte layout of one block type: the fields the probes write. ``d``/``m``/``dmin``/
    ``scales``: (start, stop) byte ranges; ``codes``: the ranges that hold the codes (set to
    the pattern ``one`` so every code reads 1); ``lo``/``hi``: the codes' range."""
    block: int                     # entries per scale
    lo: int
    hi: int
    d: tuple[int, int]
    m: Optional[tuple[int, int]] = None        # Q4_1/Q5_1: the block's float offset
    dmin: Optional[tuple[int, int]] = None     # K-quants: the super-block's minimum scale
    scales: Optional[tuple[int, int]] = None   # K-quants: packed sub-block scales
    codes: tuple = ()                          # ((start, stop, byte), ...) making codes 1


FORMATS = {
    "Q8_0": Format(32, -128, 127, d=(0, 2)),
    "Q4_0": Format(32, -8, 7, d=(0, 2)),
    "Q5_0": Format(32, -16, 15, d=(0, 2)),
    "Q4_1": Format(32, 0, 15, d=(0, 2), m=(2, 4)),
    "Q5_1": Format(32, 0, 31, d=(0, 2), m=(2, 4)),
    "Q4_K": Format(32, 0, 15, d=(0, 2), dmin=(2, 4), scales=(4, 16),
                   codes=((16, 144, 0x11),)),
    "Q5_K": Format(32, 0, 31, d=(0, 2), dmin=(2, 4), scales=(4, 16),
                   codes=((16, 48, 0x00), (48, 176, 0x11))),
    "Q6_K": Format(16, -32, 31, d=(208, 210), scales=(192, 208),
                   codes=((0, 128, 0x11), (128, 192, 0xAA))),   # raw 33: code 1
}


@dataclasses.dataclass
class Blocks:
    """A [rows, cols] tensor as ``scale * q + offset``: ``q`` int8 [rows, cols] codes,
    ``scale`` float32 [rows, cols / block], ``offset`` float32 like ``scale`` or None."""
    q: np.ndarray
    scale: np.ndarray
    offset: Optional[np.ndarray]
    block: int
    lo: int
    hi: int

    def dequantize(self) -> np.ndarray:
        a = np.repeat(self.scale, self.block, axis=-1)
        w = a * self.q.astype(np.float32)
        return w if self.offset is None else w + np.repeat(self.offset, self.block, axis=-1)


def supported(type_name: str) -> bool:
    return type_name in FORMATS


def decode(data: np.ndarray, type_name: str, cols: int) -> Blocks:
    """Raw blocks ``data`` (uint8 [rows, bytes per row], as ``gguf.GGUFReader`` maps them) of
    a ``type_name`` tensor with ``cols`` entries per row -> ``Blocks``."""
    from gguf import GGMLQuantizationType, quants

    fmt = FORMATS[type_name]
    qtype = GGMLQuantizationType[type_name]
    rows = data.shape[0]
    raw = np.ascontiguousarray(data).reshape(rows, -1)
    nbytes = raw.shape[1] // (cols // _super_block(type_name))
    raw = raw.reshape(rows, -1, nbytes)          # [rows, blocks, bytes per block]

    def dequant(blocks) -> np.ndarray:
        return np.asarray(quants.dequantize(blocks.reshape(rows, -1), qtype),
                          np.float32).reshape(rows, cols)

    def setf(blocks, field, value):
        if field is not None:
            blocks[..., field[0]:field[1]] = value

    # The codes: scales 1, offsets 0.
    probe = raw.copy()
    setf(probe, fmt.d, _F16_ONE)
    setf(probe, fmt.m, _F16_ZERO)
    setf(probe, fmt.dmin, _F16_ZERO)
    if fmt.scales is not None:
        setf(probe, fmt.scales, _K_SCALES_ONE if fmt.dmin is not None else 1)
    q = np.rint(dequant(probe)).astype(np.int8)
    # The scales: codes 1, offsets 0 (each entry then reads its block's scale).
    if fmt.codes:
        probe = raw.copy()
        setf(probe, fmt.m, _F16_ZERO)
        setf(probe, fmt.dmin, _F16_ZERO)
        for start, stop, byte in fmt.codes:
            probe[..., start:stop] = byte
        scale = dequant(probe)[:, ::fmt.block]
    else:   # d is the scale
        scale = raw[..., fmt.d[0]:fmt.d[1]].copy().view(np.float16).astype(np.float32)
        scale = scale.reshape(rows, -1)
    # The offsets: scale 0 (each entry then reads its block's offset).
    offset = None
    if fmt.m is not None:
        offset = raw[..., fmt.m[0]:fmt.m[1]].copy().view(np.float16).astype(np.float32)
        offset = offset.reshape(rows, -1)
    elif fmt.dmin is not None:
        probe = raw.copy()
        setf(probe, fmt.d, _F16_ZERO)
        offset = dequant(probe)[:, ::fmt.block]
    return Blocks(q, scale, offset, fmt.block, fmt.lo, fmt.hi)


def _super_block(type_name: str) -> int:
    return 256 if type_name.endswith("_K") else 32
