"""Teacher-forced forward over G completions of one prompt, with the prompt computed once.

A GRPO batch holds G completions of each prompt: rows ``g*G .. g*G+G-1`` share their prompt
columns. The plain forward (``head.token_logps`` over ``[prompt ++ completion]``) runs
every layer over the prompt G times, though the G copies compute the same numbers: the prompt
never attends to the completion. Here the prompt rows run once ([Bp, P]) and each completion
row ([Bp*G, N]) attends to its prompt's keys/values and to its own earlier tokens, in one
softmax over both (the "shared-prefix forward" of Prefix Grouper, arXiv 2506.05433). The
gradient reaching the prompt's keys and values is the sum over the G completions, as the plain
forward's would be: the same log-probs and gradients up to float32 summation order, at
``Bp*P + Bp*G*N`` positions instead of ``Bp*G*(P+N)``.

Groups of different sizes (``prompt_index`` int [R]: the prompt each completion row continues,
as knapsack allocation gives them) take the same path with each row's prompt keys and values
gathered: the prompt positions still run once, and the gather's gradient sums the rows'.

The projections and MLP run over the prompt and completion positions as one flattened row
axis (one matmul per weight); only attention treats the two parts apart.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from rljax.models import image_tokens
from rljax.models import head, transformer as tfm
from rljax.models.attention import scale_scores
from rljax.models.config import ModelConfig


def completion_positions(prompt_mask: jax.Array, mask: jax.Array, group_size: int,
                         prompt_index: Optional[jax.Array] = None) -> jax.Array:
    """int32 [Bp*G, N]: the positions ``default_positions`` gives the completion columns of
    ``[prompt ++ completion]`` rows (prompt_mask bool [Bp, P]; mask bool [Bp*G, N]; or
    ``prompt_index`` int [R]: row r continues prompt ``prompt_index[r]``)."""
    prompt_len = prompt_mask.astype(jnp.int32).sum(-1)
    prompt_len = (jnp.repeat(prompt_len, group_size) if prompt_index is None
                  else prompt_len[prompt_index])                                   # [R]
    return jnp.maximum(prompt_len[:, None] + jnp.cumsum(mask.astype(jnp.int32), -1) - 1, 0)


def shared_prompt_attention(q, k_prompt, v_prompt, k, v, prompt_mask, mask, scale=None,
                            softcap=None) -> jax.Array:
    """Completion queries over their prompt's keys and their own earlier keys, one softmax.

    q: [Bp, G, N, H, Dh]; k_prompt, v_prompt: [Bp, P, K, Dh]; k, v: [Bp, G, N, K, Dh];
    prompt_mask: bool [Bp, P] (real prompt tokens) or [Bp, G, N, P] (the prompt keys each
    query sees); mask: bool [Bp, G, N] (real completion tokens) or [Bp, G, N, N] (the
    completion keys each query sees, causality included). Returns [Bp, G, N, H, Dh]. Scores
    and softmax in float32, as ``transformer.attention`` (``scale``, ``softcap`` as there).
    """
    bp, g, n, h, dh = q.shape
    kv = k.shape[3]
    # Every contraction below is written in the order XLA:CPU's batched matmuls take their
    # operands and give their results (batch axes first, then rows, then the contracted or
    # column axis): q, k, v are moved to KV-head-major order once, the scores and
    # probabilities stay in it, and only the output goes back.
    q = q.reshape(bp, g, n, kv, h // kv, dh).transpose(0, 3, 1, 2, 4, 5)   # [Bp, K, G, N, h/K, Dh]
    k = k.transpose(0, 3, 1, 2, 4)                                          # [Bp, K, G, N, Dh]
    v = v.transpose(0, 3, 1, 2, 4)
    k_prompt = k_prompt.transpose(0, 2, 1, 3)                               # [Bp, K, P, Dh]
    v_prompt = v_prompt.transpose(0, 2, 1, 3)
    s_prompt = scale_scores(jnp.einsum("bkgthd,bksd->bkgths", q, k_prompt,
                                       preferred_element_type=jnp.float32), dh, scale, softcap)
    s_self = scale_scores(jnp.einsum("bkgthd,bkgsd->bkgths", q, k,
                                     preferred_element_type=jnp.float32), dh, scale, softcap)
    if prompt_mask.ndim == 2:
        s_prompt = jnp.where(prompt_mask[:, None, None, None, None, :], s_prompt,
                             tfm._MASK_VALUE)
    else:
        s_prompt = jnp.where(prompt_mask[:, None, :, :, None, :], s_prompt, tfm._MASK_VALUE)
    if mask.ndim == 3:
        causal = jnp.tril(jnp.ones((n, n), bool))
        self_mask = causal[None, None] & mask[:, :, None, :]              # [Bp, G, N, N]
    else:
        self_mask = mask
    s_self = jnp.where(self_mask[:, None, :, :, None, :], s_self, tfm._MASK_VALUE)
    p = k_prompt.shape[2]
    probs = jax.nn.softmax(jnp.concatenate([s_prompt, s_self], axis=-1), axis=-1)
    probs = probs.astype(v.dtype)
    out = (jnp.einsum("bkgths,bksd->bkgthd", probs[..., :p], v_prompt)
           + jnp.einsum("bkgths,bkgsd->bkgthd", probs[..., p:], v))
    out = out.transpose(0, 2, 3, 1, 4, 5)                                   # [Bp, G, N, K, h/K, Dh]
    return out.reshape(bp, g, n, h, dh)


def trunk(cfg: ModelConfig, params: dict, prompt_tokens: jax.Array, prompt_mask: jax.Array,
          tokens: jax.Array, mask: jax.Array, lora_dropout_rng: Optional[jax.Array] = None,
          image_embeds: Optional[jax.Array] = None, moe_stats: Optional[dict] = None,
          prompt_index: Optional[jax.Array] = None, routes: Optional[jax.Array] = None,
          prompt_routes: Optional[jax.Array] = None):
    """Embeddings + all layers + final norm over shared prompts and their completions.

    prompt_tokens: int [Bp, P], left-padded (prompt_mask bool [Bp, P]); tokens: int [Bp*G, N]
    completion rows, group-contiguous (rows ``g*G .. g*G+G-1`` continue prompt g), mask bool
    [Bp*G, N]. Positions are those of the concatenated rows (``default_positions``). Returns
    ``(prompt hidden [Bp, P, D], completion hidden [Bp*G, N, D])`` in ``cfg.dtype``; the
    completion rows' equal those of ``transformer.trunk`` on ``[prompt ++ completion]`` up to
    float32 summation order. ``lora_dropout_rng`` as in ``transformer.trunk`` (other masks:
    the positions are laid out differently). ``image_embeds`` [Bp, K, D]: the prompts' image
    embeddings, as ``transformer.trunk`` (the image tokens and their mask are the prompt's).

    ``moe_stats`` (a dict; mixtures of experts): receives the routing statistics under
    ``"stats"`` (``moe.moe_mlp``'s, stacked over layers), each prompt's tokens counted once.
    ``prompt_index`` int [R] (groups of any sizes, rows in any order): row r continues
    prompt ``prompt_index[r]`` instead of prompt ``r // G``.
    ``routes`` int [L, R, N, k] and ``prompt_routes`` int [L, Bp, P, k] (routing replay,
    both or neither): each completion token's and each prompt token's recorded experts.
    """
    bp, p = prompt_tokens.shape
    r, n = tokens.shape
    ragged = prompt_index is not None
    if ragged and image_embeds is not None:
        raise ValueError("shared_prompt.trunk: prompt_index does not take images")
    if (routes is None) != (prompt_routes is None) or (ragged and routes is not None):
        raise ValueError("shared_prompt.trunk: routes and prompt_routes go together, "
                         "without prompt_index")
    replay = None
    if routes is not None:   # [L, 1, Bp*P + R*N, k]: the layers' tokens in x's order
        nl, k = routes.shape[0], routes.shape[-1]
        replay = jnp.concatenate([prompt_routes.reshape(nl, bp * p, k),
                                  routes.reshape(nl, r * n, k)], axis=1)[:, None]
    if not ragged and r % bp:
        raise ValueError(f"shared_prompt.trunk: {r} completion rows are not a multiple of "
                         f"{bp} prompts")
    # The completions' attention view: [groups, G, N]; ragged rows are groups of one, each
    # reading its own prompt's keys and values (gathered per layer).
    g, groups = (1, r) if ragged else (r // bp, bp)
    rows_of = (lambda a: a[prompt_index]) if ragged else (lambda a: a)
    prompt_mask, mask = prompt_mask.astype(bool), mask.astype(bool)
    causal = jnp.tril(jnp.ones((p, p), bool))
    prompt_attn_mask = causal[None] & prompt_mask[:, None, :]               # [Bp, P, P]
    if cfg.image_token_id is not None:   # each image's tokens see each other both ways
        blocks = image_tokens.image_blocks(prompt_tokens, cfg.image_token_id)
        prompt_attn_mask = prompt_attn_mask | (image_tokens.same_image(blocks, blocks)
                                               & prompt_mask[:, None, :])
    prompt_pos = tfm.default_positions(prompt_mask)                         # [Bp, P]
    comp_pos = completion_positions(prompt_mask, mask, g, prompt_index)     # [R, N]
    positions = jnp.concatenate([prompt_pos.reshape(-1), comp_pos.reshape(-1)])[None]
    rope = tfm.rope_tables(positions, tfm.rope_inv_freq(cfg), cfg.compute_dtype)
    full = (prompt_attn_mask, rows_of(prompt_mask), mask.reshape(groups, g, n))
    kinds = cfg.local_layers
    if kinds:
        # Sliding-window layers: each query sees keys less than `sliding_window` positions back.
        w = cfg.sliding_window
        cpos = comp_pos.reshape(groups, g, n)
        # Both kinds' masks in the per-query form, so a scanned layer selects between them.
        full = (prompt_attn_mask,
                jnp.broadcast_to(full[1][:, None, None, :], (groups, g, n, p)),
                jnp.tril(jnp.ones((n, n), bool)) & full[2][:, :, None, :])
        local = (prompt_attn_mask & tfm.window_mask(prompt_pos, prompt_pos, w),
                 full[1] & tfm.window_mask(cpos, rows_of(prompt_pos)[:, None], w),
                 full[2] & tfm.window_mask(cpos, cpos, w))
        rope_local = tfm.local_rope(cfg, positions, rope)
    split = bp * p
    x_prompt = tfm.embed_tokens(cfg, params, prompt_tokens)
    if image_embeds is not None:
        x_prompt = image_tokens.merge_images(x_prompt, prompt_tokens, image_embeds,
                                             cfg.image_token_id)
    x = jnp.concatenate([x_prompt.reshape(split, -1),
                         tfm.embed_tokens(cfg, params, tokens).reshape(r * n, -1)])[None]

    def attend(q, k, v, masks):
        def parts(a):   # [1, Bp*P + R*N, heads, Dh] -> prompt [Bp, P, ...], completion [groups, G, N, ...]
            return (a[0, :split].reshape((bp, p) + a.shape[2:]),
                    a[0, split:].reshape((groups, g, n) + a.shape[2:]))
        (qp, qc), (kp, kc), (vp, vc) = parts(q), parts(k), parts(v)
        out_prompt = tfm.attention(qp, kp, vp, masks[0], impl=cfg.attention_impl,
                                   scale=cfg.attn_scale, softcap=cfg.attn_logit_softcapping)
        out = shared_prompt_attention(qc, rows_of(kp), rows_of(vp), kc, vc, masks[1], masks[2],
                                      cfg.attn_scale, cfg.attn_logit_softcapping)
        return jnp.concatenate([out_prompt.reshape((split,) + out_prompt.shape[2:]),
                                out.reshape((r * n,) + out.shape[3:])])[None]

    token_mask = jnp.concatenate([prompt_mask.reshape(-1), mask.reshape(-1)])[None]

    def layer(x, p, i, lp, is_local=None, replay=None):
        p = tfm._cast_layer(cfg, p)
        drop = None if lora_dropout_rng is None or lp is None else (lora_dropout_rng, i)
        masks, r = (full, rope) if is_local is None else \
            tfm.pick_layer_kind(is_local, (local, rope_local), (full, rope))
        moe_io = ({"token_mask": token_mask, "replay": replay, "stats": []} if cfg.is_moe
                  else None)
        x = tfm.block(cfg, p, x, r, lambda q, k, v: attend(q, k, v, masks), lp, drop, moe_io)
        return x, (moe_io["stats"][0] if moe_io else None)

    layer = tfm.layer_checkpoint(cfg, layer)   # as ``transformer.trunk``'s training forward
    lora_layers = params["lora"]["layers"] if "lora" in params else None

    def body(x, xs):
        return layer(x, *xs)

    idx = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    scanned_kinds = jnp.asarray(kinds) if kinds else None
    x, stats = jax.lax.scan(body, x, (params["layers"], idx, lora_layers, scanned_kinds,
                                      replay))
    if moe_stats is not None:
        moe_stats["stats"] = stats
    x = tfm.rms_norm(x, params["final_norm"], cfg.rms_norm_eps, cfg.norm_plus_one)[0]
    return x[:split].reshape(bp, p, -1), x[split:].reshape(r, n, -1)


def completion_logps(cfg: ModelConfig, params: dict, prompt_tokens: jax.Array,
                     prompt_mask: jax.Array, tokens: jax.Array, mask: jax.Array,
                     temperature=1.0, chunk_size: Optional[int] = None,
                     with_entropy: bool = False, lora_dropout_rng: Optional[jax.Array] = None,
                     extra_targets: Optional[jax.Array] = None,
                     image_embeds: Optional[jax.Array] = None,
                     moe_stats: Optional[dict] = None,
                     prompt_index: Optional[jax.Array] = None,
                     routes: Optional[jax.Array] = None,
                     prompt_routes: Optional[jax.Array] = None):
    """Log-probs (and entropies) of completion tokens after shared prompts.

    Shapes as ``trunk``; ``temperature`` a scalar or float32 [Bp*G, N] (each token at its own).
    Returns ``(logps float32 [Bp*G, N], entropy [Bp*G, N] or None)``, 0 where ``mask`` is
    False: column j is ``log p(tokens[:, j] | prompt, tokens[:, :j])``, as
    ``head.token_logps(..., first_scored=P)`` gives for the concatenated rows. Token 0
    is predicted by the prompt's last position (left padding: the last column is real).
    ``extra_targets`` int [Bp*G, N, K]: a third output, those ids' log-probs per column
    (``head.scored_logps``). ``image_embeds`` [Bp, K, D] and ``moe_stats``: as
    ``trunk``'s; ``prompt_index`` int [R], ``routes`` and ``prompt_routes`` as ``trunk``'s.
    """
    prompt_hidden, hidden = trunk(cfg, params, prompt_tokens, prompt_mask, tokens, mask,
                                  lora_dropout_rng, image_embeds, moe_stats, prompt_index,
                                  routes, prompt_routes)
    if prompt_index is None:
        g = tokens.shape[0] // prompt_tokens.shape[0]
        last = jnp.repeat(prompt_hidden[:, -1:], g, axis=0)                # [Bp*G, 1, D]
    else:
        last = prompt_hidden[prompt_index, -1:]                            # [R, 1, D]
    before = jnp.concatenate([last, hidden[:, :-1]], axis=1)              # predicts column j
    scored = head.scored_logps(cfg, params, before, tokens, temperature, chunk_size,
                              with_entropy, extra_targets)
    logp, ent = scored[:2]
    logp = jnp.where(mask, logp, 0.0)
    out = (logp, (jnp.where(mask, ent, 0.0) if with_entropy else None))
    return out + tuple(scored[2:])
