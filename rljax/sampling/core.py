"""On-device sampler: prefill once per prompt, fan out to G samples, decode in ``lax.while_loop``.

    out = sampling.generate(cfg, params, prompt_tokens, prompt_mask, rng=key, max_new_tokens=N,
                            temperature=1.0, top_k=0, top_p=1.0, eos_id=tok.eos_id,
                            pad_id=tok.pad_id, num_samples=G)
    # out.tokens int32[B*G, N]  (row i*G + g is sample g of prompt i)
    # out.logps float32[B*G, N], out.mask bool[B*G, N], out.lengths int32[B*G],
    # out.truncated bool[B*G]

The whole call is one jitted program (static: cfg, shapes, sampling knobs): a prefill of the
``[B, P]`` prompts into a KV cache of ``P + N`` slots, a broadcast of that cache to ``B*G`` rows,
and a ``while_loop`` that feeds one token per step and exits as soon as every row has emitted a
stop token. The cache only ever lives inside the program, so XLA updates it in place (a loop
carry is aliased to its own output): no per-token host round trip and no cache copies.
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from rljax import compilation_cache, models
from rljax import sharding as shd
from rljax import streams as streams_lib
from rljax.sampling import draw as draw_lib
from rljax.sampling.draw import noise_ahead, noise_ahead_size, sample_logits


@flax.struct.dataclass
class SampleOutput:
    """Completions, prompt-major (row ``i * G + g``). N = max_new_tokens.

    tokens: int32 [B*G, N]; after the stop token: ``pad_id``.
    logps: float32 [B*G, N]; log-prob of each sampled token under softmax(logits / temperature)
      (temperature 1 when greedy), before any top-k/top-p filtering; 0 where mask is False.
    mask: bool [B*G, N]; True for real tokens (stop token included).
    lengths: int32 [B*G]; ``mask.sum(-1)``.
    truncated: bool [B*G]; True when N tokens were generated without a stop token.
    routes: int32 [B*G, P+N, L, k] (``record_routes``, a mixture of experts; else None): the
      experts each layer sent each prompt and completion token to (the last completion token
      is never fed back: its entries, and those of padding, are 0).
    """
    tokens: jax.Array
    logps: jax.Array
    mask: jax.Array
    lengths: jax.Array
    truncated: jax.Array
    routes: Any = None


# ----------------------------------------------------------------------------- bucketing

DEFAULT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def bucket_length(n: int, buckets: Sequence[int] | None = None) -> int:
    """Smallest bucket >= n (buckets default to powers of two from 16). Raises if none fits."""
    buckets = sorted(DEFAULT_BUCKETS if buckets is None else buckets)
    for b in buckets:
        if b >= n:
            return int(b)
    raise ValueError(f"length {n} exceeds the largest bucket {buckets[-1]}")


def pad_to_bucket(tokens: Any, mask: Any = None, *, pad_id: int,
                  buckets: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Left-pads prompts to a bucketed length so the sampler compiles once per bucket.

    Args:
      tokens: either a list of token-id lists (ragged), or an int array [B, P] that is already
        left-padded with ``mask`` bool [B, P].
      mask: required with an array, ignored (must be None) with lists.
      pad_id: id written into padding slots.
      buckets: allowed lengths (default ``DEFAULT_BUCKETS``).

    Returns:
      ``(tokens int32 [B, bucket], mask bool [B, bucket])`` as numpy arrays, left-padded, where
      bucket = bucket_length(longest prompt).
    """
    if mask is None:
        rows = [list(map(int, r)) for r in tokens]
    else:
        tokens, mask = np.asarray(tokens), np.asarray(mask, bool)
        rows = [list(t[m]) for t, m in zip(tokens, mask)]
    p = bucket_length(max([len(r) for r in rows] + [1]), buckets)
    out = np.full((len(rows), p), pad_id, np.int32)
    out_mask = np.zeros((len(rows), p), bool)
    for i, r in enumerate(rows):
        if r:
            out[i, p - len(r):] = r
            out_mask[i, p - len(r):] = True
    return out, out_mask


# ----------------------------------------------------------------------------- generate

