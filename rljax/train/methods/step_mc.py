"""Step-level DPO pairs from Monte-Carlo step values (``data.pairs="step_mc"``; MCTS-DPO style).

One call builds one batch of step pairs for the DPO phase:

1. Level 0: K = ``algo.num_generations`` samples for each of B prompts (one ``generate`` with
   ``num_samples=K``: the prompt is prefilled once and its KV cache fanned out to K rows).
2. The best-reward sample of each prompt is the trajectory; it is cut into steps at
   ``data.step_delimiter`` (a step ends with the delimiter; the last one at the end).
3. Levels 1..: every proper step prefix of the trajectory (up to ``algo.step_mc.max_steps - 1``
   of them) is appended to its prompt and gets K continuations, again one ``generate`` with
   ``num_samples=K`` (prefill the prompt + prefix once, fork the cache K ways). A
   continuation's text is prefix + continuation, cut at ``rollout.max_new_tokens`` tokens (the
   policy's own completion budget), and scored by the reward functions.
4. Values: the value of the prefix is the mean reward of its K continuations. At each prefix,
   every distinct first step of its continuations is a candidate next step, valued by the mean
   reward of the continuations that start with it; the trajectory's own next step also counts
   the K continuations of the next prefix (they are samples of the same value).
5. Pairs: at each prefix, chosen = its best candidate step, rejected = its worst, when their
   values differ by more than ``algo.step_mc.min_value_gap``. The DPO "prompt" is prompt ++
   prefix (context only: its tokens are not scored) and the completions are the two steps, so
   the DPO loss covers the differing step only.

Prompt selection (``data.selection``) and DAPO dynamic sampling (``algo.dynamic_sampling``)
act on level 0, before any prefix is sampled: every level-0 round's rewards are the prompts'
groups of K (``observe``: MoPPS's posteriors, the curriculum's accuracy), and a filter
(``online_filter``'s pass-rate band, or rewards not all equal) keeps the prompts whose step
pairs are built; up to ``algo.max_sampling_rounds`` more level-0 rounds fill the batch, and
dropped prompts that still fill it (``rollout/filler_groups``) give no pairs.

Shapes stay static: always ``B * max_steps`` pairs (``pair_mask`` marks the real ones), prefix
prompts padded to ``data.max_prompt_length + rollout.max_new_tokens``, and a constant number of
continuation rows (rows of missing prefixes repeat a real one and are not counted).
"""
from __future__ import annotations

import time
from typing import Callable, NamedTuple, Sequence

import jax
import numpy as np

from rljax import algorithms, rewards, sampling
from rljax.data import selection
from rljax.train.core.buckets import pair_prompt_len
from rljax.train.core.rollout import RL_STREAM, expand_fields, group_filter, prompt_buckets
from rljax.train.core.sampler import generate


# ----------------------------------------------------------------------------- pure host helpers

def step_ends(ids: Sequence[int], decode: Callable[[list[int]], str], delimiter: str,
              stop_ids: Sequence[int] = (), pattern=None) -> list[int]:
    """Token counts at which the steps of a completion end: a step ends right after the token
    that completes ``delimiter`` in the decoded text (or, with ``pattern``, a compiled regex
    anchored at the end, ``\\Z``, once it matches the text), or at a stop token; the last
    step ends at ``len(ids)``. Returns an increasing list whose last element is ``len(ids)``
    ([] if empty).
    """
    ends, prev = [], ""
    at_end = ((lambda t: t.endswith(delimiter)) if pattern is None else
              (lambda t: pattern.search(t) is not None))
    for k in range(1, len(ids) + 1):
        text = decode(list(ids[:k]))
        # This token completed a delimiter (it changed the text, which now ends with it).
        if int(ids[k - 1]) in stop_ids or (text != prev and at_end(text)):
            ends.append(k)
        prev = text
    if ids and (not ends or ends[-1] != len(ids)):
        ends.append(len(ids))
    return ends


def turn_step_ends(ids: Sequence[int], turns: Sequence[int], decode: Callable[[list[int]], str],
                   delimiter: str, stop_ids: Sequence[int] = (), pattern=None) -> list[int]:
    """Step ends of a multi-turn trajectory: ``step_ends`` within each model turn (a maximal
    run of equal ``turns[k] >= 0``; ``turns[k] < 0``: an observation token, never in a step),
    so every turn's end ends a step. Token counts into ``ids``, increasing."""
    ends, start = [], 0
    for k in range(1, len(ids) + 1):
        if k < len(ids) and turns[k] == turns[start]:
            continue
        if turns[start] >= 0:
            ends += [start + e for e in step_ends(ids[start:k], decode, delimiter, stop_ids,
                                                  pattern)]
        start = k
    return ends


