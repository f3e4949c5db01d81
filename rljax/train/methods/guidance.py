"""Guidance for prompts the policy fails: hints (``algo.hint``) and SFT on the hardest
(``algo.relift``). Host-side machinery; the rollout and the GRPO phase call it.

Hints (GHPO / SEELE / POPE). When every one of a prompt's G samples fails (reward below
``hint.threshold``), its group is sampled again with the first tokens of a solution placed at
the start of the assistant turn. The prefix is appended to the *prompt* tokens of that group,
so it is context by construction: it sits before the completion slot, outside ``loss_mask``,
``old_logps`` and ``sampler_logps``; no loss, no gradient and no importance ratio involve it.
Only the sampled continuation trains. The reward judges prefix + continuation (the whole
answer). The hinted group replaces the failed one in the batch; the failed samples' tokens
still count in ``rollout/tokens``, and the re-sample's in ``rollout/decoded_tokens``. With tree
sampling (``rollout.tree``) the hinted group is a new tree grown from the hinted prompt, its
leaves the group, in the layout of every other tree.

- ``hint.mode="fixed"``: the prefix is ``hint.fraction`` of the solution's tokens (GHPO-style).
- ``hint.mode="adaptive"``: one fraction per prompt, starting at ``hint.fraction`` and moved
  after every hinted visit by ``step * (target - success rate of the hinted group)`` (SEELE:
  keep hinted groups near a target success rate, where their advantages are informative).
- ``hint.source="reference"``: the dataset's solution (``task.solution`` of the built-in
  tasks; the ``algo.solution_field`` column of a file, default the first of completion /
  solution / answer). ``"replay"``: a successful completion of the same prompt stored at an
  earlier visit (POPE / off-policy prefixes), falling back to the reference
  (``hint.replay_fallback``) or to no hint.

ReLIFT. A prompt whose unhinted groups had zero successes on its last ``relift.k_visits``
visits enters a bounded FIFO buffer (deduplicated by prompt). Every ``relift.every`` RL steps
the GRPO phase runs one SFT step (``steps.build_sft_step`` on the same train state and
optimizer, loss scaled by ``relift.coef``) on the oldest ``relift.batch_size`` buffered
prompts with their reference solutions, and removes them from the buffer.

A group is a prompt's G rows, or with knapsack allocation the rows the knapsack gave it
(``round_groups``): hints re-sample it at its own size, a demonstration replaces its last row.

Multi-turn episodes (``env.name``): a hinted group is played again from fresh environments,
the hint after its first prompt (``agent.EpisodeRounds.sample_hinted``), cut from the scripted
episode's first model turn where the environment has scripted episodes
(``agent.reference_turn``); in self-play a failed group is its seat's, played again in fresh
matches with the hint after that seat's first observation (``selfplay.play``), cut from the
seat's scripted episode (``selfplay.seat_trace``); ReLIFT's rows and demonstrations are the scripted episodes
(``agent.trace_sft_batch``, ``demos.insert_episode_demos``).

All host state (per-prompt fractions, stored successes, visit counters, buffer) is a JSON-able
``state_dict`` saved with the phase, so resume is exact.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Callable, Sequence

import jax
import numpy as np

from rljax import data as data_lib
from rljax.data import selection
from rljax.errors import ConfigError, UserError
from rljax.train.core.buckets import build_sequences, encode_prompts
from rljax.train.core.rollout import RolloutStage
from rljax.train.methods.demos import demo_old_logps, insert_demos, insert_episode_demos

SOLUTION_FIELDS = ("completion", "solution", "answer")  # looked up in this order (as SFT does)
HINT_STREAM = 1 << 16  # rng: fold_in(round rng, HINT_STREAM) samples the hinted groups
# A round's per-row fields a hinted group replaces (a round source may name more: row_keys).
ROW_FIELDS = ("tokens", "logps", "mask", "lengths", "truncated", "rewards", "versions")
# What ``env/*`` metrics read of a round's episodes (``agent.env_metrics``), one per row.
EPISODE_FIELDS = ("turns", "truncated", "model_tokens", "counters")


# ----------------------------------------------------------------------------- pure helpers

def solution_of(example: dict, task=None, field: str = "") -> str:
    """The reference solution text of ``example``: ``task.solution`` for built-in tasks, the
    ``field`` column, or the first of ``SOLUTION_FIELDS``. Raises UserError when there is none."""
    if task is not None:
        return task.solution(example)
    for key in ((field,) if field else SOLUTION_FIELDS):
        if key in example and example[key] is not None:
            return str(example[key])
    wanted = repr(field) if field else "one of " + "/".join(SOLUTION_FIELDS)
    raise UserError(f"example has no solution field ({wanted}); fields: {sorted(example)}")


def group_success(rewards: np.ndarray, g, threshold: float) -> np.ndarray:
    """Success rate per group: float32 [R / G] from rewards [R] (prompt-major groups of G), or
    with ``g`` a sequence, of consecutive groups of those sizes; a sample succeeds when its
    reward is >= ``threshold``."""
    return (selection.group_successes(np.asarray(rewards, np.float32), g, threshold)
            / np.asarray(g, np.float64)).astype(np.float32)


def round_groups(rnd: dict, g: int) -> tuple[np.ndarray, list[dict]]:
    """(size, example) of each group of a sampling round: G rows each, or the sizes a round
    source gave them (``group_sizes``, knapsack allocation, whose ``examples`` are per row)."""
    if "group_sizes" not in rnd:
        return np.full(len(rnd["examples"]), g), list(rnd["examples"])
    sizes = np.asarray(rnd["group_sizes"], np.int64)
    return sizes, [rnd["examples"][i] for i in np.cumsum(sizes) - sizes]


def prefix_length(num_tokens: int, fraction: float, room: int) -> int:
    """Hint tokens for a solution of ``num_tokens`` tokens at ``fraction`` of it: rounded, at
    least 1, at most the solution and at most ``room`` (what the prompt bucket still holds).
    0 means no hint is possible."""
    k = int(math.floor(fraction * num_tokens + 0.5))
    return max(0, min(max(k, 1), num_tokens, room))


def adaptive_update(fraction: float, success_rate: float, target: float, step: float,
                    low: float, high: float) -> float:
    """SEELE-style per-prompt control: more hint when the hinted group succeeded less often
    than ``target``, less when more often; clipped to [low, high]."""
    return float(min(high, max(low, fraction + step * (target - success_rate))))


def hint_rows(num_prompts: int, hinted: int, multiple: int = 1) -> int:
    """Prompts to sample for ``hinted`` hinted groups: the next power of two (at most
    ``num_prompts``, the round's own size), rounded up to a multiple of the data-parallel size,
    so the sampler compiles for a handful of shapes only."""
    n = min(num_prompts, 1 << max(0, hinted - 1).bit_length())
    return -(-max(n, hinted) // multiple) * multiple


def completion_ids(tokens: np.ndarray, mask: np.ndarray, eos_id: int) -> list[int]:
    """A completion's token ids (mask applied), without its trailing EOS."""
    ids = [int(t) for t in np.asarray(tokens)[np.asarray(mask, bool)]]
    return ids[:-1] if ids and ids[-1] == eos_id else ids



def _replace_episodes(rnd: dict, rows: slice, hinted: dict, src: slice) -> None:
    """The hinted episodes (``hinted``'s rows ``src``) in place of a failed group's (``rnd``'s
    ``rows``) in the round's episode record: ``env/*`` describes the episodes that train."""
    eps, h_eps = rnd.get("episodes"), hinted.get("episodes")
    if eps is None or h_eps is None:
        return
    for key in EPISODE_FIELDS:
        if len(eps[key]) == len(rnd["rewards"]) and len(h_eps[key]) == len(hinted["rewards"]):
            eps[key][rows] = h_eps[key][src]

class BoundedDict:
    """An insertion-ordered dict of at most ``size`` entries (the oldest are evicted), with a
    JSON-able state (a list of [key, value] pairs, order kept)."""

    def __init__(self, size: int):
        self.size, self.items = int(size), OrderedDict()

    def get(self, key, default=None):
        return self.items.get(key, default)

    def __contains__(self, key) -> bool:
        return key in self.items

    def __len__(self) -> int:
        return len(self.items)

    def put(self, key, value) -> None:
        self.items.pop(key, None)
        self.items[key] = value
        while len(self.items) > self.size:
            self.items.popitem(last=False)

    def pop(self, key) -> None:
        self.items.pop(key, None)

    def state(self) -> list:
        return [[k, v] for k, v in self.items.items()]

    def restore(self, state: list) -> None:
        self.items = OrderedDict((k, v) for k, v in state)


# ----------------------------------------------------------------------------- hints

class Hints:
    """Chooses hint prefixes for failed prompts and learns from hinted groups
    (``algo.hint``; see the module docstring)."""

    def __init__(self, hint_cfg, solution_fn: Callable[[dict], str], tokenizer,
                 max_prompt_length: int, room: int | None = None):
        self.cfg, self.solution_fn, self.tok = hint_cfg, solution_fn, tokenizer
        self.max_prompt_length = int(max_prompt_length)
        self.room = room   # a hint's tokens when it is not in the prompt bucket (self-play)
        self.fractions = BoundedDict(hint_cfg.max_prompts)  # adaptive: prompt -> fraction
        self.successes = BoundedDict(hint_cfg.max_prompts)  # replay: prompt -> token ids

    def fraction(self, key: str) -> float:
        if self.cfg.mode == "adaptive":
            return float(self.fractions.get(key, self.cfg.fraction))
        return float(self.cfg.fraction)

    def solution_ids(self, example: dict) -> list[int] | None:
        """Token ids the prefix is cut from: a stored success (replay) or the reference."""
        if self.cfg.source == "replay":
            stored = self.successes.get(example["prompt"])
            if stored is not None:
                return list(stored)
            if not self.cfg.replay_fallback:
                return None
        return self.tok.encode(self.solution_fn(example))

    def prefix(self, example: dict, prompt_len: int) -> list[int] | None:
        """The hint token ids for a failed prompt of ``prompt_len`` tokens, or None; at most
        what the prompt bucket still holds, or ``room`` tokens where it was given."""
        ids = self.solution_ids(example)
        if not ids:
            return None
        room = self.max_prompt_length - prompt_len if self.room is None else self.room
        k = prefix_length(len(ids), self.fraction(example["prompt"]), room)
        return ids[:k] if k else None

    def remember_success(self, key: str, ids: Sequence[int]) -> None:
        """Replay store: the newest successful completion of a prompt."""
        if self.cfg.source == "replay" and ids:
            self.successes.put(key, [int(t) for t in ids])

    def hinted_result(self, key: str, success_rate: float) -> None:
        """Adaptive mode: moves the prompt's fraction toward the target success rate."""
        if self.cfg.mode == "adaptive":
            c = self.cfg
            self.fractions.put(key, adaptive_update(self.fraction(key), success_rate, c.target,
                                                    c.step, c.min_fraction, c.max_fraction))

    def state_dict(self) -> dict:
        return {"fractions": self.fractions.state(), "successes": self.successes.state()}

    def load_state_dict(self, state: dict) -> None:
        self.fractions.restore(state["fractions"])
        self.successes.restore(state["successes"])


# ----------------------------------------------------------------------------- ReLIFT buffer

class ReliftBuffer:
    """Prompts with zero successes on their last ``k_visits`` visits, oldest first, each at
    most once, at most ``size`` (the oldest are evicted). ``streaks`` counts each prompt's
    current run of failed visits (bounded like the buffer, x8). ``failed_only=False`` is the
    control (``algo.relift.prompts="any"``): every visit counts as failed, so prompts enter
    after ``k_visits`` visits whatever their outcome."""

    def __init__(self, k_visits: int, size: int, failed_only: bool = True):
        self.k_visits = int(k_visits)
        self.failed_only = bool(failed_only)
        self.entries = BoundedDict(size)           # prompt -> example
        self.streaks = BoundedDict(8 * int(size))  # prompt -> failed visits in a row

    def __len__(self) -> int:
        return len(self.entries)

    def observe(self, example: dict, solved: bool) -> None:
        key = example["prompt"]
        if solved and self.failed_only:
            self.streaks.pop(key)
            return
        streak = int(self.streaks.get(key, 0)) + 1
        self.streaks.put(key, streak)
        if streak >= self.k_visits and key not in self.entries:
            self.entries.put(key, dict(example))

    def take(self, n: int) -> list[dict]:
        """Removes and returns the oldest ``n`` (or fewer) buffered examples."""
        keys = list(self.entries.items)[:n]
        out = [self.entries.get(k) for k in keys]
        for k in keys:
            self.entries.pop(k)
            self.streaks.pop(k)
        return out

    def state_dict(self) -> dict:
        return {"entries": self.entries.state(), "streaks": self.streaks.state()}

    def load_state_dict(self, state: dict) -> None:
        self.entries.restore(state["entries"])
        self.streaks.restore(state["streaks"])


# ----------------------------------------------------------------------------- SFT batches

def sft_batch(tokenizer, prompts: Sequence[str], solutions: Sequence[str],
              max_prompt_length: int, completion_len: int, rows: int | None = None):
    """Prompt ++ solution ++ EOS in the shared sequence layout (``steps``), loss on the
    solution and EOS. ``rows`` pads the batch with rows that count for nothing (``loss_mask``
    all False). Returns ``(batch, number of solutions cut to completion_len)``."""
    rows = len(prompts) if rows is None else rows
    prompts = list(prompts) + [prompts[0] if prompts else ""] * (rows - len(prompts))
    p_tok, p_mask = encode_prompts(tokenizer, prompts, max_prompt_length)
    c_tok = np.full((rows, completion_len), tokenizer.pad_id, np.int32)
    c_mask = np.zeros((rows, completion_len), bool)
    cut = 0
    for i, text in enumerate(solutions):
        ids = tokenizer.encode(text) + [tokenizer.eos_id]
        if len(ids) > completion_len:
            cut, ids = cut + 1, ids[:completion_len]
        c_tok[i, :len(ids)], c_mask[i, :len(ids)] = ids, True
    tokens, mask = build_sequences(p_tok, p_mask, c_tok, c_mask)
    return {"tokens": tokens, "mask": mask, "loss_mask": c_mask}, cut


# ----------------------------------------------------------------------------- the rollout hook

def solution_fn(ctx) -> Callable[[dict], str]:
    """The run's reference-solution lookup (built-in task or file field)."""
    cfg = ctx.cfg
    task = None
    if cfg.data.source in data_lib.TASKS:
        task = data_lib.get_task(ctx.data_config())
    field = cfg.algo.solution_field
    return lambda example: solution_of(example, task, field)


def hint_solution_fn(ctx, reference: Callable[[dict], str]) -> Callable[[dict], str]:
    """What a hint is cut from: the reference solution, or for an environment with scripted
    episodes the first model turn of the example's (``agent.reference_turn``: a hint for an
    episode is the start of its first turn, in the environment's format)."""
    cfg = ctx.cfg
    if not cfg.env.name:
        return reference
    from rljax.train.methods.agent import has_script, reference_turn
    if not has_script(cfg.env.name):
        return reference
    return lambda example: reference_turn(cfg, example)


def enabled(cfg) -> bool:
    a = cfg.algo
    return a.hint.mode != "off" or a.relift.every > 0 or bool(a.mixed_policy)


class Guide(RolloutStage):
    """The rollout stage of hints, ReLIFT and mixed-policy demonstrations
    (``core.rollout.RolloutStage``): after each sampling round it records visits (ReLIFT
    streaks, replay successes) and replaces failed groups by hinted ones."""

    name = "guidance"   # the key of its state in the phase's checkpoint

    def __init__(self, ctx, g: int):
        cfg = ctx.cfg
        self.g, self.threshold = g, float(cfg.algo.hint.threshold)
        self.eos_id = ctx.tokenizer.eos_id
        self.multiple = ctx.dp_size
        self.solution = solution_fn(ctx)
        # What hints are cut from (and, with episodes, what shows the scripted episode exists).
        self.reference = hint_solution_fn(ctx, self.solution)
        # Self-play: a hint follows the seat's first observation, in a chunk widened by a
        # turn's tokens (``selfplay.play``), not in the prompt bucket.
        room = None
        if cfg.env.selfplay.mode != "off":
            from rljax.train.methods.agent import turn_tokens
            room = turn_tokens(cfg)
        self.hints = (Hints(cfg.algo.hint, self.reference, ctx.tokenizer,
                            cfg.data.max_prompt_length, room)
                      if cfg.algo.hint.mode != "off" else None)
        r = cfg.algo.relift
        self.buffer = (ReliftBuffer(r.k_visits, r.buffer_size, failed_only=r.prompts == "failed")
                       if r.every > 0 else None)
        self.mixed = bool(cfg.algo.mixed_policy)

    def check(self, example: dict) -> None:
        """Before the first step: the data has reference solutions (one ConfigError line)."""
        key = ("algo.hint.mode" if self.hints is not None else
               "algo.relift.every" if self.buffer is not None else "algo.mixed_policy")
        try:
            self.reference(example)
        except (UserError, KeyError, ValueError) as e:
            raise ConfigError(f"{key} needs reference solutions: {e} (name the column with "
                              "algo.solution_field)") from None

    def after_round(self, rollout, params, rnd: dict, rng) -> dict:
        """``rnd`` (a ``Rollout.sample_round`` result) with failed groups replaced by hinted ones,
        and ``rnd["hint"]`` = {groups, hinted, prefix_tokens, successes, samples}."""
        sizes, examples = round_groups(rnd, self.g)
        rates = group_success(rnd["rewards"], sizes, self.threshold)
        ends = np.cumsum(sizes)
        for i, ex in enumerate(examples):
            if self.buffer is not None:
                self.buffer.observe(ex, solved=bool(rates[i] > 0))
            if self.hints is not None and rates[i] > 0:
                self._remember(ex, rnd, slice(ends[i] - sizes[i], ends[i]))
        stats = {"groups": len(examples), "hinted": 0, "prefix_tokens": 0, "successes": 0,
                 "samples": 0}
        rnd["hint"] = stats
        if self.mixed:   # each failed group's last row (groups may have sizes of their own)
            failed = np.flatnonzero(rates == 0)
            if "turn_ids" in rnd:   # episodes: the example's scripted episode
                last, ragged = (ends - 1)[failed], "group_sizes" in rnd
                return insert_episode_demos(
                    rollout, rnd, [examples[i] for i in failed], last,
                    [rnd["prompt_ids"][r if ragged else i] for r, i in zip(last, failed)])
            return insert_demos(rollout, rnd, [examples[i] for i in failed], (ends - 1)[failed],
                                self.solution)
        if self.hints is None:
            return rnd
        return self._hint(rollout, params, rnd, jax.random.fold_in(rng, HINT_STREAM),
                          examples, sizes, rates == 0)

    def _hint(self, rollout, params, rnd, rng, examples, sizes, failing) -> dict:
        """``rnd`` with the ``failing`` groups that get a hint replaced by hinted re-samples of
        the same sizes, and ``rnd["hint_prefixes"]`` {row: prefix token ids} of their rows. A
        round with sizes of its own (``group_sizes``) keeps prompt ids per row, else per
        group."""
        ragged, starts = "group_sizes" in rnd, np.cumsum(sizes) - sizes

        def ids_of(i, at, n) -> slice:   # group i's prompt ids: its rows' (ragged), else its own
            return slice(at[i], at[i] + n[i]) if ragged else slice(i, i + 1)
        failed, prefixes = [], []
        for i in np.flatnonzero(failing):
            p = self.hints.prefix(examples[i], len(rnd["prompt_ids"][starts[i] if ragged else i]))
            if p is not None:
                failed.append(int(i))
                prefixes.append(p)
        if not failed:
            return rnd
        h_sizes = sizes[failed]
        hinted, pad = self._resample(rollout, params, rng, [examples[i] for i in failed],
                                     prefixes, h_sizes, len(examples), ragged)
        h_starts = np.cumsum(h_sizes) - h_sizes
        h_rates = group_success(hinted["rewards"][:h_sizes.sum()], h_sizes, self.threshold)
        rnd["extra_tokens"] = rnd.get("extra_tokens", 0)
        for j, i in enumerate(failed):
            rows = slice(starts[i], starts[i] + sizes[i])
            src = slice(h_starts[j], h_starts[j] + sizes[i])
            # The failed samples were sampled too: their tokens stay in rollout/tokens.
            rnd["extra_tokens"] += int(rnd["lengths"][rows].sum())
            for key in ROW_FIELDS + tuple(rnd.get("row_keys", ())):
                if key in rnd:   # (episodes add their per-row fields: model_mask, turns, ...)
                    rnd[key][rows] = hinted[key][src]
            for name in rnd["scores"]:
                rnd["scores"][name][rows] = hinted["scores"][name][src]
            _replace_episodes(rnd, rows, hinted, src)
            rnd["prompt_ids"][ids_of(i, starts, sizes)] = \
                hinted["prompt_ids"][ids_of(j, h_starts, h_sizes)]
            # Each hinted row's prefix, for what scores its text again (VinePPO's forks).
            rnd.setdefault("hint_prefixes", {}).update(
                dict.fromkeys(range(rows.start, rows.stop), list(prefixes[j])))
            self.hints.hinted_result(examples[i]["prompt"], float(h_rates[j]))
            if h_rates[j] > 0:
                self._remember(examples[i], rnd, rows, prefix=prefixes[j])
        # What the re-sample decoded (a hinted tree's shared segments once), padding aside.
        real = hinted["decoded"] if ragged else hinted["decoded"][:len(failed)]
        rnd["extra_decoded"] = rnd.get("extra_decoded", 0) + int(np.sum(real))
        if rnd["prompt_len"] < hinted["prompt_len"]:
            rnd["prompt_len"] = hinted["prompt_len"]
        for key in ("time_sample", "time_reward", "errors", "time_env"):
            if key in rnd:
                rnd[key] += hinted[key]
        rnd["hint"].update(hinted=len(failed), prefix_tokens=sum(len(p) for p in prefixes),
                           successes=int(round(float((h_rates * h_sizes).sum()))),
                           samples=int(h_sizes.sum()), padding_groups=pad)
        return rnd

    def _resample(self, rollout, params, rng, examples, prefixes, sizes, num_groups, ragged):
        """(the hinted groups' round, padding groups in it): a knapsack round's groups at their
        own sizes (its round source's ``sample_hinted``: one program of ``budget`` rows), else
        G rows each, ``hint_rows`` prompts (repeats of the first: sampled, then discarded)."""
        if ragged:
            return rollout.rounds.sample_hinted(rollout, params, rng, examples, prefixes,
                                                sizes), 0
        pad = hint_rows(num_groups, len(examples), self.multiple) - len(examples)
        return rollout.sample_round(params, rng, examples=examples + [examples[0]] * pad,
                                    prefixes=prefixes + [prefixes[0]] * pad), pad

    def _remember(self, example: dict, rnd: dict, rows: slice, prefix: Sequence[int] = ()):
        """Replay store: the first successful sample of the group in ``rows`` (hint prefix
        included)."""
        if self.hints.cfg.source != "replay":
            return
        ok = np.flatnonzero(rnd["rewards"][rows] >= self.threshold)
        row = rows.start + int(ok[0])
        # An episode's hint is cut from its first model turn (what a prefix continues).
        mask = rnd["turn_ids"][row] == 0 if "turn_ids" in rnd else rnd["mask"][row]
        ids = list(prefix) + completion_ids(rnd["tokens"][row], mask, self.eos_id)
        self.hints.remember_success(example["prompt"], ids)

    def finish_batch(self, batch: dict, rows: dict) -> None:
        """Mixed-policy demonstrations train with ratio pi_theta / 1 (old log-probs 0). The
        batch keeps the rows (``demo`` bool [R]): one sampled ahead (asynchronous RL) gets its
        old log-probs at update time, where they are zeroed too."""
        if "demo" not in rows:
            return
        batch["demo"] = rows["demo"]
        if "old_logps" in batch:
            batch["old_logps"] = demo_old_logps(batch["old_logps"], rows["demo"])

    def metrics(self, rounds: Sequence[dict], rows: dict) -> dict:
        m = hint_metrics(rounds) if self.hints is not None else {}
        if "demo" in rows:
            m["mixed/demos"] = int(rows["demo"].sum())
        return m

    def state_dict(self) -> dict:
        return {"hints": None if self.hints is None else self.hints.state_dict(),
                "relift": None if self.buffer is None else self.buffer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.hints is not None:
            self.hints.load_state_dict(state["hints"])
        if self.buffer is not None:
            self.buffer.load_state_dict(state["relift"])


def hint_metrics(rounds: Sequence[dict]) -> dict:
    """``hint/*`` metrics over a step's rounds: share of groups hinted, mean prefix length
    (tokens, over hinted groups), success rate of the hinted samples."""
    stats = [r["hint"] for r in rounds if "hint" in r]
    groups = sum(s["groups"] for s in stats)
    hinted = sum(s["hinted"] for s in stats)
    samples = sum(s["samples"] for s in stats)
    return {"hint/fraction_hinted": hinted / max(groups, 1),
            "hint/prefix_tokens_mean": sum(s["prefix_tokens"] for s in stats) / max(hinted, 1),
            "hint/success_rate": sum(s["successes"] for s in stats) / max(samples, 1),
            "hint/padding_groups": sum(s.get("padding_groups", 0) for s in stats)}
