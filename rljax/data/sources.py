"""Random-access example sources: synthetic tasks, JSONL/Parquet files and TFDS datasets.

A source is anything with ``len(source)`` and ``source[i] -> dict``. Random access is what makes
the iterator deterministic and cheap to resume: its state is just (epoch, position), and no
stream has to be replayed.

Field mapping: ``fields={"question": "problem", "answer": "solution"}`` renames source columns
(value) to example keys (key); without a mapping every column is kept under its own name.
``kind="preference"`` requires ``prompt``, ``chosen`` and ``rejected`` after mapping.
"""
from __future__ import annotations

import json
import os
from typing import Mapping, Sequence

import numpy as np

from rljax.errors import UserError

__all__ = ["TaskSource", "RecordsSource", "SubsetSource", "TfdsSource", "load_records",
           "read_records", "split_indices", "where", "DataError", "PREFERENCE_FIELDS"]

PREFERENCE_FIELDS = ("prompt", "chosen", "rejected")


class DataError(UserError, ValueError, KeyError):
    """A data file or row the run cannot use; the message names the file and line (row).

    A UserError (the CLI prints one line); also a ValueError/KeyError for older callers."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


def where(source, index: int) -> str:
    """A human location of example ``index`` of ``source``: ``file:line`` for JSONL files."""
    fn = getattr(source, "where", None)
    return fn(index) if fn is not None else f"example {index}"


class TaskSource:
    """``num_examples`` examples of a synthetic task for one split."""

    def __init__(self, task, num_examples: int, split: str = "train"):
        self.task, self.num_examples, self.split = task, int(num_examples), split

    def __len__(self) -> int:
        return self.num_examples

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.num_examples:
            raise IndexError(index)
        return self.task.example(index, self.split)

    def where(self, index: int) -> str:
        return f"{self.task.__class__.__name__} {self.split} example {index}"


def _map_fields(row: Mapping, fields: Mapping[str, str] | None, where: str) -> dict:
    if not fields:
        return dict(row)
    missing = [col for col in fields.values() if col not in row]
    if missing:
        raise DataError(f"{where}: column(s) {missing} not found; available: {sorted(row)}")
    return {key: row[col] for key, col in fields.items()}


def _check_kind(example: dict, kind: str, where: str) -> dict:
    if kind == "preference":
        missing = [f for f in PREFERENCE_FIELDS if f not in example]
        if missing:
            raise DataError(f"{where}: preference data needs fields {list(PREFERENCE_FIELDS)}, "
                           f"missing {missing}; map them with `fields`")
    elif kind != "prompt":
        raise ValueError(f"unknown data kind {kind!r}; expected 'prompt' or 'preference'")
    return example


class RecordsSource:
    """In-memory rows (from JSONL/Parquet) with an optional field mapping."""

    def __init__(self, rows: Sequence[Mapping], fields: Mapping[str, str] | None = None,
                 kind: str = "prompt", name: str = "records", lines: Sequence[int] | None = None):
        self.rows, self.fields, self.kind, self.name = rows, dict(fields or {}), kind, name
        self.lines = lines  # the file line of each row (JSONL), for error messages
        if rows:  # fail at construction, not at step 1000, if the mapping is wrong
            self[0]

    def __len__(self) -> int:
        return len(self.rows)

    def where(self, index: int) -> str:
        if self.lines is not None:
            return f"{self.name}:{self.lines[index]}"
        return f"{self.name} row {index + 1}"

    def __getitem__(self, index: int) -> dict:
        where = self.where(index)
        return _check_kind(_map_fields(self.rows[index], self.fields, where), self.kind, where)


def load_records(path: str) -> list[dict]:
    """Reads a ``.jsonl`` (one JSON object per line) or ``.parquet`` file into a list of dicts."""
    return read_records(path)[0]


def read_records(path: str) -> tuple[list[dict], list[int] | None]:
    """(rows, the file line of each row) of a ``.jsonl`` file; (rows, None) for ``.parquet``.

    A line that is not UTF-8, not JSON or not a JSON object raises DataError naming
    ``path:line``."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"data file does not exist: {path!r}")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq  # only Parquet needs pyarrow

        return pq.read_table(path).to_pylist(), None
    if path.endswith((".jsonl", ".json")):
        rows, lines = [], []
        offset = 0
        with open(path, "rb") as f:  # decoded line by line so an error names the line
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{path}:{lineno}: not valid UTF-8 (byte offset "
                                     f"{offset + e.start} in the file); save it as UTF-8") from None
                offset += len(raw)
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno}: not valid JSON ({e})") from None
                if not isinstance(row, dict):
                    raise DataError(f"{path}:{lineno}: expected a JSON object per line "
                                     f"({{\"question\": ...}}), got a {type(row).__name__}")
                rows.append(row)
                lines.append(lineno)
        return rows, lines
    raise ValueError(f"unsupported data file {path!r}: expected .jsonl or .parquet")


class SubsetSource:
    """A view on some indices of another source (for train/eval splits of one file)."""

    def __init__(self, source, indices: Sequence[int]):
        self.source, self.indices = source, [int(i) for i in indices]
        self.name = getattr(source, "name", "data")

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> dict:
        return self.source[self.indices[index]]

    def where(self, index: int) -> str:
        return where(self.source, self.indices[index])


def split_indices(n: int, eval_fraction: float, seed: int = 0) -> tuple[list[int], list[int]]:
    """Deterministic (train, eval) index lists: a seeded shuffle, the first part held out."""
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    order = np.random.default_rng([int(seed), 7]).permutation(n)
    k = max(1, int(round(n * eval_fraction)))
    return sorted(order[k:].tolist()), sorted(order[:k].tolist())


def _to_python(value):
    """TFDS yields bytes and numpy values; examples hold str, int, float and lists."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.ndarray):
        return [_to_python(v) for v in value.tolist()] if value.dtype == object else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: _to_python(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_python(v) for v in value]
    return value


class TfdsSource:
    """A prepared TFDS dataset read through ``tfds.data_source`` (random access, no TensorFlow).

    The dataset must be prepared in the ``array_record`` file format under ``data_dir``
    (``builder.download_and_prepare(file_format="array_record")``, or ``tfds build
    --file_format=array_record``); TFRecord-only datasets need TensorFlow, which rljax does not
    depend on.
    """

    def __init__(self, name: str, split: str = "train", data_dir: str | None = None,
                 fields: Mapping[str, str] | None = None, kind: str = "prompt"):
        import tensorflow_datasets as tfds

        try:
            self._source = tfds.data_source(name, split=split, data_dir=data_dir, download=False)
        except Exception as e:  # tfds raises several types; give one message naming the dataset
            raise ValueError(f"cannot open TFDS dataset {name!r} split {split!r} in data_dir "
                             f"{data_dir!r} (prepared in array_record format?): {str(e)[:300]}") from e
        self.name, self.fields, self.kind = f"tfds:{name}/{split}", dict(fields or {}), kind
        if len(self):
            self[0]

    def __len__(self) -> int:
        return len(self._source)

    def where(self, index: int) -> str:
        return f"{self.name} example {index}"

    def __getitem__(self, index: int) -> dict:
        where = self.where(index)
        row = _to_python(self._source[int(index)])
        return _check_kind(_map_fields(row, self.fields, where), self.kind, where)
