"""Everything a run needs before its first step: mesh, tokenizer, model, data.

``check_inputs(cfg)`` (``rljax.train.core.inputs``) runs first and touches no accelerator: it turns
every problem a user can fix (files that do not exist, an unsupported checkpoint, a batch that
does not split over G or the mesh) into one ``UserError`` line. ``build_context(cfg, workdir)``
then creates the
``Context`` shared by all phases (SFT, GRPO, PPO, ...): mesh, tokenizer, model config and
initial parameters with their shardings, data configs, and optimizer factories.

The ``Phase`` protocol is what ``run.py`` drives; each algorithm file (``sft.py``, ``grpo.py``,
``ppo.py``, ...) provides a factory ``make(ctx, steps) -> Phase``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from rljax import data as data_lib
from rljax.data import selection
from rljax import models, rewards, tokenizers
from rljax.config import mesh as mesh_config
from rljax import sharding as shd
from rljax.errors import ConfigError, UserError
from rljax.train.core import optim, paths, quantized
from rljax.train.core.state import TrainState, state_shardings
# The input checks and data configs, re-exported: phases, the CLI and user code import them here.
from rljax.train.core.inputs import (TEMPLATES, check_context_length, check_data_files,  # noqa: F401
                                check_inputs, check_lengths, data_config, preference_config,
                                reward_fields, reward_kwargs, uses_preference_data)


class Phase(Protocol):
    """One training phase: a fixed number of iterations of one algorithm.

    ``init_state`` must be a pure jax function (it is also traced with ``jax.eval_shape`` to
    build the abstract state a checkpoint is restored into).
    """

    name: str
    steps: int

    def init_state(self, state: TrainState) -> TrainState:
        """The phase's starting state from the previous phase's (fresh optimizer, ref, ...)."""

    def iteration(self, state: TrainState, step: int) -> tuple[TrainState, dict]:
        """One iteration (0-based ``step`` within the phase) -> (new state, host metrics)."""

    def state_dict(self) -> dict:
        """JSON-able host state (data iterator positions) saved with checkpoints."""

    def load_state_dict(self, state: dict) -> None:
        """Restores ``state_dict()``."""


# ----------------------------------------------------------------------------- context

@dataclasses.dataclass
class Context:
    """What every phase shares. ``params`` is the freshly built or loaded (sharded) policy."""

    cfg: Any
    workdir: str
    mesh: Any
    tokenizer: Any
    model_cfg: models.ModelConfig
    params: Any
    param_shardings: Any
    stop: Any = None  # the run's StopSignal (set by the controller): waits on rewards poll it
    # Asynchronous RL with mesh.rollout_devices: the sampler's own mesh and the shardings of
    # its copy of the policy (``sharding.on_mesh``); None: the sampler uses ``mesh``.
    rollout_mesh: Any = None
    rollout_shardings: Any = None

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The ids that end a completion: EOS and ``rollout.stop_strings``."""
        return stop_ids(self.cfg, self.tokenizer)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def optimizer(self, learning_rate: float, total_steps: int):
        return optim.make_optimizer(self.cfg.optimizer, total_steps, learning_rate=learning_rate)

    def data_config(self, source: str | None = None, path: str | None = None) -> dict:
        """The ``rljax.data`` config dict for ``cfg.data`` (or another source/path)."""
        return data_config(self.cfg, source, path)

    def reward_fn(self):
        """``rewards.combine`` of ``reward.names`` / ``weights`` (``reward.kwargs[name]`` are the
        named function's options), with ``reward.timeout_s`` / ``isolation``; a stop request
        (SIGTERM, Ctrl-C) abandons a call that is still running."""
        r = self.cfg.reward
        weights = list(r.weights) or [1.0] * len(r.names)
        return rewards.combine(
            [(n, w, reward_kwargs(self.cfg, n)) for n, w in zip(r.names, weights)],
            default_score=r.default_score, timeout_s=r.timeout_s or None, isolation=r.isolation,
            # The flag itself, not should_stop(): that may be a collective (multi-host) or,
            # in tests, count calls; this is polled many times within a step.
            should_abort=lambda: getattr(self.stop, "signum", None) is not None)

    def state_shardings(self, shape_state: TrainState) -> TrainState:
        critic = None
        if shape_state.critic_params is not None:
            axes = models.value_param_logical_axes(self.model_cfg)
            if set(shape_state.critic_params["trunk"]) == {"lora"}:  # adapters on the base
                axes = {"trunk": {"lora": models.lora.lora_logical_axes(
                    self.model_cfg, models.lora.rank_of(self.params["lora"]),
                    tuple(self.params["lora"]["layers"]))}, "head": axes["head"]}
            critic = shd.logical_to_sharding(axes, self.mesh, shapes=shape_state.critic_params)
        return state_shardings(shape_state, self.param_shardings, critic)

    @property
    def dp_size(self) -> int:
        return math.prod(self.mesh.shape[a] for a in shd.BATCH_AXES)


