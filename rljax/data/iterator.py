"""Deterministic, checkpointable batch iterator and prompt tokenisation with a length check.

``DataIterator`` walks a random-access source in a seeded order per epoch and yields lists of
example dicts ``{"prompt": str, **fields}``. Its whole position is ``state()`` (a small JSON-able
dict saved with checkpoints); ``restore(state)`` continues at exactly the next example.

Prompts longer than ``max_prompt_len`` tokens are never truncated: with
``on_overlong="error"`` they raise, with ``"drop"`` they are skipped and counted
(``iterator.num_dropped``, also in the state so the count survives a restart).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from rljax.data.sources import DataError, where

__all__ = ["DataIterator", "encode_prompts", "encode_preference"]

_STATE_VERSION = 1


class DataIterator:
    """Yields batches (lists of example dicts) forever, or for ``num_epochs`` epochs."""

    def __init__(self, source, batch_size: int, seed: int = 0, shuffle: bool = True,
                 template: Callable[[dict], str] | None = None, tokenizer=None,
                 max_prompt_len: int | None = None, on_overlong: str = "error",
                 add_bos: bool = False, max_completion_len: int | None = None,
                 num_epochs: int | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(source) == 0:
            raise DataError(f"{getattr(source, 'name', 'data source')} is empty (no rows)")
        if on_overlong not in ("error", "drop"):
            raise ValueError(f"on_overlong must be 'error' or 'drop', got {on_overlong!r}")
        if (max_prompt_len or max_completion_len) and tokenizer is None:
            raise ValueError("max_prompt_len/max_completion_len need a tokenizer to count tokens")
        self.source, self.batch_size, self.seed, self.shuffle = source, int(batch_size), int(seed), shuffle
        self.template, self.tokenizer, self.add_bos = template, tokenizer, add_bos
        self.max_prompt_len, self.max_completion_len = max_prompt_len, max_completion_len
        self.on_overlong, self.num_epochs = on_overlong, num_epochs
        self.epoch, self.position, self.num_dropped = 0, 0, 0
        self._order_epoch, self._order = None, None
        self.last_indices: list[int] = []  # dataset indices of the last batch (selection)

    # -- position -------------------------------------------------------------------------------

    def state(self) -> dict:
        """The iterator's position as a JSON-able dict."""
        return {"version": _STATE_VERSION, "epoch": self.epoch, "position": self.position,
                "num_dropped": self.num_dropped, "seed": self.seed, "size": len(self.source)}

    def restore(self, state: dict) -> None:
        """Continues from a ``state()``; refuses a state from a different seed or dataset size."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported data iterator state version {state.get('version')!r}")
        if state["seed"] != self.seed or state["size"] != len(self.source):
            raise ValueError(f"data iterator state is for seed={state['seed']}, size={state['size']}, "
                             f"but this iterator has seed={self.seed}, size={len(self.source)}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.num_dropped = int(state["num_dropped"])

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            n = len(self.source)
            self._order = (np.random.default_rng([self.seed, self.epoch]).permutation(n)
                           if self.shuffle else np.arange(n))
            self._order_epoch = self.epoch
        return self._order

    # -- iteration ------------------------------------------------------------------------------

    def __iter__(self):
        return self

    def __next__(self) -> list[dict]:
        batch: list[dict] = []
        indices: list[int] = []
        dropped_in_a_row = 0
        while len(batch) < self.batch_size:
            if self.position >= len(self.source):
                if self.num_epochs is not None and self.epoch + 1 >= self.num_epochs:
                    if batch:
                        self.last_indices = indices
                        return batch  # the last, short batch of a finite pass (evaluation)
                    raise StopIteration
                self.epoch, self.position = self.epoch + 1, 0
            index = int(self._epoch_order()[self.position])
            self.position += 1
            example = self._prepare(index)
            if example is not None:
                batch.append(example)
                indices.append(index)
                dropped_in_a_row = 0
            else:
                dropped_in_a_row += 1
                if dropped_in_a_row > len(self.source):  # would loop forever otherwise
                    raise DataError(f"every example is dropped as overlong (max_prompt_len="
                                    f"{self.max_prompt_len}, max_completion_len="
                                    f"{self.max_completion_len}); raise the limit")
        self.last_indices = indices
        return batch

    def render(self, index: int) -> dict:
        """Example ``index`` of the source with its rendered prompt (no length check); a bad
        row raises DataError naming its file and line."""
        try:
            example = dict(self.source[index])
            if self.template is not None:
                example["prompt"] = self.template(example)
            elif "prompt" not in example:
                raise KeyError(f"no 'prompt' field and no template was given; "
                               f"fields: {sorted(example)}")
        except DataError:
            raise
        except (KeyError, ValueError, TypeError, IndexError) as e:
            text = e.args[0] if isinstance(e, KeyError) and e.args else e
            raise DataError(f"{where(self.source, index)}: {text}") from None
        return example

    def scan(self, limit: int | None = 1000) -> dict:
        """Checks the first ``limit`` examples (all with None) without moving the position:
        renders each (a bad row raises DataError) and measures prompt lengths.

        Returns ``{"checked", "overlong", "min_tokens", "max_tokens"}`` (token counts of the
        prompts; overlong = examples the length check would drop or refuse)."""
        n = len(self.source) if limit is None else min(limit, len(self.source))
        overlong, lengths = 0, []
        for index in range(n):
            example = self.render(index)
            if self.tokenizer is not None:
                lengths.append(len(self.tokenizer.encode(example["prompt"], add_bos=self.add_bos)))
                overlong += self._length_problem(example) is not None
        return {"checked": n, "overlong": overlong, "min_tokens": min(lengths, default=0),
                "max_tokens": max(lengths, default=0)}

    def _prepare(self, index: int) -> dict | None:
        """Example ``index`` with its rendered prompt, or None if dropped as overlong."""
        example = self.render(index)
        problem = self._length_problem(example)
        if problem is None:
            return example
        if self.on_overlong == "error":
            raise DataError(f"{where(self.source, index)}: {problem} (set on_overlong='drop' to "
                            "skip such examples)")
        self.num_dropped += 1
        return None

    def _length_problem(self, example: dict) -> str | None:
        tok = self.tokenizer
        if self.max_prompt_len is not None:
            n = len(tok.encode(example["prompt"], add_bos=self.add_bos))
            if n > self.max_prompt_len:
                return f"prompt has {n} tokens, more than max_prompt_len={self.max_prompt_len}"
        if self.max_completion_len is not None:
            for key in ("chosen", "rejected"):
                if key in example:
                    n = len(tok.encode(example[key])) + 1  # + EOS
                    if n > self.max_completion_len:
                        return (f"{key} has {n} tokens with EOS, more than max_completion_len="
                                f"{self.max_completion_len}")
        return None


def encode_prompts(tokenizer, batch: list[dict], max_prompt_len: int, add_bos: bool = False):
    """Left-padded prompt tokens ``(int32 [B, max_prompt_len], bool [B, max_prompt_len])``.

    Raises on an overlong prompt (the iterator's length check normally removed them already).
    """
    return tokenizer.batch_encode([ex["prompt"] for ex in batch], max_length=max_prompt_len,
                                  left_pad=True, add_bos=add_bos)


def encode_preference(tokenizer, batch: list[dict], max_prompt_len: int, max_completion_len: int,
                      add_bos: bool = False) -> dict[str, np.ndarray]:
    """Preference pairs as arrays: prompts left-padded, chosen/rejected right-padded with EOS.

    Returns ``prompt_tokens/prompt_mask [B, P]`` and ``chosen_tokens/chosen_mask``,
    ``rejected_tokens/rejected_mask [B, C]``; the policy scores ``prompt ++ completion``.
    """
    out = {}
    out["prompt_tokens"], out["prompt_mask"] = encode_prompts(tokenizer, batch, max_prompt_len, add_bos)
    for key in ("chosen", "rejected"):
        tokens = np.full((len(batch), max_completion_len), tokenizer.pad_id, dtype=np.int32)
        mask = np.zeros((len(batch), max_completion_len), dtype=bool)
        for i, ex in enumerate(batch):
            ids = tokenizer.encode(ex[key]) + [tokenizer.eos_id]
            if len(ids) > max_completion_len:
                raise ValueError(f"{key} completion {i} has {len(ids)} tokens with EOS, more than "
                                 f"max_completion_len={max_completion_len}")
            tokens[i, :len(ids)], mask[i, :len(ids)] = ids, True
        out[f"{key}_tokens"], out[f"{key}_mask"] = tokens, mask
    return out


class PrefetchingIterator:
    """Wraps a batch iterator (``DataIterator`` or a selector) so the next batch can be drawn
    early, e.g. while the device runs an update (``prefetch``), without changing what any
    caller sees:

    * ``next()`` returns the prefetched batch if there is one, else draws one;
    * ``state()`` is the wrapped iterator's state *before* the prefetched batch, so a
      checkpoint taken after a prefetch resumes exactly (the batch is drawn again from it);
    * ``restore()`` drops any prefetched batch.

    Other attributes (``render``, ``source``, ``last_indices``, ...) are the wrapped
    iterator's. The caller must not feed the wrapped iterator anything that would change the
    prefetched batch between ``prefetch`` and ``next`` (selectors observe a round's rewards
    before its update, i.e. before the prefetch)."""

    def __init__(self, iterator):
        self.iterator = iterator
        self._ahead: tuple[dict, list] | None = None   # (state before, batch)

    def __iter__(self):
        return self

    def prefetch(self) -> None:
        """Draws the next batch now (once; a second call keeps the first batch)."""
        if self._ahead is None:
            before = self.iterator.state()
            self._ahead = (before, next(self.iterator))

    def __next__(self) -> list[dict]:
        if self._ahead is not None:
            batch, self._ahead = self._ahead[1], None
            return batch
        return next(self.iterator)

    def state(self) -> dict:
        return self._ahead[0] if self._ahead is not None else self.iterator.state()

    def restore(self, state: dict) -> None:
        self._ahead = None
        self.iterator.restore(state)

    def __getattr__(self, name):
        if name == "iterator":   # not set yet (copy/pickle): no recursion
            raise AttributeError(name)
        return getattr(self.iterator, name)
