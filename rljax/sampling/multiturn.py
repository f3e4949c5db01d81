"""On-device multi-turn sampling: a KV cache that lives across turns, extended by prefilling only
the new tokens (each turn's observation) before the turn is decoded.

    from rljax.sampling import multiturn
    cache = multiturn.start(cfg, params, prompt_tokens, prompt_mask, layout=layout,
                            num_samples=G)                  # prompt minus its last token
    chunk, chunk_mask = multiturn.first_chunk(prompt_tokens, layout, G)   # ... that last token
    for k in range(turns):
        cache, out = multiturn.turn(cfg, params, cache, slot_mask, chunk, chunk_mask, turn=k,
                                    active=active, budget=budget, rng=key_k, layout=layout)
        # host: decode out.tokens, cut each turn after its tool call (keep ``kept`` tokens),
        # step the environments; the next chunk is [the turn's last kept token] ++ the
        # rendered observation, left-padded to O; slot_mask gains kept_slots(...) and the chunk.

Slot layout (static shapes: one program for every turn): ``S = (P - 1) + T * (O + N)`` for prompt
bucket P, chunk width O, per-turn cap N and at most T turns; turn k's chunk starts at
``P - 1 + k * (O + N)``, its N decode slots right after. Every row writes at the same slot
cursor, so ``models.trunk``'s single ``cache_index`` serves all rows; rows differ in which slots
are *valid* (``slot_mask`` bool [R, S]): padding of a left-padded chunk, the unused tail of a
turn, and tokens the host cut after a tool call stay invalid and are never attended to.
Positions are per row (the number of valid slots before a token), so a row's valid slots, read
in order, are exactly its compact trajectory with a full forward's positions: the continued
cache gives the log-probs ``models.token_logps`` gives over prompt ++ trajectory.

Why the last token moves: the decode loop feeds token t-1 while it samples token t, so a turn's
last token has no keys/values yet when the turn ends. Rather than one more model step per turn,
that token leads the next chunk (whose prefill computes it anyway), and the prompt's last token
leads turn 0's chunk, so turn 0 runs the same program as every other turn.
The price of the layout is attention over invalid slots (about ``O + N`` per turn); the cache
is donated to each call, never copied. It is kept per layer (``models.unstack_cache``: one
[R, K, S, Dh] buffer per layer) and each turn reads per-layer weights, so the decode loop
neither slices weights nor cache out of stacks at every step (see ``sampling.generate``).
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from rljax import models
from rljax import sharding as shd
from rljax.sampling.core import constrain_cache, merge_stop_ids
from rljax.sampling.draw import row_draw, row_temperature, sample_logits


@flax.struct.dataclass(frozen=True)
class SlotLayout:
    """Where each turn lives in the cache (all static): prompt bucket P (>= 2), per-turn cap N,
    chunk width O (the carried last token plus up to O - 1 observation tokens), turns T."""
    prompt_len: int = flax.struct.field(pytree_node=False)
    turn_len: int = flax.struct.field(pytree_node=False)
    chunk_len: int = flax.struct.field(pytree_node=False)
    max_turns: int = flax.struct.field(pytree_node=False)

    @property
    def num_slots(self) -> int:
        return self.prompt_len - 1 + self.max_turns * (self.chunk_len + self.turn_len)

    def chunk_start(self, turn):
        """First slot of turn ``turn``'s chunk (an int, or traced)."""
        return self.prompt_len - 1 + turn * (self.chunk_len + self.turn_len)

    def turn_start(self, turn):
        """First of the N decode slots of turn ``turn``."""
        return self.chunk_start(turn) + self.chunk_len


@flax.struct.dataclass
class TurnOutput:
    """One turn of R rows. N = per-turn cap.

    tokens: int32 [R, N]; ``pad_id`` after a row's last token (and for inactive rows).
    logps: float32 [R, N]; sampler log-probs (softmax(logits / temperature)), 0 where unused.
    lengths: int32 [R]; tokens generated this turn (0 for inactive rows).
    stopped: bool [R]; the turn ended on a stop id or stop sequence (False: cap/budget hit).
    """
    tokens: jax.Array
    logps: jax.Array
    lengths: jax.Array
    stopped: jax.Array


