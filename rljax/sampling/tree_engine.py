"""Tree-structured sampling on the slot engine: the tree's forks served as engine requests.

    out, stats = sampling.tree_engine.generate(cfg, params, prompt_tokens, prompt_mask,
                                               rng=key, max_new_tokens=N, segment_tokens=L,
                                               branching=k, depth=D, roots=R, slots=64,
                                               chunk_steps=16, eos_id=tok.eos_id)
    # out: a sampling.tree.TreeSampleOutput exactly as sampling.tree.generate returns it
    # stats: [EngineStats], one per tree level

The tree is grown level by level (``sampling.tree`` has the layout). At level j every live
path of level j-1 forks into k children (R roots per prompt at level 0); each child is one
request to the slot engine (``sampling.engine.generate``, one sample per request): its prompt
is the tree's prompt followed by the path's tokens so far (re-prefilled: positions and
attention as if decoded), and it decodes at most the level's segment. A path that stopped
(stop token) does not fork: its children are copies of it that decode nothing, as in the
static tree sampler, and the engine leaves their rows unqueued (``live``), so every level
runs programs of one shape (``B * R * k**j`` rows, prompt width ``P + j * L``).

Randomness: token t of the path at row r of level j reads ``draw_noise(fold_in(rng, t),
B * R * k**j, V)[r]``, the draw the static tree sampler makes for it; it depends on the
prompt, the path and the position only, never on the slot or the order requests ran in. So
where both programs compute equal logits the trees are identical.

In-flight weight updates (``weights``, as ``sampling.engine.generate`` takes them): each
level's engine call polls them before its prefill and between its decode chunks, so a new
version may enter between two levels or two decode chunks of a level. A level's requests
re-prefill their paths under the weights it starts with; each token keeps the version that
drew it and the log-prob that version gave (``TreeSampleOutput.versions``; a shared segment's
on every leaf that descends from it), which is what the loss's importance ratios need.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rljax import distributed as dist, models
from rljax.sampling import engine
from rljax.sampling.draw import NOISE_AHEAD_MAX_ELEMENTS, draw_noise, noise_ahead_size
from rljax.sampling.tree import TreeSampleOutput, check_tree, tree_layout


def level_bounds(max_new_tokens: int, segment_tokens: int, depth: int) -> list[tuple[int, int]]:
    """``[(start, end)]`` per level: the completion positions level j decodes (the leaves, level
    D, decode the rest)."""
    return [(j * segment_tokens, max_new_tokens if j == depth else (j + 1) * segment_tokens)
            for j in range(depth + 1)]


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _level_noise(rng, start, end, rows, vocab):
    return jax.vmap(lambda t: draw_noise(jax.random.fold_in(rng, t), rows, vocab))(
        jnp.arange(start, end))


def level_noise(rng: jax.Array, start: int, end: int, rows: int, vocab: int) -> jax.Array:
    """float32 [end - start, rows, W]: the draws of positions [start, end) of a level of
    ``rows`` paths, ``draw_noise(fold_in(rng, t), rows, vocab)`` as ``sampling.tree`` draws
    them (W = 1 or vocab)."""
    if noise_ahead_size(end - start, rows, vocab) > NOISE_AHEAD_MAX_ELEMENTS:
        raise ValueError(f"the slot engine draws all noise ahead; {end - start} tokens x {rows} "
                         f"rows x vocabulary {vocab} exceed NOISE_AHEAD_MAX_ELEMENTS")
    return _level_noise(rng, int(start), int(end), int(rows), int(vocab))


def fork(paths: dict, k: int) -> dict:
    """Each path's k children, prompt-major (rows ``[r*k, (r+1)*k)`` copy row r)."""
    return {name: np.repeat(x, k, axis=0) for name, x in paths.items()}