def candidate_values(first_steps: Sequence[tuple], step_rewards: Sequence[float],
                     extra: tuple | None = None) -> dict[tuple, tuple[float, int]]:
    """MC values of the candidate next steps at one prefix.

    Args:
      first_steps: the first step (token tuple) of each of the K continuations of the prefix.
      step_rewards: their K rewards.
      extra: optional ``(step, rewards)``: more continuations known to start with ``step``
        (those of the next prefix of the trajectory).
    Returns ``{step: (mean reward, number of continuations)}`` in first-seen order.
    """
    sums: dict[tuple, list[float]] = {}
    for step, r in zip(first_steps, step_rewards):
        acc = sums.setdefault(tuple(step), [0.0, 0])
        acc[0] += float(r)
        acc[1] += 1
    if extra is not None:
        step, more = extra
        acc = sums.setdefault(tuple(step), [0.0, 0])
        acc[0] += float(np.sum(more))
        acc[1] += len(more)
    return {k: (s / n, n) for k, (s, n) in sums.items()}


def best_worst_steps(values: dict[tuple, tuple[float, int]], min_gap: float = 0.0):
    """(chosen step, rejected step, value gap) of one prefix's candidates, or None when fewer
    than two candidates or their values differ by no more than ``min_gap``."""
    if len(values) < 2:
        return None
    items = list(values.items())
    best = max(items, key=lambda kv: kv[1][0])      # first of the ties, deterministic
    worst = min(items, key=lambda kv: kv[1][0])
    gap = best[1][0] - worst[1][0]
    if gap <= min_gap or best[0] == worst[0]:
        return None
    return best[0], worst[0], gap


def selected_rounds(draw: Callable[[int], tuple[list, np.ndarray]], group_size: int,
                    num: int, keep: Callable | None, selector, extra_rounds: int):
    """Prompt selection over rounds of first samples (step pairs' level 0, the search's root
    expansions). ``draw(r)`` draws round r's prompts: ``(items [b], rewards f32
    [b * group_size])``, an item per prompt; every round's rewards go to ``selector``
    (``observe``, None: none); ``keep(rewards, None) -> bool [b]`` (None: keep all) filters
    them, and up to ``extra_rounds`` more rounds are drawn until ``num`` are kept.

    Returns ``(items [num]: the first ``num`` kept, then dropped ones that fill the batch,
    trains bool [num]: False for those fillers, metrics)``: ``reward/mean``/``std`` (every
    sample drawn), ``rollout/rounds``, ``rollout/filler_groups`` and the selector's."""
    rounds, kept, dropped = [], [], []
    for r in range(1 + (extra_rounds if keep is not None else 0)):
        items, rewards_ = draw(r)
        rounds.append((items, rewards_))
        if selector is not None:   # learns from every round, kept or not
            selector.observe(rewards_, group_size)
        ok = (np.ones(len(items), bool) if keep is None
              else np.asarray(keep(rewards_, None), bool))
        for i, good in enumerate(ok):
            (kept if good else dropped).append(items[i])
        if len(kept) >= num:
            break
    filler = max(0, num - len(kept))
    every = np.concatenate([rw for _, rw in rounds]).astype(np.float64)
    metrics = {"reward/mean": float(every.mean()), "reward/std": float(every.std()),
               "rollout/rounds": len(rounds), "rollout/filler_groups": filler}
    if selector is not None:
        metrics.update(selector.metrics())
    picked = kept[:num] + dropped[:filler]
    return picked, np.arange(len(picked)) < len(picked) - filler, metrics


def prompt_filter(cfg, iterator, group_size: int):
    """``(selector or None, group filter or None)`` of prompt selection over ``iterator``
    (``data.selection``) and DAPO dynamic sampling, for groups of ``group_size``."""
    selector = iterator if isinstance(iterator, selection.Selector) else None
    return selector, group_filter(cfg, selector, group_size, lambda r, sizes: (
        algorithms.nonzero_variance_groups(r, group_size)))


# ----------------------------------------------------------------------------- the source

# Sampling keys of one step: fold_in(step key, stream). Level 0's extra rounds (prompt
# selection's filter) fold the round into their own stream.
LEVEL0, PREFIXES, EXTRA_ROUNDS = 0, 1, 2


def level0_key(rng, r: int):
    """The key of level 0's round ``r`` under the step's key ``rng``."""
    return (jax.random.fold_in(rng, LEVEL0) if r == 0 else
            jax.random.fold_in(jax.random.fold_in(rng, EXTRA_ROUNDS), r))