def stop_sequences_of(tokenizer, texts: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """Token ids of each stop string as the tokenizer encodes it on its own (exact for a
    character tokenizer; with BPE the model may spell it differently, which the host's text
    check still catches, only later: at the turn cap)."""
    out = []
    for text in texts:
        ids = tuple(int(i) for i in tokenizer.encode(text))
        if ids:
            out.append(ids)
    return tuple(out)


# ----------------------------------------------------------------------------- programs

def _constraints(mesh, rules):
    batch = lambda x: shd.constrain(x, ("batch",) + (None,) * (x.ndim - 1), mesh, rules)  # noqa
    return batch, functools.partial(constrain_cache, mesh=mesh, rules=rules)


@functools.partial(jax.jit, static_argnames=("cfg", "layout", "num_samples", "mesh", "rules",
                                             "cache_dtype", "record_routes"))
def _start(cfg, params, prompt_tokens, prompt_mask, image_embeds=None, *, layout, num_samples,
           mesh, rules, cache_dtype, record_routes=False):
    batch, constrain_cache = _constraints(mesh, rules)
    b, p = prompt_tokens.shape
    tokens, mask = batch(prompt_tokens[:, :-1]), batch(prompt_mask[:, :-1])
    slot_mask = jnp.zeros((b, layout.num_slots), bool).at[:, :p - 1].set(mask)
    cache = constrain_cache(models.init_cache(cfg, b, layout.num_slots, dtype=cache_dtype))
    out = models.trunk(cfg, params, tokens, attention_mask=slot_mask,
                       positions=models.default_positions(mask), cache=cache, cache_index=0,
                       image_embeds=None if image_embeds is None else batch(image_embeds),
                       with_moe_stats=record_routes)
    # Prefill once per prompt; its G rows (prompt-major) share it. Per layer from here on.
    cache = models.unstack_cache(out[1])
    if num_samples > 1:
        cache = {k: tuple(jnp.repeat(c, num_samples, axis=0) for c in v)
                 for k, v in cache.items()}
    cache = constrain_cache(cache)
    if record_routes:   # [L, R, S, k]: the prompt's slots now, each turn's as it is fed
        ids = jnp.repeat(out[2]["ids"], num_samples, axis=1)
        routes = jnp.zeros(ids.shape[:2] + (layout.num_slots, ids.shape[-1]), jnp.int32)
        cache["routes"] = jax.lax.dynamic_update_slice_in_dim(routes, ids, 0, axis=2)
    return cache


_STATIC = ("cfg", "layout", "temperature", "top_k", "top_p", "stop_ids", "stop_seqs", "pad_id",
           "mesh", "rules")


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("cache",))
def _turn(cfg, params, cache, slot_mask, chunk, chunk_mask, turn, active, budget, rng,
          temperatures=None, *, layout, temperature, top_k, top_p, stop_ids, stop_seqs, pad_id,
          mesh, rules):
    batch, constrain_cache = _constraints(mesh, rules)
    params = models.unstack_layers(params)   # once per turn, not per decode step
    cache = dict(cache)
    routes = cache.pop("routes", None)   # routing replay: each slot's experts [L, R, S, k]
    record = routes is not None
    r, n = chunk.shape[0], layout.turn_len
    chunk, chunk_mask, slot_mask = batch(chunk), batch(chunk_mask), batch(slot_mask)
    active, budget = batch(active), batch(budget)
    c0 = layout.chunk_start(turn)
    start = c0 + layout.chunk_len   # the turn's first decode slot
    # ---- prefill the chunk at its slots (slot_mask already marks its real tokens valid).
    pos = jnp.sum(slot_mask, axis=-1, dtype=jnp.int32)   # valid slots up to the turn
    before = pos - jnp.sum(chunk_mask, axis=-1, dtype=jnp.int32)
    out = models.trunk(cfg, params, chunk, attention_mask=slot_mask,
                       positions=before[:, None] + models.default_positions(chunk_mask),
                       cache=constrain_cache(cache), cache_index=c0, with_moe_stats=record)
    hidden, cache = out[:2]
    cache = constrain_cache(cache)
    if record:
        routes = jax.lax.dynamic_update_slice_in_dim(routes, out[2]["ids"], c0, axis=2)
    logits = models.logits_from_hidden(cfg, params, hidden[:, -1])  # left-padded: last is real

    # ---- decode into slots [start, start + n); token t sits at position pos + t.
    stop = jnp.asarray(stop_ids, jnp.int32) if stop_ids else None
    turn_slots = jnp.arange(layout.num_slots) - start

    def stopped_at(tokens, t):
        """bool [R]: token t ends the turn (a stop id, or the last token of a stop sequence)."""
        tok = tokens[:, t]
        hit = jnp.zeros((r,), bool) if stop is None else jnp.any(tok[:, None] == stop, -1)
        for seq in stop_seqs:
            k = len(seq)
            window = jax.lax.dynamic_slice_in_dim(tokens, jnp.maximum(t + 1 - k, 0), k, axis=1)
            hit |= (t + 1 >= k) & jnp.all(window == jnp.asarray(seq, jnp.int32), axis=-1)
        return hit

    def pick(key, logits, live, t):
        # Each row draws from its own key (``draw.row_draw``), as the episode engine does.
        noise = None
        if temperature != 0.0:
            noise = jax.vmap(lambda row: row_draw(key, row, logits.shape[-1]))(jnp.arange(r))
        temp = temperature if temperatures is None else row_temperature(temperatures, t)
        tok, logp = sample_logits(key, logits, temperature=temp, top_k=top_k, top_p=top_p,
                                  noise=noise)
        return jnp.where(live, tok, pad_id), jnp.where(live, logp, 0.0)

    live = active & (budget > 0)
    tok, logp = pick(jax.random.fold_in(rng, 0), logits, live, 0)
    tokens = batch(jnp.full((r, n), pad_id, jnp.int32).at[:, 0].set(tok))
    logps = batch(jnp.zeros((r, n), jnp.float32).at[:, 0].set(logp))
    lengths = live.astype(jnp.int32)
    stopped = live & stopped_at(tokens, 0)
    done = ~live | stopped | (lengths >= budget)

    def cond(state):
        t, _, _, _, _, done, _, _ = state
        return (t < n) & ~jnp.all(done)

    def body(state):
        # Feed token t-1 (slot start + t - 1, position pos + t - 1); sample token t.
        t, cache, tokens, logps, lengths, done, stopped, routes = state
        attn = slot_mask | ((turn_slots >= 0) & (turn_slots < t))[None, :]
        prev = jax.lax.dynamic_index_in_dim(tokens, t - 1, axis=1)  # [R, 1]
        out = models.trunk(cfg, params, prev, attention_mask=attn,
                           positions=(pos + t - 1)[:, None], cache=cache,
                           cache_index=start + t - 1, with_moe_stats=record)
        hidden, cache = out[:2]
        if record:   # token t-1's experts into its slot (a done row's slot is never valid)
            routes = jax.lax.dynamic_update_slice_in_dim(routes, out[2]["ids"], start + t - 1,
                                                         axis=2)
        cache = constrain_cache(cache)
        logits = models.logits_from_hidden(cfg, params, hidden[:, 0])
        tok, logp = pick(jax.random.fold_in(rng, t), logits, ~done, t)
        tokens = jax.lax.dynamic_update_index_in_dim(tokens, tok, t, axis=1)
        logps = jax.lax.dynamic_update_index_in_dim(logps, logp, t, axis=1)
        lengths = lengths + (~done).astype(jnp.int32)
        stopped = stopped | (~done & stopped_at(tokens, t))
        done = done | stopped | (lengths >= budget)
        return t + 1, cache, tokens, logps, lengths, done, stopped, routes

    state = (jnp.int32(1), cache, tokens, logps, lengths, done, stopped,
             routes if record else jnp.zeros((), jnp.int32))
    _, cache, tokens, logps, lengths, _, stopped, routes = jax.lax.while_loop(cond, body, state)
    if record:
        cache["routes"] = routes
    return cache, TurnOutput(tokens=tokens, logps=logps, lengths=lengths, stopped=stopped)