def requests(prompt_tokens: np.ndarray, prompt_mask: np.ndarray, tokens: np.ndarray,
             start: int) -> tuple[np.ndarray, np.ndarray]:
    """The level's requests: each path's prompt followed by its ``start`` tokens so far.

    prompt_tokens, prompt_mask: [B, P] left-padded; tokens: int32 [B*W, N], the paths
    (W per prompt, prompt-major). Returns int32 / bool [B*W, P + start]."""
    per_prompt = tokens.shape[0] // prompt_tokens.shape[0]
    prompt = np.repeat(prompt_tokens, per_prompt, axis=0)
    mask = np.repeat(prompt_mask, per_prompt, axis=0)
    return (np.concatenate([prompt, tokens[:, :start]], axis=1).astype(np.int32),
            np.concatenate([mask, np.ones((len(mask), start), bool)], axis=1))


def write_segment(paths: dict, out, live: np.ndarray, start: int,
                  versions: np.ndarray | None = None) -> dict:
    """``paths`` with the engine's segment output (``SampleOutput``, [rows, end - start]) written
    at positions [start, end) of the live rows; the others keep what their parent had.
    ``versions`` int32 [rows, end - start] (in-flight weights): each segment token's version."""
    seg = dist.to_host_tree(out)   # (several processes: the global values)
    end = start + seg.tokens.shape[1]
    paths = {name: x.copy() for name, x in paths.items()}
    paths["tokens"][live, start:end] = seg.tokens[live]
    paths["logps"][live, start:end] = np.where(seg.mask, seg.logps, 0.0)[live]
    if versions is not None:
        paths["versions"][live, start:end] = versions[live]
    paths["lengths"][live] += seg.lengths[live]
    paths["done"][live] = ~seg.truncated[live]
    return paths


