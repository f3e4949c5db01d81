"""Decoder-only transformer as pure functions over a parameter pytree.

Parameter tree (per-layer weights stacked on a leading ``layers`` axis, see
``param_logical_axes`` for the logical axis names of every leaf)::

    {"embed": [V, D],
     "layers": {"attn_norm": [L, D], "q": [L, D, H, Dh], "k": [L, D, K, Dh], "v": [L, D, K, Dh],
                "o": [L, H, Dh, D], "mlp_norm": [L, D], "gate": [L, D, F], "up": [L, D, F],
                "down": [L, F, D],
                # qwen2 (attention_bias): "q_bias": [L, H, Dh], "k_bias"/"v_bias": [L, K, Dh]
                # qwen3, gemma3 (qk_norm): "q_norm": [L, Dh], "k_norm": [L, Dh]
                # olmoe (qk_norm over the projection): "q_norm": [L, H*Dh], "k_norm": [L, K*Dh]
                # qwen3_moe, olmoe (num_experts E): "router": [L, D, E] and "expert_gate",
                # "expert_up": [L, E, D, F], "expert_down": [L, E, F, D] instead of gate/up/down
                # gemma2, gemma3 (post_norms): "post_attn_norm", "post_mlp_norm": [L, D]
               },
     "final_norm": [D],
     "lm_head": [D, V],            # absent when tie_word_embeddings
     "lora": {"layers": {...}}}    # optional LoRA adapters (rljax.models.lora)

Layers run under ``jax.lax.scan`` so the compiled program contains one layer body regardless of
depth. Norms, softmax and RoPE tables are computed in float32; matmuls run in ``cfg.dtype``.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

# Attention lives in its own module; re-exported here, where callers have always found it.
from rljax.models import image_tokens, kv_ring, moe, quant, vision_params
from rljax.models.attention import _MASK_VALUE, attention, window_mask  # noqa: F401
from rljax.models.config import ModelConfig
from rljax.models.lora import dropout as lora_dropout, dropout_key as lora_dropout_key

# ----------------------------------------------------------------------------- parameters

def _layer_shapes(cfg: ModelConfig) -> dict:
    """Per-layer parameter shapes (without the leading layers axis) and logical axes."""
    d, f, h, k, dh = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                      cfg.num_kv_heads, cfg.head_dim)
    shapes = {
        "attn_norm": ((d,), ("norm",)),
        "q": ((d, h, dh), ("embed", "heads", "head_dim")),
        "k": ((d, k, dh), ("embed", "kv_heads", "head_dim")),
        "v": ((d, k, dh), ("embed", "kv_heads", "head_dim")),
        "o": ((h, dh, d), ("heads", "head_dim", "embed")),
        "mlp_norm": ((d,), ("norm",)),
        "gate": ((d, f), ("embed", "mlp")),
        "up": ((d, f), ("embed", "mlp")),
        "down": ((f, d), ("mlp", "embed")),
    }
    if cfg.is_moe:
        for name in ("gate", "up", "down"):
            del shapes[name]
        shapes.update(moe.layer_shapes(cfg))
    if cfg.attention_bias:
        shapes["q_bias"] = ((h, dh), ("heads", "head_dim"))
        shapes["k_bias"] = ((k, dh), ("kv_heads", "head_dim"))
        shapes["v_bias"] = ((k, dh), ("kv_heads", "head_dim"))
    if cfg.qk_norm:
        whole = cfg.qk_norm_scope == "projection"
        shapes["q_norm"] = ((h * dh if whole else dh,), ("norm",))
        shapes["k_norm"] = ((k * dh if whole else dh,), ("norm",))
    if cfg.post_norms:
        shapes["post_attn_norm"] = ((d,), ("norm",))
        shapes["post_mlp_norm"] = ((d,), ("norm",))
    return shapes


def param_shapes(cfg: ModelConfig) -> dict:
    """Same tree as ``init_params``; leaves are ``(shape, logical_axes)`` pairs."""
    tree = {
        "embed": ((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed")),
        "layers": {name: ((cfg.num_layers,) + shape, ("layers",) + axes)
                   for name, (shape, axes) in _layer_shapes(cfg).items()},
        "final_norm": ((cfg.hidden_size,), ("norm",)),
    }
    if not cfg.tie_word_embeddings:
        tree["lm_head"] = ((cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"))
    if cfg.vision is not None:   # a multimodal model's image tower (models.vision)
        tree["vision"] = vision_params.vision_param_shapes(cfg.vision)
    return tree


def _is_spec(x) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple)


def param_logical_axes(cfg: ModelConfig) -> dict:
    """Pytree matching ``init_params(cfg, ...)``; leaves are tuples of logical axis names."""
    return jax.tree.map(lambda s: s[1], param_shapes(cfg), is_leaf=_is_spec)


def init_params(cfg: ModelConfig, rng: jax.Array) -> dict:
    """Random parameters: normal(init_std) matrices, zero biases, identity norm scales (a
    vision tower: ``vision_params.init_vision_params``)."""
    if cfg.vision is not None:
        text, tower = jax.random.split(rng)
        return dict(init_params(cfg.replace(vision=None), text),
                    vision=vision_params.init_vision_params(cfg.vision, tower))
    specs = param_shapes(cfg)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_spec)[0]]
    keys = jax.random.split(rng, len(leaves))
    dtype = cfg.params_dtype
    out = []
    for key, path, (shape, _) in zip(keys, paths, leaves):
        if "norm" in path:
            # Gemma stores w and applies (1 + w): identity is w = 0.
            fill = 0.0 if cfg.norm_plus_one else 1.0
            out.append(jnp.full(shape, fill, dtype))
        elif "bias" in path:
            out.append(jnp.zeros(shape, dtype))
        else:
            out.append((cfg.init_std * jax.random.normal(key, shape, jnp.float32)).astype(dtype))
    return jax.tree.unflatten(treedef, out)


# ----------------------------------------------------------------------------- building blocks

def rms_norm(x: jax.Array, scale: jax.Array, eps: float, plus_one: bool = False) -> jax.Array:
    """RMSNorm over the last axis, computed in float32 and cast back to ``x.dtype``."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    w = scale.astype(jnp.float32)
    return (x32 * (1.0 + w if plus_one else w)).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> np.ndarray:
    """float32 [Dh/2] inverse frequencies, with the configured rope scaling applied.

    ``local``: the table of the sliding-window layers: base ``cfg.rope_local_theta`` without
    scaling where that is set (gemma3), else the global table."""
    if local and cfg.rope_local_theta is not None:
        cfg = cfg.replace(rope_theta=cfg.rope_local_theta, rope_scaling_type=None)
    dh = cfg.head_dim
    exponents = np.arange(0, dh, 2, dtype=np.int64).astype(np.float32) / np.float32(dh)
    inv_freq = (1.0 / (np.float32(cfg.rope_theta) ** exponents)).astype(np.float32)
    if cfg.rope_scaling_type == "linear":
        inv_freq = inv_freq / np.float32(cfg.rope_factor)
    elif cfg.rope_scaling_type == "llama3":
        # Llama 3.1: keep high frequencies, divide low frequencies by `factor`, interpolate
        # smoothly in between (wavelength measured against the original context length).
        factor, lo, hi = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        old_len = cfg.rope_original_max_position
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        inv_freq = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv_freq