CACHE_AXES = ("layers", "batch", "kv_heads", "length", "head_dim")   # init_cache layout


def constrain_cache(cache: dict, mesh: jax.sharding.Mesh | None,
                    rules: Sequence[tuple[str, Any]]) -> dict:
    """Sharding constraints on a KV cache ``{"k", "v": ...}``, stacked (leaves [L, B, K, S, Dh],
    ``models.init_cache``) or per layer (tuples of L [B, K, S, Dh], ``models.unstack_cache``):
    batch over the data axes, K (kv heads) over tensor (``CACHE_AXES`` under ``rules``).
    The same structure back; a no-op without a mesh."""
    def one(c):
        if isinstance(c, tuple):
            return tuple(shd.constrain(x, CACHE_AXES[1:], mesh, rules) for x in c)
        return shd.constrain(c, CACHE_AXES, mesh, rules)
    return {name: one(c) for name, c in cache.items()}


def merge_stop_ids(eos_id: int | Sequence[int] | None,
                   stop_ids: int | Sequence[int] | None) -> tuple[int, ...]:
    """The stop ids of a sampler call: ``eos_id`` and ``stop_ids`` (each None, one id or
    several) as one sorted tuple of distinct ints, a static (hashable) jit argument."""
    ids = []
    for x in (eos_id, stop_ids):
        if x is None:
            continue
        ids.extend([int(x)] if np.ndim(x) == 0 else [int(i) for i in x])
    return tuple(sorted(set(ids)))


