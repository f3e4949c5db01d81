"""Process reward model (PRM) training: a value head scoring every step of a solution.

The PRM is built as the reward model is (``phases.rm``): the policy's trunk plus a fresh
scalar head, kept in ``critic_params``; the policy is not trained. Its logit at the token that
ends a step is the log-odds that the step is good (``sigmoid`` = the step's score); the loss
is binary cross-entropy at those tokens only (``algorithms.process_reward_loss``: TRL
PRMTrainer's two-class token classification with one logit).

Labels come from
  * a stepwise file (``data.source="jsonl"``, ``data.path``): TRL's ``{prompt, completions:
    [steps], labels: [per step]}`` rows, each step followed by ``data.step_delimiter`` and
    labelled on its last token (``rljax.data.stepwise``); ``data.eval_path`` holds out rows;
  * a built-in task (``data.source="arithmetic"`` with ``steps=True``): Math-Shepherd labels
    sampled on the fly from the policy (``methods.prm_labels``: the fraction of K
    continuations of each step prefix that reach the verified answer; ``algo.prm.soft_labels``
    trains on that fraction, else on ``fraction > 0``). Held out: the task's eval problems,
    each as its reference solution and a copy with one wrong step (``stepwise.corrupted_solutions``).

Batch arrays: ``rljax.data.stepwise`` (``prompt_tokens [B, P]``, ``completion_tokens [B, C]``,
``labels``/``label_mask [B, C]``, ``row_mask [B]``).
"""
from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from rljax import algorithms
from rljax import data as data_lib
from rljax import distributed as dist
from rljax.data import stepwise
from rljax.errors import UserError
from rljax.models import lora as lora_lib
from rljax.train.core import programs as programs_lib, steps
from rljax.train.core.setup import data_iterator
from rljax.train.core.steps import to_host
from rljax.train.methods.prm_labels import StepMCLabels
from rljax.train.methods.prm_loss import label_mask, prm_loss  # noqa: F401 (here too)
from rljax.train.methods.prm_rerank import step_logits
from rljax.train.phases import rm as rm_lib



def uses_task_labels(cfg) -> bool:
    """Labels sampled on the fly from a built-in task (else read from a stepwise file)."""
    return cfg.data.source in data_lib.TASKS


def num_rows(cfg) -> int:
    """Rows per update: ``rollout.batch_size`` file rows, or two labelled samples for each of
    ``rollout.batch_size / algo.num_generations`` task prompts."""
    if uses_task_labels(cfg):
        return 2 * (int(cfg.rollout.batch_size) // int(cfg.algo.num_generations))
    return int(cfg.rollout.batch_size)


def batch_spec(ctx, rows: int | None = None) -> dict:
    """Abstract stepwise batch of one update (``programs.batch_struct``; ``rows`` rows, by
    default this phase's), for ``rljax plan``."""
    cfg, mesh = ctx.cfg, ctx.mesh
    b = num_rows(cfg) if rows is None else int(rows)
    p, c = int(cfg.data.max_prompt_length), int(cfg.rollout.max_new_tokens)
    s = functools.partial(programs_lib.batch_struct, mesh)
    return {"prompt_tokens": s((b, p), jnp.int32), "prompt_mask": s((b, p), bool),
            "completion_tokens": s((b, c), jnp.int32), "completion_mask": s((b, c), bool),
            "labels": s((b, c), jnp.float32), "label_mask": s((b, c), bool),
            "row_mask": s((b,), bool)}


class StepwiseFile:
    """Batches of a stepwise JSONL file in a seeded order, epoch after epoch; checkpointable
    (``state``/``restore``: epoch and position)."""

    def __init__(self, ctx, path: str, batch_size: int, shuffle: bool = True):
        cfg = ctx.cfg
        self.ctx, self.batch_size, self.shuffle = ctx, int(batch_size), bool(shuffle)
        self.rows = read_rows(cfg, ctx.tokenizer, path)
        self.epoch = self.pos = 0

    def _order(self) -> np.ndarray:
        n = len(self.rows)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.ctx.cfg.seed, self.epoch]).permutation(n)

    def __next__(self) -> dict:
        order = self._order()
        if self.pos >= len(order):
            self.epoch, self.pos = self.epoch + 1, 0
            order = self._order()
        take = order[self.pos:self.pos + self.batch_size]
        self.pos += len(take)
        return encode_rows(self.ctx, [self.rows[i] for i in take], self.batch_size)

    def state(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def restore(self, state: dict) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])


