"""LoRA adapters on the pure-function transformer: more leaves of the same parameter pytree.

A model with adapters is the base parameter tree plus a ``"lora"`` subtree, stacked per layer
like the base weights::

    params["lora"] = {"layers": {"q": {"a": [L, D, r], "b": [L, r, H, Dh]},
                                 "o": {"a": [L, H, Dh, r], "b": [L, r, D]},
                                 "gate": {"a": [L, D, r], "b": [L, r, F]}, ...}}

``a`` has the projection's input axes then the rank, ``b`` the rank then its output axes, so
every projection ``y = x @ W`` becomes ``y = x @ W + scale * (x @ A) @ B`` with
``scale = cfg.lora_scale`` (alpha / rank), two small matmuls written with the same ``dense`` as
the base weight (no merge). ``models.forward(cfg, params)`` applies whatever adapters the tree
holds; ``base_params(params)`` (the tree without ``"lora"``) is the base model -- with LoRA on,
that is the reference policy, at no memory cost.

Initialisation as in the LoRA paper (and PEFT): ``A`` uniform(+-1/sqrt(fan_in)), ``B = 0``, so
a fresh adapter leaves the base model's outputs exactly unchanged.

Dropout (``cfg.lora_dropout`` = p, as PEFT's ``lora_dropout``) acts on the adapter's input only:
``y = x @ W + scale * (dropout(x) @ A) @ B``, inverted (kept entries scaled by 1 / (1 - p)), and
only in training passes, which hand the model a key (``lora_dropout_rng``). Every layer and
projection draws its own mask from ``dropout_key(rng, layer, name)``.
"""
from __future__ import annotations

import math
import re
from typing import Any, Iterable

import jax
import jax.numpy as jnp

from rljax.models import quant
from rljax.models.config import ModelConfig

# Projection name -> number of leading input axes of its weight (``dense``'s ``n_in``).
PROJECTIONS = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1}
ALL_TARGETS = tuple(PROJECTIONS)
# Projection name -> its stream in ``dropout_key`` (the order of ``ALL_TARGETS``; fixed, so a
# mask does not depend on which other projections are targeted).
DROPOUT_STREAMS = {name: i for i, name in enumerate(ALL_TARGETS)}


def resolve_targets(targets: str | Iterable[str]) -> tuple[str, ...]:
    """Projection names selected by ``targets``: names or regexes (``"q|v"``, ``".*"``), each
    matched in full against ``q k v o gate up down``. Raises ValueError naming an entry that
    matches no projection."""
    if isinstance(targets, str):
        targets = [t for t in targets.split(",")]
    targets = [str(t).strip() for t in targets if str(t).strip()]
    if not targets:
        raise ValueError(f"no LoRA targets given; choose from {', '.join(ALL_TARGETS)}")
    chosen = set()
    for t in targets:
        try:
            hits = {n for n in ALL_TARGETS if re.fullmatch(t, n)}
        except re.error:
            hits = set()
        if not hits:
            raise ValueError(f"LoRA target {t!r} matches no projection (projections: "
                             f"{', '.join(ALL_TARGETS)})")
        chosen |= hits
    return tuple(n for n in ALL_TARGETS if n in chosen)


def _proj_shapes(cfg: ModelConfig) -> dict:
    """name -> (input shape, input axes, output shape, output axes) of a per-layer weight."""
    d, f, h, k, dh = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                      cfg.num_kv_heads, cfg.head_dim)
    return {
        "q": ((d,), ("embed",), (h, dh), ("heads", "head_dim")),
        "k": ((d,), ("embed",), (k, dh), ("kv_heads", "head_dim")),
        "v": ((d,), ("embed",), (k, dh), ("kv_heads", "head_dim")),
        "o": ((h, dh), ("heads", "head_dim"), (d,), ("embed",)),
        "gate": ((d,), ("embed",), (f,), ("mlp",)),
        "up": ((d,), ("embed",), (f,), ("mlp",)),
        "down": ((f,), ("mlp",), (d,), ("embed",)),
    }


