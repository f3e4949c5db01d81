"""Data: example sources, prompt templates and a deterministic, checkpointable iterator.

From a config section (dict or ``ml_collections.ConfigDict``)::

    data = {"source": "arithmetic", "digits": 2, "operands": 2, "ops": "+-",
            "max_prompt_len": 16, "on_overlong": "drop"}
    it = data.make_iterator(data_cfg, batch_size=32, seed=0, tokenizer=tok)     # train split
    batch = next(it)            # [{"prompt": "12+7=", "question": "12+7=", "answer": "19"}, ...]
    tokens, mask = data.encode_prompts(tok, batch, max_prompt_len=16)
    ckpt["data"] = it.state(); ...; it.restore(ckpt["data"])

Sources (key ``source``) and their keys, besides the common ones (``template``, ``chat``,
``system_prompt``, ``max_prompt_len``, ``max_completion_len``, ``on_overlong``, ``shuffle``,
``add_bos``, ``kind``):

* ``arithmetic``: ``digits``, ``operands``, ``ops``, ``allow_negative``, ``num_examples``,
  ``eval_examples``, ``task_seed``.
* ``countdown``: ``num_numbers``, ``max_number``, ``max_target``, ``use_all``, ``num_examples``,
  ``eval_examples``, ``task_seed``.
* ``guess_number``: ``low``, ``high``, ``num_examples``, ``eval_examples``, ``task_seed``
  (examples for the multi-turn environment ``guess_number``, see docs/agents.md).
* ``tictactoe`` / ``kuhn_poker`` / ``negotiation`` / ``propose_solve``: ``seat`` ("any" or a seat name), ``num_examples``,
  ``eval_examples``, ``task_seed`` (games for the environments of the same names).
* ``shapes``: ``kinds``, ``max_shapes``, ``image_size``, ``grid``, ``image_tokens``,
  ``image_token``, ``blank``, ``num_examples``, ``eval_examples``, ``task_seed`` (pictures of
  coloured squares, for a model with a vision tower, see docs/vision.md).
* ``jsonl`` / ``parquet``: ``path``, and ``eval_path`` or ``eval_fraction`` (+ ``split_seed``);
  ``fields`` maps example keys to columns. GSM8K files work as they are: ``{question, answer}``.
* ``tfds``: ``name``, ``data_dir``, ``train_split`` ("train"), ``eval_split`` ("test"), ``fields``.
* your own loader, ``path/to/file.py:load`` or ``package.module:load``: called as
  ``load(split, **options)`` with ``split`` "train" or "eval" and every key that is not a common
  one (``data.kwargs``) as an option; returns a list of example dicts. ``fields`` applies.

``template`` may also name a function ``path/to/file.py:make_prompt`` taking an example dict and
returning the prompt text.

``kind="preference"`` makes examples ``{prompt, chosen, rejected}`` (for DPO / reward models);
use ``encode_preference`` to tokenise them.

Bad data is a ``DataError`` (a ``UserError``: one line in the CLI) naming ``file:line``:
``check_source(config, split)`` reads a whole file up front (not UTF-8, not a JSON object per
line, empty, a row without a field the template needs); ``DataIterator.scan`` renders and
measures the first rows with the tokenizer; a bad row met later still names its line.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from rljax import usercode
from rljax.errors import UserError
from rljax.data.iterator import DataIterator, encode_preference, encode_prompts
from rljax.data.sources import (PREFERENCE_FIELDS, DataError, RecordsSource, SubsetSource,
                                TaskSource, TfdsSource, load_records, read_records,
                                split_indices, where)
from rljax.data.tasks import (TASKS, ArithmeticTask, BoardGameTask, CountdownTask,
                              GuessNumberTask, solve_countdown)
from rljax.data.templates import DEFAULT_TEMPLATE, PromptTemplate

__all__ = ["make_source", "make_template", "make_iterator", "get_task", "DataIterator",
           "encode_prompts", "encode_preference", "PromptTemplate", "TaskSource", "RecordsSource",
           "SubsetSource", "TfdsSource", "ArithmeticTask", "CountdownTask", "GuessNumberTask",
           "BoardGameTask", "solve_countdown",
           "load_records", "read_records", "split_indices", "TASKS", "PREFERENCE_FIELDS",
           "DataError", "check_source", "identical_pairs"]

_COMMON = {"source", "template", "chat", "system_prompt", "max_prompt_len", "max_completion_len",
           "on_overlong", "shuffle", "add_bos", "kind"}
_TASK_KEYS = {"arithmetic": {"digits", "operands", "ops", "allow_negative", "steps"},
              "countdown": {"num_numbers", "max_number", "max_target", "use_all"},
              "guess_number": {"low", "high"},
              "tictactoe": {"seat"}, "kuhn_poker": {"seat"}, "negotiation": {"seat"},
              "propose_solve": {"seat"},
              "shapes": {"kinds", "max_shapes", "image_size", "grid", "image_tokens",
                         "image_token", "blank"}}
_SOURCE_KEYS = {
    **{name: keys | {"num_examples", "eval_examples", "task_seed"} for name, keys in _TASK_KEYS.items()},
    "jsonl": {"path", "eval_path", "eval_fraction", "split_seed", "fields"},
    "parquet": {"path", "eval_path", "eval_fraction", "split_seed", "fields"},
    "tfds": {"name", "data_dir", "train_split", "eval_split", "fields"},
}
_SPLITS = ("train", "eval")


def _as_dict(config) -> dict:
    config = config.to_dict() if hasattr(config, "to_dict") else config
    config = dict(config)
    source = config.get("source")
    if usercode.is_spec(source):  # a user loader: the other keys are its options
        return config
    if source not in _SOURCE_KEYS:
        raise ValueError(f"data.source must be one of {sorted(_SOURCE_KEYS)}, got {source!r}")
    unknown = set(config) - _COMMON - _SOURCE_KEYS[source]
    if unknown:
        raise ValueError(f"unknown data config key(s) {sorted(unknown)} for source {source!r}; "
                         f"allowed: {sorted(_COMMON | _SOURCE_KEYS[source])}")
    return config


def get_task(config):
    """The synthetic task object a config describes (for ``task.solution`` in SFT warm-up)."""
    config = _as_dict(config)
    name = config["source"]
    if name not in TASKS:
        raise ValueError(f"data.source {name!r} is not a synthetic task; tasks: {sorted(TASKS)}")
    knobs = {k: config[k] for k in _TASK_KEYS[name] if k in config}
    return TASKS[name](seed=config.get("task_seed", 0), **knobs)


def make_source(config, split: str = "train"):
    """A random-access source (``len``, ``[i] -> dict``) for ``split`` ("train" or "eval")."""
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
    config = _as_dict(config)
    name, kind, fields = config["source"], config.get("kind", "prompt"), config.get("fields")
    if name in TASKS:
        size = config.get("num_examples", 100_000) if split == "train" else config.get("eval_examples", 500)
        return TaskSource(get_task(config), size, split)
    if name == "tfds":
        if "name" not in config:
            raise ValueError("data.source='tfds' needs data.name")
        tfds_split = config.get("train_split", "train") if split == "train" else config.get("eval_split", "test")
        return TfdsSource(config["name"], tfds_split, config.get("data_dir"), fields, kind)
    if usercode.is_spec(name):
        return _user_source(config, split, kind, fields)
    return _file_source(config, split, kind, fields)


def _user_source(config: dict, split: str, kind: str, fields):
    name = config["source"]
    load = usercode.load(name, "data.source")
    options = {k: v for k, v in config.items() if k not in _COMMON | {"fields"}}
    rows = usercode.call(load, "data.source", split, **options)
    if isinstance(rows, (str, bytes, Mapping)) or not isinstance(rows, Iterable):
        raise UserError(f"data.source: {name} returned {type(rows).__name__}; expected a list "
                        "of example dicts")
    rows = list(rows)
    bad = next((i for i, r in enumerate(rows) if not isinstance(r, Mapping)), None)
    if bad is not None:
        raise UserError(f"data.source: {name} returned a {type(rows[bad]).__name__} as row "
                        f"{bad}; expected example dicts")
    return RecordsSource(rows, fields, kind, name)


def _file_source(config: dict, split: str, kind: str, fields):
    if "path" not in config:
        raise ValueError(f"data.source={config['source']!r} needs data.path")
    if "eval_path" in config and "eval_fraction" in config:
        raise ValueError("give data.eval_path or data.eval_fraction, not both")
    if split == "eval" and "eval_path" in config:
        rows, lines = read_records(config["eval_path"])
        return RecordsSource(rows, fields, kind, config["eval_path"], lines)
    rows, lines = read_records(config["path"])
    source = RecordsSource(rows, fields, kind, config["path"], lines)
    if "eval_fraction" in config:
        train, held_out = split_indices(len(rows), config["eval_fraction"], config.get("split_seed", 0))
        return SubsetSource(source, train if split == "train" else held_out)
    if split == "eval":
        raise ValueError("no eval split: set data.eval_path or data.eval_fraction")
    return source


def make_template(config, tokenizer=None) -> PromptTemplate:
    """The prompt template a config describes (``template``, ``chat``, ``system_prompt``)."""
    config = _as_dict(config)
    default = "{prompt}" if config.get("kind") == "preference" else DEFAULT_TEMPLATE
    template = config.get("template", default)
    if usercode.is_spec(template):  # a function example -> prompt text
        template = usercode.load(template, "data.template")
    return PromptTemplate(template, chat=config.get("chat", False),
                          system_prompt=config.get("system_prompt"), tokenizer=tokenizer)


def make_iterator(config, batch_size: int, seed: int = 0, split: str = "train", tokenizer=None,
                  num_epochs: int | None = None) -> DataIterator:
    """A ``DataIterator`` over ``make_source(config, split)`` with the config's template and
    length check. Eval iterators default to one unshuffled pass (``num_epochs=1``)."""
    cfg = _as_dict(config)
    is_eval = split == "eval"
    return DataIterator(
        make_source(cfg, split), batch_size, seed=seed,
        shuffle=cfg.get("shuffle", not is_eval), template=make_template(cfg, tokenizer),
        tokenizer=tokenizer, max_prompt_len=cfg.get("max_prompt_len"),
        on_overlong=cfg.get("on_overlong", "error"), add_bos=cfg.get("add_bos", False),
        max_completion_len=cfg.get("max_completion_len"),
        num_epochs=num_epochs if num_epochs is not None or not is_eval else 1)


def check_source(config, split: str = "train", limit: int | None = None,
                 one_of: Sequence[str] = (), needs: Mapping[str, str] | None = None) -> int:
    """Reads the split's rows up front (the first ``limit``; all with None) and checks each
    one has the fields the prompt template (and the kind) needs, without a tokenizer, one of
    the fields ``one_of`` when given (e.g. SFT targets), and every field of ``needs``
    (``field -> what reads it``, e.g. ``{"answer": "reward 'gsm8k'"}``).

    Returns the number of rows; raises DataError naming ``file:line`` for a bad row and the
    file for an empty one, so a bad file fails before anything compiles, not at step 1000.
    """
    cfg = _as_dict(config)
    source = make_source(cfg, split)
    if len(source) == 0:
        raise DataError(f"{getattr(source, 'name', 'data source')} is empty (no rows)")
    default = "{prompt}" if cfg.get("kind") == "preference" else DEFAULT_TEMPLATE
    template = PromptTemplate(cfg.get("template", default))  # the fields; chat needs no check
    n = len(source) if limit is None else min(limit, len(source))
    for index in range(n):
        example = source[index]
        missing = [f for f in template.fields if f not in example]
        if missing:
            raise DataError(f"{where(source, index)}: the prompt template {template.template!r} "
                            f"needs field(s) {missing}; the row has {sorted(example)}")
        if one_of and not any(f in example for f in one_of):
            raise DataError(f"{where(source, index)}: the row needs one of the fields "
                            f"{list(one_of)}; it has {sorted(example)}")
        for field, reader in (needs or {}).items():
            if field not in example:
                raise DataError(f"{where(source, index)}: {reader} reads the field {field!r}; "
                                f"the row has {sorted(example)}")
    return len(source)


def identical_pairs(source, limit: int | None = None) -> tuple[int, int]:
    """(pairs whose chosen == rejected, pairs checked) among the first ``limit`` rows of a
    preference source: such pairs carry no signal (DPO loss stays log 2, gradient 0)."""
    n = len(source) if limit is None else min(limit, len(source))
    rows = (source[i] for i in range(n))
    return sum(1 for row in rows if row["chosen"] == row["rejected"]), n
