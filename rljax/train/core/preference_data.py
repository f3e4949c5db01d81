"""Preference pairs on the host: a preference dataset's encoded batches with a checkpointable
position (``PreferenceData``; offline DPO and reward models), synthetic pairs of a task with
integer answers, online DPO's best-vs-worst pairs of G samples, the held-out batches and the
exact mean of a pair metric over them. The layout is ``data.encode_preference``'s (see
``phases.dpo``)."""
from __future__ import annotations

import sys

import numpy as np

from rljax import data as data_lib
from rljax.errors import UserError
from rljax.train.core.setup import check_lengths, preference_config


# ----------------------------------------------------------------------------- pairs (host)

def synthetic_pairs(examples: list[dict], rng: np.random.Generator,
                    solution=lambda ex: str(ex["answer"])) -> list[dict]:
    """Preference pairs from task examples with integer answers (built-in ``arithmetic``):
    chosen = the verified solution, rejected = a wrong integer near it (a small nonzero
    offset or a digit change), so the pair differs only in correctness."""
    pairs = []
    for ex in examples:
        right = solution(ex)
        value = int(str(ex["answer"]).strip())
        wrong = value
        while wrong == value or (wrong < 0 <= value):
            if rng.random() < 0.5:
                wrong = value + int(rng.choice([-1, 1])) * int(rng.integers(1, 11))
            else:  # change one digit: a near-miss in the token space
                digits = list(str(value))
                i = int(rng.integers(len(digits)))
                digits[i] = str(int(rng.integers(10)))
                wrong = int("".join(digits))
        pairs.append({**ex, "chosen": right, "rejected": right.replace(str(value), str(wrong))
                      if str(value) in right else str(wrong)})
    return pairs


def best_worst_pairs(prompt_batch: dict, completions: dict, rewards: np.ndarray,
                     num_generations: int) -> dict:
    """Online DPO pairs from G samples per prompt: chosen = the highest-reward sample,
    rejected = the lowest; ties (no reward difference) become padding pairs.

    Args:
      prompt_batch: ``prompt_tokens/prompt_mask [B, P]``.
      completions: ``tokens/mask [B*G, N]`` (prompt-major rows ``i*G + g``, right-padded),
        and for multi-turn episodes ``score_mask [B*G, N]``: the model's own tokens (the
        observations between them are context, not scored).
      rewards: [B*G] host floats.
    Returns a preference batch (``encode_preference`` layout) with ``pair_mask [B]`` (and
    ``chosen_score_mask`` / ``rejected_score_mask`` with ``score_mask``); shapes are static
    (always B pairs) so the DPO step compiles once.
    """
    g = num_generations
    r = np.asarray(rewards, np.float64).reshape(-1, g)
    best, worst = r.argmax(axis=1), r.argmin(axis=1)
    rows = np.arange(r.shape[0]) * g
    tokens, mask = np.asarray(completions["tokens"]), np.asarray(completions["mask"], bool)
    out = {
        "prompt_tokens": np.asarray(prompt_batch["prompt_tokens"]),
        "prompt_mask": np.asarray(prompt_batch["prompt_mask"], bool),
        "chosen_tokens": tokens[rows + best], "chosen_mask": mask[rows + best],
        "rejected_tokens": tokens[rows + worst], "rejected_mask": mask[rows + worst],
        "pair_mask": r.max(axis=1) > r.min(axis=1),
    }
    if "score_mask" in completions:
        score = np.asarray(completions["score_mask"], bool)
        out.update(chosen_score_mask=score[rows + best], rejected_score_mask=score[rows + worst])
    return out


# ----------------------------------------------------------------------------- data

