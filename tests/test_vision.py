"""Gemma 3 with images: the vision tower, the image-token merge and mask, loading a
``Gemma3ForConditionalGeneration`` checkpoint, against transformers on a random tiny one."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import models, sampling
from rljax.models import image_tokens, vision
from rljax.models.hf_vision import load_hf_vlm

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB, IMG, BOI, EOI = 128, 100, 101, 102
MM = 4          # image tokens per image
WINDOW = 5      # smaller than an image block plus its neighbours: local layers drop keys


def _hf_tiny_vlm(path):
    """A tiny random transformers Gemma 3 multimodal model saved at ``path``; every parameter
    random (the projector and norms start at zero in transformers' init)."""
    torch.manual_seed(0)
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=128, sliding_window=WINDOW, query_pre_attn_scalar=12,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                bos_token_id=2, eos_token_id=1, pad_token_id=0)
    vis = dict(model_type="siglip_vision_model", hidden_size=24, intermediate_size=40,
               num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8)
    config = transformers.Gemma3Config(text_config=text, vision_config=vis,
                                       mm_tokens_per_image=MM, image_token_index=IMG,
                                       boi_token_index=BOI, eoi_token_index=EOI)
    config._attn_implementation = "eager"
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model = model.float().eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3vlm")
    hf = _hf_tiny_vlm(path)
    cfg, vcfg, params = load_hf_vlm(str(path))
    return path, hf, cfg, vcfg, params


def _image(n):
    return [BOI] + [IMG] * MM + [EOI]


def _batch(total=20):
    """Two left-padded rows: two images in row 0, one in row 1; pixels [2, 2, 3, 32, 32]
    (row 1's second image unused)."""
    rows = [[2, 5, 6] + _image(0) + [7, 8] + _image(1) + [9],
            [2, 11] + _image(0) + [12, 13, 14]]
    toks = np.zeros((2, total), np.int32)
    mask = np.zeros((2, total), bool)
    for i, r in enumerate(rows):
        toks[i, total - len(r):] = r
        mask[i, total - len(r):] = True
    pixels = np.random.default_rng(0).normal(size=(2, 2, 3, 32, 32)).astype(np.float32)
    return toks, mask, pixels


def _hf_inputs(toks, mask, pixels):
    real = [pixels[0, 0], pixels[0, 1], pixels[1, 0]]   # transformers: images in row order
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0)
    return dict(input_ids=torch.tensor(toks, dtype=torch.long),
                attention_mask=torch.tensor(mask, dtype=torch.long),
                position_ids=torch.tensor(pos, dtype=torch.long),
                token_type_ids=torch.tensor(toks == IMG, dtype=torch.long),
                pixel_values=torch.tensor(np.stack(real)))


def _embeds(vcfg, params, pixels):
    e = vision.encode_images(vcfg, params["vision"], jnp.asarray(pixels))   # [B, I, M, D]
    return e.reshape(e.shape[0], -1, e.shape[-1])


def test_config_and_names(tiny):
    _, hf, cfg, vcfg, params = tiny
    assert cfg.image_token_id == IMG and cfg.model_type == "gemma3"
    assert (vcfg.num_patches, vcfg.pool, vcfg.text_hidden_size) == (16, 2, 32)
    assert params["vision"]["layers"]["q"].shape == (2, 24, 2, 12)