def read_rows(cfg, tokenizer, path: str) -> list[dict]:
    """A stepwise file's rows, checked (format and lengths): UserError with one line."""
    try:
        rows = stepwise.read_jsonl(path)
        stepwise.check_lengths(rows, tokenizer, cfg.data.step_delimiter,
                               int(cfg.data.max_prompt_length), int(cfg.rollout.max_new_tokens),
                               path)
    except (OSError, ValueError) as e:
        raise UserError(f"PRM data: {e}") from None
    return rows


def encode_rows(ctx, rows: list[dict], batch_size: int) -> dict:
    """Stepwise rows -> a static batch (TRL's label placement, ``data.step_delimiter``)."""
    cfg, tok = ctx.cfg, ctx.tokenizer
    enc = [stepwise.encode_row(tok, r["prompt"], r["completions"], r["labels"],
                               cfg.data.step_delimiter) for r in rows]
    return stepwise.stepwise_batch(enc, batch_size, int(cfg.data.max_prompt_length),
                                   int(cfg.rollout.max_new_tokens), tok.pad_id)


def eval_batches(ctx) -> list[dict]:
    """Held-out stepwise batches: ``data.eval_path`` rows, or for a task its eval problems as
    (reference solution, copy with one wrong step) in the policy's own format (steps joined by
    the delimiter, then EOS). [] when there is nothing held out."""
    cfg, tok = ctx.cfg, ctx.tokenizer
    b = num_rows(cfg)
    if uses_task_labels(cfg):
        from rljax.train.core import evaluate as eval_lib
        task = data_lib.get_task(dict(cfg.data.kwargs, source=cfg.data.source))
        rng = np.random.default_rng([cfg.seed, 1])
        rows = [r for ex in eval_lib.eval_examples(ctx)
                for r in stepwise.corrupted_solutions(ex["prompt"], task.solution(ex), rng,
                                                      cfg.data.step_delimiter)]
        enc = [stepwise.encode_solution(tok, r["prompt"], r["completions"], r["labels"],
                                        cfg.data.step_delimiter) for r in rows]
        # A wrong result can be a digit longer than the budget allows: such rows are left out.
        enc = [e for e in enc if len(e[0]) <= cfg.data.max_prompt_length
               and len(e[1]) <= cfg.rollout.max_new_tokens]
        return [stepwise.stepwise_batch(enc[i:i + b], b, int(cfg.data.max_prompt_length),
                                        int(cfg.rollout.max_new_tokens), tok.pad_id)
                for i in range(0, len(enc), b)]
    if not cfg.data.eval_path:
        return []
    rows = read_rows(cfg, tok, cfg.data.eval_path)
    return [encode_rows(ctx, rows[i:i + b], b) for i in range(0, len(rows), b)]


def eval_metrics(logits_fn, batches: list[dict], mode: str = "min") -> dict:
    """Held-out metrics over stepwise batches: eval/loss (mean BCE per labelled step),
    eval/step_accuracy, eval/step_auroc (step scores vs labels > 0.5) and
    eval/solution_auroc (each row's ``mode`` step score vs all its labels > 0.5)."""
    loss = count = correct = 0.0
    step_s, step_y, sol_s, sol_y = [], [], [], []
    for b in batches:
        logits = np.asarray(logits_fn(b), np.float64)
        m = np.asarray(label_mask(b))
        y = np.asarray(b["labels"], np.float64)
        bce = np.logaddexp(0.0, -logits) * y + np.logaddexp(0.0, logits) * (1 - y)
        loss, count = loss + bce[m].sum(), count + m.sum()
        correct += ((logits > 0) == (y > 0.5))[m].sum()
        step_s.append(logits[m])
        step_y.append(y[m] > 0.5)
        rows = m.any(axis=1)
        probs = 1.0 / (1.0 + np.exp(-logits))
        sol_s.append(np.asarray(algorithms.aggregate_step_scores(probs, m, mode))[rows])
        sol_y.append(np.where(m, y > 0.5, True).all(axis=1)[rows])
    if not count:
        return {}
    return {"eval/loss": float(loss / count), "eval/step_accuracy": float(correct / count),
            "eval/step_auroc": algorithms.auroc(np.concatenate(step_s), np.concatenate(step_y)),
            "eval/solution_auroc": algorithms.auroc(np.concatenate(sol_s),
                                                    np.concatenate(sol_y)),
            "eval/steps": int(count)}


