"""A run's inputs: where its data, templates and reward arguments come from, and every check
that needs no accelerator (``check_inputs``, run first; ``check_context_length`` and
``check_lengths`` once the model and data are known). Each problem a user can fix is one
``UserError`` line before anything compiles."""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import sys

import jax

from rljax import data as data_lib
from rljax import models, rewards, usercode
from rljax.config import mesh as mesh_config
from rljax.errors import ConfigError, UserError
from rljax.train.core import teacher as teacher_lib


# Named prompt templates (``data.template``); anything else containing "{" is a format string.
TEMPLATES = {
    "plain": "{question}",
    "qa": "Question: {question}\nAnswer:",
    "gsm8k": ("Solve the problem. Think step by step, then give the final answer on its own "
              "line as '#### <number>'.\n\nQuestion: {question}\nAnswer:"),
}


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


def _check_rollout_devices(cfg, n: int) -> int:
    """``mesh.rollout_devices`` (the sampler's own devices, asynchronous RL) against the ``n``
    devices there are (at least one must be left to train; several processes give the sampler
    the same number each). Returns the rollout devices."""
    r = int(cfg.mesh.get("rollout_devices", 0))
    if not r:
        return 0
    if r >= n:
        raise ConfigError(f"mesh.rollout_devices={r} leaves no device to train: there are {n} "
                          "devices (the rollout mesh takes the last ones, training the rest)")
    procs = jax.process_count()
    if r % procs or r // procs >= n // procs:
        raise ConfigError(f"mesh.rollout_devices={r} must give the sampler the same number of "
                          f"each of the {procs} processes' {n // procs} devices and leave each "
                          "some to train")
    return r