def generate(cfg: models.ModelConfig, params: Any, prompt_tokens: jax.Array,
             prompt_mask: jax.Array, *, rng: jax.Array, max_new_tokens: int,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             eos_id: int | Sequence[int] | None = None, pad_id: int = 0,
             num_samples: int = 1, stop_ids: Sequence[int] = (), min_new_tokens: int = 0,
             mesh: jax.sharding.Mesh | None = None,
             rules: Sequence[tuple[str, Any]] = shd.DEFAULT_RULES,
             cache_dtype: Any = None, temperatures: Any = None,
             streams: int = 1, image_embeds: Any = None,
             record_routes: bool = False, prompt_index: Any = None,
             row_keys: Any = None) -> SampleOutput:
    """Samples ``num_samples`` completions per prompt, entirely on device.

    Args:
      cfg: model config (static).
      params: model parameters; used as given (e.g. the trainer's own sharded arrays).
      prompt_tokens: int32 [B, P], left-padded (bucket P with ``pad_to_bucket``). Real tokens
        (``prompt_mask`` True) must be in ``[0, cfg.vocab_size)``: ValueError otherwise (checked
        on the host when the arrays are concrete; inside a jit, out-of-range ids are clipped).
      prompt_mask: bool [B, P], True for real prompt tokens.
      rng: PRNG key; the same key gives the same output.
      max_new_tokens: N, the completion length.
      temperature: softmax temperature; 0 = greedy.
      top_k, top_p: filtering for sampling (0 / 1.0 = off); ignored when greedy.
      eos_id: stop token id, or several; None = no stop token (always N tokens).
      pad_id: written after the stop token.
      num_samples: G completions per prompt; the prompt is prefilled once and its KV cache
        broadcast to its G rows. Output row ``i * G + g``.
      stop_ids: extra stop ids (same role as eos_id).
      min_new_tokens: stop ids cannot be among the first ``min_new_tokens`` tokens (as HF's
        ``min_new_tokens``); logps are still reported under the unfiltered distribution.
      mesh: when given, the batch is constrained over the data/fsdp axes and the KV cache's heads
        over tensor (``rules``); params keep whatever sharding they already have.
      rules: logical-axis rules for those constraints.
      cache_dtype: KV cache dtype (default the model's compute dtype).
      temperatures: optional float32 [N] per-position temperatures (``temperature_schedule``),
        all > 0; completion token t is sampled, and its logp reported, at ``temperatures[t]``
        (``temperature`` is then unused). A traced argument: new values do not recompile.
        Or float32 [R, N], one schedule per output row (row r's token t at [r, t]).
      streams: decode the prompts in this many equal chunks, concurrent programs dispatched
        from threads (``rljax.streams``); 0 = auto (2 on a multi-core CPU, else 1). Each chunk
        reads its rows of the noise drawn for the whole batch, so the tokens are one stream's
        (logps to float32 rounding: a smaller batch's matmuls). ``stream_count``: how many run.
      image_embeds: optional [B, K, D] image embeddings (``models.vision.encode_images``) for
        the image tokens of each prompt (``models.trunk``); they are prefilled once per prompt
        with the rest of it, and the G samples share that KV cache.
      record_routes: a mixture of experts: also return each token's experts
        (``SampleOutput.routes``), for routing replay in the update.
      prompt_index: optional int32 [R]: groups of any sizes (knapsack allocation): output row
        r continues prompt ``prompt_index[r]``, whose prefill it shares (``num_samples`` must
        be 1; not with routes; ``image_embeds`` stay the B prompts').
      row_keys: optional PRNG keys, one per output row ([B * num_samples], or [R] with
        ``prompt_index``): row r draws token t from ``draw.row_draw(row_keys[r], t, vocab)``
        (``draw.row_noise_ahead``) instead of the batch's draw from ``rng``, so its tokens do
        not depend on the other rows (to float32 rounding of the batch's matmuls).

    Returns:
      ``SampleOutput`` with ``B * num_samples`` rows, or R with ``prompt_index`` (see its
      docstring).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if record_routes and not cfg.is_moe:
        raise ValueError("record_routes needs a mixture-of-experts model")
    if prompt_index is not None:
        prompt_index = np.asarray(prompt_index, np.int32)
        if (num_samples != 1 or record_routes
                or prompt_index.ndim != 1 or prompt_index.min(initial=0) < 0
                or prompt_index.max(initial=0) >= np.shape(prompt_tokens)[0]):
            raise ValueError("prompt_index must be int [R] of prompt rows, with num_samples=1 "
                             "and no routes")
    # Out-of-range ids would be clipped silently inside the program: reject them here.
    models.transformer.check_token_ids(cfg, prompt_tokens, prompt_mask,
                                       what="generate: prompt_tokens")
    if temperatures is not None:
        rows = (np.shape(prompt_tokens)[0] * num_samples if prompt_index is None
                else prompt_index.size)
        temperatures = draw_lib.check_temperatures(temperatures, max_new_tokens, rows)
    static = dict(
        max_new_tokens=int(max_new_tokens), temperature=float(temperature), top_k=int(top_k),
        top_p=float(top_p), stop_ids=merge_stop_ids(eos_id, stop_ids), pad_id=int(pad_id),
        num_samples=int(num_samples), min_new_tokens=int(min_new_tokens), mesh=mesh,
        rules=tuple((k, v if isinstance(v, (str, type(None))) else tuple(v)) for k, v in rules),
        cache_dtype=None if cache_dtype is None else jnp.dtype(cache_dtype).name,
        record_routes=bool(record_routes))
    greedy = temperatures is None and temperature == 0.0
    noise = None
    if row_keys is not None:
        rows = (np.shape(prompt_tokens)[0] * num_samples if prompt_index is None
                else prompt_index.size)
        if np.shape(row_keys)[0] != rows:
            raise ValueError(f"row_keys must hold one key per output row ({rows})")
        if not greedy:
            noise = _row_noise(jnp.asarray(row_keys), int(max_new_tokens), cfg.vocab_size)
    # With prompt_index the streams split the rows (each prefills every prompt: a few).
    units = np.shape(prompt_tokens)[0] if prompt_index is None else prompt_index.size
    k = stream_count(streams, units, max_new_tokens, cfg.vocab_size, greedy, num_samples, mesh)
    traced = isinstance(prompt_tokens, jax.core.Tracer)
    if k == 1 or traced:   # inside a trace: one program
        return (_generate if traced else _generate_program())(
            cfg, params, jnp.asarray(prompt_tokens, jnp.int32), jnp.asarray(prompt_mask, bool),
            rng, temperatures=temperatures, image_embeds=image_embeds, noise=noise,
            prompt_index=None if prompt_index is None else jnp.asarray(prompt_index), **static)
    return _generate_streams(cfg, params, np.asarray(prompt_tokens, np.int32),
                             np.asarray(prompt_mask, bool), rng, k, greedy,
                             temperatures=temperatures, image_embeds=image_embeds,
                             prompt_index=prompt_index, row_noise=noise, **static)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _row_noise(keys, n, vocab):
    return draw_lib.row_noise_ahead(keys, n, vocab)


def stream_count(streams: int, prompts: int, max_new_tokens: int, vocab: int, greedy: bool,
                 num_samples: int = 1, mesh: jax.sharding.Mesh | None = None) -> int:
    """Decode streams that run for a ``streams`` setting (``rljax.streams.resolve``: 0 = auto):
    the largest count up to it that splits the prompts into equal chunks (one compiled
    program for all); 1 where the whole batch's noise is too large to draw ahead
    (``draw.NOISE_AHEAD_MAX_ELEMENTS``): the per-step draws depend on the batch's shape, so
    chunks would not sample what one stream samples."""
    k = streams_lib.resolve(streams, mesh)
    rows = prompts * num_samples
    if k == 1 or (not greedy and
                  noise_ahead_size(max_new_tokens, rows, vocab) >
                  draw_lib.NOISE_AHEAD_MAX_ELEMENTS):
        return 1
    return streams_lib.largest_divisor(min(k, prompts), prompts)


def _stream_noise(rng, n, rows, vocab, k):
    """The whole batch's noise (``draw.noise_ahead``) in k row chunks: [n, rows / k, W] each."""
    return _stream_noise_fn()(rng, n, rows, vocab, k)


