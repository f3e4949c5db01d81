"""Reward-model scoring: a value-head model's output at the last token of prompt + completion.

``RewardModelScorer(cfg, value_params, tokenizer)`` is a reward function like the others
(``scorer(prompts, completions, **fields) -> list[float]``), so it composes with ``combine``
(use ``isolation="thread"``: it closes over device arrays and cannot move to another process).

Sequences are left-padded to a multiple of ``bucket`` tokens so the jitted forward pass compiles
once per bucket, not once per batch. A sequence longer than ``max_length`` raises (combine turns
that into a counted error) rather than being truncated.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["RewardModelScorer"]


class RewardModelScorer:
    """Scores ``prompt + completion`` with ``models.value_forward`` at the last real token."""

    def __init__(self, cfg, value_params, tokenizer, max_length: int = 1024, bucket: int = 64,
                 batch_size: int | None = None, add_bos: bool = True, append_eos: bool = False):
        import jax

        from rljax import models  # imported here so that `rljax.rewards` stays light

        self.cfg, self.params, self.tokenizer = cfg, value_params, tokenizer
        self.max_length, self.bucket, self.batch_size = int(max_length), int(bucket), batch_size
        self.add_bos, self.append_eos = add_bos, append_eos
        self.__name__ = "reward_model"
        self._forward = jax.jit(lambda p, t, m: models.value_forward(cfg, p, t, attention_mask=m))

    def _ids(self, prompt: str, completion: str) -> list[int]:
        # Encode separately so the completion's tokens match what the policy sampled after the prompt.
        ids = self.tokenizer.encode(prompt, add_bos=self.add_bos) + self.tokenizer.encode(completion)
        if self.append_eos:
            ids.append(self.tokenizer.eos_id)
        if len(ids) > self.max_length:
            raise ValueError(f"reward model input has {len(ids)} tokens, more than max_length="
                             f"{self.max_length}")
        return ids

    def _pad(self, rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        longest = max(len(r) for r in rows)
        length = min(self.max_length, -(-longest // self.bucket) * self.bucket)
        tokens = np.full((len(rows), length), self.tokenizer.pad_id, dtype=np.int32)
        mask = np.zeros((len(rows), length), dtype=bool)
        for i, r in enumerate(rows):
            tokens[i, length - len(r):] = r  # left padding: the last column is every row's last token
            mask[i, length - len(r):] = True
        return tokens, mask

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **_) -> list[float]:
        rows = [self._ids(p, c) for p, c in zip(prompts, completions)]
        step = self.batch_size or len(rows) or 1
        scores: list[float] = []
        for start in range(0, len(rows), step):
            tokens, mask = self._pad(rows[start:start + step])
            values = np.asarray(self._forward(self.params, tokens, mask))
            scores.extend(float(v) for v in values[:, -1])
        return scores
