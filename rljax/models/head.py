"""The language-model head: logits from the trunk's hidden states, and per-token log-probs
scored through the head in chunks, so no float32 [B, T, V] logits are ever held.

``forward`` and ``token_logps`` run ``transformer.trunk`` and then this head; a caller that
already has hidden states (the shared-prompt scorer, the paged sampler) calls
``logits_from_hidden`` or ``scored_logps`` directly.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from rljax.models import quant
from rljax.models.config import ModelConfig
from rljax.models.transformer import trunk


def logits_from_hidden(cfg: ModelConfig, params: dict, hidden: jax.Array) -> jax.Array:
    """[..., D] -> float32 [..., V] (tied models reuse the embedding matrix; gemma2
    soft-caps them: ``c * tanh(logits / c)``)."""
    tied = cfg.tie_word_embeddings
    w = params["embed"] if tied else params["lm_head"]
    lead = hidden.shape[:-1]
    h = hidden.reshape(-1, hidden.shape[-1])

    def head(h, w):
        w = w.astype(h.dtype)
        if h.dtype == jnp.float32:
            return jax.lax.dot_general(h, w, _head_dims(tied), preferred_element_type=jnp.float32)
        return _low_precision_head(h, w, tied)

    # A quantized head is dequantized inside the (rematerialised) matmul (``models.quant``).
    logits = quant.rematerialised_matmul(head)(h, w) if quant.is_quantized(w) else head(h, w)
    if cfg.final_logit_softcapping is not None:
        c = cfg.final_logit_softcapping
        logits = jnp.tanh(logits / c) * c
    return logits.reshape(lead + (logits.shape[-1],))


def _head_dims(tied: bool):
    """dot_general dimensions of h [N, D] against the head: [V, D] when tied, else [D, V]."""
    return (((1,), (1,)), ((), ())) if tied else (((1,), (0,)), ((), ()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _low_precision_head(h: jax.Array, w: jax.Array, tied: bool) -> jax.Array:
    """float32 logits of bf16/fp16 ``h`` [N, D] and head ``w``, whose backward runs its two
    matmuls in the compute dtype. Left to autodiff, the float32 cotangent of the logits
    promotes both backward matmuls to float32 (TF32 GEMMs on a GPU): 13% of the GRPO update
    of a 0.5B model (vocab 151,936) on an H200 (``bench/gpu_profile.py``). The cotangent is
    rounded to the compute dtype instead, as a bf16 head's own output gradient would be."""
    return jax.lax.dot_general(h, w, _head_dims(tied), preferred_element_type=jnp.float32)


def _low_precision_head_fwd(h, w, tied):
    return _low_precision_head(h, w, tied), (h, w)


def _low_precision_head_bwd(tied, res, g):
    h, w = res
    g = g.astype(h.dtype)
    f32 = jnp.float32
    if tied:   # logits = h @ w.T with w [V, D]
        dh = jax.lax.dot_general(g, w, (((1,), (0,)), ((), ())), preferred_element_type=f32)
        dw = jax.lax.dot_general(g, h, (((0,), (0,)), ((), ())), preferred_element_type=f32)
    else:      # logits = h @ w with w [D, V]
        dh = jax.lax.dot_general(g, w, (((1,), (1,)), ((), ())), preferred_element_type=f32)
        dw = jax.lax.dot_general(h, g, (((0,), (0,)), ((), ())), preferred_element_type=f32)
    return dh.astype(h.dtype), dw.astype(w.dtype)


_low_precision_head.defvjp(_low_precision_head_fwd, _low_precision_head_bwd)


def forward(cfg: ModelConfig, params: dict, tokens: jax.Array, attention_mask=None,
            positions=None, lora_dropout_rng: Optional[jax.Array] = None,
            image_embeds=None) -> jax.Array:
    """tokens int [B, T] -> float32 logits [B, T, V]. See ``trunk`` for the mask semantics,
    ``lora_dropout_rng`` (None = no LoRA dropout) and ``image_embeds``."""
    hidden, _ = trunk(cfg, params, tokens, attention_mask=attention_mask, positions=positions,
                      lora_dropout_rng=lora_dropout_rng, image_embeds=image_embeds)
    return logits_from_hidden(cfg, params, hidden)


