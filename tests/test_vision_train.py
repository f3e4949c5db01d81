"""Image inputs in the training passes: the shared-prompt forward with images equals the
per-row one (the sampler's shared and ragged prefills too), and the vision tower is frozen unless ``train_vision``."""
import jax
import jax.numpy as jnp
import numpy as np

from rljax import models, sampling
from rljax.models import shared_prompt, vision
from rljax.models.config import VisionConfig
from rljax.train.core import steps

IMG, MM = 60, 4


def _tiny(train_vision=False):
    vcfg = VisionConfig(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                        image_size=16, patch_size=4, mm_tokens_per_image=MM,
                        text_hidden_size=32)
    cfg = models.get_preset("tiny", model_type="gemma3", vocab_size=64, hidden_size=32,
                            intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8,
                            num_layers=3, sliding_window=4,
                            layer_types=("sliding_attention", "full_attention",
                                         "sliding_attention"),
                            image_token_id=IMG, vision=vcfg, train_vision=train_vision)
    params = models.init_params(cfg, jax.random.PRNGKey(0))
    params["vision"] = vision.init_vision_params(vcfg.replace(init_std=0.3), jax.random.PRNGKey(1))
    return cfg, params


def _prompts():
    """Two left-padded prompts with one image each; pixels [2, 1, 3, 16, 16]."""
    rows = [[2, 5, 61] + [IMG] * MM + [62, 7, 8], [2, 61] + [IMG] * MM + [62, 9]]
    p = max(map(len, rows))
    toks = np.zeros((2, p), np.int32)
    mask = np.zeros((2, p), bool)
    for i, r in enumerate(rows):
        toks[i, p - len(r):], mask[i, p - len(r):] = r, True
    pixels = np.random.default_rng(0).normal(size=(2, 1, 3, 16, 16)).astype(np.float32)
    return toks, mask, pixels


def test_shared_image_prefill_equals_per_row():
    cfg, params = _tiny()
    toks, mask, pixels = _prompts()
    g, n = 3, 5
    comp = np.random.default_rng(1).integers(3, 59, (2 * g, n)).astype(np.int32)
    cmask = np.ones((2 * g, n), bool)
    cmask[1, 3:] = False
    emb = vision.image_embeddings(cfg, params, jnp.asarray(pixels))          # [2, M, D]
    shared, _ = shared_prompt.completion_logps(cfg, params, jnp.asarray(toks), jnp.asarray(mask),
                                               jnp.asarray(comp), jnp.asarray(cmask),
                                               image_embeds=emb)
    full = np.concatenate([np.repeat(toks, g, 0), comp], 1)
    fmask = np.concatenate([np.repeat(mask, g, 0), cmask], 1)
    per_row, _ = models.token_logps(cfg, params, jnp.asarray(full), jnp.asarray(fmask),
                                    first_scored=toks.shape[1],
                                    image_embeds=jnp.repeat(emb, g, 0))
    np.testing.assert_allclose(np.asarray(shared), np.asarray(per_row)[:, toks.shape[1]:],
                               rtol=1e-5, atol=1e-5)
    # The sampler's shared prefill (one per prompt, fanned out to G rows) decodes what a
    # G-times-repeated batch decodes.
    out = sampling.generate(cfg, params, jnp.asarray(toks), jnp.asarray(mask),
                            rng=jax.random.PRNGKey(0), max_new_tokens=4, temperature=0.0,
                            num_samples=g, image_embeds=emb)
    rep = sampling.generate(cfg, params, jnp.asarray(np.repeat(toks, g, 0)),
                            jnp.asarray(np.repeat(mask, g, 0)), rng=jax.random.PRNGKey(0),
                            max_new_tokens=4, temperature=0.0, image_embeds=jnp.repeat(emb, g, 0))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(rep.tokens))
    np.testing.assert_allclose(np.asarray(out.logps), np.asarray(rep.logps), rtol=1e-5, atol=1e-5)
    # Groups of any sizes (``prompt_index``, knapsack allocation; in one stream or two): each
    # row continues its prompt's prefill, images included.
    index = np.asarray([1, 0, 0, 1, 1, 1], np.int32)
    for streams in (1, 2):
        ragged = sampling.generate(cfg, params, toks, mask, rng=jax.random.PRNGKey(0),
                                   max_new_tokens=4, temperature=0.0, num_samples=1,
                                   image_embeds=emb, prompt_index=index, streams=streams)
        rows = sampling.generate(cfg, params, toks[index], mask[index],
                                 rng=jax.random.PRNGKey(0), max_new_tokens=4, temperature=0.0,
                                 image_embeds=emb[index])
        np.testing.assert_array_equal(np.asarray(ragged.tokens), np.asarray(rows.tokens))
        np.testing.assert_allclose(np.asarray(ragged.logps), np.asarray(rows.logps),
                                   rtol=1e-5, atol=1e-5)


def _grads(cfg, params):
    toks, mask, pixels = _prompts()
    comp = np.random.default_rng(2).integers(3, 59, (2, 3)).astype(np.int32)
    batch = {"tokens": jnp.asarray(np.concatenate([toks, comp], 1)),
             "mask": jnp.asarray(np.concatenate([mask, np.ones((2, 3), bool)], 1)),
             "loss_mask": jnp.ones((2, 3), jnp.float32), "pixels": jnp.asarray(pixels)}
    return jax.grad(lambda p: steps.completion_logps(cfg, p, batch)[0].sum())(params)


def test_the_tower_is_frozen_unless_train_vision():
    cfg, params = _tiny()
    frozen = _grads(cfg, params)
    assert all(not np.asarray(x).any() for x in jax.tree.leaves(frozen["vision"]))
    assert np.abs(np.asarray(frozen["embed"])).max() > 0
    cfg_t, _ = _tiny(train_vision=True)
    trained = _grads(cfg_t, params)
    assert np.abs(np.asarray(trained["vision"]["mm_proj"])).max() > 0
    assert np.abs(np.asarray(trained["vision"]["patch"])).max() > 0


def test_a_random_tower_starts_as_siglip_starts():
    """LeCun-normal patch embedding, Xavier-uniform attention and MLP matrices (o's fan-in is
    heads x head_dim), positions normal(1/sqrt(width)), the projector normal(init_std)."""
    vcfg = VisionConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                        image_size=32, patch_size=8, mm_tokens_per_image=4, text_hidden_size=48)
    tower = vision.init_vision_params(vcfg, jax.random.PRNGKey(0))
    e, f, cpp = 64, 128, 3 * 8 * 8
    xavier = lambda fan_in, fan_out: np.sqrt(2.0 / (fan_in + fan_out))   # uniform's std
    expected = {"patch": 1 / np.sqrt(cpp), "pos": 1 / np.sqrt(e), "mm_proj": vcfg.init_std}
    layers = {"q": xavier(e, e), "k": xavier(e, e), "v": xavier(e, e), "o": xavier(e, e),
              "fc1": xavier(e, f), "fc2": xavier(f, e)}
    for name, std in expected.items():
        np.testing.assert_allclose(np.std(np.asarray(tower[name])), std, rtol=0.1, err_msg=name)
    for name, std in layers.items():
        x = np.asarray(tower["layers"][name])
        np.testing.assert_allclose(np.std(x), std, rtol=0.1, err_msg=name)
        assert np.abs(x).max() <= np.sqrt(3) * std * (1 + 1e-6), name   # uniform's bound
    assert not np.asarray(tower["layers"]["q_bias"]).any()
    np.testing.assert_array_equal(np.asarray(tower["post_ln"]), 1.0)