def rope_tables(positions: jax.Array, inv_freq: np.ndarray, dtype) -> tuple:
    """``(cos, sin)``, each [B, T, 1, Dh] in ``dtype``, for positions int [B, T] (half-split
    layout). Computed once per forward and shared by every layer's queries and keys: inside
    the training forward's layer scan they were recomputed per layer, and again in the
    rematerialised backward. (The unrolled decode loop gains nothing: XLA:CPU fuses a copy of
    the cos/sin into each consumer there either way.)"""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B,T,Dh/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def rotate(x: jax.Array, tables: tuple) -> jax.Array:
    """Applies ``rope_tables``' ``(cos, sin)`` to x [B, T, N, Dh]."""
    cos, sin = tables
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos + rotated * sin


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotary embedding (half-split layout, as in HF checkpoints).

    x: [B, T, N, Dh]; positions: int [B, T]. Tables in float32, product in ``x.dtype``.
    """
    return rotate(x, rope_tables(positions, inv_freq, x.dtype))


def dense(x: jax.Array, w: jax.Array, n_in: int = 1, preferred_element_type=None) -> jax.Array:
    """Contracts the last ``n_in`` axes of ``x`` with the first ``n_in`` axes of ``w``.

    Written as one 2-D matmul ``[prod(lead), K] @ [K, prod(out)]`` (reshapes of contiguous
    axes are free). With the batch and length axes kept separate, the weight gradient contracts
    two axes at once and XLA:CPU materialised a transposed copy of the activation gradient
    (``[F, B*T]``) before every weight-gradient matmul; with one flattened row axis the
    backward dots read the activations and gradients as they are.
    """
    lead, out = x.shape[:x.ndim - n_in], w.shape[n_in:]
    k = math.prod(w.shape[:n_in])
    y = jnp.dot(x.reshape(-1, k), w.reshape(k, -1), preferred_element_type=preferred_element_type)
    return y.reshape(lead + out)


def _proj(cfg: ModelConfig, p: dict, lp, name: str, x: jax.Array, n_in: int = 1,
          drop=None) -> jax.Array:
    """``x @ p[name]``, plus ``scale * (x @ A) @ B`` when ``lp`` (this layer's LoRA adapters,
    see ``rljax.models.lora``) has an adapter for ``name``; the adapter matmuls run unmerged
    in the compute dtype. ``drop`` = ``(rng, layer)``: the adapter reads
    ``dropout(x)`` (rate ``cfg.lora_dropout``, key ``lora.dropout_key(rng, layer, name)``)
    instead of ``x``; the base matmul always reads ``x`` itself (PEFT's LoRA dropout). A
    quantized base weight (``models.quant``) is dequantized inside its matmul."""
    w = p[name]
    if quant.is_quantized(w):
        y = quant.rematerialised_matmul(functools.partial(dense, n_in=n_in))(x, w)
    else:
        y = dense(x, w, n_in=n_in)
    if lp is None or name not in lp:
        return y
    a = lp[name]["a"].astype(x.dtype)
    b = lp[name]["b"].astype(x.dtype)
    if drop is not None and cfg.lora_dropout > 0:
        x = lora_dropout(x, cfg.lora_dropout, lora_dropout_key(drop[0], drop[1], name))
    return y + dense(dense(x, a, n_in=n_in) * jnp.asarray(cfg.lora_scale, x.dtype), b)


def _mlp(cfg: ModelConfig, p: dict, h: jax.Array, lp=None, drop=None) -> jax.Array:
    gate = _proj(cfg, p, lp, "gate", h, drop=drop)
    up = _proj(cfg, p, lp, "up", h, drop=drop)
    if cfg.activation == "silu":
        act = jax.nn.silu(gate)
    else:  # GeGLU with the tanh approximation (gemma's gelu_pytorch_tanh)
        act = jax.nn.gelu(gate, approximate=True)
    return _proj(cfg, p, lp, "down", act * up, drop=drop)


def _qkv(cfg: ModelConfig, p: dict, h: jax.Array, rope: tuple, lp=None, drop=None):
    """Projected, normalised and rotated q, k and v; ``rope`` = ``rope_tables(...)``."""
    q = _proj(cfg, p, lp, "q", h, drop=drop)
    k = _proj(cfg, p, lp, "k", h, drop=drop)
    v = _proj(cfg, p, lp, "v", h, drop=drop)
    if cfg.attention_bias:
        q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
    if cfg.qk_norm:
        q = _qk_norm(cfg, q, p["q_norm"])
        k = _qk_norm(cfg, k, p["k_norm"])
    return rotate(q, rope), rotate(k, rope), v


def _qk_norm(cfg: ModelConfig, x: jax.Array, scale: jax.Array) -> jax.Array:
    """RMSNorm of q or k [..., N, Dh]: over each head (scale [Dh]) or, with
    ``qk_norm_scope="projection"`` (olmoe), over all N*Dh values at once (scale [N*Dh])."""
    if cfg.qk_norm_scope == "head":
        return rms_norm(x, scale, cfg.rms_norm_eps, cfg.norm_plus_one)
    flat = x.reshape(x.shape[:-2] + (-1,))
    return rms_norm(flat, scale, cfg.rms_norm_eps, cfg.norm_plus_one).reshape(x.shape)


def block(cfg: ModelConfig, p: dict, x: jax.Array, rope: tuple, attend, lp=None,
          drop=None, moe_io: Optional[dict] = None) -> jax.Array:
    """One decoder layer on x [..., T, D] (p already ``_cast_layer``-ed): pre-norm attention
    and MLP with residual adds; with ``cfg.post_norms`` (gemma2/3) each branch's output is
    normalised again before its add. ``attend(q, k, v)`` maps the rotated [..., T, H|K, Dh]
    projections to the attention output [..., T, H, Dh] (masks and caches are its business).

    Mixture-of-experts layers read ``moe_io`` (optional): ``"token_mask"`` bool [..., T] and
    ``"replay"`` int [..., T, k] (``moe.moe_mlp``); the layer's routing statistics are
    appended to its list ``"stats"`` when there is one."""
    h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps, cfg.norm_plus_one)
    q, k, v = _qkv(cfg, p, h, rope, lp, drop)
    out = _proj(cfg, p, lp, "o", attend(q, k, v), n_in=2, drop=drop)
    if cfg.post_norms:
        out = rms_norm(out, p["post_attn_norm"], cfg.rms_norm_eps, cfg.norm_plus_one)
    x = x + out
    h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps, cfg.norm_plus_one)
    if cfg.is_moe:
        io = moe_io or {}
        out, stats = moe.moe_mlp(cfg, p, h, io.get("token_mask"), io.get("replay"))
        if "stats" in io:
            io["stats"].append(stats)
    else:
        out = _mlp(cfg, p, h, lp, drop)
    if cfg.post_norms:
        out = rms_norm(out, p["post_mlp_norm"], cfg.rms_norm_eps, cfg.norm_plus_one)
    return x + out


def local_rope(cfg: ModelConfig, positions: jax.Array, rope: tuple) -> tuple:
    """The sliding-window layers' ``rope_tables`` for ``positions``: ``rope`` itself unless
    their base differs (``cfg.rope_local_theta``)."""
    if cfg.rope_local_theta is None:
        return rope
    return rope_tables(positions, rope_inv_freq(cfg, local=True), cfg.compute_dtype)


def pick_layer_kind(is_local, local, full):
    """``local`` where the layer is a sliding-window one, else ``full`` (pytrees alike).
    ``is_local``: a Python bool (unrolled layers: nothing is computed) or a traced bool
    scalar (scanned layers: an elementwise select)."""
    if isinstance(is_local, (bool, np.bool_)):
        return local if is_local else full
    return jax.tree.map(lambda a, b: jnp.where(is_local, a, b), local, full)


def _cast_layer(cfg: ModelConfig, p: dict) -> dict:
    """Matmul weights to the compute dtype; norm scales stay as stored (used in float32)."""
    return {name: (w if "norm" in name else w.astype(cfg.compute_dtype)) for name, w in p.items()}


def embed_tokens(cfg: ModelConfig, params: dict, tokens: jax.Array) -> jax.Array:
    """int [B, T] -> [B, T, D] in the compute dtype (gemma scales by sqrt(D)).

    Ids outside ``[0, vocab_size)`` are clipped into range (deterministic, never NaN); callers
    with concrete host arrays should reject them first (``check_token_ids``).
    """
    tokens = jnp.clip(tokens, 0, cfg.vocab_size - 1)
    x = quant.take_rows(params["embed"], tokens).astype(cfg.compute_dtype)
    if cfg.scale_embeddings:
        # HF rounds the normaliser to the activation dtype first; do the same for parity.
        x = x * jnp.asarray(math.sqrt(cfg.hidden_size), cfg.compute_dtype)
    return x


def check_token_ids(cfg: ModelConfig, tokens, mask=None, what: str = "tokens") -> None:
    """Raises ValueError if a concrete token array has an id outside ``[0, vocab_size)``.

    Host-side check for concrete (numpy / committed jax) arrays before they enter a jitted
    program; positions where ``mask`` is False (padding) are ignored. Tracers are skipped:
    inside jit, ``embed_tokens`` clips instead.
    """
    for x in (tokens, mask):
        if isinstance(x, jax.core.Tracer) or not getattr(x, "is_fully_addressable", True):
            return
    ids = np.asarray(tokens)
    if mask is not None:
        ids = ids[np.asarray(mask, bool)]
    if ids.size == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= cfg.vocab_size:
        bad = hi if hi >= cfg.vocab_size else lo
        raise ValueError(f"{what}: token id {bad} is out of range for vocab_size "
                         f"{cfg.vocab_size} (ids must be in [0, {cfg.vocab_size - 1}]; "
                         f"max id {hi}, min id {lo})")


def default_positions(attention_mask: jax.Array) -> jax.Array:
    """Positions for a left-padded batch: cumsum(mask) - 1, clipped at 0. int32 [B, T]."""
    return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)


# ----------------------------------------------------------------------------- trunk / forward

def init_cache(cfg: ModelConfig, batch_size: int, max_len: int, dtype=None) -> dict:
    """Zeroed KV cache ``{"k", "v": [L, B, K, S, Dh]}`` (dtype defaults to ``cfg.dtype``).

    Heads before slots: one layer's ``[B, K, S, Dh]`` slice is what the decode-step attention
    contracts over, in the order it needs (see ``attention``, ``kv_layout="bksd"``).
    """
    shape = (cfg.num_layers, batch_size, cfg.num_kv_heads, max_len, cfg.head_dim)
    dtype = cfg.compute_dtype if dtype is None else dtype
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def unstack_layers(params: dict) -> dict:
    """``params`` with ``"layers"`` (and LoRA's ``"lora"/"layers"``) as a tuple of L per-layer
    dicts (leaves without the leading ``layers`` axis); other entries shared, not copied.

    For decode loops: inside a ``while_loop``, a layer scan over stacked weights slices each
    layer's matrices out of the stack at every step, and XLA:CPU materialises every slice (a
    copy of all layer weights per generated token). Unstacked once before the loop, the
    per-layer arrays are loop invariants the matmuls read in place (``trunk`` then unrolls
    the layers). An already unstacked tree is returned as is.
    """
    def split(tree):
        if isinstance(tree, (tuple, list)):
            return tuple(tree)
        return tuple(jax.tree.map(lambda w, i=i: w[i], tree) for i in range(_num_layers(tree)))

    out = dict(params, layers=split(params["layers"]))
    if "lora" in params:
        out["lora"] = dict(params["lora"], layers=split(params["lora"]["layers"]))
    return out


def _num_layers(stacked: dict) -> int:
    return int(jax.tree.leaves(stacked)[0].shape[0])


def unstack_cache(cache: dict) -> dict:
    """``{"k", "v": [L, B, K, S, Dh]}`` -> ``{"k", "v": tuple of L [B, K, S, Dh]}``: one buffer
    per layer, so a decode step writes each layer's new slots in place and its attention reads
    the layer's keys/values without slicing them out of the stack (a copy of the whole cache
    per step on XLA:CPU). ``trunk`` accepts either form; ``stack_cache`` inverts this."""
    return {name: tuple(c[i] for i in range(c.shape[0])) if not isinstance(c, tuple) else c
            for name, c in cache.items()}


def stack_cache(cache: dict) -> dict:
    """Inverse of ``unstack_cache`` (a stacked cache is returned as is)."""
    return {name: jnp.stack(c) if isinstance(c, tuple) else c for name, c in cache.items()}


def trunk(cfg: ModelConfig, params: dict, tokens: jax.Array, attention_mask=None,
          positions=None, cache: Optional[dict] = None, cache_index=None,
          lora_dropout_rng: Optional[jax.Array] = None, image_embeds=None,
          routes: Optional[jax.Array] = None, with_moe_stats: bool = False):
    """Embeddings + all layers + final norm.

    tokens: int [B, T]. Without a cache, ``attention_mask`` is bool [B, T] (True = real token,
    left padding expected) and ``positions`` default to ``cumsum(mask) - 1``.
    With a cache (from ``init_cache``), the new keys/values are written to slots
    ``[cache_index, cache_index + T)``; ``attention_mask`` is bool [B, S] over the whole cache
    (None = every slot below ``cache_index + T`` is valid) and ``positions`` int [B, T] must be
    given. A query in slot s attends to valid slots <= s. With a per-layer cache
    (``unstack_cache``) the layers are unrolled instead of scanned, reading per-layer weights
    when ``params`` is unstacked (``unstack_layers``): the decode loops' fast path.

    ``lora_dropout_rng``: a key for LoRA dropout (``cfg.lora_dropout`` on the adapters'
    inputs; layer ``i``, projection ``name`` use ``lora.dropout_key(lora_dropout_rng, i,
    name)``). Training passes only; None (the default) = no dropout, the deterministic model.

    ``image_embeds`` [B, K, D] (``models.vision.encode_images``, a row's images one after
    another): they replace the embeddings of the image tokens (``cfg.image_token_id``), in
    order. With ``cfg.image_token_id`` set, each image's tokens among ``tokens`` also attend to
    each other both ways (``models.image_tokens``), with or without ``image_embeds``.

    Mixture of experts: ``routes`` int [L, B, T, k] (routing replay) makes layer l send token
    (b, t) to experts ``routes[l, b, t]`` instead of its router's top k (the weights still
    come from the router); ``with_moe_stats`` adds a third output, each layer's routing
    statistics stacked over layers (``moe.moe_mlp``'s dict, leaves [L, ...]; counted over
    ``attention_mask``'s real tokens without a cache, over every new token with one).

    Returns ``(hidden [B, T, D] in cfg.dtype, cache or None)`` (+ the statistics).
    """
    if (routes is not None or with_moe_stats) and not cfg.is_moe:
        raise ValueError("trunk: routes / with_moe_stats need a mixture-of-experts model")
    b, t = tokens.shape
    if cache is None:
        if attention_mask is None:
            attention_mask = jnp.ones((b, t), bool)
        attention_mask = attention_mask.astype(bool)
        if positions is None:
            positions = default_positions(attention_mask)
        causal = jnp.tril(jnp.ones((t, t), bool))
        mask = causal[None] & attention_mask[:, None, :]  # [B, T, T]
        key_positions = positions
    else:
        if positions is None:
            raise ValueError("trunk: `positions` must be given when decoding with a cache")
        if cache_index is None:
            raise ValueError("trunk: `cache_index` must be given with a cache")
        # Per-layer caches may hold sliding-window layers in shorter rings (``kv_ring``).
        s = (max(c.shape[2] for c in cache["k"]) if isinstance(cache["k"], tuple)
             else cache["k"].shape[3])
        cache_index = jnp.asarray(cache_index, jnp.int32)
        slots = jnp.arange(s)
        q_slots = cache_index + jnp.arange(t)
        mask = slots[None, :] <= q_slots[:, None]  # [T, S]
        if attention_mask is None:
            mask = jnp.broadcast_to(mask[None], (b, t, s))
            key_positions = positions[:, :1] - cache_index + slots[None, :]
        else:
            mask = mask[None] & attention_mask.astype(bool)[:, None, :]
            # A valid slot's position is the number of valid slots before it (multi-turn
            # caches have invalid slots between a row's tokens).
            key_positions = default_positions(attention_mask)
    if cfg.image_token_id is not None:
        mask = mask | _image_mask(cfg, tokens, attention_mask, mask.shape[-1],
                                  None if cache is None else cache_index)
    positions = positions.astype(jnp.int32)
    rope = rope_tables(positions, rope_inv_freq(cfg), cfg.compute_dtype)
    kinds = cfg.local_layers   # () unless some layers attend within a sliding window
    if kinds:
        # The window is over positions, so it holds however a row's tokens sit in the cache.
        local_mask = mask & window_mask(positions, key_positions, cfg.sliding_window)
        rope_local = local_rope(cfg, positions, rope)
    x = embed_tokens(cfg, params, tokens)
    if image_embeds is not None:
        if cfg.image_token_id is None:
            raise ValueError("trunk: image_embeds given to a model without image_token_id")
        x = image_tokens.merge_images(x, tokens, image_embeds, cfg.image_token_id)

    token_mask = attention_mask if cache is None else None

    def layer(x, p, kv_cache, i, lp=None, is_local=None, replay=None):
        """-> (x, this layer's new cache or None, its MoE statistics or None)."""
        p = _cast_layer(cfg, p)
        moe_io = ({"token_mask": token_mask, "replay": replay, "stats": []}
                  if cfg.is_moe else None)
        # The layer index is scanned in, so each layer's masks come from its own key.
        drop = None if lora_dropout_rng is None or lp is None else (lora_dropout_rng, i)
        m, r = (mask, rope) if is_local is None else \
            pick_layer_kind(is_local, (local_mask, rope_local), (mask, rope))
        new_cache = []

        def attend(q, k, v):
            if kv_cache is None:
                return attention(q, k, v, m, impl=cfg.attention_impl, scale=cfg.attn_scale,
                                 softcap=cfg.attn_logit_softcapping)
            if kv_cache[0].ndim == 4 and kv_cache[0].shape[2] < s:   # a local layer's ring
                k, v, ring_mask, ck, cv = kv_ring.ring_attend(*kv_cache, k, v, m, cache_index)
                new_cache.append((ck, cv))
                return attention(q, k.astype(q.dtype), v.astype(q.dtype), ring_mask,
                                 kv_layout="bksd",
                                 scale=cfg.attn_scale, softcap=cfg.attn_logit_softcapping)
            ck, k = _write_kv(kv_cache[0], k, i, cache_index)
            cv, v = _write_kv(kv_cache[1], v, i, cache_index)
            new_cache.append((ck, cv))
            return attention(q, k.astype(q.dtype), v.astype(q.dtype), m, kv_layout="bksd",
                             scale=cfg.attn_scale, softcap=cfg.attn_logit_softcapping)

        x = block(cfg, p, x, r, attend, lp, drop, moe_io)
        return x, (new_cache[0] if new_cache else None), (moe_io["stats"][0] if moe_io else None)

    if cache is None:
        layer = layer_checkpoint(cfg, layer)

    idx = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    # LoRA adapters (``params["lora"]``, stacked per layer like the base) scan alongside, and
    # so does each layer's kind where they differ.
    lora_layers = params["lora"]["layers"] if "lora" in params else None
    scanned_kinds = jnp.asarray(kinds) if kinds else None
    if cache is None:
        def body(x, xs):
            x, _, stats = layer(x, xs[0], None, xs[1], xs[2], xs[3], xs[4])
            return x, stats

        x, stats = jax.lax.scan(body, x, (params["layers"], idx, lora_layers, scanned_kinds,
                                          routes))
    elif isinstance(cache["k"], tuple):
        # Per-layer caches: the layers unrolled, each reading its own weights and cache buffer.
        layers = unstack_layers(params)
        lora_list = layers["lora"]["layers"] if "lora" in layers else (None,) * len(idx)
        ks, vs = list(cache["k"]), list(cache["v"])
        per_layer = []
        for i, (p, lp) in enumerate(zip(layers["layers"], lora_list)):
            x, (ks[i], vs[i]), st = layer(x, p, (ks[i], vs[i]), idx[i], lp,
                                          kinds[i] if kinds else None,
                                          None if routes is None else routes[i])
            per_layer.append(st)
        cache = {"k": tuple(ks), "v": tuple(vs)}
        stats = jax.tree.map(lambda *a: jnp.stack(a), *per_layer) if cfg.is_moe else None
    else:
        # The whole cache is carried (not scanned over) so each layer updates it in place.
        def body(carry, xs):
            x, ck, cv = carry
            x, (ck, cv), st = layer(x, xs[0], (ck, cv), xs[1], xs[2], xs[3], xs[4])
            return (x, ck, cv), st

        (x, ck, cv), stats = jax.lax.scan(
            body, (x, cache["k"], cache["v"]),
            (params["layers"], idx, lora_layers, scanned_kinds, routes))
        cache = {"k": ck, "v": cv}
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps, cfg.norm_plus_one)
    if with_moe_stats:
        return x, cache, stats
    return x, cache


def _image_mask(cfg: ModelConfig, tokens, attention_mask, slots: int, cache_index):
    """bool [B, T, S]: the keys of the same image as each query (``image_tokens``); S =
    ``slots`` (T without a cache, whose slots ``cache_index + [0, T)`` the tokens fill)."""
    q = image_tokens.image_blocks(tokens, cfg.image_token_id)
    k = q if cache_index is None else image_tokens.cache_blocks(q, slots, cache_index)
    same = image_tokens.same_image(q, k)
    if attention_mask is not None:
        same = same & attention_mask.astype(bool)[:, None, :]
    return same


def layer_checkpoint(cfg: ModelConfig, layer):
    """``layer`` wrapped for a training forward: what its backward pass recomputes.

    ``cfg.remat``: only each layer's input is kept; the whole layer is recomputed.
    Else ``cfg.remat_policy``: "dots" keeps the projection/MLP matmul outputs and recomputes
    the attention scores, softmax and elementwise ops. Saving every intermediate
    ([L, B, K, G, T, S] probabilities, activations before and after each elementwise op)
    stacked over the layer scan made the backward memory-bound on CPU (zero-filled residual
    buffers, copies): the GRPO update on the benchmark shape ran ~16% faster with "dots", with
    identical results. "everything" recomputes nothing (``bench/gpu.py`` compares the two on a
    GPU). Forward-only calls (sampling, old log-probs) are the same under every choice.
    """
    if cfg.remat:
        return jax.checkpoint(layer, prevent_cse=False)
    if cfg.remat_policy == "everything":
        return layer
    return jax.checkpoint(layer, prevent_cse=False,
                          policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)


def _write_kv(cache: jax.Array, new: jax.Array, layer, cache_index) -> tuple:
    """Writes ``new`` [B, T, K, Dh] into slots ``[cache_index, cache_index + T)`` of one layer's
    cache, in place: ``cache`` is that layer's [B, K, S, Dh] buffer, or the stacked
    [L, B, K, S, Dh] cache with ``layer`` its index. Returns ``(cache, this layer's keys or
    values [B, K, S, Dh])``."""
    new = new.astype(cache.dtype).swapaxes(1, 2)   # [B, K, T, Dh]: only T slots are written
    zero = jnp.zeros((), jnp.int32)
    if cache.ndim == 4:
        cache = jax.lax.dynamic_update_slice(cache, new, (zero, zero, cache_index, zero))
        return cache, cache
    cache = jax.lax.dynamic_update_slice(cache, new[None], (layer, zero, zero, cache_index, zero))
    return cache, jax.lax.dynamic_index_in_dim(cache, layer, 0, keepdims=False)
