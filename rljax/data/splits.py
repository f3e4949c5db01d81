"""Train/eval streams of the synthetic tasks: each example draws from its own generator,
and a stable hash bucket keeps a share of the problem space for evaluation only."""
from __future__ import annotations

import zlib

import numpy as np

_SPLIT_STREAM = {"train": 0, "eval": 1, "test": 1}
# Share of the problem space reserved for evaluation. Splits are disjoint by construction, so
# held-out accuracy measures problems the policy never trained on (a small task's train stream
# would otherwise cover its whole space).
HOLDOUT_FRACTION = 0.1


def _rng(seed: int, split: str, index: int) -> np.random.Generator:
    """Independent generator per example; train and eval draw from different streams."""
    if split not in _SPLIT_STREAM:
        raise ValueError(f"unknown split {split!r}; expected one of {sorted(_SPLIT_STREAM)}")
    return np.random.default_rng([int(seed), _SPLIT_STREAM[split], int(index)])


def _belongs_to(split: str, question: str, seed: int) -> bool:
    """Whether ``question`` is in ``split``'s part of the problem space (a stable hash bucket)."""
    held_out = zlib.crc32(f"{seed}:{question}".encode()) % 10_000 < HOLDOUT_FRACTION * 10_000
    return held_out == (_SPLIT_STREAM[split] == 1)
