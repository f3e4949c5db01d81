"""Tree-structured sampling (TreePO-style segment trees) on device, sharing KV caches.

    out = sampling.tree.generate(cfg, params, prompt_tokens, prompt_mask, rng=key,
                                 max_new_tokens=N, segment_tokens=L, branching=k, depth=D,
                                 roots=R, temperature=1.0, eos_id=tok.eos_id, pad_id=tok.pad_id)
    # M = R * k**D leaves per prompt; out.tokens int32[B*M, N] (row i*M + m: leaf m of prompt i)
    # out.logps, out.mask, out.lengths, out.truncated: as sampling.SampleOutput
    # out.node_ids int32[B*M, D+1]: the tree node each leaf's segment j belongs to
    # out.decoded int32[B]: tokens decoded per prompt (a shared segment counts once)
    # temperatures=f32[N] (a schedule): token t of every path drawn, and its logp, at [t]

The tree has D + 1 levels of segments. Level j < D covers completion positions
``[j*L, (j+1)*L)`` and has ``R * k**j`` paths per prompt; the last level covers ``[D*L, N)``
with all M leaves. Each prompt is prefilled once; its cache is fanned out to R root paths;
at the end of level j every path feeds its last token once, then its cache row, logits and
tokens so far are gathered into k child rows (one gather per boundary: the prefix is never
recomputed), and each child samples its own next token from the shared logits.

Every level runs at its own static width (``B * R * k**j`` rows), so decoding a level costs
what its live paths need and the whole call is one program that compiles once per shape.
A path that stops (stop token) before a boundary still "forks": its children are copies
of it that decode nothing (masked, not counted in ``decoded``). So every one of the M rows is,
marginally, an exact sample of the policy (as an independent sample would be) and a prompt's
group is always its M leaves; only the correlation between rows differs.

Node ids (per prompt tree, static): level-j nodes are numbered ``offset_j + q`` with
``offset_j = R * (k**j - 1) / (k - 1)`` (``R * j`` when k = 1) and q the path index within the
level; leaf m belongs to path ``m // k**(D - j)`` at level j. ``tree_layout`` returns the table.
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
from rljax.config.rollout import tree_depth
from rljax.sampling.core import merge_stop_ids
from rljax.sampling.draw import check_temperatures, row_temperature, sample_logits


@flax.struct.dataclass
class TreeSampleOutput:
    """Leaves of the sampled trees, prompt-major (row ``i * M + m``). N = max_new_tokens.

    tokens, logps, mask, lengths, truncated: as ``sampling.SampleOutput`` ([B*M, N], [B*M]).
    node_ids: int32 [B*M, D+1]; node (per-prompt id, ``tree_layout``) of each leaf at each level.
    decoded: int32 [B]; tokens the sampler decoded per prompt, each tree node's segment once.
    versions: int32 [B*M, N] or None; with in-flight weight updates (``sampling.tree_engine``),
      the version of the weights that drew each token (a shared segment's, on every leaf).
    routes: int32 [B*M, P+N, L, k] or None (``record_routes``): each fed token's experts, as
      ``sampling.SampleOutput.routes`` (a shared segment's, on every leaf of it).
    """
    tokens: jax.Array
    logps: jax.Array
    mask: jax.Array
    lengths: jax.Array
    truncated: jax.Array
    node_ids: jax.Array
    decoded: jax.Array
    versions: jax.Array | None = None
    routes: jax.Array | None = None


def num_leaves(roots: int, branching: int, depth: int) -> int:
    """M = roots * branching**depth: the leaves (completions) per prompt."""
    return int(roots) * int(branching) ** int(depth)


def tree_layout(roots: int, branching: int, depth: int) -> tuple[np.ndarray, np.ndarray]:
    """Static structure of one prompt's tree.

    Returns:
      ``(node_ids int32 [M, D+1], parents int32 [K])``: the node of leaf m at level j, and the
      parent node of each of the K nodes (-1 for the roots), node ids as in the module doc.
    """
    m = num_leaves(roots, branching, depth)
    widths = [roots * branching ** j for j in range(depth + 1)]
    offsets = np.cumsum([0] + widths[:-1])
    leaf = np.arange(m)
    node_ids = np.stack([offsets[j] + leaf // branching ** (depth - j)
                         for j in range(depth + 1)], axis=1).astype(np.int32)
    parents = [-1] * roots + [int(offsets[j - 1]) + q // branching
                              for j in range(1, depth + 1) for q in range(widths[j])]
    return node_ids, np.asarray(parents, np.int32)


def own_branches(node_ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``node_ids`` int32 [N, D+1] with each of ``rows`` (bool [N]) a tree of its own: a node
    id at every level that no other row has (e.g. a demonstration in place of a leaf, which
    shares no segment with the sampled ones). Tree estimators then see it as a one-leaf
    tree beside the sampled one(s) in its group."""
    out = np.array(node_ids, np.int32, copy=True)
    flagged = np.flatnonzero(np.asarray(rows, bool))
    out[flagged] = (out.max(initial=-1) + 1 + np.arange(len(flagged)))[:, None]
    return out


def segment_of_position(max_new_tokens: int, segment_tokens: int, depth: int) -> np.ndarray:
    """int32 [N]: the tree level (segment) each completion position belongs to:
    ``min(t // segment_tokens, depth)``."""
    return np.minimum(np.arange(max_new_tokens) // segment_tokens, depth).astype(np.int32)


def options_from_config(tree_cfg, num_generations: int) -> dict | None:
    """``generate`` options from the ``rollout.tree`` config section (None when it is off):
    segment_tokens, branching, roots and the depth that gives ``num_generations`` leaves
    (``rljax.config`` has checked that one exists)."""
    if not tree_cfg.enabled:
        return None
    depth = tree_depth(tree_cfg.roots, tree_cfg.branching, num_generations)
    return dict(segment_tokens=int(tree_cfg.segment_tokens), branching=int(tree_cfg.branching),
                roots=int(tree_cfg.roots), depth=int(depth))


def check_tree(max_new_tokens: int, segment_tokens: int, branching: int, depth: int,
               roots: int) -> None:
    """ValueError unless the tree fits the static shapes: every level decodes >= 1 token."""
    if segment_tokens < 1 or branching < 1 or depth < 0 or roots < 1:
        raise ValueError(f"need segment_tokens >= 1, branching >= 1, depth >= 0, roots >= 1; "
                         f"got {segment_tokens}, {branching}, {depth}, {roots}")
    if depth * segment_tokens >= max_new_tokens:
        raise ValueError(f"depth * segment_tokens = {depth} * {segment_tokens} must be < "
                         f"max_new_tokens = {max_new_tokens} (the leaves need a segment)")


def generate(cfg: models.ModelConfig, params: Any, prompt_tokens: jax.Array,
             prompt_mask: jax.Array, *, rng: jax.Array, max_new_tokens: int,
             segment_tokens: int, branching: int, depth: int, roots: int = 1,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             eos_id: int | Sequence[int] | None = None, pad_id: int = 0,
             stop_ids: Sequence[int] = (), mesh: jax.sharding.Mesh | None = None,
             rules: Sequence[tuple[str, Any]] = shd.DEFAULT_RULES,
             cache_dtype: Any = None, image_embeds: Any = None,
             temperatures: Any = None, record_routes: bool = False) -> TreeSampleOutput:
    """Samples a tree of ``roots * branching**depth`` leaves per prompt, entirely on device.

    Args:
      cfg, params, prompt_tokens, prompt_mask, rng, max_new_tokens, temperature, top_k, top_p,
        eos_id, pad_id, stop_ids, mesh, rules, cache_dtype, image_embeds, record_routes: as
        ``sampling.generate`` (the images are prefilled with their prompt, once).
      segment_tokens: L, tokens per segment (levels 0..D-1; the leaves decode the rest).
      branching: k children per path at each boundary.
      depth: D boundaries; ``depth * segment_tokens < max_new_tokens``.
      roots: R independent paths per prompt before the first boundary.
      temperatures: optional float32 [N] per-position temperatures (a schedule, all > 0):
        a segment's token at completion position t is drawn, and its logp reported, at
        ``temperatures[t]``, whichever level decodes it (``temperature`` is then unused).

    Returns:
      ``TreeSampleOutput`` with ``B * M`` leaf rows. With ``branching=1`` it is
      ``sampling.generate(..., num_samples=roots)`` (the same samples for the same key).
    """
    check_tree(max_new_tokens, segment_tokens, branching, depth, roots)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if record_routes and not cfg.is_moe:
        raise ValueError("record_routes needs a mixture-of-experts model")
    models.transformer.check_token_ids(cfg, prompt_tokens, prompt_mask,
                                       what="sampling.tree.generate: prompt_tokens")
    if temperatures is not None:   # one schedule: every path of a level is at the same t
        temperatures = check_temperatures(temperatures, max_new_tokens, 1)
    return _tree_generate(
        cfg, params, jnp.asarray(prompt_tokens, jnp.int32), jnp.asarray(prompt_mask, bool), rng,
        image_embeds, temperatures,
        max_new_tokens=int(max_new_tokens), segment_tokens=int(segment_tokens),
        branching=int(branching), depth=int(depth), roots=int(roots),
        temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
        stop_ids=merge_stop_ids(eos_id, stop_ids), pad_id=int(pad_id), mesh=mesh,
        rules=tuple((k, v if isinstance(v, (str, type(None))) else tuple(v)) for k, v in rules),
        cache_dtype=None if cache_dtype is None else jnp.dtype(cache_dtype).name,
        record_routes=bool(record_routes))


_STATIC = ("cfg", "max_new_tokens", "segment_tokens", "branching", "depth", "roots",
           "temperature", "top_k", "top_p", "stop_ids", "pad_id", "mesh", "rules", "cache_dtype",
           "record_routes")


@functools.partial(jax.jit, static_argnames=_STATIC)
@shd.traced_on_mesh_kwarg   # the MoE dispatch splits the experts' work over the mesh
def _tree_generate(cfg, params, prompt_tokens, prompt_mask, rng, image_embeds, temperatures, *,
                   max_new_tokens, segment_tokens, branching, depth, roots, temperature, top_k,
                   top_p, stop_ids, pad_id, mesh, rules, cache_dtype, record_routes=False):
    b, p = prompt_tokens.shape
    n = max_new_tokens
    s = p + n
    batch = lambda x: shd.constrain(x, ("batch",) + (None,) * (x.ndim - 1), mesh, rules)
    cache_axes = ("layers", "batch", "kv_heads", "length", "head_dim")  # init_cache layout

    def constrain_cache(c):   # stacked (prefill) or per-layer (decode: ``unstack_cache``)
        return {k: (tuple(shd.constrain(x, cache_axes[1:], mesh, rules) for x in v)
                    if isinstance(v, tuple) else shd.constrain(v, cache_axes, mesh, rules))
                for k, v in c.items()}
    # Decode steps read per-layer weights and cache buffers (see ``models.unstack_layers``):
    # in the loops, slicing a layer out of the stacks copied every layer's weights per token.
    decode_params = models.unstack_layers(params)
    stop = jnp.asarray(stop_ids, jnp.int32) if stop_ids else None
    new_slots = jnp.arange(n)

    def is_stop(tok):
        if stop is None:
            return jnp.zeros(tok.shape, bool)
        return jnp.any(tok[:, None] == stop[None, :], axis=-1)

    def pick(t, logits):
        # A schedule gives position t its temperature (a traced scalar, always > 0).
        temp = temperature if temperatures is None else row_temperature(temperatures, t)
        return sample_logits(jax.random.fold_in(rng, t), logits, temperature=temp,
                             top_k=top_k, top_p=top_p)

    def feed(cache, prev, t, prompt_mask, prompt_len, routes, done):
        """Feeds token t-1 (slot P+t-1) of every row: (logits [rows, V], cache, routes: with
        ``record_routes`` its experts written at that slot of [rows, P+N, L, k], 0 where the
        row is ``done``)."""
        rows = prev.shape[0]
        attn = jnp.concatenate([prompt_mask, jnp.broadcast_to(new_slots < t, (rows, n))], 1)
        out = models.trunk(cfg, decode_params, prev[:, None], attention_mask=attn,
                           positions=(prompt_len + t - 1)[:, None], cache=cache,
                           cache_index=p + t - 1, with_moe_stats=record_routes)
        if record_routes:   # [L, rows, 1, k] -> [rows, 1, L, k]
            ids = jnp.where(done[:, None, None, None], 0,
                            jnp.transpose(out[2]["ids"], (1, 2, 0, 3)))
            routes = jax.lax.dynamic_update_slice_in_dim(routes, ids, p + t - 1, axis=1)
        return (models.logits_from_hidden(cfg, params, out[0][:, 0]), constrain_cache(out[1]),
                routes)

    def emit(t, logits, paths):
        """Samples token t for every row from ``logits`` [rows, V]; rows already done get pad."""
        tokens, logps, lengths, done = paths
        tok, logp = pick(t, logits)
        tok = jnp.where(done, pad_id, tok)
        logp = jnp.where(done, 0.0, logp)
        lengths = lengths + (~done).astype(jnp.int32)
        tokens = jax.lax.dynamic_update_index_in_dim(tokens, tok, t, axis=1)
        logps = jax.lax.dynamic_update_index_in_dim(logps, logp, t, axis=1)
        return tok, (tokens, logps, lengths, done | is_stop(tok))

    def fork(x, rows, k, axis=0):
        """Rows ``[r*k, (r+1)*k)`` of the result are copies of row r (prompt-major stays)."""
        return x if k == 1 else jnp.take(x, jnp.arange(rows * k) // k, axis=axis)

    # ---- prefill: B prompts, once; then fan out to the R roots of each prompt.
    prompt_tokens, prompt_mask = batch(prompt_tokens), batch(prompt_mask)
    prompt_len = jnp.sum(prompt_mask, axis=-1, dtype=jnp.int32)  # [B]
    slot_mask = jnp.concatenate([prompt_mask, jnp.zeros((b, n), bool)], axis=1)
    cache = constrain_cache(models.init_cache(cfg, b, s, dtype=cache_dtype))
    out = models.trunk(cfg, params, prompt_tokens, attention_mask=slot_mask,
                       positions=models.default_positions(prompt_mask),
                       cache=cache, cache_index=0, image_embeds=image_embeds,
                       with_moe_stats=record_routes)
    logits = models.logits_from_hidden(cfg, params, out[0][:, -1])  # [B, V]
    cache = constrain_cache(models.unstack_cache(out[1]))
    # Routes [rows, P+N, L, k]: the prompt's from the prefill, forked with the paths.
    routes = (jnp.concatenate([jnp.transpose(out[2]["ids"], (1, 2, 0, 3)), jnp.zeros(
        (b, n, cfg.num_layers, cfg.num_experts_per_tok), jnp.int32)], axis=1)
        if record_routes else jnp.zeros((b,), jnp.int32))

    rows = b
    paths = (jnp.full((b, n), pad_id, jnp.int32), jnp.zeros((b, n), jnp.float32),
             jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool))
    decoded = jnp.zeros((b,), jnp.int32)
    start = 0
    for level in range(depth + 1):
        # ---- fork: k children per path (R roots per prompt at level 0), one gather each.
        k = roots if level == 0 else branching
        cache = constrain_cache({name: tuple(fork(x, rows, k) for x in v)
                                 for name, v in cache.items()})
        logits, prompt_mask, prompt_len = (fork(x, rows, k) for x in (logits, prompt_mask,
                                                                      prompt_len))
        paths = tuple(batch(fork(x, rows, k)) for x in paths)
        routes = batch(fork(routes, rows, k))
        rows *= k
        logits = batch(logits)
        # ---- decode this level's segment: positions [start, end).
        end = n if level == depth else (level + 1) * segment_tokens
        tok, paths = emit(start, logits, paths)

        def cond(state, end=end):
            t, _, _, paths, _ = state
            return (t < end) & ~jnp.all(paths[3])

        def body(state, prompt_mask=prompt_mask, prompt_len=prompt_len):
            t, cache, prev, paths, routes = state
            # A row done by token t-1 (its stop token, or padding) has no route there.
            logits, cache, routes = feed(cache, prev, t, prompt_mask, prompt_len, routes,
                                         paths[3])
            tok, paths = emit(t, logits, paths)
            return t + 1, cache, tok, paths, routes

        _, cache, tok, paths, routes = jax.lax.while_loop(
            cond, body, (jnp.int32(start + 1), cache, tok, paths, routes))
        lengths = paths[2]
        # Tokens this level's paths decoded (each path is one tree node): per prompt.
        own = jnp.clip(lengths - start, 0, end - start)
        decoded = decoded + own.reshape(b, -1).sum(axis=1)
        if level < depth:
            # The segment's last token goes into the cache once, before its row is copied.
            logits, cache, routes = feed(cache, tok, end, prompt_mask, prompt_len, routes,
                                         paths[3])
        start = end

    tokens, logps, lengths, done = paths
    mask = new_slots[None, :] < lengths[:, None]
    node_ids, _ = tree_layout(roots, branching, depth)
    node_ids = jnp.asarray(np.tile(node_ids, (b, 1)))
    return TreeSampleOutput(tokens=tokens, logps=logps, mask=mask, lengths=lengths,
                            truncated=~done, node_ids=node_ids, decoded=decoded,
                            routes=routes if record_routes else None)
