"""The rollout stage of ``algo.adv_estimator='vineppo'``: Monte-Carlo values of step prefixes.

After the call's last round (G completions per prompt, a tree's G leaves, or the knapsack's
group sizes; rewards; any group filter), each completion of the groups that train (``picked``)
is cut into steps (``algo.vine.splitter``: a newline, or a regex matched at the text's end; a
stop token also ends a step; steps past ``algo.vine.max_steps`` join the last one). For every
step t of every completion the prefix s_t = prompt ++ completion[:start of step t] is prefilled
once and its KV cache forked ``algo.vine.forks`` = K ways (``generate(num_samples=K)``, the
step-MC machinery of ``rljax.train.methods.step_mc``); a continuation is cut to the completion
budget (``rollout.max_new_tokens`` minus the prefix) and prefix ++ continuation is scored by
the reward functions (a ``rollout.temperature_schedule`` draws a fork's token at the
temperature of the completion position it continues: ``fork_temperatures``). V(s_t) is the mean
of the K rewards, and the advantages are ``algorithms.vine.vineppo_advantages``, which the
rollout's estimator call receives as ``rows["estimator_inputs"]`` (``step_ids``,
``step_values``, ``num_steps``). Fork rows are padded (repeating a real one) to a multiple of
the update's rows (``rollout.batch_size``), so at most ``max_steps`` fork programs are
compiled. Multi-turn episode rows (``env.name``) are cut within the model's turns and
forked as whole episodes, the environment replayed: ``methods.vine_episodes``.

The stage runs after guidance (``methods.guidance``) and after the groups are picked (dynamic
sampling and the online filter drop groups, extra rounds add some), so it values exactly the
rows that train, the batch's first rows (filler groups and padding rows get no steps): a
hinted row's prefixes are prompt ++ hint ++ completion[:start] and its forks' texts carry the
hint, as its own reward's does (``rnd["hint_prefixes"]``); a mixed-policy demonstration is
valued from its own prefixes under the policy, like a sample. ReLIFT's SFT steps do not touch
the rows.

Metrics: ``vine/fork_tokens`` (continuation tokens decoded for values, padding rows excluded),
``vine/fork_padding_tokens``, ``vine/prefixes``, ``vine/steps_mean``, ``vine/value_mean``;
``rollout/tokens`` and ``rollout/decoded_tokens`` include every decoded fork token (the
method's whole sampling cost).
"""
from __future__ import annotations

import re

import jax
import numpy as np

from rljax import sampling
from rljax.train.core.rollout import RolloutStage, expand_fields
from rljax.train.core.sampler import generate
from rljax.train.methods.allocation import group_rows
from rljax.train.methods.step_mc import step_ends

FORK_STREAM = 11   # rng stream of the value forks (fold_in of the round's key)


def step_pattern(vine_cfg):
    """The compiled end-of-step regex (anchored at the text's end)."""
    text = r"\n" if vine_cfg.splitter == "newline" else vine_cfg.regex
    return re.compile(f"(?:{text})\\Z")


def cap_steps(ends: list[int], max_steps: int) -> list[int]:
    """Step ends with the steps past ``max_steps`` joined into the last one."""
    return ends if len(ends) <= max_steps else ends[:max_steps - 1] + [ends[-1]]


def fork_temperatures(schedule, starts, k: int) -> np.ndarray:
    """f32 [len(starts) * k, N]: the K forks of the prefix cut at completion token
    ``starts[j]`` continue that completion, so their token t is its token starts[j] + t and is
    drawn at the temperature the schedule (f32 [N]) gives there (its last past the end: those
    tokens are cut)."""
    n = len(schedule)
    at = np.minimum(np.asarray(starts)[:, None] + np.arange(n)[None, :], n - 1)
    return np.repeat(np.asarray(schedule, np.float32)[at], k, axis=0)