def level_pairs(levels: Sequence[tuple], min_gap: float, chain: bool = True):
    """Pairs of one trajectory's prefixes. ``levels[d] = (first steps, rewards, next step)``:
    the first step (token tuple) of each continuation of prefix d, their rewards, and the
    trajectory's own step after prefix d (valued with the next prefix's continuations too,
    unless ``chain`` is False: where what follows the step is not the step's alone).
    Yields ``(d, chosen step ids, rejected step ids, value gap)`` for the prefixes with a
    pair (``candidate_values``, ``best_worst_steps``)."""
    for d, (steps, rs, own) in enumerate(levels):
        extra = (own, levels[d + 1][1]) if chain and d + 1 < len(levels) else None
        pick = best_worst_steps(candidate_values(steps, rs, extra), min_gap)
        if pick is not None:
            yield d, list(pick[0]), list(pick[1]), pick[2]


def pair_metrics(first, pairs: list[tuple], prefixes: int, steps: list[int],
                 prefix_values: list[float], tokens: int, tokens_padding: int) -> dict:
    """A step's ``step_mc/*`` and rollout metrics: ``first`` its ``FirstLevel``, ``pairs``
    ``(context, chosen, rejected, gap, depth)``, ``prefixes`` the prefixes sampled, ``steps``
    each trajectory's number of steps, ``prefix_values`` every prefix's (the roots') value."""
    return {
        **first.metrics,
        "step_mc/pairs": len(pairs), "step_mc/prefixes": prefixes,
        "step_mc/steps_mean": float(np.mean(steps)),
        "step_mc/single_step_frac": float(np.mean([n <= 1 for n in steps])),
        "step_mc/prefix_value_mean": float(np.mean(prefix_values)) if prefix_values else 0.0,
        "step_mc/value_gap_mean": float(np.mean([p[3] for p in pairs])) if pairs else 0.0,
        "step_mc/pair_depth_mean": float(np.mean([p[4] for p in pairs])) if pairs else 0.0,
        "rollout/tokens": tokens, "rollout/tokens_padding": tokens_padding,
        "completion/length_mean": float(first.lengths.mean()),
    }


class FirstLevel(NamedTuple):
    """Level 0 of one step, on the B prompts that fill the batch (kept ones first)."""
    rng: jax.Array               # the step's key
    examples: list[dict]         # [B]
    prompt_ids: list[list[int]]  # [B] token ids
    rewards: np.ndarray          # f32 [B, K]
    completions: list[list[int]]  # [B * K] token ids, prompt-major
    lengths: np.ndarray          # int [B * K] sampled completion lengths
    trains: np.ndarray           # bool [B]: the prompt's pairs train (False: filler)
    tokens: int                  # tokens sampled at level 0, in every round
    metrics: dict                # reward/*, rollout/rounds, rollout/filler_groups, selection/*


