"""Hostile or broken files are one line, never a RecursionError or a huge allocation: a GGUF
header nesting arrays 200,000 deep, a chat template that renders 100 MB, a deeply nested
config.json."""
import struct

import pytest

from rljax import models
from rljax.errors import UserError


def _nested_gguf(path, depth):
    """A GGUF v3 header with one metadata key: an array of an array of ... (``depth``)."""
    key = b"evil.nested"
    out = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    out += struct.pack("<I", 9)                         # ARRAY
    out += struct.pack("<IQ", 9, 1) * depth             # of ARRAY, count 1, ...
    out += struct.pack("<IQ", 0, 0)                     # ... of no UINT8
    path.write_bytes(out)
    return str(path)


def test_a_gguf_header_nesting_arrays_200k_deep_is_one_line(tmp_path):
    from rljax.models.gguf_file import GGUFFile, GGUFFormatError
    path = _nested_gguf(tmp_path / "evil.gguf", 200_000)
    with pytest.raises(GGUFFormatError, match="nest more than 32 deep"):
        GGUFFile(path)
    with pytest.raises(UserError) as err:   # what `rljax train` reports
        models.inspect_gguf(path)
    assert "\n" not in str(err.value) and "nest" in str(err.value)


def test_shallow_nesting_still_reads(tmp_path):
    from rljax.models.gguf_file import GGUFFile
    reader = GGUFFile(_nested_gguf(tmp_path / "ok.gguf", 3))
    assert reader.value("evil.nested") == [[[[]]]]   # 3 arrays of arrays, then an empty one
