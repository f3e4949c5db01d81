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
import difflib
import json
import os
import re
import sys
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from rljax import data as data_lib
from rljax.data import selection
from rljax import models, rewards, tokenizers, usercode
from rljax import sharding as shd
from rljax.errors import ConfigError, UserError
from rljax.train import optim, paths
from rljax.train.state import TrainState, state_shardings
from rljax.train.step_mc import check_step_delimiter

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
    if usercode.is_spec(name):  # a function of the example (rljax.data loads it)
        return name
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
    lora = cfg.model.lora
    if lora.rank or cfg.model.adapter_path:
        try:
            models.lora.resolve_targets(lora.targets)
        except ValueError as e:
            raise ConfigError(f"model.lora.targets: {e}") from None
    if cfg.model.adapter_path and not os.path.isfile(
            os.path.join(cfg.model.adapter_path, models.peft.ADAPTER_CONFIG)):
        raise UserError(f"model.adapter_path={cfg.model.adapter_path!r} is not a PEFT adapter "
                        f"directory (no {models.peft.ADAPTER_CONFIG})")
    for key in ("data.path", "data.eval_path", "sft.path", "tokenizer.path"):
        section, name = key.split(".")
        value = cfg[section][name]
        if value and not os.path.exists(value):
            raise UserError(f"{key}={value!r} does not exist")
    _check_reward_kwargs(cfg)
    for name in cfg.reward.names:  # user code (file.py:fn) is imported here, before compiling
        rewards.check(name, reward_kwargs(cfg, name))
    _check_model_overrides(cfg)
    _template(cfg)
    for key in ("data.source", "data.template"):  # user code: imported before compiling
        value = cfg.data[key.split(".")[1]]
        if usercode.is_spec(value) and not value.startswith("tfds:"):  # tfds:NAME is built in
            usercode.load(value, key)
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
              ("sft.batch_size", cfg.sft.batch_size if cfg.sft.steps else 0),
              ("algo.relift.batch_size",
               cfg.algo.relift.batch_size if cfg.algo.relift.every else 0)]
    problems = [f"{key}={value} is not divisible by the data-parallel mesh size {dp} "
                "(mesh.data x mesh.fsdp)" for key, value in checks if value and value % dp]
    if problems:  # all of them at once, not one per run
        raise ConfigError("; ".join(problems))
    if cfg.data.max_prompt_length >= cfg.sft.max_length and cfg.sft.steps:
        raise ConfigError(f"sft.max_length={cfg.sft.max_length} must exceed "
                          f"data.max_prompt_length={cfg.data.max_prompt_length}")
    check_data_files(cfg)
    check_step_delimiter(cfg)


def _check_reward_kwargs(cfg) -> None:
    """``reward.kwargs.NAME`` must be options that reward ``NAME`` (one of reward.names) takes."""
    names = list(cfg.reward.names)
    known = set(names) | {rewards.display_name(n) for n in names}
    for key, kwargs in dict(cfg.reward.kwargs).items():
        if key not in known:
            raise ConfigError(f"reward.kwargs.{key}: {key!r} is not in reward.names "
                              f"({', '.join(names)}); kwargs are keyed by reward name")
        kwargs = kwargs.to_dict() if hasattr(kwargs, "to_dict") else kwargs
        if not isinstance(kwargs, dict):
            raise ConfigError(f"reward.kwargs.{key}={kwargs!r}: expected a dict of options "
                              f"for reward {key!r}")
    for name in names:
        if usercode.is_spec(name) or name not in rewards.names():
            continue  # user code: rewards.check builds it with its kwargs
        try:
            rewards.get(name, **reward_kwargs(cfg, name))  # built-in factories store options
        except (TypeError, ValueError, KeyError, re.error) as e:
            raise ConfigError(f"reward.kwargs.{name}: {e}") from None


def _check_model_overrides(cfg) -> None:
    """``model.overrides`` keys are ModelConfig fields with values of the field's type."""
    fields = {f.name: f for f in dataclasses.fields(models.ModelConfig)}
    for key, value in dict(cfg.model.overrides).items():
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"model.overrides.{key}: not a model setting; {hint}"
                              f"settings: {', '.join(sorted(fields))}")
        default = fields[key].default
        if default is None or default is dataclasses.MISSING:
            continue
        kind = type(default)
        ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            raise ConfigError(f"model.overrides.{key}={value!r}: expected {kind.__name__} "
                              f"(like the default {default!r})")