def _build(ctx, optimizer, state):
    micro, rows = ctx.cfg.algo.micro_batch_size, num_rows(ctx.cfg)
    num_micro = rows // micro if micro and rows % micro == 0 else 1
    return steps.build_value_step(ctx.model_cfg, optimizer, prm_loss, num_micro=num_micro,
                                  state_shardings=ctx.state_shardings(state), mesh=ctx.mesh)


class PRMPhase:
    """``steps`` PRM updates; each on one batch of labelled solutions (a stepwise file's
    ``rollout.batch_size`` rows, or Math-Shepherd labels sampled from the policy).
    Evaluation: held-out step loss, accuracy and AUROC (``eval_metrics``)."""

    name = "prm"

    def __init__(self, ctx, steps: int):
        cfg = ctx.cfg
        self.ctx, self.steps = ctx, int(steps)
        self.rows = num_rows(cfg)
        if self.rows % ctx.dp_size:
            raise UserError(f"the PRM trains on {self.rows} rows per step, which do not split "
                            f"over the data-parallel mesh size {ctx.dp_size}")
        if uses_task_labels(cfg):
            self.iterator = data_iterator(ctx, cfg.rollout.batch_size // cfg.algo.num_generations)
            self.source = StepMCLabels(ctx, self.iterator)
        else:
            self.iterator = StepwiseFile(ctx, cfg.data.path, self.rows, bool(cfg.data.shuffle))
            self.source = None
        self.optimizer = rm_lib._optimizer(ctx, self.steps)
        self._step_fn = self._eval_fn = self._eval_batches = None

    def init_state(self, state):
        return rm_lib._init_state(self.ctx, self.optimizer, state)

    def _compiled(self, state):
        if self._step_fn is None:
            self._step_fn = _build(self.ctx, self.optimizer, state)
        return self._step_fn

    @staticmethod
    def programs(ctx, steps: int):
        """``(abstract state, [Program])``: the update on one stepwise batch."""
        optimizer = rm_lib._optimizer(ctx, steps)
        state = programs_lib.phase_state(ctx, lambda s: rm_lib._init_state(ctx, optimizer, s))
        return state, [programs_lib.Program("update", _build(ctx, optimizer, state),
                                            (state, batch_spec(ctx)),
                                            programs_lib.shard_bytes(state))]

    def iteration(self, state, step: int):
        t0 = time.perf_counter()
        if self.source is not None:
            batch, metrics = self.source(state, step)
        else:
            batch, metrics = next(self.iterator), {}
        t1 = time.perf_counter()
        state, m = self._compiled(state)(state, dist.device_batch(batch, self.ctx.mesh))
        metrics.update(to_host(m))
        metrics.update({"prm/rows": int(batch["row_mask"].sum()), "time/rollout": t1 - t0,
                        "time/step": time.perf_counter() - t0})
        return state, metrics

    def evaluate(self, state, rng) -> dict:
        del rng
        if self._eval_batches is None:
            self._eval_batches = eval_batches(self.ctx)
            cfg = self.ctx.model_cfg.replace(lora_dropout=0.0)  # evaluation: no LoRA dropout
            self._eval_fn = jax.jit(functools.partial(step_logits, cfg))
        value = lora_lib.value_on_base(state.params, state.critic_params)
        return eval_metrics(lambda b: self._eval_fn(value, b), self._eval_batches,
                            self.ctx.cfg.algo.prm.step_score)

    def state_dict(self) -> dict:
        return {"data": self.iterator.state()}

    def load_state_dict(self, state: dict) -> None:
        self.iterator.restore(state["data"])
