"""Exporting a vision-language model: ``save_hf_vlm`` (and ``rljax export`` of a ``tiny-vlm``
run) writes a ``Gemma3ForConditionalGeneration`` directory that transformers loads with the
same logits for a prompt with images, and that ``load_hf_vlm`` reads back equal."""
import json

import jax
import numpy as np
import pytest

from rljax.models.hf_vision import load_hf_vlm, save_hf_vlm

from test_vision import _hf_tiny_vlm, logits_against_transformers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _randomized(params, seed=7):
    """Every leaf random (biases and norm scales too), so each tensor's name and layout
    matter."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(treedef, [0.3 * jax.random.normal(k, x.shape, x.dtype)
                                        for k, x in zip(keys, leaves)])


def test_exported_vlm_loads_in_transformers_and_back(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    _hf_tiny_vlm(src)
    cfg, vcfg, params = load_hf_vlm(str(src))
    params = _randomized(params)     # not the source's weights: the export must carry them
    save_hf_vlm(cfg, params, str(out), extra_config={"boi_token_index": 101,
                                                     "eoi_token_index": 102})
    hf = json.loads((out / "config.json").read_text())
    assert hf["architectures"] == ["Gemma3ForConditionalGeneration"]
    assert hf["vision_config"]["num_hidden_layers"] == 2 and hf["image_token_index"] == 100

    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        str(out), attn_implementation="eager", dtype=torch.float32).eval()
    logits_against_transformers(model, cfg, vcfg, params)

    cfg2, vcfg2, back = load_hf_vlm(str(out))
    assert (cfg2, vcfg2) == (cfg, vcfg)
    jax.tree.map(np.testing.assert_array_equal, back, params)


def test_image_marker_ids_come_from_the_checkpoint(tmp_path):
    from rljax.models.hf_vision import image_marker_ids
    (tmp_path / "config.json").write_text(json.dumps({"boi_token_index": 7,
                                                      "eoi_token_index": 8, "x": 1}))
    assert image_marker_ids(str(tmp_path)) == {"boi_token_index": 7, "eoi_token_index": 8}
    assert image_marker_ids(None) == {}