def test_image_features_match_transformers(tiny):
    _, hf, cfg, vcfg, params = tiny
    pixels = np.random.default_rng(1).normal(size=(3, 3, 32, 32)).astype(np.float32)
    with torch.no_grad():
        want = hf.model.get_image_features(torch.tensor(pixels)).pooler_output.numpy()
    got = np.asarray(vision.encode_images(vcfg, params["vision"], jnp.asarray(pixels)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def logits_against_transformers(hf, cfg, vcfg, params):
    """``(ours, transformers', mask)``: both models' logits [B, T, V] on ``_batch()``, after
    checking they agree on real tokens (1e-5 relative to the largest logit)."""
    toks, mask, pixels = _batch()
    with torch.no_grad():
        want = hf(**_hf_inputs(toks, mask, pixels)).logits.numpy()
    got = np.asarray(models.forward(cfg, params, jnp.asarray(toks), jnp.asarray(mask),
                                    image_embeds=_embeds(vcfg, params, pixels)))
    np.testing.assert_allclose(got[mask], want[mask], rtol=1e-5, atol=1e-5 * np.abs(want).max())
    return got, want, mask


def test_logits_with_images_match_transformers(tiny):
    _, hf, cfg, vcfg, params = tiny
    _, want, mask = logits_against_transformers(hf, cfg, vcfg, params)
    toks = _batch()[0]
    # The image tokens see each other both ways: the causal-only text model differs there.
    text_only = cfg.replace(image_token_id=None, vision=None)
    causal = np.asarray(models.forward(text_only, params, jnp.asarray(toks), jnp.asarray(mask),
                                       image_embeds=None))
    assert np.abs(causal[mask] - want[mask]).max() > 1e-3


def test_greedy_decoding_with_images_matches_transformers(tiny):
    _, hf, cfg, vcfg, params = tiny
    toks, mask, pixels = _batch()
    new = 6
    inputs = _hf_inputs(toks, mask, pixels)
    inputs.pop("position_ids")
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          pad_token_id=0, eos_token_id=None)
    want = out[:, toks.shape[1]:].numpy()
    ours = sampling.generate(cfg, params, jnp.asarray(toks), jnp.asarray(mask),
                             rng=jax.random.PRNGKey(0), max_new_tokens=new, temperature=0.0,
                             image_embeds=_embeds(vcfg, params, pixels))
    np.testing.assert_array_equal(np.asarray(ours.tokens), want)


def test_the_slot_engine_prefills_the_images_into_its_pages(tiny):
    """The slot engine with images (fewer slots than rows, so rows refill): greedy, it decodes
    transformers' tokens; sampled, the static sampler's tokens with its log-probs up to float32
    rounding (the two programs draw the same noise per row and step)."""
    _, hf, cfg, vcfg, params = tiny
    toks, mask, pixels = _batch()
    embeds = _embeds(vcfg, params, pixels)
    inputs = _hf_inputs(toks, mask, pixels)
    inputs.pop("position_ids")
    with torch.no_grad():
        want = hf.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                           pad_token_id=0, eos_token_id=None)[:, toks.shape[1]:].numpy()
    greedy, _ = sampling.engine.generate(cfg, params, toks, mask, rng=jax.random.PRNGKey(0),
                                         max_new_tokens=6, temperature=0.0, slots=1,
                                         chunk_steps=2, image_embeds=embeds)
    np.testing.assert_array_equal(np.asarray(greedy.tokens), want)
    kw = dict(rng=jax.random.PRNGKey(3), max_new_tokens=6, temperature=1.0, num_samples=2)
    ref = sampling.generate(cfg, params, jnp.asarray(toks), jnp.asarray(mask),
                            image_embeds=embeds, **kw)
    out, stats = sampling.engine.generate(cfg, params, toks, mask, slots=2, chunk_steps=2,
                                          image_embeds=embeds, **kw)
    assert stats.rows == 4 and stats.slots == 2
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    m = np.asarray(ref.mask)
    np.testing.assert_allclose(np.asarray(out.logps)[m], np.asarray(ref.logps)[m], atol=2e-5)


def test_image_blocks_and_merge():
    toks = jnp.asarray([[5, IMG, IMG, 6, IMG, IMG, 0]])
    blocks = image_tokens.image_blocks(toks, IMG)
    np.testing.assert_array_equal(np.asarray(blocks), [[-1, 0, 0, -1, 1, 1, -1]])
    same = np.asarray(image_tokens.same_image(blocks, blocks))[0]
    assert same[1, 2] and same[2, 1] and not same[1, 4] and not same[0, 0]
    x = jnp.zeros((1, 7, 2))
    emb = jnp.arange(8.0).reshape(1, 4, 2)
    merged = np.asarray(image_tokens.merge_images(x, toks, emb, IMG))[0]
    np.testing.assert_array_equal(merged[[1, 2, 4, 5]], np.arange(8.0).reshape(4, 2))
    assert not merged[[0, 3, 6]].any()
    assert image_tokens.count_images(np.asarray(toks), IMG, 2) == [2]
    with pytest.raises(ValueError, match="each image takes exactly 3"):
        image_tokens.count_images(np.asarray(toks), IMG, 3)
