"""One token per row from logits: temperature, top-k / top-p filtering and the random draw.

    tokens, logps = draw.sample_logits(rng, logits, temperature=1.0, top_k=0, top_p=1.0)
    # logits float32[B, V] -> tokens int32[B], logps float32[B] (unfiltered log-softmax)
    noise = draw.noise_ahead(rng, N, B, V, greedy=False)   # float32[N, B, W]: every step's draw

Shared by every sampler (``rljax.sampling.core``, ``.tree``, ``.multiturn``). The module
constants are read when a sampler traces: tests and benchmarks patch them here.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


# ----------------------------------------------------------------------------- token sampling

def sample_logits(rng: jax.Array, logits: jax.Array, *, temperature: float = 1.0,
                  top_k: int = 0, top_p: float = 1.0,
                  noise: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row.

    Args:
      rng: PRNG key (unused when ``noise`` is given).
      logits: float32 [B, V] (already masked where tokens are forbidden).
      temperature: 0 means greedy (argmax); otherwise logits are divided by it. May be a
        traced float32 scalar (a per-position schedule), which must then be > 0.
      top_k: keep the k largest logits (0 = off).
      top_p: keep the smallest set of tokens whose probability mass reaches top_p (1 = off).
      noise: ``draw_noise(rng, B, V)`` computed ahead (same tokens as passing ``rng``).

    Returns:
      ``(tokens int32 [B], logps float32 [B])``; logps are log softmax(logits / temperature) at
      the chosen token (temperature 1 when greedy), i.e. *without* top-k/top-p renormalisation,
      the quantity a trainer recomputes from the model.
    """
    logits = logits.astype(jnp.float32)
    if not isinstance(temperature, jax.Array) and temperature == 0.0:
        tokens = first_argmax(logits)
        logp_all = jax.nn.log_softmax(logits, axis=-1)
    else:
        scaled = logits / temperature
        logp_all = jax.nn.log_softmax(scaled, axis=-1)
        filtered = scaled
        neg = jnp.finfo(jnp.float32).min
        if 0 < top_k < logits.shape[-1]:
            filtered = jnp.where(scaled < _top_k_threshold(scaled, top_k), neg, filtered)
        if top_p < 1.0:
            filtered = jnp.where(filtered < _top_p_threshold(filtered, top_p, top_k), neg,
                                 filtered)
        if noise is None:
            noise = draw_noise(rng, *logits.shape)
        if logits.shape[-1] >= INVERSE_CDF_MIN_VOCAB:
            tokens = categorical_inverse_cdf(None, filtered, uniform=noise)
        else:   # small vocabularies: the Gumbel draw is cheap (and older seeds unchanged)
            # jax.random.categorical(rng, filtered) is exactly this argmax.
            tokens = first_argmax(noise + filtered)
    logps = jnp.take_along_axis(logp_all, tokens[:, None], axis=-1)[:, 0]
    return tokens, logps


def first_argmax(x: jax.Array) -> jax.Array:
    """int32 [B]: ``jnp.argmax(x, axis=-1)`` for float x [B, V] without NaNs (the first index of
    each row's maximum), as a max and a min over indices: XLA:CPU runs argmax's paired
    (value, index) reduction element by element, ~3/4 of a millisecond per [64, 259] draw,
    a fifth of a decode step at the toy model."""
    best = jnp.max(x, axis=-1, keepdims=True)
    index = jnp.arange(x.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(x == best, index, x.shape[-1] - 1), axis=-1)


# Vocabularies from this size on draw by inverse CDF instead of the Gumbel-max trick.
INVERSE_CDF_MIN_VOCAB = 8192
INVERSE_CDF_BLOCK = 256
# generate draws all steps' noise before its decode loop up to this many float32s (64 MiB).
NOISE_AHEAD_MAX_ELEMENTS = 1 << 24