@functools.cache
def _stream_noise_fn():
    def stream_noise(rng, n, rows, vocab, k):
        return tuple(jnp.split(noise_ahead(rng, n, rows, vocab, greedy=False), k, axis=1))
    return jax.jit(stream_noise, static_argnums=(1, 2, 3, 4),
                   compiler_options=compilation_cache.elementwise_compiler_options())


@jax.jit
def _concat_outputs(outs):
    return jax.tree.map(lambda *xs: jnp.concatenate(xs), *outs)


def _generate_streams(cfg, params, prompt_tokens, prompt_mask, rng, k, greedy,
                      image_embeds=None, prompt_index=None, row_noise=None, **kw):
    """``_generate`` over k equal chunks of prompts (or of ``prompt_index``'s rows, each
    chunk with every prompt), run concurrently; one SampleOutput. ``row_noise``: the rows'
    own noise (``row_keys``), split with the rows."""
    rows = (prompt_tokens.shape[0] * kw["num_samples"] if prompt_index is None
            else prompt_index.size)
    temps = kw.pop("temperatures")   # one schedule for all, or each chunk's rows' own
    temps = ((temps,) * k if temps is None or temps.ndim == 1 else
             tuple(jnp.split(temps, k)))
    if row_noise is not None:
        noise = tuple(jnp.split(row_noise, k, axis=1))
    else:
        noise = ((None,) * k if greedy else
                 _stream_noise(rng, kw["max_new_tokens"], rows, cfg.vocab_size, k))
    if prompt_index is None:
        tok, mask = np.split(prompt_tokens, k), np.split(prompt_mask, k)
        index = (None,) * k
    else:
        tok, mask = (prompt_tokens,) * k, (prompt_mask,) * k
        index = [jnp.asarray(i) for i in np.split(prompt_index, k)]
    # (image_embeds are the prompts': with prompt_index every chunk prefills every prompt)
    images = ((image_embeds,) * k if image_embeds is None or prompt_index is not None
              else jnp.split(image_embeds, k))

    def stream(i):
        return lambda: jax.block_until_ready(
            _generate_program()(cfg, params, tok[i], mask[i], rng, noise=noise[i],
                                temperatures=temps[i], image_embeds=images[i],
                                prompt_index=index[i], **kw))

    return _concat_outputs(streams_lib.run([stream(i) for i in range(k)]))