class PreferenceData:
    """Encoded preference batches for offline DPO and reward models, with a checkpointable
    position.

    The pairs come from ``data.source``: a preference file (JSONL/Parquet/TFDS rows with
    ``prompt``, ``chosen``, ``rejected``; ``data.kwargs.fields`` maps other column names; the
    default template renders ``{prompt}`` as is), or a synthetic task (``arithmetic``), whose
    examples become (right answer, wrong answer) pairs with ``synthetic_pairs``. Prompts are
    left-padded to ``data.max_prompt_length`` and completions right-padded to
    ``rollout.max_new_tokens`` (EOS included), so the step compiles once; longer pairs are
    dropped (and counted by the iterator).
    """

    def __init__(self, ctx, batch_size: int, split: str = "train", seed_offset: int = 0,
                 num_epochs=None):
        cfg = ctx.cfg
        config = preference_config(cfg)
        self.task = data_lib.get_task(config) if config["source"] in data_lib.TASKS else None
        self.max_prompt = int(cfg.data.max_prompt_length)
        self.max_completion = int(cfg.rollout.max_new_tokens)
        config["max_completion_len"] = self.max_completion
        if split == "eval":
            config["shuffle"] = False
        self.ctx, self.batch_size, self.split = ctx, int(batch_size), split
        self.seed = cfg.seed + seed_offset
        try:
            self.iterator = data_lib.make_iterator(config, batch_size=batch_size, seed=self.seed,
                                                   split=split, tokenizer=ctx.tokenizer,
                                                   num_epochs=num_epochs)
        except (ValueError, KeyError) as e:
            raise UserError(f"preference data: {e}") from None
        if self.task is None:
            check_identical_pairs(self.iterator.source, split)
            check_lengths(cfg, self.iterator, "preference data", completions=True)
        self.batches = 0  # seeds the wrong answers of synthetic pairs (so resume replays them)

    def encode(self, examples: list[dict]) -> dict:
        """Examples -> ``encode_preference`` arrays (+ ``pair_mask``), padded to batch_size."""
        if self.task is not None:
            rng = np.random.default_rng([self.seed, int(self.split == "eval"), self.batches])
            examples = synthetic_pairs(examples, rng, solution=self.task.solution)
        n = len(examples)
        padded = examples + [examples[-1]] * (self.batch_size - n)  # static shapes
        out = data_lib.encode_preference(self.ctx.tokenizer, padded, self.max_prompt,
                                         self.max_completion)
        out["pair_mask"] = np.arange(self.batch_size) < n
        return out

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        try:
            examples = next(self.iterator)
        except StopIteration:
            raise StopIteration from None
        batch = self.encode(examples)
        self.batches += 1
        return batch

    def state(self) -> dict:
        return {"data": self.iterator.state(), "batches": self.batches}

    def restore(self, state: dict) -> None:
        self.iterator.restore(state["data"])
        self.batches = int(state["batches"])


def check_identical_pairs(source, split: str = "train") -> None:
    """Pairs with chosen == rejected teach nothing (loss log 2, gradient 0): refuses data made
    only of them, warns about some."""
    same, n = data_lib.identical_pairs(source, limit=100_000)
    name = getattr(source, "name", "preference data")
    if n and same == n:
        raise UserError(f"preference data {name} ({split}): chosen == rejected in all {n} pairs; "
                        "DPO/RM cannot learn from them (check the chosen/rejected fields)")
    if same:
        print(f"rljax: warning: preference data {name} ({split}): chosen == rejected in {same} "
              f"of {n} pairs; they carry no signal", file=sys.stderr, flush=True)


def eval_pair_batches(ctx) -> list[dict]:
    """The held-out preference batches (``eval.num_examples`` pairs, 0 = all; batches of
    ``eval.batch_size``), or [] when the data has no eval split."""
    cfg = ctx.cfg
    try:
        pairs = PreferenceData(ctx, cfg.eval.batch_size, split="eval", seed_offset=EVAL_SEED,
                               num_epochs=1)
    except UserError:
        return []
    out, count, limit = [], 0, cfg.eval.num_examples or None
    for batch in pairs:
        out.append(batch)
        count += int(batch["pair_mask"].sum())
        if limit and count >= limit:
            break
    return out


EVAL_SEED = 17  # the wrong answers of held-out synthetic pairs differ from training ones


def pair_metrics(fn, batches: list[dict], prefix: str = "eval/") -> dict:
    """Runs ``fn(batch) -> ((loss_sum, weight), {name: (sum, count)})`` over ``batches`` and
    returns exact means ``{prefix + name}`` (loss included)."""
    total: dict[str, list[float]] = {}
    for batch in batches:
        (num, den), metrics = fn(batch)
        for name, (s, c) in {"loss": (num, den), **metrics}.items():
            acc = total.setdefault(name, [0.0, 0.0])
            acc[0] += float(s)
            acc[1] += float(c)
    return {prefix + k: (s / c if c else 0.0) for k, (s, c) in total.items()}