# ----------------------------------------------------------------------------- log-probs

# One LM-head chunk's float32 logits hold about this many elements at most: 256 MiB on CPU,
# 1 GiB on accelerators (None), where fewer, larger head matmuls paid: the GRPO update of a
# 0.5B model (vocab 151,936) on an H200 took 294 ms instead of 330 (bench/gpu.py).
LOGITS_CHUNK_ELEMENTS = {"cpu": 1 << 26, None: 1 << 28}


def _auto_chunk(batch: int, length: int, vocab: int) -> int:
    budget = LOGITS_CHUNK_ELEMENTS.get(jax.default_backend(), LOGITS_CHUNK_ELEMENTS[None])
    return int(max(1, min(length, budget // max(1, batch * vocab))))


def scoring_temperature(temperature: float) -> float:
    """The temperature log-probs are scored at for a rollout sampled at ``temperature``: itself,
    except greedy decoding (0), whose log-probs are reported at temperature 1 (a softmax at 0
    is not a distribution). The sampler, the old/reference log-probs and every loss use this,
    so the first update's ratio is 1."""
    return float(temperature) or 1.0


def token_logps(cfg: ModelConfig, params: dict, tokens: jax.Array, attention_mask=None,
                positions=None, temperature=1.0, chunk_size: Optional[int] = None,
                with_entropy: bool = False, lora_dropout_rng: Optional[jax.Array] = None,
                first_scored: int = 1, extra_targets: Optional[jax.Array] = None,
                image_embeds=None, routes: Optional[jax.Array] = None,
                moe_stats: Optional[dict] = None):
    """Per-token log-probabilities of ``tokens`` under the model (teacher forcing).

    Returns ``(logps float32 [B, T], entropy float32 [B, T] or None)`` with
    ``logps[:, t] = log p(tokens[:, t] | tokens[:, :t])`` under ``softmax(logits / temperature)``
    and ``entropy[:, t]`` the entropy of that same distribution; column 0 is 0, and so are
    positions whose token is padding (``attention_mask`` False). ``temperature`` is a scalar or
    a float32 [B, T] array giving each position its own (``temperature[:, t]`` for token t;
    column 0 unused): tokens sampled with a per-position schedule are scored at theirs.

    The LM head runs in chunks of ``chunk_size`` positions (``scored_logps``): no float32
    [B, T, V] logits are held. ``lora_dropout_rng``: LoRA dropout key of a training pass (see ``trunk``; None = none).

    ``first_scored`` (static int): columns below it are not scored -- their logps (and
    entropies) are 0 and the LM head never runs for them. Every loss over a completion masks
    the prompt, so passing the prompt length skips the [*, D] x [D, V] head and its log-softmax
    over the prompt positions (at vocab 49k the head is ~20% of the forward FLOPs per position,
    and the backward recomputes it). Scored columns are computed exactly as with the default 1.

    ``extra_targets`` int [B, T - first_scored, K] (optional; ``first_scored`` >= 1): K more
    ids per scored column, whose log-probs come back as a third output f32 [B, T -
    first_scored, K] (see ``scored_logps``). ``image_embeds``: as ``trunk``.

    Mixtures of experts: ``routes`` int [L, B, T, k] replays recorded routes (``trunk``);
    ``moe_stats``, a dict, receives the routing statistics under ``"stats"`` (``trunk``'s
    ``with_moe_stats``; for ``moe.load_balance``).
    """
    b, t = tokens.shape
    out = trunk(cfg, params, tokens, attention_mask=attention_mask, positions=positions,
                lora_dropout_rng=lora_dropout_rng, image_embeds=image_embeds, routes=routes,
                with_moe_stats=moe_stats is not None)
    hidden = out[0]
    if moe_stats is not None:
        moe_stats["stats"] = out[2]
    start = min(max(int(first_scored), 1), t)   # column 0 has no prediction
    n = t - start
    if n == 0:
        zeros = jnp.zeros((b, t), jnp.float32)
        return zeros, (zeros if with_entropy else None)
    # hidden[:, s - 1] predicts tokens[:, s]: scored columns [start, t).
    temperature = jnp.asarray(temperature, jnp.float32)
    if temperature.ndim == 2:
        temperature = temperature[:, start:]
    scored = scored_logps(cfg, params, hidden[:, start - 1:-1], tokens[:, start:],
                          temperature, chunk_size, with_entropy, extra_targets)
    logp, ent = scored[:2]
    first = jnp.zeros((b, start), jnp.float32)
    logp = jnp.concatenate([first, logp], axis=1)
    ent = jnp.concatenate([first, ent], axis=1)
    if attention_mask is not None:
        valid = attention_mask.astype(bool)
        logp = jnp.where(valid, logp, 0.0)
        ent = jnp.where(valid, ent, 0.0)
    if extra_targets is not None:
        return logp, (ent if with_entropy else None), scored[2]
    return logp, (ent if with_entropy else None)


def scored_logps(cfg: ModelConfig, params: dict, hidden: jax.Array, targets: jax.Array,
                 temperature=1.0, chunk_size: Optional[int] = None, with_entropy: bool = False,
                 extra_targets: Optional[jax.Array] = None):
    """The LM head and log-softmax over given positions, chunked.

    hidden: [B, n, D], each row's hidden state *before* its target; targets: int [B, n];
    temperature: scalar or float32 [B, n]. Returns ``(logps float32 [B, n], entropy float32
    [B, n])`` (entropy zeros unless ``with_entropy``). The head runs over chunks of
    ``chunk_size`` positions inside a rematerialised ``lax.map``, so neither the forward nor
    the backward pass holds float32 [B, n, V] logits.

    ``extra_targets`` int [B, n, K] (optional): K more token ids per position whose log-probs
    the same head pass also returns, as a third output f32 [B, n, K] (a distillation teacher's
    top-k, ``rljax.algorithms.distill``).
    """
    b, n = targets.shape
    c = min(chunk_size or _auto_chunk(b, n, cfg.vocab_size), n)
    num_chunks = -(-n // c)
    pad = num_chunks * c - n
    h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    # [num_chunks, B, C, ...] so lax.map walks over chunks.
    h = h.reshape(b, num_chunks, c, -1).swapaxes(0, 1)
    targets = targets.reshape(b, num_chunks, c).swapaxes(0, 1)
    inv_temp = 1.0 / jnp.asarray(temperature, jnp.float32)
    if inv_temp.ndim == 2:  # per position: chunked like the targets, [num_chunks, B, C, 1]
        inv_temp = jnp.pad(inv_temp, ((0, 0), (0, pad)), constant_values=1.0)
        inv_temp = inv_temp.reshape(b, num_chunks, c).swapaxes(0, 1)[..., None]
    else:  # one scalar for every chunk
        inv_temp = jnp.broadcast_to(inv_temp, (num_chunks,))
    args = (h, targets, inv_temp)
    if extra_targets is not None:
        k = extra_targets.shape[-1]
        extra = jnp.pad(extra_targets, ((0, 0), (0, pad), (0, 0)))
        args += (extra.reshape(b, num_chunks, c, k).swapaxes(0, 1),)

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def chunk(args):
        h_c, tgt, inv_t = args[:3]
        logits = logits_from_hidden(cfg, params, h_c) * inv_t  # f32 [B, C, V]
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, tgt[..., None], axis=-1)[..., 0]
        logp = picked - lse
        if not with_entropy:
            ent = jnp.zeros_like(logp)
        else:
            probs = jnp.exp(logits - lse[..., None])
            ent = lse - jnp.sum(probs * logits, axis=-1)
        if len(args) == 3:
            return logp, ent
        return logp, ent, jnp.take_along_axis(logits, args[3], axis=-1) - lse[..., None]

    outs = jax.lax.map(chunk, args)
    out = (outs[0].swapaxes(0, 1).reshape(b, -1)[:, :n],
           outs[1].swapaxes(0, 1).reshape(b, -1)[:, :n])
    if extra_targets is not None:
        out += (outs[2].swapaxes(0, 1).reshape(b, -1, extra_targets.shape[-1])[:, :n],)
    return out