def _generate_program():
    """``_generate``, or its twin jitted with ``compilation_cache.sampler_compiler_options()``
    when those are not the defaults (a nested call inside another trace takes ``_generate``:
    JAX refuses compiler options on an inner jit)."""
    options = compilation_cache.sampler_compiler_options()
    return _generate if options is None else _generate_with(tuple(sorted(options.items())))


@functools.cache
def _generate_with(options: tuple):
    return jax.jit(_generate.__wrapped__, static_argnames=_STATIC, compiler_options=dict(options))


_STATIC = ("cfg", "max_new_tokens", "temperature", "top_k", "top_p", "stop_ids", "pad_id",
           "num_samples", "min_new_tokens", "mesh", "rules", "cache_dtype", "record_routes")


@functools.partial(jax.jit, static_argnames=_STATIC)
@shd.traced_on_mesh_kwarg   # the MoE dispatch splits the experts' work over the mesh
def _generate(cfg, params, prompt_tokens, prompt_mask, rng, *, max_new_tokens, temperature,
              top_k, top_p, stop_ids, pad_id, num_samples, min_new_tokens, mesh, rules,
              cache_dtype, record_routes=False, temperatures=None, noise=None,
              image_embeds=None, prompt_index=None):
    """``noise``: this call's rows of noise drawn ahead for a larger batch (streams); None =
    drawn here. ``image_embeds``: [B, K, D] for the prompts' image tokens (``generate``).
    ``prompt_index`` int32 [R]: row r continues prompt ``prompt_index[r]`` (``generate``)."""
    b, p = prompt_tokens.shape
    n, g = max_new_tokens, num_samples
    bg = b * g if prompt_index is None else prompt_index.shape[0]
    s = p + n  # cache slots: the prompt bucket plus the completion, nothing more
    batch = lambda x: shd.constrain(x, ("batch",) + (None,) * (x.ndim - 1), mesh, rules)
    constrain_kv = functools.partial(constrain_cache, mesh=mesh, rules=rules)
    stop = jnp.asarray(stop_ids, jnp.int32) if stop_ids else None

    def is_stop(tok):
        if stop is None:
            return jnp.zeros(tok.shape, bool)
        return jnp.any(tok[:, None] == stop[None, :], axis=-1)

    if noise is None:
        noise = noise_ahead(rng, n, bg, cfg.vocab_size,
                            greedy=temperatures is None and temperature == 0.0)

    def pick(logits, t):
        # Stop ids are forbidden until min_new_tokens tokens exist; logps stay unfiltered.
        # A schedule gives token t its own temperature (a traced scalar, always > 0).
        temp = (temperature if temperatures is None
                else draw_lib.row_temperature(temperatures, t))
        draw = dict(temperature=temp, top_k=top_k, top_p=top_p,
                    noise=None if noise is None else noise[t])
        key = jax.random.fold_in(rng, t)   # unused (and not computed) when noise is given
        if stop is None or min_new_tokens == 0:
            return sample_logits(key, logits, **draw)
        forbid = jnp.zeros(logits.shape[-1], bool).at[stop].set(True) & (t < min_new_tokens)
        masked = jnp.where(forbid[None, :], jnp.finfo(jnp.float32).min, logits)
        tok, _ = sample_logits(key, masked, **draw)
        logp_all = jax.nn.log_softmax(logits / (temp if temperatures is not None
                                                else models.scoring_temperature(temperature)),
                                      axis=-1)
        return tok, jnp.take_along_axis(logp_all, tok[:, None], axis=-1)[:, 0]

    # ---- prefill: B prompts, once.
    prompt_tokens, prompt_mask = batch(prompt_tokens), batch(prompt_mask)
    prompt_len = jnp.sum(prompt_mask, axis=-1, dtype=jnp.int32)  # [B]
    slot_mask = jnp.concatenate([prompt_mask, jnp.zeros((b, n), bool)], axis=1)  # [B, S]
    # Sliding-window layers keep only their window (``models.kv_ring``) when the cache outgrows
    # it; the prefill then runs layer by layer over those per-layer buffers.
    cache = constrain_kv(models.init_layer_cache(cfg, b, s, dtype=cache_dtype)
                         if models.kv_ring.ring_size(cfg, s) else
                         models.init_cache(cfg, b, s, dtype=cache_dtype))
    out = models.trunk(cfg, params, prompt_tokens, attention_mask=slot_mask,
                       positions=models.default_positions(prompt_mask),
                       cache=cache, cache_index=0, image_embeds=image_embeds,
                       with_moe_stats=record_routes)
    hidden, cache = out[:2]
    # Left padding: every prompt's last token sits in slot P-1.
    logits = models.logits_from_hidden(cfg, params, hidden[:, -1])  # [B, V]

    # ---- fan out to G rows per prompt (prompt-major), sharing the prefill. The decode loop
    # reads per-layer weights and cache buffers (see models.unstack_layers / unstack_cache):
    # sliced out of the stacks once here, not at every step.
    if prompt_index is not None:   # groups of any sizes: each row gathers its prompt's
        fan = lambda x, axis=0: jnp.take(x, prompt_index, axis=axis)   # noqa: E731
    else:
        fan = lambda x, axis=0: jnp.repeat(x, g, axis=axis) if g > 1 else x   # noqa: E731
    cache = constrain_kv({k: tuple(fan(c) for c in v)
                             for k, v in models.unstack_cache(cache).items()})
    params = models.unstack_layers(params)
    logits, prompt_mask, prompt_len = batch(fan(logits)), batch(fan(prompt_mask)), fan(prompt_len)
    # Routes [L, B*G, P+N, k]: the prompt's from the prefill, the completion's written as each
    # token is fed.
    routes = (jnp.concatenate([fan(out[2]["ids"], 1), jnp.zeros(
        (cfg.num_layers, bg, n, cfg.num_experts_per_tok), jnp.int32)], axis=2)
        if record_routes else jnp.zeros((), jnp.int32))

    tok, logp = pick(logits, 0)
    tokens = jnp.full((bg, n), pad_id, jnp.int32).at[:, 0].set(tok)
    logps = jnp.zeros((bg, n), jnp.float32).at[:, 0].set(logp)
    done = is_stop(tok)
    lengths = jnp.ones((bg,), jnp.int32)
    new_slots = jnp.arange(n)

    def cond(state):
        t, _, _, _, done, _, _, _ = state
        return (t < n) & ~jnp.all(done)

    def body(state):
        # Feed token t-1 (slot P+t-1), sample token t.
        t, cache, prev, lengths, done, tokens, logps, routes = state
        attn = jnp.concatenate([prompt_mask, jnp.broadcast_to(new_slots < t, (bg, n))], axis=1)
        out = models.trunk(cfg, params, prev[:, None], attention_mask=attn,
                           positions=(prompt_len + t - 1)[:, None], cache=cache,
                           cache_index=p + t - 1, with_moe_stats=record_routes)
        hidden, cache = out[:2]
        if record_routes:   # token t-1's experts, [L, B*G, 1, k], into slot P+t-1
            ids = jnp.where(done[None, :, None, None], 0, out[2]["ids"])
            routes = jax.lax.dynamic_update_slice_in_dim(routes, ids, p + t - 1, axis=2)
        cache = constrain_kv(cache)
        logits = models.logits_from_hidden(cfg, params, hidden[:, 0])
        tok, logp = pick(logits, t)
        tok = jnp.where(done, pad_id, tok)
        logp = jnp.where(done, 0.0, logp)
        lengths = lengths + (~done).astype(jnp.int32)
        tokens = jax.lax.dynamic_update_index_in_dim(tokens, tok, t, axis=1)
        logps = jax.lax.dynamic_update_index_in_dim(logps, logp, t, axis=1)
        done = done | is_stop(tok)
        return t + 1, cache, tok, lengths, done, tokens, logps, routes

    state = (jnp.int32(1), cache, tok, lengths, done, batch(tokens), batch(logps), routes)
    _, _, _, lengths, done, tokens, logps, routes = jax.lax.while_loop(cond, body, state)
    mask = new_slots[None, :] < lengths[:, None]
    return SampleOutput(tokens=tokens, logps=logps, mask=mask, lengths=lengths, truncated=~done,
                        routes=(batch(jnp.transpose(routes, (1, 2, 0, 3))) if record_routes
                                else None))