class StepMCPairs:
    """Callable ``(state, step) -> (preference batch, metrics)`` for the DPO phase; its only
    host state is the data iterator's (the sampling keys derive from ``state.rng`` and step)."""

    def __init__(self, ctx, iterator):
        cfg = ctx.cfg
        self.ctx, self.cfg, self.iterator = ctx, cfg, iterator
        self.k = int(cfg.algo.num_generations)
        self.num_prompts = cfg.rollout.batch_size // self.k
        self.max_steps = int(cfg.algo.step_mc.max_steps)
        self.num_pairs = self.num_prompts * self.max_steps
        self.n = int(cfg.rollout.max_new_tokens)
        self.prefix_bucket = int(cfg.data.max_prompt_length) + self.n
        self.pair_bucket = pair_prompt_len(cfg)   # (over an environment's turns: wider)
        # (None without reward.names: the layout of MCTS pairs over an environment's turns)
        self.reward_fn = ctx.reward_fn() if cfg.reward.names else None
        self.monitor = rewards.RewardMonitor(cfg.reward.max_consecutive_error_steps)
        tok = ctx.tokenizer
        self.decode = lambda ids: tok.decode(ids)
        self.stop_ids = tuple(i for i in (tok.eos_id,) if i is not None)
        # Prompt selection: the iterator is a selector to report level 0's rounds to.
        self.selector, self.keep = prompt_filter(cfg, iterator, self.k)

    # -- sampling and scoring ----------------------------------------------------------------

    def _sample(self, params, prompt_ids: list[list[int]], rng, bucket=None):
        """K continuations of each prompt (token lists): numpy ``tokens/mask/lengths``."""
        tok, cfg = self.ctx.tokenizer, self.cfg
        buckets = prompt_buckets(cfg.data.max_prompt_length) if bucket is None else (bucket,)
        p_tok, p_mask = sampling.pad_to_bucket(prompt_ids, pad_id=tok.pad_id, buckets=buckets)
        micro = cfg.rollout.micro_batch_size // self.k if cfg.rollout.micro_batch_size else 0
        return generate(self.ctx, params, p_tok, p_mask, rng, num_samples=self.k,
                        max_new_tokens=self.n, temperature=cfg.rollout.temperature,
                        top_k=cfg.rollout.top_k, top_p=cfg.rollout.top_p, micro_prompts=micro)

    def _score(self, examples: list[dict], owners: list[int], prefixes: list[list[int]],
               out: dict) -> tuple[np.ndarray, list[list[int]]]:
        """Rewards [rows * K] of prefix ++ continuation (cut to N tokens) and the continuation
        token lists (cut the same way). ``owners[r]`` is the example of prefix row r."""
        k, texts, conts, prompts, rows = self.k, [], [], [], []
        for r, (owner, prefix) in enumerate(zip(owners, prefixes)):
            room = self.n - len(prefix)
            for j in range(k):
                i = r * k + j
                cont = out["tokens"][i][out["mask"][i]].tolist()[:room]
                conts.append(cont)
                texts.append(self.decode(prefix + cont))
                prompts.append(examples[owner]["prompt"])
                rows.append(examples[owner])
        lengths = [len(prefixes[i // k]) + len(c) for i, c in enumerate(conts)]
        result = self.reward_fn(prompts, texts, completion_lengths=lengths,
                                **expand_fields(rows, 1))
        self.monitor.observe(result)
        return np.asarray(result.total, np.float32), conts

    # -- one batch -------------------------------------------------------------------------------

    def _level0_round(self, params, rng, r: int) -> tuple[list, np.ndarray]:
        """Round ``r`` of level 0: the iterator's next prompts, K samples each, scored.
        Returns ``(items, rewards f32 [B*K])``, an item per prompt: ``(example, prompt ids,
        rewards [K], completions (K id lists), lengths [K])``."""
        key, examples, k = level0_key(rng, r), next(self.iterator), self.k
        b = len(examples)
        prompt_ids = [self.ctx.tokenizer.encode(ex["prompt"]) for ex in examples]
        out = self._sample(params, prompt_ids, key)
        rewards_, conts = self._score(examples, list(range(b)), [[] for _ in range(b)], out)
        return [(examples[i], prompt_ids[i], rewards_[i * k:(i + 1) * k],
                 conts[i * k:(i + 1) * k], out["lengths"][i * k:(i + 1) * k])
                for i in range(b)], rewards_

    def first_level(self, state, step: int) -> FirstLevel:
        """Level 0 of step ``step``: the next prompts' K samples each, scored; with a group
        filter (module docstring) up to ``algo.max_sampling_rounds`` more rounds, then the
        first B kept prompts, filled up with dropped ones (``selected_rounds``)."""
        rng = jax.random.fold_in(jax.random.fold_in(state.rng, RL_STREAM), step)
        tokens = []

        def draw(r):
            items, rewards_ = self._level0_round(state.params, rng, r)
            tokens.append(int(sum(item[4].sum() for item in items)))
            return items, rewards_
        items, trains, metrics = selected_rounds(
            draw, self.k, self.num_prompts, self.keep, self.selector,
            int(self.cfg.algo.max_sampling_rounds))
        return FirstLevel(
            rng=rng, examples=[it[0] for it in items], prompt_ids=[it[1] for it in items],
            rewards=np.stack([it[2] for it in items]),
            completions=[c for it in items for c in it[3]],
            lengths=np.concatenate([it[4] for it in items]), trains=trains,
            tokens=sum(tokens), metrics=metrics)

    def __call__(self, state, step: int) -> tuple[dict, dict]:
        t0 = time.perf_counter()
        k = self.k
        first = self.first_level(state, step)
        rng, examples, prompt_ids = first.rng, first.examples, first.prompt_ids
        r0, conts0 = first.rewards, first.completions
        b = len(examples)
        # Level 0's best sample per prompt is the trajectory.
        trajectories = [conts0[i * k + int(np.argmax(r0[i]))] for i in range(b)]
        ends = [step_ends(t, self.decode, self.cfg.data.step_delimiter, self.stop_ids)
                for t in trajectories]

        # Levels 1..: the proper step prefixes of each trajectory whose pairs train, K
        # continuations each.
        levels = [(i, e) for i in range(b) if first.trains[i]
                  for e in ends[i][:-1][:self.max_steps - 1]]
        static_rows = self.num_prompts * (self.max_steps - 1)
        tokens_real = first.tokens
        tokens_padding = 0
        r1 = conts1 = None
        if levels and static_rows:
            owners = [i for i, _ in levels]
            prefixes = [trajectories[i][:e] for i, e in levels]
            pad = static_rows - len(levels)   # static shapes: repeat a real row
            out1 = self._sample(state.params,
                                [prompt_ids[i] + p for i, p in zip(owners, prefixes)]
                                + [prompt_ids[owners[-1]] + prefixes[-1]] * pad,
                                jax.random.fold_in(rng, PREFIXES), bucket=self.prefix_bucket)
            real = len(levels) * k
            tokens_real += int(out1["lengths"][:real].sum())
            tokens_padding = int(out1["lengths"][real:].sum())
            out1 = {key: v[:real] for key, v in out1.items()}
            r1, conts1 = self._score(examples, owners, prefixes, out1)

        # Values and pairs, prefix by prefix.
        row_of = {lv: r for r, lv in enumerate(levels)}
        pairs, prefix_values = [], []
        for i in np.flatnonzero(first.trains):
            # (prefix end, its K continuations, their rewards): the root, then each prefix
            nodes = [(0, conts0[i * k:(i + 1) * k], r0[i])]
            for e in ends[i][:-1][:self.max_steps - 1]:
                r = row_of[(i, e)]
                nodes.append((e, conts1[r * k:(r + 1) * k], r1[r * k:(r + 1) * k]))
            prefix_values += [float(np.mean(rs)) for _, _, rs in nodes]  # V = mean of K
            pairs += [(prompt_ids[i] + trajectories[i][:e], *pick)
                      for e, pick in self._node_pairs(trajectories[i], nodes)]
        metrics = pair_metrics(first, pairs, len(levels), [len(e) for e in ends], prefix_values,
                               tokens_real, tokens_padding)
        metrics["time/sample_and_score"] = time.perf_counter() - t0
        return self.encode_pairs(pairs), metrics

    def _first_step(self, ids: list[int]) -> tuple:
        """The first step of a continuation (token tuple; () for an empty one)."""
        if not ids:
            return ()
        return tuple(ids[:step_ends(ids, self.decode, self.cfg.data.step_delimiter,
                                    self.stop_ids)[0]])

    def _node_pairs(self, trajectory: list[int], nodes: list[tuple]):
        """Yields ``(prefix end, (chosen, rejected, value gap, depth))`` for the prefixes of one
        trajectory that have a pair; ``nodes[d] = (prefix end, continuations, rewards)``."""
        ends = [e for e, _, _ in nodes[1:]] + [None]
        levels = [([self._first_step(c) for c in conts], rs, tuple(trajectory[e:end]))
                  for (e, conts, rs), end in zip(nodes, ends)]
        gap = float(self.cfg.algo.step_mc.min_value_gap)
        for d, chosen, rejected, value_gap in level_pairs(levels, gap):
            yield nodes[d][0], (chosen, rejected, value_gap, d)

    def encode_pairs(self, pairs: list[tuple]) -> dict:
        """Step pairs ``(context ids, chosen step ids, rejected step ids, gap, depth)`` -> the
        ``encode_preference`` layout with ``pair_mask``, always ``num_pairs`` rows: context
        left-padded to ``pair_bucket``, steps right-padded to ``rollout.max_new_tokens``."""
        tok, n = self.ctx.tokenizer, self.n
        pairs = pairs[:self.num_pairs]
        rows = pairs + [pairs[-1] if pairs else ([tok.pad_id], [tok.pad_id], [tok.pad_id], 0, 0)
                        ] * (self.num_pairs - len(pairs))
        p_tok, p_mask = sampling.pad_to_bucket([r[0] for r in rows], pad_id=tok.pad_id,
                                               buckets=(self.pair_bucket,))

        def right_pad(seqs):
            t = np.full((len(seqs), n), tok.pad_id, np.int32)
            m = np.zeros((len(seqs), n), bool)
            for j, s in enumerate(seqs):
                t[j, :len(s)], m[j, :len(s)] = s, True
            return t, m
        c_tok, c_mask = right_pad([r[1] for r in rows])
        r_tok, r_mask = right_pad([r[2] for r in rows])
        return {"prompt_tokens": p_tok, "prompt_mask": p_mask, "chosen_tokens": c_tok,
                "chosen_mask": c_mask, "rejected_tokens": r_tok, "rejected_mask": r_mask,
                "pair_mask": np.arange(self.num_pairs) < len(pairs)}