def check_inputs(cfg, num_devices: int | None = None, teacher: bool = True) -> None:
    """Raises UserError for problems found without compiling anything. ``teacher=False``:
    a distillation run's teacher is not checked (``eval``/``sample``/``export`` of the
    student never read it)."""
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
    mesh_sizes = mesh_config.axis_sizes(cfg.mesh)
    n = num_devices if num_devices is not None else jax.device_count()
    n -= _check_rollout_devices(cfg, n)   # the training mesh gets the rest
    fixed = 1
    for v in mesh_sizes.values():
        fixed *= v if v != -1 else 1
    sizes = {k: (n // fixed if v == -1 else v) for k, v in mesh_sizes.items()}
    if (-1 in mesh_sizes.values() and n % fixed) or \
            sizes["data"] * sizes["fsdp"] * sizes["expert"] * sizes["tensor"] != n:
        raise ConfigError(f"mesh {mesh_sizes} does not match the {n} available devices")
    dp = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    checks = [("rollout.batch_size", cfg.rollout.batch_size),
              ("algo.mini_batch_size", cfg.algo.mini_batch_size),
              ("algo.micro_batch_size", cfg.algo.micro_batch_size),
              ("sft.batch_size", cfg.sft.batch_size
               if cfg.sft.steps or cfg.algo.name == "sft" else 0),
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
    check_mcts_prm(cfg)
    if cfg.algo.adv_estimator == "grpo_process":
        check_prm_run(cfg, "algo.process_reward.prm", cfg.algo.process_reward.prm)
    if cfg.algo.name == "distill" and teacher:   # its files and tokenizer, before any model
        teacher_lib.check(cfg)


def check_step_delimiter(cfg) -> None:
    """``data.pairs="step_mc"`` (or ``algo.name="prm"``) on a built-in task: the task's reference solutions must contain
    ``data.step_delimiter`` (else every solution is one step and no step pairs exist): UserError
    naming the key, before anything compiles. Other sources have no reference solutions; their
    samples are counted at run time (``step_mc/single_step_frac``)."""
    on = (cfg.data.pairs in ("step_mc", "mcts") or cfg.algo.name == "prm"
          or cfg.sft.traces == "mcts")
    if not on or cfg.data.source not in data_lib.TASKS:
        return
    if cfg.env.name and (cfg.data.pairs in ("step_mc", "mcts") or cfg.sft.traces == "mcts"):
        return   # over an environment's turns a step is a model turn, whatever the solutions
    task = data_lib.get_task(dict(cfg.data.kwargs, source=cfg.data.source))
    solutions = [task.solution(task.example(i)) for i in range(8)]
    if not any(cfg.data.step_delimiter in s for s in solutions):
        raise UserError(f"data.step_delimiter={cfg.data.step_delimiter!r} never occurs in the "
                        f"{cfg.data.source} task's solutions (e.g. {solutions[0]!r}): every "
                        "solution would be one step (arithmetic: data.kwargs.steps=True with "
                        "operands >= 3)")


def check_mcts_prm(cfg) -> None:
    """``algo.mcts.value='prm'``: ``algo.mcts.prm`` is the workdir of a process reward model
    run with the policy's model and tokenizer sections (its checkpoint is read later)."""
    m = cfg.algo.mcts
    if (cfg.sft.traces != "mcts" and cfg.data.pairs != "mcts") or m.value != "prm":
        return
    check_prm_run(cfg, "algo.mcts.prm", m.prm)


def check_prm_run(cfg, key: str, where: str) -> None:
    """``key=where`` is the workdir of a process reward model run with this run's model and
    tokenizer sections (its checkpoint is read later)."""
    # The run's config.json read as plain JSON (rljax.config's loader would import this
    # module back through the phases).
    path = os.path.join(where, "config.json")
    if not os.path.isfile(path):
        raise UserError(f"{key}={where} has no config.json; is it a run directory?")
    with open(path) as f:
        prm_cfg = json.load(f)
    name = prm_cfg.get("algo", {}).get("name")
    if name != "prm":
        raise UserError(f"{key}={where}: its run trains algo.name={name!r}, not a "
                        "process reward model ('prm')")
    for section in ("model", "tokenizer"):
        same = [json.dumps(c, sort_keys=True, default=str) for c in
                (prm_cfg.get(section), json.loads(json.dumps(cfg[section].to_dict(),
                                                             default=str)))]
        if same[0] != same[1]:
            raise UserError(f"{key}={where}: its {section} section differs from this "
                            "run's (the PRM is read with the policy's model config)")


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


# ModelConfig fields only `rljax plan` sets (a planning stand-in whose outputs are not the
# model's): a run that asks for one is refused.
PLAN_ONLY = ("moe_plan_balanced",)


def _check_model_overrides(cfg) -> None:
    """``model.overrides`` keys are ModelConfig fields with values of the field's type."""
    fields = {f.name: f for f in dataclasses.fields(models.ModelConfig)}
    for key, value in dict(cfg.model.overrides).items():
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"model.overrides.{key}: not a model setting; {hint}"
                              f"settings: {', '.join(sorted(fields))}")
        if key in PLAN_ONLY:
            raise ConfigError(f"model.overrides.{key}: set by `rljax plan` on the model it "
                              "compiles, not a setting of a run (its outputs are not the "
                              "model's)")
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
    if cfg.data.source in files and cfg.algo.name != "prm":  # stepwise rows: check_prm_files
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
    check_prm_files(cfg)


def check_prm_files(cfg) -> None:
    """``algo.name="prm"`` on a JSONL file: every row of ``data.path`` (and ``data.eval_path``)
    is a stepwise row, with one label per step (``rljax.data.stepwise``), or one UserError
    naming the file and line."""
    if cfg.algo.name != "prm" or cfg.data.source != "jsonl":
        return
    from rljax.data import stepwise
    for key in ("path", "eval_path"):
        path = cfg.data[key]
        if not path:
            continue
        try:
            stepwise.read_jsonl(path)
        except (OSError, ValueError) as e:
            raise UserError(f"PRM data (data.{key}): {e}") from None


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


def reward_kwargs(cfg, name: str) -> dict:
    """``reward.kwargs`` entry of reward ``name`` (a ``file.py:fn`` entry is keyed by ``fn``)."""
    kwargs = dict(cfg.reward.kwargs)
    entry = kwargs.get(name, kwargs.get(rewards.display_name(name), {}))
    return dict(entry.to_dict() if hasattr(entry, "to_dict") else entry)


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