def make_tokenizer(cfg, workdir: str | None):
    """The run's tokenizer: ``tokenizer.path``, else the model dir, else a CharTokenizer
    (saved into the workdir so ``eval``/``sample`` use the very same one)."""
    t = cfg.tokenizer
    path = t.path or (cfg.model.path if t.kind != "char" else "")
    if workdir and not path and paths.isfile(paths.join(workdir, tokenizers.CHAR_TOKENIZER_FILE)):
        return tokenizers.CharTokenizer.load(workdir)
    if path and t.kind != "char":
        try:
            tok = tokenizers.load(path)
        except (ValueError, OSError) as e:
            raise UserError(f"cannot load a tokenizer from {path!r}: {e}") from None
        if t.chat_template and not tok.has_chat_template:
            raise ConfigError(f"tokenizer.chat_template=True but the tokenizer from {path!r} "
                              "has no chat template")
        return tok
    tok = tokenizers.CharTokenizer()
    if t.chat_template and not tok.has_chat_template:
        raise ConfigError("tokenizer.chat_template=True but the character tokenizer has no "
                          "chat template")
    if workdir:
        paths.makedirs(workdir)  # a local directory or a URL (gs://...)
        tok.save(workdir)
    return tok


def stop_ids(cfg, tokenizer) -> tuple[int, ...]:
    """EOS (when the tokenizer has one) and the id of each ``rollout.stop_strings`` text;
    ConfigError naming the text when it is not exactly one token."""
    ids = [] if tokenizer.eos_id is None else [int(tokenizer.eos_id)]
    for text in cfg.rollout.get("stop_strings", ()):
        got = tokenizer.encode(text)
        if len(got) != 1:
            raise ConfigError(f"rollout.stop_strings: {text!r} is {len(got)} tokens of this "
                              f"tokenizer ({got}); each stop string must be exactly one token")
        ids.append(int(got[0]))
    return tuple(dict.fromkeys(ids))


def build_model(cfg, tokenizer, mesh, rng) -> tuple[models.ModelConfig, Any, Any]:
    """(model_cfg, params, param_shardings): a preset from scratch or a HF checkpoint."""
    m = cfg.model
    if m.path and m.vision.load:
        return _load_vlm(cfg, tokenizer, mesh)
    if m.path:
        try:
            model_cfg = models.load_config(m.path, dtype=jnp.dtype(m.dtype),
                                           remat=bool(m.remat), **dict(m.overrides))
        except (ValueError, TypeError) as e:
            raise ConfigError(f"model: {e}") from None
        check_context_length(cfg, model_cfg)
        shardings = _param_shardings(model_cfg, mesh)
        quantizer, q_shardings = _quantizer(cfg, model_cfg, mesh, shardings)
        try:
            model_cfg, params = models.load_hf(m.path, dtype=jnp.dtype(m.dtype),
                                               shardings=shardings, transform=quantizer,
                                               remat=bool(m.remat), **dict(m.overrides))
        except models.HFCheckpointError as e:
            raise UserError(f"model.path={m.path!r}: {e}") from None
        if model_cfg.vocab_size < tokenizer.vocab_size:
            raise UserError(f"tokenizer has {tokenizer.vocab_size} tokens but the model's "
                            f"vocabulary has only {model_cfg.vocab_size}")
        return model_cfg, params, q_shardings
    overrides = {"vocab_size": tokenizer.vocab_size, "dtype": m.dtype, "param_dtype": m.dtype,
                 "remat": bool(m.remat), "eos_token_id": tokenizer.eos_id,
                 "pad_token_id": tokenizer.pad_id, "bos_token_id": tokenizer.bos_id}
    overrides.update(dict(m.overrides))
    if models.PRESETS.get(m.preset, {}).get("vision") is not None:
        overrides.update(image_token_id=image_token_id(cfg, tokenizer),
                         train_vision=bool(m.vision.train))
    try:
        model_cfg = models.get_preset(m.preset, **overrides)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"model: {e}") from None
    if model_cfg.vision is not None and (m.quantize or m.lora.rank and m.vision.train):
        raise ConfigError("model.vision: a vision tower trains only with full fine-tuning "
                          "and is never quantized (model.quantize='', and model.lora.rank=0 "
                          "with vision.train=True)")
    check_context_length(cfg, model_cfg)
    shardings = _param_shardings(model_cfg, mesh)
    params = jax.jit(lambda r: models.init_params(model_cfg, r), out_shardings=shardings)(rng)
    quantizer, q_shardings = _quantizer(cfg, model_cfg, mesh, shardings)
    if quantizer is not None:
        params = quantized.quantize_tree(quantizer, params)
    return model_cfg, params, q_shardings