def lora_shapes(cfg: ModelConfig, rank: int, targets) -> dict:
    """Same tree as ``init_lora``; leaves are ``(shape, logical_axes)`` pairs. The rank axis
    is replicated (``None``); the others follow the base weight's axes."""
    L = cfg.num_layers
    out = {}
    chosen = resolve_targets(targets)
    if cfg.is_moe and {"gate", "up", "down"} & set(chosen):
        raise ValueError(f"LoRA on a mixture of experts covers attention only (q, k, v, o); "
                         f"drop {sorted({'gate', 'up', 'down'} & set(chosen))} from the targets")
    for name in chosen:
        i_shape, i_axes, o_shape, o_axes = _proj_shapes(cfg)[name]
        out[name] = {"a": ((L,) + i_shape + (rank,), ("layers",) + i_axes + (None,)),
                     "b": ((L, rank) + o_shape, ("layers", None) + o_axes)}
    return {"layers": out}


def _is_spec(x) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple)


def lora_logical_axes(cfg: ModelConfig, rank: int, targets) -> dict:
    """Logical axes of ``init_lora(cfg, rank, targets, ...)`` (same tree, tuples of names)."""
    return jax.tree.map(lambda s: s[1], lora_shapes(cfg, rank, targets), is_leaf=_is_spec)


def init_lora(cfg: ModelConfig, rank: int, targets, rng: jax.Array,
              dtype=jnp.float32) -> dict:
    """Fresh adapters: ``A`` uniform(+-1/sqrt(fan_in)) (PEFT's kaiming-uniform(a=sqrt 5)),
    ``B`` zeros -- the adapted model equals the base model exactly."""
    if int(rank) <= 0:
        raise ValueError(f"LoRA rank must be > 0, got {rank}")
    specs = lora_shapes(cfg, int(rank), targets)["layers"]
    keys = jax.random.split(rng, len(specs))
    out = {}
    for key, (name, spec) in zip(keys, specs.items()):
        a_shape, b_shape = spec["a"][0], spec["b"][0]
        fan_in = math.prod(a_shape[1:-1])
        bound = 1.0 / math.sqrt(fan_in)
        out[name] = {"a": jax.random.uniform(key, a_shape, jnp.float32, -bound, bound).astype(dtype),
                     "b": jnp.zeros(b_shape, dtype)}
    return {"layers": out}


# ----------------------------------------------------------------------------- dropout

def dropout_key(rng: jax.Array, layer, name: str) -> jax.Array:
    """The dropout key of projection ``name`` in layer ``layer`` (int, may be traced) of one
    forward pass keyed by ``rng``: ``fold_in(fold_in(rng, layer), DROPOUT_STREAMS[name])``,
    so masks are independent across layers and projections (q, k and v read the same input
    but drop different entries of it, like PEFT's one dropout module per adapted layer)."""
    return jax.random.fold_in(jax.random.fold_in(rng, layer), DROPOUT_STREAMS[name])


def dropout(x: jax.Array, rate: float, rng: jax.Array) -> jax.Array:
    """Inverted dropout: each entry of ``x`` (any shape) is kept with probability ``1 - rate``
    and scaled by ``1 / (1 - rate)``, else set to 0. Same shape and dtype as ``x``; the mask is
    ``jax.random.bernoulli(rng, 1 - rate, x.shape)``."""
    keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
    return jnp.where(keep, x * jnp.asarray(1.0 / (1.0 - rate), x.dtype), jnp.zeros((), x.dtype))


# ----------------------------------------------------------------------------- tree helpers

def has_lora(params: Any) -> bool:
    return isinstance(params, dict) and "lora" in params


def base_params(params: dict) -> dict:
    """The tree without adapters: the base model (the free reference policy)."""
    return {k: v for k, v in params.items() if k != "lora"}


def _value_with_lora(params: Any) -> bool:
    return isinstance(params, dict) and "trunk" in params and has_lora(params["trunk"])


def _joint(params: Any) -> bool:  # PPO's {"policy", "critic"} view of the state
    return isinstance(params, dict) and set(params) == {"policy", "critic"}


def trainable(params: Any) -> Any:
    """What the optimizer sees (and a checkpoint holds): ``{"lora": adapters}`` when the tree
    has adapters; for a value model whose trunk has them, the trunk's adapters plus the head;
    else the whole tree. Works on any tree of the same structure (shardings, shapes)."""
    if _joint(params):
        return {k: trainable(v) for k, v in params.items()}
    if has_lora(params):
        return {"lora": params["lora"]}
    if _value_with_lora(params):
        return {**params, "trunk": {"lora": params["trunk"]["lora"]}}
    return params


