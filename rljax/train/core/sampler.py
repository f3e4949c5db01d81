"""The rollout's sampler, chosen in one place (``sampler_kind``): the static batch sampler
(``sampling.generate``: prefill once per prompt, fan out G samples), the slot engine
(``sampling.engine``: continuous batching over ``rollout.slots`` slots), its partial-rollout
pool (``sampling.partial``, groups carried across iterations), or tree sampling
(``sampling.tree``, or with ``rollout.engine='slots'`` the tree's forks served as slot-engine
requests, ``sampling.tree_engine``); for multi-turn episodes, the static turn batches or the
episode engine (``episode_engine``). ``generate`` runs the chosen one on a batch of prompts
and returns numpy arrays; ``core.programs`` plans the same choice's programs for
``rljax plan``.

The parameters the sampler reads are the update's own arrays (``sampling_params``: with LoRA
on a float32 base, the adapters folded in once per version).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from rljax import distributed as dist
from rljax import sampling
from rljax.models import lora as lora_lib
from rljax.sampling import tree as tree_sampling

KINDS = ("static", "slots", "partial", "tree", "tree_slots")


def rollout_temperatures(cfg) -> np.ndarray | None:
    """float32 [rollout.max_new_tokens] per-position temperatures of the configured
    ``rollout.temperature_schedule``, or None when it is "constant" (``rollout.temperature``).
    Multi-turn episodes: [env.max_total_tokens], one per model token of the trajectory (its
    k-th model token, whatever turn it is in: ``episodes.run_episodes``)."""
    s = cfg.rollout.temperature_schedule
    if s.name == "constant":
        return None
    length = cfg.env.max_total_tokens if cfg.env.name else cfg.rollout.max_new_tokens
    return sampling.temperature_schedule(s.name, s.start, s.end, s.tokens, int(length))


def token_temperatures(schedule: np.ndarray, shape, model_mask=None) -> np.ndarray:
    """f32 ``shape`` [R, N]: the temperature each completion token was drawn at: position t's
    ``schedule[t]``, or for episodes (``model_mask`` bool [R, N]) a row's k-th model token's
    ``schedule[k]``, 1 on observation tokens (context: never scored)."""
    if model_mask is None:
        return np.broadcast_to(schedule, shape).astype(np.float32)
    k = np.clip(np.cumsum(model_mask, axis=1) - 1, 0, len(schedule) - 1)
    return np.where(model_mask, np.asarray(schedule, np.float32)[k], 1.0).astype(np.float32)


def sampler_kind(cfg, tree: bool = False) -> str:
    """Which sampler a rollout of ``cfg`` runs: "tree" / "tree_slots" (``tree``: a tree-sampled
    group, on the slot engine with ``rollout.engine='slots'``), "partial" (the slot engine's
    pool, ``rollout.partial``), "slots" (``rollout.engine``) or "static". Config validation
    refuses the combinations that have no meaning."""
    if tree:
        return "tree_slots" if cfg.rollout.engine == "slots" else "tree"
    if cfg.rollout.engine == "slots":
        return "partial" if cfg.rollout.partial else "slots"
    return "static"


def engine_slots(cfg, rows: int) -> int:
    """The slot engine's slots: ``rollout.slots``, or a quarter of the rows it samples."""
    return int(cfg.rollout.slots or max(1, rows // 4))


def episode_engine(cfg, rows: int):
    """Multi-turn episodes' sampler: ``episodes.EngineOptions`` with ``rollout.engine='slots'``
    (each episode on a slot of its own, ``sampling.episode_engine``), None for the static turn
    batches."""
    if sampler_kind(cfg) != "slots":
        return None
    from rljax.train.core.episodes import EngineOptions
    return EngineOptions(slots=engine_slots(cfg, rows), chunk_steps=int(cfg.rollout.chunk_steps))


@functools.partial(jax.jit, static_argnums=0)
def _merged(model_cfg, params):
    return lora_lib.merge(model_cfg, params)


def merges_for_sampling(cfg, model_cfg, params) -> bool:
    """Whether the sampler reads the adapters merged into the base (``sampling_params``)."""
    return bool(cfg.model.lora.merge_for_sampling and lora_lib.has_lora(params)
                and jnp.dtype(model_cfg.dtype) == jnp.float32
                and not cfg.model.get("quantize", ""))


def sampling_params(ctx, params):
    """The parameters the sampler reads: ``params`` as they are, or, with LoRA adapters on a
    float32 base and ``model.lora.merge_for_sampling``, the adapters folded in once
    (``lora.merge``). Same model up to float32 rounding; the training step keeps the
    unmerged tree. A quantized base is never merged (that would be a float copy of it)."""
    if not merges_for_sampling(ctx.cfg, ctx.model_cfg, params):
        return params
    return _merged(ctx.model_cfg, params)


def rebucket_routes(routes: np.ndarray, p_from: int, p_to: int) -> np.ndarray:
    """Routes int [R, p_from + N, L, k] of left-padded prompts, laid out for a prompt bucket of
    ``p_to`` columns (real prompt tokens end at the bucket's last column either way): left
    padding added (entries 0) or removed."""
    prompt, completion = routes[:, :p_from], routes[:, p_from:]
    if p_to >= p_from:
        pad = np.zeros((routes.shape[0], p_to - p_from) + routes.shape[2:], routes.dtype)
        prompt = np.concatenate([pad, prompt], axis=1)
    else:
        prompt = prompt[:, p_from - p_to:]
    return np.concatenate([prompt, completion], axis=1)


def generate(ctx, params, prompt_tokens, prompt_mask, rng, *, num_samples: int,
             max_new_tokens: int, temperature: float, top_k: int = 0, top_p: float = 1.0,
             micro_prompts: int = 0, temperatures=None, tree: dict | None = None,
             pixels=None, images=None, weights=None, prompt_index=None, row_keys=None):
    """``sampling.generate`` over chunks of ``micro_prompts`` prompts; numpy outputs, plus
    ``decoded`` int [B]: the tokens decoded per prompt.

    ``temperatures``: optional per-position schedule f32 [max_new_tokens], or one per output
    row, [B * num_samples, max_new_tokens] (``sampling.generate``).
    ``tree`` (``tree_sampling.options_from_config``): ``tree_sampling.generate`` instead (or
    ``sampling.tree_engine.generate`` with ``rollout.engine='slots'``); its
    ``num_samples`` leaves per prompt are the group; shared segments are decoded (and counted)
    once; a tree takes one schedule [max_new_tokens], each segment drawn at its positions'
    temperatures.
    ``pixels`` [B, I, 3, S, S] with ``images`` (``image_inputs.ImageInputs``): each prompt's
    images, embedded by the tower and prefilled with the prompt (a tree's: with every path).
    ``weights`` (slot engine only): in-flight weight updates, ``() -> (params, version)``
    polled between decode chunks (``sampling.engine.generate``; a tree's also between its
    levels, ``sampling.tree_engine``); adds ``versions`` int [R, N]
    (the version that drew each token) and ``swaps`` (how often the weights changed, between
    two prompt chunks included).
    ``prompt_index`` int [R] (one chunk, no tree; ``num_samples`` 1): row r continues prompt
    ``prompt_index[r]`` (groups of any sizes). The static sampler shares each prompt's prefill
    among its rows (``sampling.generate``); the slot engine prefills each row's prompt.
    ``row_keys`` [B * num_samples], or [R] with ``prompt_index`` (static sampler): each
    output row draws from its own key (``sampling.generate``), whatever rows share its batch.
    """
    kind = sampler_kind(ctx.cfg, tree is not None)
    params = sampling_params(ctx, params)
    if weights is not None:   # swaps counted across the prompt chunks (between two, too)
        weights = sampling.engine.VersionPolls(sampling_weights(ctx, weights))
    b = prompt_tokens.shape[0]
    chunk = micro_prompts or b
    if prompt_index is not None and (chunk < b or tree is not None):
        raise ValueError("prompt_index needs one chunk of prompts and no tree")
    if row_keys is not None and kind != "static":
        raise ValueError(f"row_keys needs the static sampler, not the {kind} one")
    if prompt_index is not None and kind != "static":   # the engine's rows: one per prompt
        prompt_tokens, prompt_mask = prompt_tokens[prompt_index], prompt_mask[prompt_index]
        pixels = None if pixels is None else pixels[prompt_index]
        b, chunk, prompt_index = len(prompt_index), len(prompt_index), None
    outs, engine_stats = [], []
    for i, start in enumerate(range(0, b, chunk)):
        p_tok, p_mask = prompt_tokens[start:start + chunk], prompt_mask[start:start + chunk]
        if kind in ("static", "tree"):   # multi-host: same prompts, each process its own rows
            p_tok, p_mask = dist.device_batch((p_tok, p_mask), ctx.mesh)
        temps = (temperatures if temperatures is None or np.ndim(temperatures) == 1 else
                 temperatures[start * num_samples:(start + chunk) * num_samples])
        kw = dict(rng=jax.random.fold_in(rng, i), max_new_tokens=max_new_tokens,
                  temperature=temperature, top_k=top_k, top_p=top_p,
                  eos_id=ctx.stop_ids, pad_id=ctx.tokenizer.pad_id, mesh=ctx.mesh)
        if pixels is not None:
            kw["image_embeds"] = images.embeds(params, pixels[start:start + chunk])
        if kind in ("slots", "partial"):   # (the partial pool itself is PartialRounds')
            out = _slot_engine(ctx, params, p_tok, p_mask, num_samples, temps, kw,
                               engine_stats, weights)
        elif kind == "tree_slots":
            out = _tree_engine(ctx, params, p_tok, p_mask, tree, kw, engine_stats, weights,
                               temps)
        elif kind == "static":
            out = sampling.generate(ctx.model_cfg, params, p_tok, p_mask,
                                    num_samples=num_samples, temperatures=temps,
                                    streams=ctx.cfg.rollout.streams,
                                    record_routes=bool(ctx.cfg.algo.get("routing_replay")),
                                    prompt_index=prompt_index,
                                    row_keys=row_keys if row_keys is None or prompt_index
                                    is not None else   # (prompt_index: one chunk)
                                    row_keys[start * num_samples:(start + chunk) * num_samples],
                                    **kw)
        else:
            out = tree_sampling.generate(ctx.model_cfg, params, p_tok, p_mask,
                                         temperatures=temps, **tree,
                                         record_routes=bool(ctx.cfg.algo.get("routing_replay")),
                                         **kw)
        outs.append(dist.to_host_tree(out) if dist.is_multiprocess() else jax.device_get(out))
    result = {k: np.concatenate([getattr(o, k) for o in outs]) for k in
              ("tokens", "logps", "mask", "lengths", "truncated")}
    if getattr(outs[0], "routes", None) is not None:
        result["routes"] = np.concatenate([o.routes for o in outs])
    result["decoded"] = (np.concatenate([o.decoded for o in outs]) if tree is not None else
                         result["lengths"].reshape(-1, num_samples).sum(axis=1))
    if engine_stats:   # the slot engine's busy and run slot-steps (its utilisation)
        result["slot_steps"] = (sum(st.useful_steps for st in engine_stats),
                                sum(st.slots * st.decode_steps for st in engine_stats))
    if weights is not None:   # a tree's are its leaves' (its levels' stats have other rows)
        result["versions"] = np.concatenate([o.versions for o in outs] if tree is not None else
                                            [st.versions for st in engine_stats])
        result["swaps"] = weights.swaps
    return result


def sampling_weights(ctx, weights):
    """``weights`` with ``sampling_params`` applied once per version."""
    seen = {}

    def current():
        params, version = weights()
        if version not in seen:
            seen.clear()
            seen[version] = sampling_params(ctx, params)
        return seen[version], version
    return current


def _tree_engine(ctx, params, prompt_tokens, prompt_mask, tree: dict, kw, stats: list,
                 weights=None, temperatures=None):
    """``sampling.tree_engine.generate`` for one chunk of prompts (appends each level's
    EngineStats), with in-flight ``weights`` polled between levels and decode chunks and
    the ``temperatures`` schedule [N] drawn at each segment's positions."""
    rows = int(np.shape(prompt_tokens)[0]) * tree_sampling.num_leaves(
        tree["roots"], tree["branching"], tree["depth"])
    kw = {k: v for k, v in kw.items() if k != "mesh"}   # params keep their own sharding
    out, st = sampling.tree_engine.generate(
        ctx.model_cfg, params, np.asarray(prompt_tokens), np.asarray(prompt_mask), **tree,
        slots=engine_slots(ctx.cfg, rows), chunk_steps=ctx.cfg.rollout.chunk_steps,
        weights=weights, temperatures=temperatures,
        record_routes=bool(ctx.cfg.algo.get("routing_replay")), **kw)
    stats.extend(st)
    return out


def _slot_engine(ctx, params, prompt_tokens, prompt_mask, num_samples, temperatures, kw,
                 stats: list, weights=None):
    """``sampling.engine.generate`` for one chunk of prompts (appends its EngineStats)."""
    rows = int(np.shape(prompt_tokens)[0]) * num_samples
    kw = {k: v for k, v in kw.items() if k != "mesh"}   # params keep their own sharding
    out, st = sampling.engine.generate(
        ctx.model_cfg, params, np.asarray(prompt_tokens), np.asarray(prompt_mask),
        num_samples=num_samples, temperatures=temperatures,
        slots=engine_slots(ctx.cfg, rows),
        chunk_steps=ctx.cfg.rollout.chunk_steps, weights=weights,
        record_routes=bool(ctx.cfg.algo.get("routing_replay")), **kw)
    stats.append(st)
    return out


def scores_kl(algo_cfg) -> bool:
    """Asynchronous RL with GRPO's KL in the reward: the sampler scores the batch it draws under
    the policy that drew it and under the reference, a copy of which it keeps on its mesh
    (PPO shapes its token rewards at update time instead)."""
    a = algo_cfg
    return bool(a.get("asynchronous", False) and a.kl_in_reward and a.beta > 0
                and a.name != "ppo")
