"""Process-reward labels sampled on the fly (Math-Shepherd): Monte-Carlo step values.

One call builds one batch of labelled solutions for the PRM phase, with the sampling and
scoring machinery of :mod:`rljax.train.methods.step_mc`:

1. K = ``algo.num_generations`` samples for each of B prompts (the prompt prefilled once).
2. Two of them per prompt are labelled: the highest- and the lowest-reward sample (samples 0
   and 1 when all K score the same), so wrong solutions are labelled even when the policy is
   mostly right. Each is cut into steps at ``data.step_delimiter`` (``step_mc.step_ends``).
3. Every proper step prefix (the first ``algo.step_mc.max_steps - 1``) gets K continuations
   (prefix prefilled once, its cache forked K ways); a continuation's text is prefix +
   continuation, cut at ``rollout.max_new_tokens`` tokens, scored by the reward functions.
4. A step's soft label is the fraction of its prefix's continuations whose reward is at least
   ``algo.prm.correct_reward`` (the verified answer); the hard label is ``soft > 0`` (a step
   is good when some continuation from it reaches the answer). The last step of a solution
   is labelled by the solution's own reward (the solution is its only completion). Steps past
   ``max_steps - 1`` that are not last stay unlabelled.

The labels sit on the token that ends each step (its delimiter, or the stop token), as in
TRL's stepwise format. Batches are ``rljax.data.stepwise.stepwise_batch`` arrays of
``2 * B`` rows; ``last_details`` keeps, per labelled step, the continuation texts its label
came from (so a test can recompute it).
"""
from __future__ import annotations

import time

import jax
import numpy as np

from rljax.data import stepwise
from rljax.train.methods.step_mc import StepMCPairs, step_ends


def shepherd_labels(rewards: np.ndarray, correct_reward: float) -> tuple[np.ndarray, np.ndarray]:
    """Math-Shepherd labels of S prefixes from their continuations' rewards [S, K]:
    (soft [S] = fraction with reward >= ``correct_reward``, hard [S] = soft > 0)."""
    r = np.asarray(rewards, np.float64)
    soft = (r >= correct_reward).mean(axis=1).astype(np.float32)
    return soft, (soft > 0).astype(np.float32)


def labelled_pair(rewards: np.ndarray) -> tuple[int, int]:
    """Indices of the two samples of one prompt to label from their K rewards: the best and
    the worst (first of ties); (0, 1) when every reward is the same."""
    best, worst = int(np.argmax(rewards)), int(np.argmin(rewards))
    return (best, worst) if best != worst else (0, 1)


class StepMCLabels(StepMCPairs):
    """Callable ``(state, step) -> (PRM batch, metrics)``; host state: the data iterator's."""

    def __init__(self, ctx, iterator):
        super().__init__(ctx, iterator)
        p = ctx.cfg.algo.prm
        self.soft, self.correct = bool(p.soft_labels), float(p.correct_reward)
        self.num_rows = 2 * self.num_prompts
        self.last_details: list[dict] = []

    def __call__(self, state, step: int) -> tuple[dict, dict]:
        t0 = time.perf_counter()
        k, tok, cfg = self.k, self.ctx.tokenizer, self.cfg
        first = self.first_level(state, step)
        rng, examples, prompt_ids = first.rng, first.examples, first.prompt_ids
        r0, conts0 = first.rewards, first.completions
        b = len(examples)
        rows = [(i, j) for i in range(b) for j in labelled_pair(r0[i])]   # (prompt, sample)
        trajs = [conts0[i * k + j] for i, j in rows]
        ends = [step_ends(t, self.decode, cfg.data.step_delimiter, self.stop_ids) for t in trajs]

        # K continuations of every labelled proper prefix, one generate (static row count).
        prefixes = [(r, e) for r, es in enumerate(ends) for e in es[:-1][:self.max_steps - 1]]
        static_rows = len(rows) * (self.max_steps - 1)
        cont_rewards = np.zeros((0, k), np.float32)
        cont_texts: list[list[str]] = []
        tokens_real = first.tokens
        if prefixes and static_rows:
            owners = [rows[r][0] for r, _ in prefixes]
            pre = [trajs[r][:e] for r, e in prefixes]
            pad = static_rows - len(prefixes)
            out1 = self._sample(state.params,
                                [prompt_ids[o] + p for o, p in zip(owners, pre)]
                                + [prompt_ids[owners[-1]] + pre[-1]] * pad,
                                jax.random.fold_in(rng, 1), bucket=self.prefix_bucket)
            real = len(prefixes) * k
            tokens_real += int(out1["lengths"][:real].sum())
            out1 = {key: v[:real] for key, v in out1.items()}
            flat, conts = self._score(examples, owners, pre, out1)
            cont_rewards = flat.reshape(-1, k)
            cont_texts = [[self.decode(p + c) for c in conts[s * k:(s + 1) * k]]
                          for s, p in enumerate(pre)]
        soft, hard = shepherd_labels(cont_rewards, self.correct)
        labels = soft if self.soft else hard
        at = {pe: s for s, pe in enumerate(prefixes)}

        encoded, details = [], []
        for r, (i, j) in enumerate(rows):
            positions, ys = [], []
            for e in ends[r][:-1][:self.max_steps - 1]:
                s = at[(r, e)]
                positions.append(e - 1)
                ys.append(float(labels[s]))
                details.append({"row": r, "prefix_end": e, "label": ys[-1],
                                "continuations": cont_texts[s], "answer": examples[i]})
            if ends[r]:   # the last step: the solution's own outcome
                positions.append(ends[r][-1] - 1)
                ys.append(float(r0[i, j] >= self.correct))
            encoded.append((prompt_ids[i], trajs[r], positions, ys))
        batch = stepwise.stepwise_batch(encoded, self.num_rows, int(cfg.data.max_prompt_length),
                                        self.n, tok.pad_id)
        self.last_details = details
        good = batch["labels"][batch["label_mask"]]
        metrics = {
            "reward/mean": float(r0.mean()), "reward/std": float(r0.std()),
            "prm/labels": int(batch["label_mask"].sum()),
            "prm/label_mean": float(good.mean()) if good.size else 0.0,
            "prm/prefixes": len(prefixes),
            "prm/steps_mean": float(np.mean([len(e) for e in ends])),
            "rollout/tokens": tokens_real,
            "time/sample_and_score": time.perf_counter() - t0,
        }
        return batch, metrics