# ----------------------------------------------------------------------------- public calls

def _rules(rules):
    return tuple((k, v if isinstance(v, (str, type(None))) else tuple(v)) for k, v in rules)


def start(cfg: models.ModelConfig, params: Any, prompt_tokens, prompt_mask, *,
          layout: SlotLayout, num_samples: int = 1, mesh=None, rules=shd.DEFAULT_RULES,
          cache_dtype=None, record_routes: bool = False, image_embeds=None) -> dict:
    """Prefills each prompt but its last token once and fans the cache out to G rows.

    Args:
      prompt_tokens: int32 [B, P] left-padded (P == ``layout.prompt_len`` >= 2); prompt_mask.
      image_embeds: [B, K, D] (a model with a vision tower): each prompt's image embeddings,
        prefilled with it; the turns after attend to their keys/values as to any others.
      record_routes: a mixture of experts: the cache also carries ``"routes"`` int32
        [L, B*G, S, k], the experts each slot's keys/values were computed with (every fed
        token's: the prefill's here, each ``turn``'s chunk and decode steps as they run), for
        routing replay in the update (``trajectory_routes`` lays them out).
    Returns:
      the cache ``{"k", "v": tuple of L [B*G, Hkv, S, Dh]}`` (per layer, rows prompt-major;
      ``models.stack_cache`` stacks it); the valid slots are ``first_chunk``'s ``slot_mask``.
    """
    if prompt_tokens.shape[1] != layout.prompt_len or layout.prompt_len < 2:
        raise ValueError(f"prompt bucket {prompt_tokens.shape[1]} != layout.prompt_len "
                         f"{layout.prompt_len} (>= 2)")
    if record_routes and not cfg.is_moe:
        raise ValueError("record_routes needs a mixture-of-experts model")
    models.transformer.check_token_ids(cfg, prompt_tokens, prompt_mask, what="prompt_tokens")
    return _start(cfg, params, jnp.asarray(prompt_tokens, jnp.int32),
                  jnp.asarray(prompt_mask, bool), image_embeds, layout=layout,
                  num_samples=int(num_samples), mesh=mesh, rules=_rules(rules),
                  cache_dtype=None if cache_dtype is None else jnp.dtype(cache_dtype).name,
                  record_routes=bool(record_routes))