def with_trainable(params: Any, new: Any) -> Any:
    """Inverse of ``trainable``: ``params`` (the full tree) with its trainable part ``new``."""
    if _joint(params):
        return {k: with_trainable(v, new[k]) for k, v in params.items()}
    if has_lora(params):
        return {**params, "lora": new["lora"]}
    if _value_with_lora(params):
        return {**new, "trunk": {**params["trunk"], "lora": new["trunk"]["lora"]}}
    return new


def attach(saved: Any, base: Any) -> Any:
    """A tree cut down by ``trainable`` (``{"lora": ...}``, or a value model whose trunk is
    ``{"lora": ...}``) put back on the frozen ``base`` tree; anything else is returned as is."""
    if isinstance(saved, dict) and set(saved) == {"lora"}:
        return {**base_params(base), "lora": saved["lora"]}
    if isinstance(saved, dict) and isinstance(saved.get("trunk"), dict) and \
            set(saved["trunk"]) == {"lora"}:
        return {**saved, "trunk": {**base_params(base["trunk"]), "lora": saved["trunk"]["lora"]}}
    return saved


def critic_base(params: dict) -> dict:
    """A value model's frozen trunk on a LoRA policy: the policy's base arrays (shared, no
    copy) without the LM head."""
    return {k: v for k, v in base_params(params).items() if k != "lm_head"}


def init_value_adapters(cfg: ModelConfig, policy_params: dict, rng: jax.Array) -> dict:
    """A critic / reward model on the policy's frozen base: its own fresh adapters (the
    policy's rank and targets) and a scalar head, ``{"trunk": {"lora": ...}, "head": ...}``.
    The trunk's base is not stored: ``value_on_base`` adds the policy's base arrays."""
    ad = policy_params["lora"]
    k_lora, k_head = jax.random.split(rng)
    kernel = cfg.init_std * jax.random.normal(k_head, (cfg.hidden_size,), jnp.float32)
    return {"trunk": {"lora": init_lora(cfg, rank_of(ad), tuple(ad["layers"]), k_lora)},
            "head": {"kernel": kernel, "bias": jnp.zeros((), jnp.float32)}}


def value_on_base(policy_params: dict, critic: Any) -> Any:
    """The full value-model tree of a critic whose trunk holds adapters only (see
    ``init_value_adapters``): the policy's base arrays under the critic's adapters."""
    if isinstance(critic, dict) and isinstance(critic.get("trunk"), dict) and \
            set(critic["trunk"]) == {"lora"}:
        return {**critic, "trunk": {**critic_base(policy_params), "lora": critic["trunk"]["lora"]}}
    return critic


def rank_of(adapters: dict) -> int:
    first = next(iter(adapters["layers"].values()))
    return int(first["a"].shape[-1])


def lora_delta(cfg: ModelConfig, name: str, ad: dict) -> jax.Array:
    """float32 ``scale * A @ B`` shaped like the (stacked) base weight ``name``."""
    del name  # the shapes say it all: a [L, in..., r], b [L, r, out...]
    a, b = ad["a"].astype(jnp.float32), ad["b"].astype(jnp.float32)
    L, r = a.shape[0], a.shape[-1]
    in_shape, out_shape = a.shape[1:-1], b.shape[2:]
    d = jnp.einsum("lkr,lrn->lkn", a.reshape(L, -1, r), b.reshape(L, r, -1))
    return (cfg.lora_scale * d).reshape((L,) + in_shape + out_shape)


def merge(cfg: ModelConfig, params: dict) -> dict:
    """Base tree with every adapter folded in: ``W + scale * A @ B`` (sum in float32, stored in
    the base weight's dtype). A model with adapters and its merge give the same outputs up to
    rounding. A quantized base (``models.quant``) is dequantized first: the merge is a float
    tree."""
    if not has_lora(params):
        return params
    out = quant.dequantize_params(base_params(params))
    layers = dict(out["layers"])
    for name, ad in params["lora"]["layers"].items():
        w = layers[name]
        layers[name] = (w.astype(jnp.float32) + lora_delta(cfg, name, ad)).astype(w.dtype)
    out["layers"] = layers
    return out