def generate(cfg: models.ModelConfig, params: Any, prompt_tokens: Any, prompt_mask: Any, *,
             rng: jax.Array, max_new_tokens: int, segment_tokens: int, branching: int,
             depth: int, roots: int = 1, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, eos_id: int | Sequence[int] | None = None, pad_id: int = 0,
             stop_ids: Sequence[int] = (), slots: int = 64, chunk_steps: int = 16,
             cache_dtype: Any = None, weights: Callable[[], tuple[Any, int]] | None = None,
             image_embeds: Any = None, temperatures: Any = None, record_routes: bool = False,
             ) -> tuple[TreeSampleOutput, list[engine.EngineStats]]:
    """Samples ``sampling.tree.generate``'s trees (B*M leaf rows) with the slot engine.

    Arguments as ``sampling.tree.generate`` (prompt_tokens int32 [B, P] left-padded,
    prompt_mask bool [B, P]), plus the engine's ``slots``, ``chunk_steps`` and in-flight
    ``weights`` (module docstring; ``params`` is then unused). ``image_embeds`` [B, K, D]: each
    prompt's images, prefilled with every request of its tree. ``temperatures`` float32 [N]
    (a schedule): each level's requests decode positions [start, end) at
    ``temperatures[start:end]``, as ``sampling.tree.generate`` draws them.
    ``record_routes`` (a mixture of experts): the output's ``routes`` int32 [B*M, P+N, L, k],
    each leaf's from the level that decoded its last segment (that level's prefill of the
    prompt and the path so far, then the segment's decode), as ``sampling.tree`` lays them
    out; a leaf of a path that stopped earlier keeps its ancestor's.
    Returns ``(TreeSampleOutput, [EngineStats] per level)``; with ``weights``, the output's
    ``versions`` int32 [B*M, N] and each level's ``swaps`` counting a change at its start.
    """
    check_tree(max_new_tokens, segment_tokens, branching, depth, roots)
    prompt_tokens = np.asarray(prompt_tokens, np.int32)
    prompt_mask = np.asarray(prompt_mask, bool)
    b, n = prompt_tokens.shape[0], int(max_new_tokens)
    paths = dict(tokens=np.full((b, n), pad_id, np.int32), logps=np.zeros((b, n), np.float32),
                 lengths=np.zeros(b, np.int32), done=np.zeros(b, bool))
    polls = None if weights is None else engine.VersionPolls(weights)
    if polls is not None:
        paths["versions"] = np.zeros((b, n), np.int32)
    if record_routes:
        paths["routes"] = np.zeros((b, prompt_tokens.shape[1] + n, cfg.num_layers,
                                    cfg.num_experts_per_tok), np.int32)
    decoded, stats = np.zeros(b, np.int32), []
    draw = dict(temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos_id,
                pad_id=pad_id, stop_ids=stop_ids)
    if temperatures is not None:
        temperatures = np.asarray(temperatures, np.float32)
        if temperatures.shape != (n,):
            raise ValueError(f"temperatures must have shape ({n},), got {temperatures.shape}")
    greedy = temperatures is None and temperature == 0.0
    for level, (start, end) in enumerate(level_bounds(n, segment_tokens, depth)):
        paths = fork(paths, roots if level == 0 else branching)
        rows = len(paths["done"])
        live = ~paths["done"]   # a stopped path's children decode nothing
        tokens, mask = requests(prompt_tokens, prompt_mask, paths["tokens"], start)
        noise = None if greedy else level_noise(rng, start, end, rows, cfg.vocab_size)
        swaps = 0 if polls is None else polls.swaps
        out, st = engine.generate(cfg, params, tokens, mask, rng=rng, max_new_tokens=end - start,
                                  slots=slots, chunk_steps=chunk_steps, cache_dtype=cache_dtype,
                                  noise=noise, live=live, weights=polls, **draw,
                                  image_embeds=None if image_embeds is None else
                                  np.repeat(dist.to_host(image_embeds), rows // b, axis=0),
                                  temperatures=(None if temperatures is None else
                                                temperatures[start:end]),
                                  record_routes=record_routes)
        if polls is not None:
            st = dataclasses.replace(st, swaps=polls.swaps - swaps)
        before = paths["lengths"].copy()
        paths = write_segment(paths, out, live, start, st.versions)
        if record_routes:   # the prompt, the path so far and the segment, as this level fed them
            routes = dist.to_host(out.routes)
            paths["routes"][live, :routes.shape[1]] = routes[live]
        decoded += (paths["lengths"] - before).reshape(b, -1).sum(axis=1).astype(np.int32)
        stats.append(st)
    node_ids, _ = tree_layout(roots, branching, depth)
    lengths = paths["lengths"]
    return TreeSampleOutput(
        tokens=paths["tokens"], logps=paths["logps"],
        mask=np.arange(n)[None, :] < lengths[:, None], lengths=lengths,
        truncated=~paths["done"], node_ids=np.tile(node_ids, (b, 1)), decoded=decoded,
        versions=paths.get("versions"), routes=paths.get("routes")), stats


def programs(cfg: models.ModelConfig, params: Any, prompt_tokens: Any, prompt_mask: Any,
             rng: Any, *, max_new_tokens: int, segment_tokens: int, branching: int, depth: int,
             roots: int = 1, **engine_kw) -> list[tuple[str, Any, tuple]]:
    """The engine programs of the widest level, the leaves', for a memory plan:
    ``sampling.engine.programs`` for ``B * M`` requests of ``P + D * L`` prompt tokens, each
    decoding ``N - D * L`` (the most rows and the longest pages any level holds).
    prompt_tokens, prompt_mask: [B, P] (``jax.ShapeDtypeStruct``s or arrays); ``engine_kw``:
    ``sampling.engine.programs``' decoding arguments (slots, chunk_steps, temperature, ...)."""
    b, p = prompt_tokens.shape
    start, end = level_bounds(int(max_new_tokens), int(segment_tokens), int(depth))[-1]
    shape = (b * int(roots) * int(branching) ** int(depth), p + start)
    return engine.programs(cfg, params, jax.ShapeDtypeStruct(shape, jnp.int32),
                           jax.ShapeDtypeStruct(shape, jnp.bool_), rng,
                           max_new_tokens=end - start, num_samples=1, **engine_kw)