def image_token_id(cfg, tokenizer) -> int:
    """The id of ``model.vision.image_token`` (ConfigError unless it is one token)."""
    text = cfg.model.vision.image_token
    ids = tokenizer.encode(text)
    if len(ids) != 1 or ids[0] == getattr(tokenizer, "unk_id", None):
        raise ConfigError(f"model.vision.image_token={text!r} is {ids} in this tokenizer; it "
                          "must be exactly one known token")
    return int(ids[0])


def _load_vlm(cfg, tokenizer, mesh):
    """A multimodal Gemma 3 checkpoint with its tower (full precision), each tensor placed
    in its sharding as it is read."""
    from rljax.models import hf_vision
    m = cfg.model
    if m.quantize or (m.lora.rank and m.vision.train):
        raise ConfigError("model.vision: a vision tower trains only with full fine-tuning "
                          "and is never quantized")
    kwargs = dict(dtype=jnp.dtype(m.dtype), remat=bool(m.remat),
                  train_vision=bool(m.vision.train), **dict(m.overrides))
    try:
        vlm = hf_vision.vlm_config(m.path, **kwargs)
        model_cfg = vlm[0]
        check_context_length(cfg, model_cfg)
        if image_token_id(cfg, tokenizer) != model_cfg.image_token_id:
            raise ConfigError(f"model.vision.image_token={m.vision.image_token!r} is not the "
                              f"checkpoint's image token id {model_cfg.image_token_id}")
        shardings = _param_shardings(model_cfg, mesh)
        model_cfg, _, params = hf_vision.load_hf_vlm(m.path, shardings=shardings, **kwargs)
    except models.HFCheckpointError as e:
        raise UserError(f"model.path={m.path!r}: {e}") from None
    return model_cfg, params, shardings


def quantized_base(cfg, model_cfg):
    """``(shapes, logical_axes, keep_plan)`` of the base tree ``model.quantize`` keeps
    (abstract); ``keep_plan`` is ``gguf_keep.keep_plan``'s for ``keep``, else None."""
    m = cfg.model
    return quantized.quantized_shapes(model_cfg, m.quantize, int(m.quantize_block), m.path)


def _quantizer(cfg, model_cfg, mesh, shardings):
    """``make_quantizer`` for ``model.quantize`` (and ``model.quantize_block``, ``model.path``)."""
    m = cfg.model
    return quantized.make_quantizer(model_cfg, mesh, shardings, m.get("quantize", ""),
                                    int(m.get("quantize_block", 64)), m.path)


def add_lora(cfg, model_cfg, params, shardings, mesh, rng):
    """With ``model.lora.rank`` > 0 (or ``model.adapter_path``): float32 LoRA adapters (fresh,
    or loaded from a PEFT adapter dir) under ``params["lora"]``, and ``lora_scale`` and
    ``lora_dropout`` in the model config. The base parameters are left as they are (frozen, in
    ``model.dtype``). The dropout rate is ``model.lora.dropout``; when that is 0 and an adapter
    dir is loaded, its ``lora_dropout`` (as PEFT resumes training an adapter)."""
    m = cfg.model
    if not m.lora.rank and not m.adapter_path:
        return model_cfg, params, shardings
    lora = models.lora
    if m.adapter_path:
        try:
            adapters, rank, alpha = models.peft.load_adapter(m.adapter_path, model_cfg)
            dropout = float(m.lora.dropout) or models.peft.adapter_dropout(m.adapter_path)
        except ValueError as e:
            raise UserError(f"model.adapter_path={m.adapter_path!r}: {e}") from None
        targets = tuple(adapters["layers"])
    else:
        rank, alpha, targets = int(m.lora.rank), float(m.lora.alpha), m.lora.targets
        dropout = float(m.lora.dropout)
        adapters = None
    model_cfg = model_cfg.replace(lora_scale=alpha / rank, lora_dropout=dropout)
    axes = lora.lora_logical_axes(model_cfg, rank, targets)
    shapes = jax.eval_shape(lambda: lora.init_lora(model_cfg, rank, targets, jax.random.key(0)))
    lora_sh = shd.logical_to_sharding(axes, mesh, shapes=shapes)
    if adapters is None:
        adapters = jax.jit(lambda r: lora.init_lora(model_cfg, rank, targets, r),
                           out_shardings=lora_sh)(rng)
    else:
        adapters = shd.shard_params(adapters, lora_sh)
    return model_cfg, {**params, "lora": adapters}, {**shardings, "lora": lora_sh}


