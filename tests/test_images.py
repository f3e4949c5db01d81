"""Image inputs on the host: decoding row values, Gemma 3's preprocessing, batching."""
import io
import json
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from rljax.data import images
from rljax.data.sources import DataError, RecordsSource, load_records


def _picture(seed=0, shape=(40, 50, 3)):
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def _by_hand(array, size):
    """Reference: PIL bilinear resize, x / 255, (x - 0.5) / 0.5, channels first."""
    x = np.asarray(Image.fromarray(array).resize((size, size), Image.BILINEAR), np.float32)
    return ((x / 255.0 - 0.5) / 0.5).transpose(2, 0, 1)


def test_pixels_match_the_gemma3_processor_and_a_hand_reference(tmp_path):
    transformers = pytest.importorskip("transformers")
    arr = _picture()
    # The processor as a Gemma 3 checkpoint ships it: preprocessor_config.json in the directory.
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    Gemma3ImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(tmp_path)
    want = transformers.AutoImageProcessor.from_pretrained(str(tmp_path))(
        images=[Image.fromarray(arr)], return_tensors="np")["pixel_values"]
    got = images.ImageProcessor(32, path=str(tmp_path))([images.load_image(arr)])
    assert got.shape == (1, 3, 32, 32) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(got[0], _by_hand(arr, 32), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="resizes to 32x32"):
        images.ImageProcessor(16, path=str(tmp_path))


def test_preprocessing_runs_without_pytorch():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['torchvision'] = None\n"
            "import numpy as np\n"
            "from rljax.data import images\n"
            "a = np.zeros((20, 30, 3), np.uint8)\n"
            "print(images.ImageProcessor(16)([images.load_image(a)]).shape)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "(1, 3, 16, 16)" in out.stdout


def test_every_image_value_kind_decodes_to_the_same_pixels(tmp_path):
    arr = _picture(1, (24, 24, 3))
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    (tmp_path / "a.png").write_bytes(buf.getvalue())
    proc = images.ImageProcessor(16)
    kinds = [arr, buf.getvalue(), {"bytes": buf.getvalue(), "path": None},
             {"path": "a.png"}, "a.png", str(tmp_path / "a.png"), Image.fromarray(arr)]
    pixels = [proc([images.load_image(v, str(tmp_path))]) for v in kinds]
    for p in pixels[1:]:
        np.testing.assert_array_equal(p, pixels[0])
    with pytest.raises(DataError, match="does not exist"):
        images.load_image("missing.png", str(tmp_path))
    with pytest.raises(DataError, match="could not be decoded"):
        images.load_image(b"not an image")


def test_jsonl_rows_carry_images_into_batch_pixels(tmp_path):
    for i in range(3):
        Image.fromarray(_picture(i, (20, 20, 3))).save(tmp_path / f"{i}.png")
    rows = [{"prompt": "one <boi>", "images": "0.png"},
            {"prompt": "two <boi> <boi>", "images": ["1.png", "2.png"]},
            {"prompt": "none"}]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = RecordsSource(load_records(str(path)))
    batch = [source[i] for i in range(3)]
    proc = images.ImageProcessor(16)
    pixels, counts = images.batch_pixels(batch, proc, max_images=2, base_dir=str(tmp_path))
    assert pixels.shape == (3, 2, 3, 16, 16)
    np.testing.assert_array_equal(counts, [1, 2, 0])
    np.testing.assert_allclose(pixels[1, 1], _by_hand(_picture(2, (20, 20, 3)), 16), atol=1e-6)
    assert not pixels[0, 1].any() and not pixels[2].any()
    with pytest.raises(DataError, match="more than max_images=1"):
        images.batch_pixels(batch, proc, max_images=1, base_dir=str(tmp_path))


def _png_header(width, height):
    """A few dozen bytes of PNG whose IHDR claims ``width`` x ``height`` (no real pixels)."""
    import struct
    import zlib

    def chunk(kind, data):
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b""))


def test_an_image_over_the_pixel_cap_or_not_a_regular_file_is_refused_before_decoding(
        tmp_path):
    import os
    from rljax import config as config_lib
    assert config_lib.default_config().data.max_image_pixels == images.DEFAULT_MAX_IMAGE_PIXELS
    huge = _png_header(12000, 12000)   # under PIL's own bomb limit; ~1.9 GB decoded
    (tmp_path / "huge.png").write_bytes(huge)
    for value in (huge, "huge.png", {"bytes": huge}):
        with pytest.raises(DataError, match="12000x12000 = 144,000,000 pixels, more than "
                                            "data.max_image_pixels=50,000,000"):
            images.load_image(value, str(tmp_path))
    with pytest.raises(DataError, match="more than data.max_image_pixels=100"):
        images.load_image(_picture(0, (20, 20, 3)), max_pixels=100)
    os.mkfifo(tmp_path / "fifo.png")   # opening it for reading would wait for a writer
    with pytest.raises(DataError, match="is not a regular file"):
        images.load_image("fifo.png", str(tmp_path))


