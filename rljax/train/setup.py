"""Everything a run needs before its first step: input checks, mesh, tokenizer, model, data.

``check_inputs(cfg)`` runs first and touches no accelerator: it turns every problem a user can
fix (files that do not exist, an unsupported checkpoint, a batch that does not split over G or
the mesh) into one ``UserError`` line. ``build_context(cfg, workdir)`` then creates the
``Context`` shared by all phases (SFT, GRPO, PPO, ...): mesh, tokenizer, model config and
initial parameters with their shardings, data configs, and optimizer factories.

The ``Phase`` protocol is what ``run.py`` drives; each algorithm file (``sft.py``, ``grpo.py``,
``ppo.py``, ...) provides a factory ``make(ctx, steps) -> Phase``.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from rljax import data as data_lib
from rljax import models, rewards, tokenizers
from rljax import sharding as shd
from rljax.errors import ConfigError, UserError
from rljax.train import optim, paths
from rljax.train.state import TrainState, state_shardings

# Named prompt templates (``data.template``); anything else containing "{" is a format string.
TEMPLATES = {
    "plain": "{question}",
    "qa": "Question: {question}\nAnswer:",
    "gsm8k": ("Solve the problem. Think step by step, then give the final answer on its own "
              "line as '#### <number>'.\n\nQuestion: {question}\nAnswer:"),
}


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


# ----------------------------------------------------------------------------- input checks

def _template(cfg) -> str:
    name = cfg.data.template
    if name in TEMPLATES:
        return TEMPLATES[name]
    if "{" not in name:
        raise ConfigError(f"data.template={name!r} is neither a known template "
                          f"({', '.join(TEMPLATES)}) nor a format string like '{{question}}'")
    return name


def check_inputs(cfg, num_devices: int | None = None) -> None:
    """Raises UserError for problems found without compiling anything."""
    if cfg.model.path and models.is_gguf_path(cfg.model.path):
        models.inspect_gguf(cfg.model.path)  # GGUFError (a UserError) names what it cannot load
    elif cfg.model.path:
        path = cfg.model.path
        if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
            raise UserError(f"model.path={path!r} does not exist or has no config.json")
        with open(os.path.join(path, "config.json")) as f:
            model_type = json.load(f).get("model_type")
        if model_type not in models.SUPPORTED_MODEL_TYPES:
            raise UserError(f"model.path={path!r} has unsupported model_type {model_type!r}; "
                            f"supported: {', '.join(models.SUPPORTED_MODEL_TYPES)}")
    elif cfg.model.preset not in models.PRESETS:
        raise ConfigError(f"model.preset={cfg.model.preset!r} is not one of: "
                          f"{', '.join(sorted(models.PRESETS))}")
    for key in ("data.path", "data.eval_path", "sft.path", "tokenizer.path"):
        section, name = key.split(".")
        value = cfg[section][name]
        if value and not os.path.exists(value):
            raise UserError(f"{key}={value!r} does not exist")
    for name in cfg.reward.names:
        if name not in rewards.names():
            raise ConfigError(f"reward.names: unknown reward {name!r}; known: "
                              f"{', '.join(rewards.names())}")
    _template(cfg)
    mesh_sizes = dict(cfg.mesh.items())
    n = num_devices if num_devices is not None else jax.device_count()
    fixed = 1
    for v in mesh_sizes.values():
        fixed *= v if v != -1 else 1
    sizes = {k: (n // fixed if v == -1 else v) for k, v in mesh_sizes.items()}
    if (-1 in mesh_sizes.values() and n % fixed) or \
            sizes["data"] * sizes["fsdp"] * sizes["tensor"] != n:
        raise ConfigError(f"mesh {mesh_sizes} does not match the {n} available devices")
    dp = sizes["data"] * sizes["fsdp"]
    checks = [("rollout.batch_size", cfg.rollout.batch_size),
              ("algo.mini_batch_size", cfg.algo.mini_batch_size),
              ("algo.micro_batch_size", cfg.algo.micro_batch_size),
              ("sft.batch_size", cfg.sft.batch_size if cfg.sft.steps else 0)]
    for key, value in checks:
        if value and value % dp:
            raise ConfigError(f"{key}={value} is not divisible by the data-parallel mesh size "
                              f"{dp} (mesh.data x mesh.fsdp)")
    if cfg.data.max_prompt_length >= cfg.sft.max_length and cfg.sft.steps:
        raise ConfigError(f"sft.max_length={cfg.sft.max_length} must exceed "
                          f"data.max_prompt_length={cfg.data.max_prompt_length}")


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

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def optimizer(self, learning_rate: float, total_steps: int):
        return optim.make_optimizer(self.cfg.optimizer, total_steps, learning_rate=learning_rate)

    def data_config(self, source: str | None = None, path: str | None = None) -> dict:
        """The ``rljax.data`` config dict for ``cfg.data`` (or another source/path)."""
        d = self.cfg.data
        source = source or d.source
        out = {"template": _template(self.cfg), "max_prompt_len": int(d.max_prompt_length),
               "on_overlong": "drop", "shuffle": bool(d.shuffle)}
        if self.cfg.tokenizer.chat_template:
            out["chat"] = True
        if source.startswith("tfds:"):
            out.update(source="tfds", name=source[len("tfds:"):], train_split=d.split,
                       eval_split=d.eval_split)
        else:
            out["source"] = source
        if source in ("jsonl", "parquet"):
            out["path"] = path or d.path
            if d.eval_path:
                out["eval_path"] = d.eval_path
        out.update(dict(d.kwargs))
        return out

    def reward_fn(self):
        """``rewards.combine`` of ``reward.names`` / ``weights`` (``reward.kwargs[name]`` are the
        named function's options)."""
        r = self.cfg.reward
        weights = list(r.weights) or [1.0] * len(r.names)
        kwargs = dict(r.kwargs)
        return rewards.combine([(n, w, dict(kwargs.get(n, {}))) for n, w in zip(r.names, weights)])

    def state_shardings(self, shape_state: TrainState) -> TrainState:
        critic = None
        if shape_state.critic_params is not None:
            axes = models.value_param_logical_axes(self.model_cfg)
            critic = shd.logical_to_sharding(axes, self.mesh, shapes=shape_state.critic_params)
        return state_shardings(shape_state, self.param_shardings, critic)

    @property
    def dp_size(self) -> int:
        return self.mesh.shape["data"] * self.mesh.shape["fsdp"]


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
    if workdir:
        paths.makedirs(workdir)  # a local directory or a URL (gs://...)
        tok.save(workdir)
    return tok


def build_model(cfg, tokenizer, mesh, rng) -> tuple[models.ModelConfig, Any, Any]:
    """(model_cfg, params, param_shardings): a preset from scratch or a HF checkpoint."""
    m = cfg.model
    if m.path:
        model_cfg = models.load_config(m.path, dtype=jnp.dtype(m.dtype), remat=bool(m.remat),
                                       **dict(m.overrides))
        shardings = _param_shardings(model_cfg, mesh)
        try:
            model_cfg, params = models.load_hf(m.path, dtype=jnp.dtype(m.dtype),
                                               shardings=shardings, remat=bool(m.remat),
                                               **dict(m.overrides))
        except models.HFCheckpointError as e:
            raise UserError(f"model.path={m.path!r}: {e}") from None
        if model_cfg.vocab_size < tokenizer.vocab_size:
            raise UserError(f"tokenizer has {tokenizer.vocab_size} tokens but the model's "
                            f"vocabulary has only {model_cfg.vocab_size}")
        return model_cfg, params, shardings
    overrides = {"vocab_size": tokenizer.vocab_size, "dtype": m.dtype, "param_dtype": m.dtype,
                 "remat": bool(m.remat), "eos_token_id": tokenizer.eos_id,
                 "pad_token_id": tokenizer.pad_id, "bos_token_id": tokenizer.bos_id}
    overrides.update(dict(m.overrides))
    try:
        model_cfg = models.get_preset(m.preset, **overrides)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"model: {e}") from None
    shardings = _param_shardings(model_cfg, mesh)
    params = jax.jit(lambda r: models.init_params(model_cfg, r), out_shardings=shardings)(rng)
    return model_cfg, params, shardings


def _param_shardings(model_cfg, mesh):
    shapes = jax.eval_shape(lambda: models.init_params(model_cfg, jax.random.key(0)))
    return shd.logical_to_sharding(models.param_logical_axes(model_cfg), mesh, shapes=shapes)


def build_context(cfg, workdir: str, devices=None) -> Context:
    """Mesh, tokenizer, model and shardings for ``cfg`` (call ``check_inputs`` first)."""
    try:
        mesh = shd.make_mesh(dict(cfg.mesh.items()), devices=devices)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    tokenizer = make_tokenizer(cfg, workdir)
    model_cfg, params, shardings = build_model(cfg, tokenizer, mesh,
                                               jax.random.fold_in(jax.random.key(cfg.seed), 1))
    return Context(cfg, workdir, mesh, tokenizer, model_cfg, params, shardings)


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
        return data_lib.make_iterator(ctx.data_config(source, path), batch_size=batch_size,
                                      seed=ctx.cfg.seed + seed_offset, split=split,
                                      tokenizer=ctx.tokenizer, num_epochs=num_epochs)
    except (ValueError, KeyError) as e:
        raise UserError(f"data: {e}") from None
