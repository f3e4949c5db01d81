"""A GGUF file's metadata and tensor table, read in milliseconds.

``gguf.GGUFReader`` builds numpy views for every element of every metadata array: for a
49k-token vocabulary (tokens, token types and merges, ~150k elements) that took 3.5-4.2 s
and ~170 MB of Python objects, in every process that opened the file. rljax reads scalar
metadata and the tensor table; this reader decodes scalars when parsed, arrays of numbers as
one numpy array each, and arrays of strings only when asked for (``value``), and maps each
tensor's data exactly as ``GGUFReader`` does (same dtype and shape, from ``gguf``'s own type
sizes). Dequantizing stays with ``gguf.quants``.

Format (GGUF v2/v3): magic ``GGUF``, version u32, tensor count u64, metadata count u64; each
metadata entry a string key, a u32 value type and the value (a string is a u64 length and
bytes; an array a u32 element type, a u64 count and the elements); each tensor a string name,
u32 dimension count, u64 dimensions (fastest first), u32 type and u64 offset; then the tensor
data from the next multiple of ``general.alignment`` (default 32).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import struct
from typing import Any

import numpy as np

DEFAULT_ALIGNMENT = 32
# Arrays of arrays nest at most this deep (real files: 1 or 2). A crafted header nesting
# 200,000 deep otherwise ended in a RecursionError with a 3,000-line traceback.
MAX_ARRAY_DEPTH = 32
_ENDS_EARLY = "the file ends inside its header"


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader understands (truncated, corrupt, ...)."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file. ``shape``: GGUF's dimensions, fastest first (ggml's ne).
    ``data``: its bytes in the file as ``GGUFReader`` maps them (float types as floats in
    numpy order, quantized types as uint8 rows of blocks), a read-only view of the file."""
    name: str
    tensor_type: Any   # gguf.GGMLQuantizationType
    shape: tuple
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


@functools.cache
def _gguf():
    import gguf  # here: only GGUF users pay for the import

    return gguf


class _StringArray:
    """An array of strings not decoded yet: where its first element starts and how many."""

    def __init__(self, offset: int, count: int):
        self.offset, self.count = offset, count


