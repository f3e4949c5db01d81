"""rljax.models: parity with transformers (PyTorch CPU) on tiny random checkpoints, export round
trip, bf16, KV cache, log-probs, value head, sharded loading, program size vs depth, error
messages."""
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import models

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FAMILIES = ("llama", "qwen2", "qwen3", "gemma")
B, T = 3, 12
PADS = (0, 3, 5)  # left padding per row


def _hf_config(family):
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, attn_implementation="eager")
    if family == "llama":
        # Small original context so the llama3 frequency scaling changes every band in use.
        return transformers.LlamaConfig(
            **common, rope_theta=10000.0, tie_word_embeddings=False,
            rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    if family == "qwen2":
        return transformers.Qwen2Config(**common, rope_theta=1e6, tie_word_embeddings=True,
                                        rope_scaling={"rope_type": "linear", "factor": 2.0})
    if family == "qwen3":
        # head_dim 32 != hidden/heads = 16
        return transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)
    if family == "gemma":
        common.update(num_key_value_heads=1)
        return transformers.GemmaConfig(**common, head_dim=16)
    raise ValueError(family)


def _randomise(model, family):
    """Weights large enough that logits are O(1) and every norm/bias actually matters."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(0.2 * noise + (0.0 if family == "gemma" else 1.0))
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            else:
                p.copy_(0.12 * noise)


def _batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 256, size=(B, T)).astype(np.int32)
    mask = np.ones((B, T), bool)
    for i, pad in enumerate(PADS):
        mask[i, :pad] = False
        tokens[i, :pad] = 0
    return tokens, mask


def _hf_logits(model, tokens, mask):
    pos = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                    attention_mask=torch.tensor(mask, dtype=torch.long),
                    position_ids=torch.tensor(pos, dtype=torch.long))
    return out.logits.float().numpy()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """family -> (checkpoint dir, HF reference logits on the left-padded batch)."""
    root = tmp_path_factory.mktemp("hf")
    tokens, mask = _batch()
    out = {}
    for family in FAMILIES:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(_hf_config(family)).float().eval()
        _randomise(model, family)
        path = str(root / family)
        model.save_pretrained(path)
        out[family] = (path, _hf_logits(model, tokens, mask))
    return out


@pytest.fixture(scope="module")
def loaded(ckpts):
    return {f: models.load_hf(ckpts[f][0], dtype=jnp.float32) for f in FAMILIES}


_fwd = jax.jit(models.forward, static_argnums=0)
_logps = jax.jit(models.token_logps, static_argnums=0,
                 static_argnames=("chunk_size", "with_entropy", "first_scored"))


@pytest.mark.parametrize("family", FAMILIES)
def test_parity_with_transformers(family, ckpts, loaded):
    tokens, mask = _batch()
    cfg, params = loaded[family]
    assert cfg.model_type == family
    ours = np.asarray(_fwd(cfg, params, jnp.asarray(tokens), jnp.asarray(mask)))
    ref = ckpts[family][1]
    diff = np.abs(ours - ref)[mask].max()
    scale = np.abs(ref[mask]).max()
    print(f"{family}: max|dlogit| = {diff:.2e} (max|logit| {scale:.2f}, rel {diff / scale:.1e})")
    assert scale > 0.5  # the comparison is not between near-zero numbers
    assert diff <= 1e-4


def test_rope_scaling_is_applied(loaded):
    cfg, _ = loaded["qwen2"]
    assert cfg.rope_scaling_type == "linear" and cfg.rope_factor == 2.0
    cfg, _ = loaded["llama"]
    assert cfg.rope_scaling_type == "llama3" and cfg.rope_factor == 4.0
    plain = models.rope_inv_freq(cfg.replace(rope_scaling_type=None))
    scaled = models.rope_inv_freq(cfg)
    assert not np.allclose(plain, scaled)
    np.testing.assert_allclose(scaled[-1], plain[-1] / 4.0, rtol=1e-6)  # lowest frequency / factor


@pytest.mark.parametrize("family", FAMILIES)
def test_save_hf_round_trip(family, ckpts, loaded, tmp_path):
    cfg, params = loaded[family]
    models.save_hf(cfg, params, str(tmp_path))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), attn_implementation="eager").float().eval()
    tokens, mask = _batch()
    diff = np.abs(_hf_logits(model, tokens, mask) - ckpts[family][1])[mask].max()
    assert diff <= 1e-5
    cfg2, params2 = models.load_hf(str(tmp_path))
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_save_hf_sharded_and_bf16(loaded, tmp_path):
    cfg, params = loaded["qwen3"]
    bf = cfg.replace(param_dtype="bfloat16", dtype="bfloat16")
    params_bf = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    models.save_hf(bf, params_bf, str(tmp_path), max_shard_bytes=40_000)
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
    cfg2, params2 = models.load_hf(str(tmp_path), dtype=jnp.bfloat16)
    assert cfg2 == bf
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a, np.float32),
                                                            np.asarray(b, np.float32)),
                 params2, params_bf)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert model.dtype == torch.bfloat16


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_bf16_close_to_float32(family, ckpts, loaded):
    tokens, mask = _batch()
    cfg32, p32 = loaded[family]
    cfg16, p16 = models.load_hf(ckpts[family][0], dtype=jnp.bfloat16)
    assert p16["layers"]["q"].dtype == jnp.bfloat16
    l16 = _fwd(cfg16, p16, jnp.asarray(tokens), jnp.asarray(mask))
    assert l16.dtype == jnp.float32
    l32 = np.asarray(_fwd(cfg32, p32, jnp.asarray(tokens), jnp.asarray(mask)))
    diff = np.abs(np.asarray(l16) - l32)[mask].max()
    scale = np.abs(l32[mask]).max()
    print(f"{family} bf16 vs f32: max|dlogit| = {diff:.3f} (max|logit| {scale:.2f})")
    # bf16 has 8 mantissa bits (~0.4% per rounding); two layers of rounding stay within 5%.
    assert diff <= 0.05 * scale
    # f32 params with bf16 compute also runs.
    lmix = _fwd(cfg32.replace(dtype="bfloat16"), p32, jnp.asarray(tokens), jnp.asarray(mask))
    assert np.abs(np.asarray(lmix) - l32)[mask].max() <= 0.05 * scale


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_kv_cache_decoding_matches_full_forward(family, loaded):
    cfg, params = loaded[family]
    prompt, pmask = _batch()  # [B, 12], left-padded
    n_new, s = 6, 20
    rng = np.random.default_rng(1)
    new = rng.integers(1, 256, size=(B, n_new)).astype(np.int32)
    full = np.concatenate([prompt, new], axis=1)
    fmask = np.concatenate([pmask, np.ones((B, n_new), bool)], axis=1)
    ref = np.asarray(_fwd(cfg, params, jnp.asarray(full), jnp.asarray(fmask)))
    pos = np.asarray(models.default_positions(jnp.asarray(fmask)))
    cache_mask = jnp.asarray(np.concatenate([fmask, np.ones((B, s - full.shape[1]), bool)], 1))

    step = jax.jit(models.trunk, static_argnums=0)
    cache = models.init_cache(cfg, B, s)
    assert cache["k"].shape == (cfg.num_layers, B, cfg.num_kv_heads, s, cfg.head_dim)
    p = prompt.shape[1]
    hidden, cache = step(cfg, params, jnp.asarray(prompt), cache_mask, jnp.asarray(pos[:, :p]),
                         cache, 0)
    got = [models.logits_from_hidden(cfg, params, hidden)]
    # First two new tokens as one chunk (T=2 at a non-zero index), then one at a time.
    chunks = [(p, p + 2)] + [(i, i + 1) for i in range(p + 2, p + n_new)]
    for a, b in chunks:
        hidden, cache = step(cfg, params, jnp.asarray(full[:, a:b]), cache_mask,
                             jnp.asarray(pos[:, a:b]), cache, a)
        got.append(models.logits_from_hidden(cfg, params, hidden))
    got = np.asarray(jnp.concatenate(got, axis=1))
    diff = np.abs(got - ref)[fmask].max()
    print(f"{family} cached vs full: {diff:.2e}")
    assert diff <= 1e-4


@pytest.mark.parametrize("with_lora", [False, True])
def test_unstacked_cache_decoding_matches_stacked(with_lora):
    """The decode loops' path (per-layer weights and cache buffers, layers unrolled) computes
    what the layer scan over the stacked weights and cache does, LoRA adapters included."""
    cfg = models.get_preset("tiny", num_layers=3, init_std=0.1)
    params = models.init_params(cfg, jax.random.key(0))
    if with_lora:
        lora = models.lora.init_lora(cfg, 4, "q,v,down", jax.random.key(1))
        lora = jax.tree.map(lambda x: x + 0.05, lora)   # B != 0: the adapters change outputs
        params = dict(params, lora=lora)
    prompt, pmask = _batch()
    s = T + 3
    mask = jnp.asarray(np.concatenate([pmask, np.ones((B, 3), bool)], axis=1))
    pos = models.default_positions(mask)
    step = jax.jit(models.trunk, static_argnums=0)
    _, stacked = step(cfg, params, jnp.asarray(prompt), mask, pos[:, :T],
                      models.init_cache(cfg, B, s), 0)
    per_layer = models.unstack_cache(stacked)
    assert len(per_layer["k"]) == cfg.num_layers
    assert per_layer["k"][0].shape == (B, cfg.num_kv_heads, s, cfg.head_dim)
    np.testing.assert_array_equal(models.stack_cache(per_layer)["v"], stacked["v"])
    unstacked = models.unstack_layers(params)
    assert isinstance(unstacked["layers"], tuple) and len(unstacked["layers"]) == cfg.num_layers
    assert models.unstack_layers(unstacked)["layers"] is unstacked["layers"]
    new = jnp.asarray(np.arange(1, B + 1, dtype=np.int32)[:, None])
    for t in range(T, s):   # one token at a time, as the decode loop feeds them
        h_ref, stacked = step(cfg, params, new, mask, pos[:, t:t + 1], stacked, t)
        h, per_layer = step(cfg, unstacked, new, mask, pos[:, t:t + 1], per_layer, t)
        np.testing.assert_allclose(h, h_ref, rtol=1e-5, atol=1e-5)
        new = (new * 7 + t) % cfg.vocab_size
    np.testing.assert_allclose(models.stack_cache(per_layer)["k"], stacked["k"], rtol=1e-5,
                               atol=1e-5)


def test_token_logps_and_entropy(loaded):
    cfg, params = loaded["qwen2"]
    tokens, mask = _batch()
    tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
    temp = 0.7
    logits = _fwd(cfg, params, tokens, mask) / temp
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    ref = jnp.take_along_axis(logp_all[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
    ref = jnp.where(mask[:, 1:], ref, 0.0)
    ref_ent = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)[:, :-1]
    ref_ent = jnp.where(mask[:, 1:], ref_ent, 0.0)
    for chunk in (5, 11, None):  # 5 does not divide T-1=11: exercises chunk padding
        logps, ent = _logps(cfg, params, tokens, mask, temperature=temp, chunk_size=chunk,
                            with_entropy=True)
        assert logps.shape == (B, T) and logps.dtype == jnp.float32
        np.testing.assert_array_equal(logps[:, 0], 0.0)
        np.testing.assert_allclose(logps[:, 1:], ref, atol=1e-5)
        np.testing.assert_allclose(ent[:, 1:], ref_ent, atol=1e-5)
    assert float(ent[mask].max()) > 0.1
    _, none = _logps(cfg, params, tokens, mask)
    assert none is None

    # Gradients through the chunked, rematerialised path equal the direct ones.
    def direct(p):
        lp = jax.nn.log_softmax(models.forward(cfg, p, tokens, mask), axis=-1)
        return jnp.sum(jnp.take_along_axis(lp[:, :-1], tokens[:, 1:, None], -1)[..., 0]
                       * mask[:, 1:])

    g_ref = jax.jit(jax.grad(direct))(params)
    g = jax.jit(jax.grad(
        lambda p: models.token_logps(cfg, p, tokens, mask, chunk_size=4)[0].sum()))(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4), g, g_ref)


def test_token_logps_first_scored_matches_full():
    """``first_scored=k``: columns >= k (and the gradients of a loss over them) equal the full
    computation, columns < k are 0 -- with left padding, a per-position temperature,
    entropies and a chunk size that does not divide the scored length."""
    cfg = models.get_preset("tiny", num_layers=1)
    params = models.init_params(cfg, jax.random.PRNGKey(3))
    tokens, mask = _batch()
    tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
    temp = jnp.asarray(np.random.default_rng(0).uniform(0.5, 1.5, (B, T)), jnp.float32)
    k = 7
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(B, T - k)), jnp.float32)

    def loss(p, first):
        lp, ent = models.token_logps(cfg, p, tokens, mask, temperature=temp, with_entropy=True,
                                     chunk_size=4, first_scored=first)
        return jnp.sum((lp[:, k:] + 0.1 * ent[:, k:]) * weights), (lp, ent)

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (_, (lp_full, ent_full)), g_full = grad(params, 1)
    (_, (lp, ent)), g_part = grad(params, k)
    assert lp.shape == (B, T) and ent.shape == (B, T)
    np.testing.assert_array_equal(lp[:, :k], 0.0)
    np.testing.assert_array_equal(ent[:, :k], 0.0)
    np.testing.assert_allclose(lp[:, k:], lp_full[:, k:], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ent[:, k:], ent_full[:, k:], rtol=1e-6, atol=1e-6)
    assert float(jnp.abs(lp_full[:, 1:k]).max()) > 0.1   # the full call did score them
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 g_part, g_full)
    # Past the end: nothing is scored.
    none, _ = _logps(cfg, params, tokens, mask, first_scored=T + 3)
    np.testing.assert_array_equal(none, 0.0)


def test_init_params_axes_and_remat():
    for family in FAMILIES:
        cfg = models.get_preset("tiny", model_type=family, remat=True)
        params = models.init_params(cfg, jax.random.PRNGKey(0))
        axes = models.param_logical_axes(cfg)
        assert jax.tree.structure(params) == jax.tree.structure(
            axes, is_leaf=lambda x: isinstance(x, tuple))
        flat_p = jax.tree.leaves(params)
        flat_a = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
        for p, a in zip(flat_p, flat_a):
            assert p.ndim == len(a)
        assert sum(p.size for p in flat_p) == cfg.num_params()
    assert "q_bias" in models.init_params(models.get_preset("tiny", model_type="qwen2"),
                                          jax.random.PRNGKey(0))["layers"]
    # Remat changes memory, not numbers.
    cfg = models.get_preset("tiny")
    params = models.init_params(cfg, jax.random.PRNGKey(1))
    tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
    loss = lambda c: (lambda p: models.forward(c, p, tokens).sum())
    g1 = jax.jit(jax.grad(loss(cfg)))(params)
    g2 = jax.jit(jax.grad(loss(cfg.replace(remat=True))))(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4), g1, g2)
    g3 = jax.jit(jax.grad(loss(cfg.replace(remat_policy="everything"))))(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4), g1, g3)
    with pytest.raises(ValueError, match="remat_policy"):
        cfg.replace(remat_policy="some")
    assert hash(cfg) == hash(models.get_preset("tiny"))
    # Presets have the shapes of the real checkpoints (published parameter counts).
    expected = {"qwen2.5-0.5b": 494.0e6, "qwen2.5-1.5b": 1.544e9, "qwen2.5-7b": 7.616e9,
                "llama-3.2-1b": 1.236e9, "llama-3.2-3b": 3.213e9, "llama-3.1-8b": 8.030e9,
                "gemma-2b": 2.506e9}
    for name, count in expected.items():
        n = models.get_preset(name).num_params()
        assert abs(n - count) / count < 0.01, (name, n)
    assert models.get_preset("tiny", dtype=jnp.bfloat16).dtype == "bfloat16"


def test_value_head(loaded):
    cfg, params = loaded["llama"]
    tokens, mask = _batch()
    vp = models.init_value_params(cfg, jax.random.PRNGKey(0), from_params=params)
    assert "lm_head" not in vp["trunk"]
    np.testing.assert_array_equal(vp["trunk"]["layers"]["q"], params["layers"]["q"])
    values = jax.jit(models.value_forward, static_argnums=0)(cfg, vp, jnp.asarray(tokens),
                                                             jnp.asarray(mask))
    assert values.shape == (B, T) and values.dtype == jnp.float32
    hidden, _ = jax.jit(models.trunk, static_argnums=0)(cfg, params, jnp.asarray(tokens),
                                                        jnp.asarray(mask))
    np.testing.assert_allclose(values, hidden @ vp["head"]["kernel"] + vp["head"]["bias"],
                               atol=1e-5)
    fresh = models.init_value_params(cfg, jax.random.PRNGKey(0))
    axes = models.value_param_logical_axes(cfg)
    assert jax.tree.structure(fresh) == jax.tree.structure(
        axes, is_leaf=lambda x: isinstance(x, tuple))
    g = jax.jit(jax.grad(lambda v: models.value_forward(cfg, v, jnp.asarray(tokens)).sum()))(fresh)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(g))


def test_load_hf_into_shardings(ckpts, loaded):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    assert len(jax.devices()) >= 8
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    rules = {"embed": "data", "mlp": "model", "heads": "model", "vocab": "model"}
    cfg, ref_params = loaded["llama"]
    shardings = jax.tree.map(
        lambda axes: NamedSharding(mesh, PartitionSpec(*[rules.get(a) for a in axes])),
        models.param_logical_axes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    _, params = models.load_hf(ckpts["llama"][0], shardings=shardings)
    assert params["layers"]["gate"].sharding == shardings["layers"]["gate"]
    assert len(params["layers"]["gate"].addressable_shards[0].data.shape) == 3
    assert params["layers"]["gate"].addressable_shards[0].data.shape == (2, 32, 32)
    jax.tree.map(np.testing.assert_array_equal, params, ref_params)


def test_compiled_program_size_independent_of_depth():
    """Layers run under a scan, so the compiled forward holds one layer body at any depth and
    compile time does not grow with it. Counting the optimized HLO's instructions shows that
    without timing the compiler, which a busy machine skews (the ratio of two timings did)."""
    tokens = jax.ShapeDtypeStruct((2, 32), jnp.int32)
    sizes = {}
    for layers in (2, 24):  # not 1: a one-trip loop is inlined, which is a different program
        cfg = models.get_preset("tiny", num_layers=layers)
        params = jax.eval_shape(lambda: models.init_params(cfg, jax.random.PRNGKey(0)))
        fn = jax.jit(lambda p, t, cfg=cfg: models.forward(cfg, p, t))
        hlo = fn.lower(params, tokens).compile().as_text()
        sizes[layers] = sum(1 for line in hlo.splitlines()
                            if re.match(r"\s+(ROOT )?%?[\w.-]+ = ", line))
    print(f"optimized HLO instructions: 2 layers {sizes[2]}, 24 layers {sizes[24]}")
    assert sizes[2] > 100, sizes  # the count sees the whole program
    assert sizes[24] <= 1.1 * sizes[2], sizes  # unrolled, 24 layers would be several times more


# ----------------------------------------------------------------------------- errors

def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def test_error_unsupported_model_type(ckpts, tmp_path):
    path = _copy(ckpts["llama"][0], tmp_path / "x")
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["model_type"] = "mamba"
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(models.HFCheckpointError, match="unsupported model_type 'mamba'"):
        models.load_hf(path)


def test_error_missing_tensor(ckpts, tmp_path):
    from safetensors.numpy import load_file, save_file

    path = _copy(ckpts["llama"][0], tmp_path / "x")
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        models.load_hf(path)


def test_error_shape_mismatch(ckpts, tmp_path):
    path = _copy(ckpts["llama"][0], tmp_path / "x")
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["intermediate_size"] = 96
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(models.HFCheckpointError,
                       match=r"shape mismatch for tensor 'model\.layers\.0\.mlp\.gate_proj\.weight'"
                             r": expected \(96, 64\), got \(128, 64\)"):
        models.load_hf(path)


def test_error_no_config(tmp_path):
    with pytest.raises(models.HFCheckpointError, match="no config.json"):
        models.load_hf(str(tmp_path))


def test_out_of_range_token_ids_clip_and_check():
    # jnp.take fills out-of-range rows with NaN; embed_tokens clips instead (deterministic).
    cfg = models.get_preset("tiny")
    params = models.init_params(cfg, jax.random.key(0))
    v = cfg.vocab_size
    tokens = jnp.asarray([[1, v, v + 100, -5]], jnp.int32)
    logits = np.asarray(models.forward(cfg, params, tokens))
    assert np.isfinite(logits).all()
    clipped = np.asarray(models.forward(cfg, params, jnp.asarray([[1, v - 1, v - 1, 0]])))
    np.testing.assert_array_equal(logits, clipped)
    check = models.transformer.check_token_ids
    with pytest.raises(ValueError, match=rf"token id {v + 100} .*vocab_size {v}"):
        check(cfg, np.asarray(tokens))
    with pytest.raises(ValueError, match="token id -5"):
        check(cfg, np.asarray([[1, -5]]))
    check(cfg, np.asarray([[1, v]]), mask=np.asarray([[True, False]]))  # masked: ignored
    check(cfg, jnp.asarray([[0, v - 1]]))


def test_attention_impl_auto_is_xla_off_gpu_and_cudnn_needs_a_gpu():
    # The fused cuDNN path only exists on GPU (bench/gpu.py checks its parity there); elsewhere
    # "auto" must be the dense path bit for bit and "cudnn" must say why it cannot run.
    cfg = models.get_preset("tiny")
    params = models.init_params(cfg, jax.random.PRNGKey(0))
    tokens = jnp.array([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]], jnp.int32)
    mask = tokens > 0
    ref = models.forward(cfg, params, tokens, attention_mask=mask)
    auto = models.forward(cfg.replace(attention_impl="auto"), params, tokens, attention_mask=mask)
    if jax.default_backend() != "gpu":
        np.testing.assert_array_equal(np.asarray(auto), np.asarray(ref))
        with pytest.raises(ValueError, match="needs a GPU"):
            models.forward(cfg.replace(attention_impl="cudnn"), params, tokens,
                           attention_mask=mask)
    with pytest.raises(ValueError, match="unsupported attention_impl"):
        models.get_preset("tiny", attention_impl="flash")


def test_decode_attention_equals_the_dot_path():
    """A single query against the KV cache (the decode step's multiply-and-sum form on CPU)
    equals the dot-product form the full forward uses, in float32."""
    from rljax.models import transformer
    b, k_heads, g, s, dh = 5, 3, 3, 41, 16
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, 1, k_heads * g, dh))
    k = jax.random.normal(keys[1], (b, k_heads, s, dh))
    v = jax.random.normal(keys[2], (b, k_heads, s, dh))
    mask = jax.random.uniform(keys[3], (b, 1, s)) < 0.7
    mask = mask.at[:, :, 0].set(True)
    got = transformer.attention(q, k, v, mask, kv_layout="bksd")
    want = transformer.attention(q, k.swapaxes(1, 2), v.swapaxes(1, 2), mask, kv_layout="bskd")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tied", [False, True])
def test_low_precision_head_backward_runs_in_the_compute_dtype(tied):
    # bf16 compute: the head's backward matmuls read the cotangent rounded to bf16 (no float32
    # GEMMs); gradients stay within bf16 rounding of the float32 model's.
    from rljax.models import head
    cfg = models.get_preset("tiny", tie_word_embeddings=tied)
    params = models.init_params(cfg, jax.random.PRNGKey(0))
    h = jax.random.normal(jax.random.PRNGKey(1), (3, 5, cfg.hidden_size))
    target = jax.random.normal(jax.random.PRNGKey(2), (3, 5, cfg.vocab_size))
    name = "embed" if tied else "lm_head"

    def grads(c):
        def loss(p, x):
            return (head.logits_from_hidden(c, p, x.astype(c.compute_dtype)) * target).sum()
        return jax.grad(loss, argnums=(0, 1)), loss

    ref_fn, _ = grads(cfg)
    ref = ref_fn(params, h)
    bf16 = cfg.replace(dtype="bfloat16")
    fn, _ = grads(bf16)
    got = fn(params, h)
    for a, b in [(ref[1], got[1]), (ref[0][name], got[0][name])]:
        assert b.dtype == a.dtype == jnp.float32
        assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(a)) < 1e-2
    dots = [e for e in jax.make_jaxpr(fn)(params, h).jaxpr.eqns
            if e.primitive.name == "custom_vjp_call"]
    assert dots, "the bf16 head goes through its custom VJP"
    bwd = jax.make_jaxpr(lambda g: head._low_precision_head_bwd(
        tied, (h.reshape(15, -1).astype(jnp.bfloat16),
               params[name].astype(jnp.bfloat16)), g))(jnp.ones((15, cfg.vocab_size)))
    operand_dtypes = {v.aval.dtype for e in bwd.jaxpr.eqns if e.primitive.name == "dot_general"
                      for v in e.invars}
    assert operand_dtypes == {jnp.dtype(jnp.bfloat16)}