def _files_read(cfg) -> list[tuple[str, dict, str, tuple, dict]]:
    """(what, data config, split, fields one of which each row needs, fields each row needs
    -> what reads them) of every JSONL/Parquet file the run reads, for ``check_data_files``."""
    out = []
    files = ("jsonl", "parquet")
    has_eval = bool(cfg.data.eval_path) or "eval_fraction" in dict(cfg.data.kwargs)
    if cfg.data.source in files:
        if uses_preference_data(cfg):
            config = preference_config(cfg)
        else:
            config = data_config(cfg)
        needs = {} if uses_preference_data(cfg) else reward_fields(cfg)
        out.append(("data", config, "train", (), needs))
        if has_eval:
            out.append(("eval data", config, "eval", (), needs))
    guided = [k for k, on in (("algo.hint.mode", cfg.algo.hint.mode != "off"),
                              ("algo.relift.every", cfg.algo.relift.every > 0),
                              ("algo.mixed_policy", cfg.algo.mixed_policy)) if on]
    if guided and cfg.data.source in files:  # hints / ReLIFT read every row's solution
        field = cfg.algo.solution_field
        out.append((f"{guided[0]} needs reference solutions: data", data_config(cfg), "train",
                    (field,) if field else ("completion", "solution", "answer"), {}))
    sft_source = cfg.sft.source or cfg.data.source
    if (cfg.sft.steps or cfg.algo.name == "sft") and sft_source in files:
        config = data_config(cfg, sft_source, cfg.sft.path or None)
        out.append(("SFT data", config, "train", ("completion", "solution", "answer"), {}))
    return out


def reward_fields(cfg) -> dict[str, str]:
    """``field -> "reward 'NAME'"`` for every dataset field the configured rewards read
    (``rewards.required_fields``: their signatures), when the run's phases call rewards."""
    if not cfg.reward.names or cfg.algo.name == "sft":  # supervised only: no reward is called
        return {}
    out: dict[str, str] = {}
    for name in cfg.reward.names:
        fn = rewards.get(name, **reward_kwargs(cfg, name))
        for field in rewards.required_fields(fn):
            out.setdefault(field, f"reward {rewards.display_name(name)!r}")
    return out


def check_data_files(cfg) -> None:
    """Reads every row of the run's data files up front (cheap next to a compile): a file that
    is empty, not UTF-8 or not JSON objects, or a row without a field the template needs, is
    one UserError naming file and line, before anything compiles. So is a row without a
    field a configured reward reads (``reward_fields``): it would score every sample as a
    failure."""
    for what, config, split, one_of, needs in _files_read(cfg):
        try:
            data_lib.check_source(config, split, one_of=one_of, needs=needs)
        except (ValueError, KeyError) as e:
            raise UserError(f"{what}: {e}") from None


def data_config(cfg, source: str | None = None, path: str | None = None) -> dict:
    """The ``rljax.data`` config dict for ``cfg.data`` (or another source/path)."""
    d = cfg.data
    source = source or d.source
    out = {"template": _template(cfg), "max_prompt_len": int(d.max_prompt_length),
           "on_overlong": "drop", "shuffle": bool(d.shuffle)}
    if cfg.tokenizer.chat_template and not cfg.env.name:  # episodes render their own messages
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


def preference_config(cfg) -> dict:
    """The data config of preference pairs (offline DPO, reward models): ``kind="preference"``
    and the template ``{prompt}`` unless one is set; synthetic tasks stay prompt data."""
    config = dict(data_config(cfg))
    if config["source"] not in data_lib.TASKS:
        config.setdefault("kind", "preference")
        if cfg.data.template == "plain":  # the default "{question}" is for prompt data
            config["template"] = "{prompt}"
    return config


def uses_preference_data(cfg) -> bool:
    return cfg.algo.name == "rm" or (cfg.algo.name == "dpo" and not cfg.algo.online)


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
        return self.mesh.shape["data"] * self.mesh.shape["fsdp"]