def first_chunk(prompt_tokens, prompt_mask, layout: SlotLayout, num_samples: int = 1):
    """Turn 0's inputs on the host: ``(chunk int32 [R, O], chunk_mask bool [R, O],
    slot_mask bool [R, S])``: the chunk holds each prompt's last token, the slots its others."""
    pt = np.repeat(np.asarray(prompt_tokens), num_samples, axis=0)
    pm = np.repeat(np.asarray(prompt_mask, bool), num_samples, axis=0)
    r, o = pt.shape[0], layout.chunk_len
    chunk = np.zeros((r, o), np.int32)
    chunk[:, -1] = pt[:, -1]
    chunk_mask = np.zeros((r, o), bool)
    chunk_mask[:, -1] = pm[:, -1]
    slot_mask = np.zeros((r, layout.num_slots), bool)
    slot_mask[:, :layout.prompt_len - 1] = pm[:, :-1]
    slot_mask[:, layout.chunk_start(0):layout.turn_start(0)] = chunk_mask
    return chunk, chunk_mask, slot_mask


def turn(cfg: models.ModelConfig, params: Any, cache: dict, slot_mask, chunk, chunk_mask, *,
         turn: int, active, budget, rng: jax.Array, layout: SlotLayout, temperature=1.0,
         top_k=0, top_p=1.0, eos_id=None, stop_ids=(), stop_sequences=(), pad_id=0, mesh=None,
         rules=shd.DEFAULT_RULES, temperatures=None):
    """Prefills each row's chunk at turn ``turn``'s chunk slots, then decodes the turn.

    Args:
      cache: from ``start`` or the previous ``turn`` (donated: do not reuse it).
      slot_mask: bool [R, S], the valid slots *including* this chunk's real tokens (and
        nothing after them).
      chunk, chunk_mask: int32 / bool [R, O], left-padded; an active row needs at least one
        real token (the last one predicts the turn's first token).
      turn: 0 .. layout.max_turns - 1 (traced: one program serves every turn).
      active: bool [R]; inactive rows generate nothing (their outputs are padding).
      budget: int32 [R], tokens each row may generate (<= ``layout.turn_len``).
      temperature, top_k, top_p, eos_id, stop_ids, pad_id, mesh, rules: as
        ``sampling.generate``; stop_sequences: token-id tuples that end a turn when generated
        in a row (e.g. a tool call's closing tag).
      temperatures: f32 [R, N] or None: row r's turn token t is drawn at
        ``temperatures[r, t]`` (a temperature schedule over the episode's model tokens), and
        its log-prob is the one at that temperature; None: ``temperature``.

    Returns:
      ``(cache, TurnOutput)``. Keys/values of the turn's tokens but its last are in the cache
      (and, with ``start(record_routes=True)``, the experts of each fed token in its
      ``"routes"``).
    """
    if not 0 <= turn < layout.max_turns:
        raise ValueError(f"turn {turn} outside 0..{layout.max_turns - 1}")
    if chunk.shape[1] != layout.chunk_len:
        raise ValueError(f"chunk width {chunk.shape[1]} != layout.chunk_len {layout.chunk_len}")
    if temperature < 0 or not 0.0 < top_p <= 1.0:
        raise ValueError(f"need temperature >= 0 and top_p in (0, 1], got {temperature}, {top_p}")
    models.transformer.check_token_ids(cfg, chunk, chunk_mask, what="observation chunk")
    return _turn(cfg, params, cache, jnp.asarray(slot_mask, bool), jnp.asarray(chunk, jnp.int32),
                 jnp.asarray(chunk_mask, bool), jnp.int32(turn), jnp.asarray(active, bool),
                 jnp.asarray(budget, jnp.int32), rng,
                 None if temperatures is None else jnp.asarray(temperatures, jnp.float32),
                 layout=layout,
                 temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                 stop_ids=merge_stop_ids(eos_id, stop_ids),
                 stop_seqs=tuple(tuple(int(i) for i in q) for q in stop_sequences if len(q)),
                 pad_id=int(pad_id), mesh=mesh, rules=_rules(rules))