def _param_shardings(model_cfg, mesh):
    shapes = jax.eval_shape(lambda: models.init_params(model_cfg, jax.random.key(0)))
    return shd.logical_to_sharding(models.param_logical_axes(model_cfg), mesh, shapes=shapes)


def build_context(cfg, workdir: str, devices=None) -> Context:
    """Mesh, tokenizer, model and shardings for ``cfg`` (call ``check_inputs`` first)."""
    mesh, rollout_mesh = make_meshes(cfg, devices)
    tokenizer = make_tokenizer(cfg, workdir)
    stop_ids(cfg, tokenizer)   # a bad stop string is named before the model loads
    model_cfg, params, shardings = build_model(cfg, tokenizer, mesh,
                                               jax.random.fold_in(jax.random.key(cfg.seed), 1))
    model_cfg, params, shardings = add_lora(cfg, model_cfg, params, shardings, mesh,
                                            jax.random.fold_in(jax.random.key(cfg.seed), 2))
    rollout_shardings = (None if rollout_mesh is None else
                         shd.on_mesh(shardings, params, rollout_mesh))
    return Context(cfg, workdir, mesh, tokenizer, model_cfg, params, shardings,
                   rollout_mesh=rollout_mesh, rollout_shardings=rollout_shardings)


def sampler_context(ctx: Context) -> Context:
    """The context the sampler of asynchronous RL runs in: the rollout mesh and the shardings
    of the policy's copy there (``mesh.rollout_devices``), or ``ctx`` itself on one mesh."""
    if ctx.rollout_mesh is None:
        return ctx
    return dataclasses.replace(ctx, mesh=ctx.rollout_mesh, params=None,
                               param_shardings=ctx.rollout_shardings)


def make_meshes(cfg, devices=None):
    """``(training mesh, rollout mesh or None)``: with ``mesh.rollout_devices`` = r > 0 the
    last r devices form the rollout mesh (axes ``mesh.rollout``), the rest the training mesh
    (``mesh.data/fsdp/tensor``); otherwise one mesh of every device and None."""
    devices = list(jax.devices() if devices is None else devices)
    r = int(cfg.mesh.get("rollout_devices", 0))
    try:
        train, rollout = shd.split_devices(devices, r)
        mesh = shd.make_mesh(mesh_config.axis_sizes(cfg.mesh), devices=train)
        rollout_mesh = (shd.make_mesh(mesh_config.axis_sizes(cfg.mesh.rollout), devices=rollout)
                        if r else None)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return mesh, rollout_mesh


def update_sizes(cfg) -> tuple[int, int, int]:
    """(mini-batch rows, micro-batches per mini-batch, updates per iteration) of an RL phase.

    ``rollout.batch_size`` completions are split into mini-batches of ``algo.mini_batch_size``
    (default: all), each one exact update accumulated over micro-batches of
    ``algo.micro_batch_size``, for ``algo.num_iterations`` epochs.
    """
    a, batch = cfg.algo, cfg.rollout.batch_size
    mini = a.mini_batch_size or batch
    num_micro = mini // a.micro_batch_size if a.micro_batch_size else 1
    return mini, num_micro, a.num_iterations * (batch // mini)


def data_iterator(ctx: Context, batch_size: int, split: str = "train", seed_offset: int = 0,
                  source: str | None = None, path: str | None = None, num_epochs=None):
    """A checkpointable ``DataIterator`` over the run's data (or another source/path)."""
    try:
        it = data_lib.make_iterator(ctx.data_config(source, path), batch_size=batch_size,
                                    seed=ctx.cfg.seed + seed_offset, split=split,
                                    tokenizer=ctx.tokenizer, num_epochs=num_epochs)
    except (ValueError, KeyError) as e:
        raise UserError(f"data: {e}") from None
    check_lengths(ctx.cfg, it, "data")
    return it


def rl_iterator(ctx: Context, num_prompts: int):
    """The RL rollout's prompts: the run's data iterator behind the configured prompt
    selection (``data.selection``; ``uniform`` is the iterator itself). Checkpointable."""
    return selection.make(data_iterator(ctx, num_prompts), ctx.cfg.data.selection,
                          seed=ctx.cfg.seed)