def reward_kwargs(cfg, name: str) -> dict:
    """``reward.kwargs`` entry of reward ``name`` (a ``file.py:fn`` entry is keyed by ``fn``)."""
    kwargs = dict(cfg.reward.kwargs)
    entry = kwargs.get(name, kwargs.get(rewards.display_name(name), {}))
    return dict(entry.to_dict() if hasattr(entry, "to_dict") else entry)


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


def build_model(cfg, tokenizer, mesh, rng) -> tuple[models.ModelConfig, Any, Any]:
    """(model_cfg, params, param_shardings): a preset from scratch or a HF checkpoint."""
    m = cfg.model
    if m.path:
        try:
            model_cfg = models.load_config(m.path, dtype=jnp.dtype(m.dtype),
                                           remat=bool(m.remat), **dict(m.overrides))
        except (ValueError, TypeError) as e:
            raise ConfigError(f"model: {e}") from None
        check_context_length(cfg, model_cfg)
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
    check_context_length(cfg, model_cfg)
    shardings = _param_shardings(model_cfg, mesh)
    params = jax.jit(lambda r: models.init_params(model_cfg, r), out_shardings=shardings)(rng)
    return model_cfg, params, shardings


def check_context_length(cfg, model_cfg) -> None:
    """The longest sequence each phase builds must fit the model's context
    (``max_position_embeddings``); checked before anything compiles."""
    p = cfg.data.max_prompt_length  # the largest prompt bucket
    seqs = [("data.max_prompt_length + rollout.max_new_tokens",
             f"{p} + {cfg.rollout.max_new_tokens}", p + cfg.rollout.max_new_tokens)]
    if cfg.eval.max_new_tokens:
        seqs.append(("data.max_prompt_length + eval.max_new_tokens",
                     f"{p} + {cfg.eval.max_new_tokens}", p + cfg.eval.max_new_tokens))
    if cfg.sft.steps or cfg.algo.name == "sft":
        seqs.append(("sft.max_length", f"{cfg.sft.max_length}", cfg.sft.max_length))
    if cfg.env.name:  # an episode's training row: prompt ++ the whole trajectory
        seqs.append(("data.max_prompt_length + env.max_total_tokens",
                     f"{p} + {cfg.env.max_total_tokens}", p + cfg.env.max_total_tokens))
    limit = model_cfg.max_position_embeddings
    problems = [f"{keys} = {terms} = {total}" for keys, terms, total in seqs if total > limit]
    if problems:
        raise ConfigError(f"sequences longer than the model's context (max_position_embeddings="
                          f"{limit}): {'; '.join(problems)}; shorten them or use a model with a "
                          "longer context")


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
    try:
        mesh = shd.make_mesh(dict(cfg.mesh.items()), devices=devices)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    tokenizer = make_tokenizer(cfg, workdir)
    model_cfg, params, shardings = build_model(cfg, tokenizer, mesh,
                                               jax.random.fold_in(jax.random.key(cfg.seed), 1))
    model_cfg, params, shardings = add_lora(cfg, model_cfg, params, shardings, mesh,
                                            jax.random.fold_in(jax.random.key(cfg.seed), 2))
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


LENGTH_SCAN = 1000  # examples whose token lengths are checked before the first step


def check_lengths(cfg, it, what: str = "data", completions: bool = False) -> None:
    """Before the first step: refuses data whose every example (of the first ``LENGTH_SCAN``)
    is too long for ``data.max_prompt_length`` (they would all be dropped), and warns when some
    are. ``completions``: preference pairs, whose completions must fit rollout.max_new_tokens."""
    try:
        scan = it.scan(LENGTH_SCAN)
    except (ValueError, KeyError) as e:
        raise UserError(f"{what}: {e}") from None
    n, long = scan["checked"], scan["overlong"]
    if not n or not long:
        return
    limit = f"data.max_prompt_length={cfg.data.max_prompt_length}"
    if completions:
        limit += f" (prompts) or rollout.max_new_tokens={cfg.rollout.max_new_tokens} (chosen/rejected + EOS)"
    lengths = f"prompts have {scan['min_tokens']} to {scan['max_tokens']} tokens"
    if long == n:
        raise UserError(f"{what}: all {n} examples checked are longer than {limit}; {lengths}; "
                        "raise the limit")
    print(f"rljax: warning: {what}: {long} of the first {n} examples are longer than {limit} "
          f"and will be skipped ({lengths})", file=sys.stderr, flush=True)