def trajectory_routes(routes, slot_mask, prompt_mask, width: int) -> np.ndarray:
    """A cache's recorded routes (``start(record_routes=True)``: ``cache["routes"]`` [L, R,
    S, k]) laid out as the training rows' columns: int32 [R, P + width, L, k] for the
    left-padded prompt bucket P (``prompt_mask`` bool [R, P]) and the compact trajectory
    after it. A row's valid slots (``slot_mask`` bool [R, S], every kept token's included),
    read in order, are its prompt and trajectory but the last token (never fed: entries 0)."""
    routes = np.transpose(np.asarray(routes), (1, 2, 0, 3))
    prompt_mask = np.asarray(prompt_mask, bool)
    r, p = prompt_mask.shape
    out = np.zeros((r, p + width) + routes.shape[2:], np.int32)
    for i in range(r):
        fed = routes[i, np.asarray(slot_mask[i], bool)]
        first = p - int(prompt_mask[i].sum())   # the prompt's real tokens end at column P-1
        out[i, first:first + len(fed)] = fed[:p + width - first]
    return out


def kept_slots(layout: SlotLayout, turn: int, kept) -> np.ndarray:
    """bool [R, S]: the slots of turn ``turn``'s first ``kept[r] - 1`` tokens (the last kept
    token goes into the next chunk), to add to ``slot_mask`` after the host cut the turn."""
    s = np.arange(layout.num_slots) - layout.turn_start(turn)
    return (s[None, :] >= 0) & (s[None, :] < np.asarray(kept)[:, None] - 1)


def programs(cfg: models.ModelConfig, params: Any, prompt_tokens, prompt_mask, rng, *,
             layout: SlotLayout, num_samples: int = 1, temperature=1.0, top_k=0, top_p=1.0,
             eos_id=None, stop_ids=(), stop_sequences=(), pad_id=0, mesh=None,
             rules=shd.DEFAULT_RULES) -> list[tuple[str, Any, tuple]]:
    """The turn batches' two programs for a memory plan: ``[(name, jitted fn, abstract
    args)]`` (``start``: the B prompts' prefill fanned out to R = B * G rows; ``turn``: one
    turn's chunk prefill and decode over the R rows' whole cache), as ``start`` and ``turn``
    compile them for prompts of this shape. Inputs may be ``jax.ShapeDtypeStruct``s."""
    r, rules = prompt_tokens.shape[0] * int(num_samples), _rules(rules)

    def start_fn(params, tokens, mask):
        return _start(cfg, params, tokens, mask, layout=layout, num_samples=int(num_samples),
                      mesh=mesh, rules=rules, cache_dtype=None)

    static = dict(layout=layout, temperature=float(temperature), top_k=int(top_k),
                  top_p=float(top_p), stop_ids=merge_stop_ids(eos_id, stop_ids),
                  stop_seqs=tuple(tuple(int(i) for i in q) for q in stop_sequences if len(q)),
                  pad_id=int(pad_id), mesh=mesh, rules=rules)

    def turn_fn(params, cache, slot_mask, chunk, chunk_mask, turn, active, budget, rng):
        return _turn(cfg, params, cache, slot_mask, chunk, chunk_mask, turn, active, budget,
                     rng, **static)

    rows = lambda dtype, *tail: jax.ShapeDtypeStruct((r, *tail), dtype)  # noqa: E731
    o = layout.chunk_len
    return [("start", jax.jit(start_fn), (params, prompt_tokens, prompt_mask)),
            ("turn", jax.jit(turn_fn, donate_argnums=(1,)),
             (params, jax.eval_shape(start_fn, params, prompt_tokens, prompt_mask),
              rows(bool, layout.num_slots), rows(jnp.int32, o), rows(bool, o),
              jax.ShapeDtypeStruct((), jnp.int32), rows(bool), rows(jnp.int32), rng))]