class VineValues(RolloutStage):
    """Rollout stage (``core.rollout.RolloutStage``): each round's step layout and forked
    step-prefix values, given to the ``vineppo`` estimator."""

    name = "vine"

    def __init__(self, ctx):
        self.ctx, self.cfg = ctx, ctx.cfg
        v = ctx.cfg.algo.vine
        self.k, self.max_steps = int(v.forks), int(v.max_steps)
        self.pattern = step_pattern(v)
        self.n = int(ctx.cfg.rollout.max_new_tokens)
        self.prefix_bucket = int(ctx.cfg.data.max_prompt_length) + self.n
        self.decode = ctx.tokenizer.decode
        self.stop_ids = tuple(ctx.stop_ids)
        self.rollout = None   # the rollout whose rounds it values (its reward functions)
        self._last = None     # the last round's step layout and values

    def picked(self, rollout, params, rounds, groups, rng) -> None:
        """Values the rows of the groups that train (after any group filter; groups of any
        sizes), as one round of rows (``valued_rows``), kept for the batch."""
        self.rollout = rollout
        view = valued_rows(rounds, groups, rollout.g)
        if len(view["tokens"]):
            view.update(self.step_values(params, view, jax.random.fold_in(rng, FORK_STREAM)))
            # Every decoded fork token is sampling work: in rollout/tokens and decoded_tokens.
            spent = view["fork_tokens"] + view["fork_padding_tokens"]
            last = rounds[-1]
            last["extra_tokens"] = last.get("extra_tokens", 0) + spent
            last["extra_decoded"] = last.get("extra_decoded", 0) + spent
        self._last = view

    def finish_batch(self, batch: dict, rows: dict) -> None:
        """The valued rows are the batch's first rows, in order; the rest (filler groups,
        padding) do not train: no steps, advantage 0. Step layout and values go to the
        estimator."""
        v, r, n = self._last, len(rows["tokens"]), rows["tokens"].shape[1]
        t = len(v["tokens"])
        inputs = {"step_ids": np.full((r, n), -1, np.int32),
                  "step_values": np.zeros((r, self.max_steps), np.float32),
                  "num_steps": np.ones(r, np.int32)}
        for key in inputs if t else ():
            inputs[key][:t] = v[key]
        rows["estimator_inputs"] = {**rows.get("estimator_inputs", {}), **inputs}

    def metrics(self, rounds, rows) -> dict:
        v = self._last
        if not len(v["tokens"]):
            return {"vine/fork_tokens": 0, "vine/fork_padding_tokens": 0, "vine/prefixes": 0}
        return {"vine/fork_tokens": v["fork_tokens"],
                "vine/fork_padding_tokens": v["fork_padding_tokens"],
                "vine/prefixes": len(v["fork_rows"]),
                "vine/steps_mean": float(np.mean(v["num_steps"])),
                "vine/value_mean": float(np.mean(v["fork_rewards"]))}

    def sample_forks(self, params, rng, prefix_ids: list, starts: list, multiple: int,
                     pixels=None) -> dict:
        """K continuations of each prefix (token ids; the completion token it is cut at,
        ``starts``): ``generate``'s rows, K per prefix. The prefixes are padded, repeating
        the last, to a multiple of ``multiple`` rows (few programs compile). ``pixels``
        [prefixes, I, 3, S, S] (a vision tower): each prefix's prompt images, prefilled with
        it."""
        rows = -(-len(prefix_ids) // multiple) * multiple
        pad = rows - len(prefix_ids)
        schedule = self.rollout.temperatures   # None: rollout.temperature everywhere
        temps = (None if schedule is None else
                 fork_temperatures(schedule, starts + [starts[-1]] * pad, self.k))
        p_tok, p_mask = sampling.pad_to_bucket(prefix_ids + [prefix_ids[-1]] * pad,
                                               pad_id=self.ctx.tokenizer.pad_id,
                                               buckets=(self.prefix_bucket,))
        if pixels is not None:
            pixels = np.concatenate([pixels, np.repeat(pixels[-1:], pad, 0)])
        r = self.cfg.rollout
        return generate(self.ctx, params, p_tok, p_mask, rng, num_samples=self.k,
                        max_new_tokens=self.n, temperature=r.temperature, top_k=r.top_k,
                        top_p=r.top_p, temperatures=temps, pixels=pixels,
                        images=self.rollout.images)

    def step_values(self, params, rnd: dict, rng) -> dict:
        """The step layout and MC values of ``rnd``, a round of rows (``valued_rows``):
        ``step_ids`` int [R, N], ``step_values`` f32 [R, max_steps], ``num_steps`` int [R],
        the forks (``fork_rows``: (completion, step) of each real prefix; ``fork_rewards``
        f32 [prefixes, K]; ``fork_texts``) and their token counts. Episode rows (``turn_ids``)
        are valued by ``vine_episodes``."""
        if "turn_ids" in rnd:
            from rljax.train.methods import vine_episodes
            return vine_episodes.step_values(self, params, rnd, rng)
        n, k = self.n, self.k
        tokens, mask = rnd["tokens"], rnd["mask"]
        r = len(tokens)
        comps = [tokens[i][mask[i]].tolist() for i in range(r)]
        ends = [cap_steps(step_ends(c, self.decode, "", self.stop_ids, self.pattern),
                          self.max_steps) for c in comps]
        step_ids = np.full((r, mask.shape[1]), -1, np.int32)
        fork_rows, prefix_ids = [], []
        for i, e in enumerate(ends):
            cols = np.flatnonzero(mask[i])
            for t, (start, end) in enumerate(zip([0] + e[:-1], e)):
                step_ids[i, cols[start:end]] = t
                fork_rows.append((i, t, start))
                prefix_ids.append(list(rnd["prompt_ids"][i]) + comps[i][:start])
        real = len(fork_rows)
        if not real:   # no completion has a token: nothing to value
            prefix_ids = [list(rnd["prompt_ids"][0])]
        pixels = (None if "pixels" not in rnd else
                  rnd["pixels"][[f[0] for f in fork_rows] or [0]])   # each prefix's row's
        # A multiple of the update's rows whatever the filters kept: few fork programs compile.
        out = self.sample_forks(params, rng, prefix_ids, [f[2] for f in fork_rows] or [0],
                                int(self.cfg.rollout.batch_size), pixels)
        texts, prompts, lengths, owners = [], [], [], []
        hints = rnd.get("hint_prefixes", {})   # a hinted row's reward judges hint ++ completion
        for j, (i, _, start) in enumerate(fork_rows):
            for q in range(k):
                row = j * k + q
                cont = out["tokens"][row][out["mask"][row]].tolist()[:n - start]
                texts.append(self.decode(hints.get(i, []) + comps[i][:start] + cont))
                lengths.append(start + len(cont))
                owners.append(rnd["examples"][i])
                prompts.append(owners[-1]["prompt"])
        result = self.rollout.reward_fn(prompts, texts, completion_lengths=lengths,
                                        **expand_fields(owners, 1))
        self.rollout.monitor.observe(result)
        fork_rewards = np.asarray(result.total, np.float32)[:real * k].reshape(real, k)
        values = np.zeros((r, self.max_steps), np.float32)
        for (i, t, _), rs in zip(fork_rows, fork_rewards):
            values[i, t] = rs.mean()
        decoded = int(out["lengths"].sum())
        fork_tokens = int(out["lengths"][:real * k].sum())
        return {"step_ids": step_ids, "step_values": values,
                "num_steps": np.asarray([len(e) for e in ends], np.int32),
                "fork_rows": fork_rows, "fork_rewards": fork_rewards, "fork_texts": texts,
                "fork_tokens": fork_tokens, "fork_padding_tokens": decoded - fork_tokens}


def valued_rows(rounds, groups, g: int) -> dict:
    """The rows of ``groups`` ((round, group) pairs; G rows each, or a ragged round's
    ``group_sizes``) as one round of rows: ``tokens``, ``mask`` (episodes: ``turn_ids``)
    [T, N], ``lengths``,
    ``rewards`` (and ``demo``) [T], ``prompt_ids`` and ``examples`` per row,
    ``hint_prefixes`` keyed by position; with a vision tower ``pixels`` [T, I, 3, S, S], each
    row's prompt's."""
    picked = []   # (round, row, its prompt's entry in the round)
    for r, i in groups:
        if "group_sizes" in rounds[r]:   # (prompt ids and examples are per row)
            picked += [(r, s, s) for s in group_rows(rounds[r], i)]
        else:
            picked += [(r, s, i) for s in range(i * g, (i + 1) * g)]
    first = rounds[0]
    view = {key: np.asarray([rounds[r][key][s] for r, s, _ in picked], first[key].dtype)
            .reshape((len(picked),) + first[key].shape[1:])
            for key in ("tokens", "mask", "lengths", "rewards", "demo", "turn_ids")
            if key in first}
    view["prompt_ids"] = [rounds[r]["prompt_ids"][p] for r, _, p in picked]
    view["examples"] = [rounds[r]["examples"][p] for r, _, p in picked]
    if "pixels" in first:   # the forks prefill each row's prompt with its images
        view["pixels"] = np.stack([rounds[r]["pixels"][p] for r, _, p in picked])
    view["hint_prefixes"] = {j: rounds[r]["hint_prefixes"][s]
                             for j, (r, s, _) in enumerate(picked)
                             if s in rounds[r].get("hint_prefixes", {})}
    return view