def draw_noise(rng: jax.Array, batch: int, vocab: int) -> jax.Array:
    """The randomness of one ``sample_logits`` draw over [batch, vocab] logits, exactly what it
    draws from ``rng`` itself: float32 [batch, 1] uniforms in [0, 1) where the vocabulary uses
    the inverse-CDF draw, else float32 [batch, vocab] Gumbel noise (``jax.random.categorical``'s).
    Independent of the logits, so a decode loop draws every step's noise in one batched call
    before the loop (``noise_ahead``) instead of a small threefry loop per token."""
    if vocab >= INVERSE_CDF_MIN_VOCAB:
        return jax.random.uniform(rng, (batch, 1), jnp.float32)
    return jax.random.gumbel(rng, (batch, vocab), jnp.float32)


def row_draw(key: jax.Array, row: jax.Array, vocab: int) -> jax.Array:
    """Row ``row``'s own draw, float32 [W] (W = 1 or vocab): ``draw_noise(fold_in(key, row), 1,
    vocab)[0]``. Multi-turn sampling draws each row from its own key, so a row's tokens do not
    depend on which other rows share its batch (the static turn batch or the episode engine's
    slots)."""
    return draw_noise(jax.random.fold_in(key, row), 1, vocab)[0]


def categorical_inverse_cdf(rng: jax.Array | None, logits: jax.Array,
                            block: int | None = None,
                            uniform: jax.Array | None = None) -> jax.Array:
    """int32 [B]: one draw per row of softmax(logits [B, V]), by inverse CDF with one
    uniform per row, where ``jax.random.categorical`` (Gumbel-max) hashes B x V random
    numbers and takes two logs of each: on XLA:CPU at V = 49,152 that draw was nearly all of
    the per-token sampling cost (bench/RESULTS.md).

    Two levels keep the float32 sums short: the mass of each ``block`` of tokens, a cumsum over
    the V / block blocks picks the block, a cumsum inside it picks the token. Exact in
    distribution up to float32 rounding (the uniform has 2^-23 resolution, like the Gumbel
    draw's default mode, so tokens with probability below ~1e-7 are not sampled exactly).
    Tokens with probability 0 (logits at float32 min, e.g. top-k/top-p filtered) are never
    drawn: where rounding overshoots the last sum, the last token with mass is taken.
    ``uniform``: float32 [B, 1] in [0, 1) drawn ahead (``draw_noise``) instead of from ``rng``.
    """
    block = int(block or INVERSE_CDF_BLOCK)   # tokens per block (default 256)
    b, v = logits.shape
    c = -(-v // block)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    probs = jnp.pad(probs, ((0, 0), (0, c * block - v))).reshape(b, c, block)
    mass = probs.sum(-1)                                               # [B, C]
    cum = jnp.cumsum(mass, axis=-1)
    if uniform is None:
        uniform = jax.random.uniform(rng, (b, 1), jnp.float32)
    u = uniform * cum[:, -1:]   # in [0, total)
    j = jnp.minimum(jnp.sum(cum <= u, axis=-1), _last_positive(mass))   # block of the draw
    rest = u[:, 0] - jnp.take_along_axis(cum - mass, j[:, None], axis=1)[:, 0]
    inner = jnp.take_along_axis(probs, j[:, None, None], axis=1)[:, 0]   # [B, block]
    i = jnp.minimum(jnp.sum(jnp.cumsum(inner, axis=-1) <= rest[:, None], axis=-1),
                    _last_positive(inner))
    return (j * block + i).astype(jnp.int32)


def _last_positive(x: jax.Array) -> jax.Array:
    """int32 [B]: index of the last entry > 0 in each row of x [B, K] (K - 1 if none)."""
    k = x.shape[-1]
    last = jnp.max(jnp.where(x > 0, jnp.arange(k, dtype=jnp.int32), -1), axis=-1)
    return jnp.where(last < 0, k - 1, last)   # a max, not an argmax (see first_argmax)


def _ordered_keys(x: jax.Array) -> jax.Array:
    """int32 keys of float32 ``x`` in the same order as the floats (for bisection)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


def _top_k_threshold(x: jax.Array, k: int) -> jax.Array:
    """float32 [B, 1]: the k-th largest entry of each row of x [B, V], counted with
    multiplicity (``lax.top_k(x, k)[0][:, -1:]``): keeping ``x >= threshold`` keeps the top k
    and every entry tied with the k-th.

    Without sorting: ``count(x >= t) >= k`` is monotone in t, and the largest t where it holds
    is the k-th largest entry; a bisection over the float32 bit patterns finds it exactly in
    32 counting passes over the row. At [32, 49,152] on XLA:CPU ``lax.top_k`` took ~240 ms
    per draw, this ~16 ms.
    """
    key = _ordered_keys(x)
    lo = jnp.min(key, axis=-1, keepdims=True)   # holds: every entry counts
    hi = jnp.max(key, axis=-1, keepdims=True)

    def step(_, bounds):   # invariant: holds(lo); the answer is in [lo, hi]
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + ((lo | hi) & 1)   # ceil((lo + hi) / 2) without overflow
        ok = (jnp.sum(key >= mid, axis=-1, keepdims=True) >= k) & (lo < hi)
        return jnp.where(ok, mid, lo), jnp.where(ok | (lo >= hi), hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, 32, step, (lo, hi))
    return jnp.min(jnp.where(key >= lo, x, jnp.inf), axis=-1, keepdims=True)


def _top_p_threshold(filtered: jax.Array, top_p: float, top_k: int = 0) -> jax.Array:
    """float32 [B, 1]: the smallest logit of the smallest set of tokens whose probability mass
    (under softmax(filtered)) reaches ``top_p``, the token that crosses ``top_p`` included.

    Without sorting the vocabulary: token i is kept iff the mass of the tokens with a strictly
    larger logit is < top_p (what a descending sort + cumsum keeps, ties included). That
    predicate is monotone in the logit, so a bisection over the float32 bit patterns (mapped
    to int32 in the same order) finds the smallest kept logit exactly in 32 masked sums over
    the row, where a full sort of [B, V] on CPU cost ~15x the rest of sampling (V = 49,152).
    ``top_k`` is unused (top-k already set the other logits to float32 min, mass 0).
    """
    del top_k
    probs = jax.nn.softmax(filtered, axis=-1)
    key = _ordered_keys(filtered)
    lo = jnp.min(key, axis=-1, keepdims=True)   # kept(lo) may be false; kept(hi) is true
    hi = jnp.max(key, axis=-1, keepdims=True)

    def kept(k):   # [B, 1] bool: would a token with key k be kept?
        return jnp.sum(jnp.where(key > k, probs, 0.0), axis=-1, keepdims=True) < top_p

    def step(_, bounds):   # invariant: kept(hi); smallest kept key in (lo, hi] unless kept(lo)
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)   # floor((lo + hi) / 2) without overflow
        ok = kept(mid)
        return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

    lo_kept = kept(lo)
    lo, hi = jax.lax.fori_loop(0, 32, step, (lo, hi))
    first = jnp.where(lo_kept, lo, hi)   # the smallest kept key
    return jnp.min(jnp.where(key >= first, filtered, jnp.inf), axis=-1, keepdims=True)


# ------------------------------------------------------------------------- temperature schedules

TEMPERATURE_SCHEDULES = ("constant", "linear", "cosine", "exp")


def check_temperatures(temperatures, max_new_tokens: int, rows: int):
    """``temperatures`` as a device array: f32 [N] (one schedule for every row) or [R, N] (each
    output row its own, e.g. continuations of prefixes cut at different positions of a
    scheduled completion); ValueError for another shape or a value <= 0."""
    temperatures = np.asarray(temperatures, np.float32)
    if temperatures.shape not in ((max_new_tokens,), (rows, max_new_tokens)):
        raise ValueError(f"temperatures must have shape ({max_new_tokens},) or ({rows}, "
                         f"{max_new_tokens}), got {temperatures.shape}")
    if not np.all(temperatures > 0):
        raise ValueError("temperatures must all be > 0 (a schedule has no greedy position)")
    return jnp.asarray(temperatures)


def row_temperature(temperatures, t, row=None):
    """The temperature of token ``t`` under ``check_temperatures``'s [N] or [R', N]: a scalar
    for one schedule and a scalar ``t`` (the static sampler's step), else f32 [R, 1], row i's
    at its token ``t`` (or ``t[i]``, the slot engine's rows each at their own step) of its
    schedule (``row[i]``; default the rows in order)."""
    if temperatures.ndim == 2:
        return (temperatures[:, t] if row is None else temperatures[row, t])[:, None]
    return temperatures[t] if jnp.ndim(t) == 0 else temperatures[t][:, None]


def temperature_schedule(name: str, start: float, end: float, tokens: int,
                         length: int) -> np.ndarray:
    """Per-position sampling temperatures: float32 [length], ``out[t]`` for completion token t.

    Every schedule goes from ``start`` at t = 0 to ``end`` at t = ``tokens`` (0 = ``length``)
    and stays at ``end`` after it:

      constant: ``start`` everywhere.
      linear:   start + (end - start) * u, with u = min(t / tokens, 1).
      cosine:   end + (start - end) * (1 + cos(pi * u)) / 2.
      exp:      max(1 + start - exp(t / d), end), the exploratory annealed decoding form
                (Yang et al. 2025, "Let it Calm"), with the decay d = tokens / ln(1 + start - end)
                chosen so that it reaches ``end`` at t = tokens (needs start >= end).

    Temperatures must be > 0 (a schedule has no greedy position): ValueError otherwise.
    """
    if name not in TEMPERATURE_SCHEDULES:
        raise ValueError(f"unknown temperature schedule {name!r}; one of {TEMPERATURE_SCHEDULES}")
    if start <= 0 or end <= 0:
        raise ValueError(f"temperature schedule temperatures must be > 0, got start={start}, "
                         f"end={end}")
    span = float(tokens or length)
    t = np.arange(length, dtype=np.float64)
    u = np.minimum(t / span, 1.0)
    if name == "constant":
        out = np.full(length, start, np.float64)
    elif name == "linear":
        out = start + (end - start) * u
    elif name == "cosine":
        out = end + (start - end) * 0.5 * (1.0 + np.cos(np.pi * u))
    else:
        if start < end:
            raise ValueError(f"the 'exp' schedule anneals down: needs start >= end, got "
                             f"start={start}, end={end}")
        gap = np.log1p(start - end)
        out = (np.full(length, start, np.float64) if gap == 0.0 else
               np.maximum(1.0 + start - np.exp(np.minimum(t, span) * gap / span), end))
    return out.astype(np.float32)


# ----------------------------------------------------------------------------- noise ahead

def noise_ahead_size(n: int, rows: int, vocab: int) -> int:
    """float32s in ``noise_ahead(rng, n, rows, vocab)``: n * rows * (1 or vocab)."""
    return n * rows * (1 if vocab >= INVERSE_CDF_MIN_VOCAB else vocab)


def noise_ahead(rng: jax.Array, n: int, rows: int, vocab: int, greedy: bool):
    """float32 [n, rows, W] = ``draw_noise(fold_in(rng, t), rows, vocab)`` for t < n (W = 1 or
    vocab), or None when greedy or larger than ``NOISE_AHEAD_MAX_ELEMENTS``.

    Token t's randomness comes from fold_in(rng, t) either way; drawn for all tokens in one
    batched call before the decode loop, the numbers (and so the tokens) are the same as drawn
    step by step, without a small threefry loop (and its fold_in) in every step, which was a
    fifth of a decode step at a small model."""
    if greedy or noise_ahead_size(n, rows, vocab) > NOISE_AHEAD_MAX_ELEMENTS:
        return None
    return jax.vmap(lambda t: draw_noise(jax.random.fold_in(rng, t), rows, vocab))(jnp.arange(n))


def row_noise_ahead(keys: jax.Array, n: int, vocab: int) -> jax.Array:
    """float32 [n, R, W]: row r's noise for token t is ``row_draw(keys[r], t, vocab)``, drawn
    from that row's own key ``keys`` [R] (W = 1 or vocab). A row's tokens then do not depend on
    which rows share its batch, nor where it sits (a search's node samples the same steps
    alone or with other prompts' nodes)."""
    return jax.vmap(lambda t: jax.vmap(lambda k: row_draw(k, t, vocab))(keys))(jnp.arange(n))