def test_a_corrupt_or_huge_image_costs_its_example_not_the_run(tmp_path):
    """One warning naming file:line, the row's images zero, the others decoded; the same
    batch drawn again (a resume) does the same."""
    Image.fromarray(_picture(0, (20, 20, 3))).save(tmp_path / "ok.png")
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    (tmp_path / "huge.png").write_bytes(_png_header(12000, 12000))
    rows = [{"prompt": "a", "images": "ok.png"}, {"prompt": "b", "images": "bad.png"},
            {"prompt": "c", "images": "huge.png"}]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = RecordsSource(load_records(str(path)))
    batch = [source[i] for i in range(3)]
    where = [f"{path}:{i + 1}" for i in range(3)]
    proc = images.ImageProcessor(16)
    with pytest.raises(DataError, match="could not be decoded"):   # strict without a list
        images.batch_pixels(batch, proc, 1, base_dir=str(tmp_path))
    for _ in range(2):   # the run, then its resume on the same batch
        skipped, stream = [], io.StringIO()
        pixels, counts = images.batch_pixels(batch, proc, 1, base_dir=str(tmp_path),
                                             skipped=skipped, locations=where, stream=stream)
        assert skipped == where[1:] and counts.tolist() == [1, 0, 0]
        assert pixels[0].any() and not pixels[1:].any()
        lines = stream.getvalue().splitlines()
        assert len(lines) == 2 and lines[0].startswith(f"rljax: warning: {path}:2: ")
        assert "data.max_image_pixels" in lines[1] and f"{path}:3" in lines[1]


def test_run_image_inputs_mark_the_examples_whose_images_were_skipped(tmp_path):
    """``ImageInputs``: the count the rollout logs as data/skipped_images, and the rows it
    takes out of the loss (an example with no images at all still trains)."""
    import types

    from rljax import config as config_lib
    from rljax.models.config import VisionConfig
    from rljax.train.core.image_inputs import ImageInputs
    Image.fromarray(_picture(0, (20, 20, 3))).save(tmp_path / "ok.png")
    (tmp_path / "bad.png").write_bytes(b"not a png")
    cfg = config_lib.default_config()
    cfg.data.path = str(tmp_path / "data.jsonl")
    ctx = types.SimpleNamespace(cfg=cfg, model_cfg=types.SimpleNamespace(
        vision=VisionConfig(image_size=16, patch_size=8)))
    inputs = ImageInputs(ctx)
    examples = [{"images": "ok.png"}, {"images": "bad.png"}, {"prompt": "no image"}]
    pixels = inputs.pixels(examples, [f"data.jsonl:{i + 1}" for i in range(3)])
    assert pixels.shape[0] == 3 and inputs.skipped == 1
    assert inputs.usable.tolist() == [True, False, True]


def test_markers_expand_as_gemma3s_processor():
    text = images.expand_image_markers("Look: <boi> ok", "<boi>", "<img>", "<eoi>", 3)
    assert text == "Look: \n\n<boi><img><img><img><eoi>\n\n ok"


def test_resumed_iterator_gives_the_same_image_batches(tmp_path):
    from rljax.data.iterator import DataIterator
    for i in range(6):
        Image.fromarray(_picture(10 + i, (18, 22, 3))).save(tmp_path / f"{i}.png")
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "images": f"{i}.png"}) + "\n"
                            for i in range(6)))
    source = RecordsSource(load_records(str(path)))
    proc = images.ImageProcessor(8)

    def pixels(it, n):
        return [images.batch_pixels(next(it), proc, 1, base_dir=str(tmp_path))[0]
                for _ in range(n)]

    first = DataIterator(source, 2, seed=3)
    pixels(first, 2)
    saved = json.loads(json.dumps(first.state()))
    want = pixels(first, 3)          # crosses the epoch boundary
    resumed = DataIterator(source, 2, seed=3)
    resumed.restore(saved)
    for a, b in zip(want, pixels(resumed, 3)):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(want, want[1:]))