class GGUFFile:
    """``GGUFFile(path)``: ``fields`` (key -> parsed value; see ``value``), ``tensors``
    (``TensorInfo`` in file order), ``alignment``, ``data_offset``, ``version``.

    Raises ``GGUFFormatError`` for a file that is not GGUF v2/v3 or ends early; ``OSError``
    when it cannot be read."""

    def __init__(self, path: str):
        self.path = path
        if os.path.getsize(path) < 24:   # also: numpy cannot map an empty file
            raise GGUFFormatError(_ENDS_EARLY)
        self._buf = np.memmap(path, mode="r").view(np.ndarray)
        self._mem = memoryview(self._buf)
        if bytes(self._mem[:4]) != b"GGUF":
            raise GGUFFormatError(f"not a GGUF file (it starts with {bytes(self._mem[:4])!r})")
        little = self._unpack("<I", 4)[0]
        self._order = "<" if little & 0xFFFF else ">"   # a big-endian file reads as 0x0N000000
        self.version = self._unpack(self._order + "I", 4)[0]
        if self.version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {self.version} is not supported (2 or 3)")
        n_tensors, n_fields = self._unpack(self._order + "QQ", 8)
        self._offset = 24
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            if key in self.fields:
                raise GGUFFormatError(f"duplicate metadata key {key!r}")
            self.fields[key] = self._value(self._scalar("I"))
        infos = [self._tensor_info() for _ in range(n_tensors)]
        self.alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise GGUFFormatError(f"general.alignment {self.alignment} is not a power of two")
        self.data_offset = -(-self._offset // self.alignment) * self.alignment
        self.tensors = [self._tensor(*info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise GGUFFormatError("duplicate tensor names")

    # ------------------------------------------------------------------ metadata

    def value(self, key: str, default: Any = KeyError) -> Any:
        """Metadata ``key`` as Python values: int, float, bool, str, or a list of them
        (``default`` when absent; KeyError when absent and no default)."""
        if key not in self.fields:
            if default is KeyError:
                raise KeyError(key)
            return default
        return self._python(self.fields[key])

    def _python(self, v):
        if isinstance(v, _StringArray):
            return self._strings(v)
        if isinstance(v, list):   # an array of arrays
            return [self._python(x) for x in v]
        return v.tolist() if isinstance(v, np.ndarray) else v

    def _unpack(self, fmt: str, at: int) -> tuple:
        try:
            return struct.unpack_from(fmt, self._mem, at)
        except struct.error:
            raise GGUFFormatError(_ENDS_EARLY) from None

    def _check_within(self, end: int) -> None:
        if end > len(self._mem):
            raise GGUFFormatError(_ENDS_EARLY)

    def _scalar(self, fmt: str):
        (v,) = self._unpack(self._order + fmt, self._offset)
        self._offset += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        n = self._scalar("Q")   # read first: it moves self._offset past the length
        end = self._offset + n
        self._check_within(end)
        s = bytes(self._mem[self._offset:end])
        self._offset = end
        try:
            return s.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFFormatError(f"a string is not UTF-8 ({e.reason})") from None

    def _numpy_type(self, raw_type: int) -> np.dtype:
        """The numpy dtype of a GGUF number type (gguf's table), in the file's byte order."""
        g = _gguf()
        try:
            np_type = g.GGUFReader.gguf_scalar_to_np[g.GGUFValueType(raw_type)]
        except (ValueError, KeyError):
            raise GGUFFormatError(f"unknown metadata value type {raw_type}") from None
        return np.dtype(np_type).newbyteorder(self._order)

    def _value(self, raw_type: int, depth: int = 0):
        types = _gguf().GGUFValueType
        if depth > MAX_ARRAY_DEPTH:
            raise GGUFFormatError(f"metadata arrays nest more than {MAX_ARRAY_DEPTH} deep "
                                  "(a corrupt or hostile header)")
        if raw_type == types.STRING:
            return self._string()
        if raw_type != types.ARRAY:
            return self._numbers(self._numpy_type(raw_type), 1)[0].item()
        item_type, count = self._scalar("I"), self._scalar("Q")
        if item_type == types.STRING:
            arr = _StringArray(self._offset, count)
            for _ in range(count):   # only the lengths are read here
                self._offset += 8 + self._unpack(self._order + "Q", self._offset)[0]
            self._check_within(self._offset)
            return arr
        if item_type == types.ARRAY:
            return [self._value(item_type, depth + 1) for _ in range(count)]
        return self._numbers(self._numpy_type(item_type), count)

    def _numbers(self, dtype: np.dtype, count: int) -> np.ndarray:
        end = self._offset + dtype.itemsize * count
        self._check_within(end)
        out = np.frombuffer(self._mem, dtype, count, self._offset)
        self._offset = end
        return out

    def _strings(self, arr: _StringArray) -> list:
        out, at = [], arr.offset
        for _ in range(arr.count):
            (n,) = struct.unpack_from(self._order + "Q", self._mem, at)
            out.append(bytes(self._mem[at + 8:at + 8 + n]).decode("utf-8"))
            at += 8 + n
        return out

    # ------------------------------------------------------------------ tensors

    def _tensor_info(self) -> tuple:
        name = self._string()
        n_dims = self._scalar("I")
        dims = tuple(int(d) for d in self._numbers(np.dtype(self._order + "u8"), n_dims))
        return name, dims, self._scalar("I"), self._scalar("Q")

    def _tensor(self, name: str, dims: tuple, raw_type: int, offset: int) -> TensorInfo:
        g = _gguf()
        try:
            ggml_type = g.GGMLQuantizationType(raw_type)
            block_size, type_size = g.GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise GGUFFormatError(f"tensor {name}: unknown tensor type {raw_type}") from None
        n_elements = math.prod(dims)   # Python ints: huge dims cannot wrap around int64
        n_bytes = n_elements * type_size // block_size
        np_dims = tuple(reversed(dims))
        item_type = _PLAIN_TYPES.get(ggml_type.name)
        if item_type is None:   # quantized: rows of blocks, as bytes
            item_type, np_dims = np.uint8, g.quants.quant_shape_to_byte_shape(np_dims, ggml_type)
        start = self.data_offset + offset
        if start + n_bytes > len(self._buf):
            raise GGUFFormatError(f"tensor {name} ends past the end of the file")
        data = self._buf[start:start + n_bytes].view(np.dtype(item_type).newbyteorder(
            self._order)).reshape(np_dims)
        return TensorInfo(name, ggml_type, dims, n_elements, n_bytes, start, data)


# GGML types stored as plain numbers (GGUFReader's choice of numpy type for each).
_PLAIN_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
                "I16": np.int16, "I32": np.int32, "I64": np.int64}
