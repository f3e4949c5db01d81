"""ReST-MCTS*'s value-model half: the PRM of the search refitted on the search's per-step values
each round (``algo.mcts.refit_prm``, with ``algo.mcts.value='prm'``).

After a round's search (``methods.mcts_search``), every non-root node the search valued
(visits >= 1) gives one PRM training row: prompt ++ the node's steps, in the PRM phase's
stepwise layout (``data.stepwise``): step k of the path is labelled on its last token with the
mean value Q of the path's node at depth k, clipped to [0, 1] (a soft label; a terminal node's
Q is the mean of its reward). Over an environment's turns (``mcts_episodes``) the row is
prompt ++ the node's trajectory (``env.max_total_tokens`` columns) and turn k is labelled on
its last model token, where the search's scorer reads it. The PRM then takes
``algo.mcts.refit_updates`` updates with the PRM phase's loss (``prm_loss``: binary
cross-entropy at the labelled step ends) on those rows, padded to a fixed number
(``refit_rows``; padded rows weigh nothing), and the next round's search values its leaves
with the refitted PRM.

The PRM lives in the train state (``critic_params`` and ``critic_opt_state``, as the PRM
phase keeps it), initialised from the latest checkpoint of the PRM run in ``algo.mcts.prm``:
the run's checkpoints hold it, and a resumed run continues with the same PRM and optimizer
state. With LoRA the PRM run trained adapters and a head on the frozen base (it has this
run's model section), so the refit trains those too, on the policy's base: the PRM is never
a second full copy of the model.

The refit runs in the SFT phase (``sft.traces='mcts'``: before each update on the round's
traces) and in online DPO (``data.pairs='mcts'``: after each round's search, before the
updates on its pairs).
"""
from __future__ import annotations

import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from rljax import distributed as dist
from rljax.data import stepwise
from rljax.train.core import programs as programs_lib
from rljax.train.core import steps as steps_lib
from rljax.train.core.steps import to_host
from rljax.train.methods.prm_loss import prm_loss
from rljax.train.methods.mcts_programs import load_prm, scorer_rows
from rljax.train.methods.prm_scoring import PRMScorer, batch_struct, initial_value
from rljax.train.methods.mcts_search import Tree, walk


def q_label(node) -> float:
    """A node's soft label: its mean backed-up value Q, clipped to [0, 1]."""
    return float(np.clip(node.value, 0.0, 1.0))


def path_nodes(tree: Tree, node) -> list:
    """The nodes from the root's child down to ``node`` (one per step of ``node``)."""
    out, cur = [], tree.root
    for i in tree.info[node.steps]["path"]:
        cur = cur.children[i]
        out.append(cur)
    return out


def label_rows(tree: Tree) -> list[tuple]:
    """One stepwise row per non-root node with visits >= 1 (``walk`` order): ``(prompt ids,
    completion ids = ``tree.tokens(node)``, step-end positions [depth] (``tree.step_ends``),
    labels [depth])``, step k's label (on its last token) being the Q of the path's node at
    depth k."""
    rows = []
    for node in walk(tree.root):
        if not node.steps or node.visits < 1:
            continue
        rows.append((list(tree.prompt_ids), tree.tokens(node), tree.step_ends(node),
                     [q_label(n) for n in path_nodes(tree, node)]))
    return rows


def refit_rows(cfg, prompts: int) -> int:
    """Rows of a refit batch (static): each simulation values at most one node not valued
    before, the first one the root, so a tree has at most ``min(simulations, max_nodes) - 1``
    valued non-root nodes."""
    m = cfg.algo.mcts
    return int(prompts) * max(1, min(int(m.simulations), int(m.max_nodes)) - 1)


def refit_batch(trees: list[Tree], rows: int, max_prompt: int, max_completion: int,
                pad_id: int) -> tuple[dict | None, int]:
    """``(stepwise batch of ``rows`` rows, real rows)`` of the trees' ``label_rows`` (the
    first ``rows`` of them); ``(None, 0)`` when no node was valued."""
    enc = [r for t in trees for r in label_rows(t)][:rows]
    if not enc:
        return None, 0
    return stepwise.stepwise_batch(enc, rows, max_prompt, max_completion, pad_id), len(enc)


def refit_optimizer(ctx, steps: int):
    """The PRM's optimizer over ``steps`` rounds of ``algo.mcts.refit_updates`` updates, at
    ``algo.mcts.refit_learning_rate`` (0: ``optimizer.critic_learning_rate``, else
    ``optimizer.learning_rate``)."""
    m, o = ctx.cfg.algo.mcts, ctx.cfg.optimizer
    lr = float(m.refit_learning_rate) or o.critic_learning_rate or o.learning_rate
    return ctx.optimizer(lr, int(steps) * int(m.refit_updates))


def with_prm(optimizer, state, critic):
    """``state`` with the value model ``critic`` and a fresh optimizer state for it."""
    return state.replace(critic_params=critic, critic_opt_state=optimizer.init(critic))


def build_refit_step(ctx, optimizer, state, rows: int) -> Callable:
    """The PRM update: ``(state, stepwise batch of ``rows`` rows) -> (state, metrics)``, the
    PRM phase's loss (``prm_loss``) on the PRM in ``critic_params``; ``state.step`` stays (the
    policy's update of the same iteration counts it)."""
    micro = ctx.cfg.algo.micro_batch_size
    num_micro = rows // micro if micro and rows % micro == 0 else 1
    return steps_lib.build_value_step(ctx.model_cfg, optimizer, prm_loss, num_micro=num_micro,
                                      state_shardings=ctx.state_shardings(state),
                                      mesh=ctx.mesh, count_steps=False)


def planned_state(ctx, steps: int, state):
    """``state`` (abstract, for ``rljax plan``) holding a value model of the PRM run's shapes
    (it has this run's model section: a full value model, or with LoRA adapters and a head on
    the policy's base), no checkpoint read."""
    return with_prm(refit_optimizer(ctx, steps), state,
                    initial_value(ctx.model_cfg, state.params, state.rng))


def program(ctx, steps: int, state, prompts: int) -> programs_lib.Program:
    """The refit's update for ``rljax plan``, ``prm_refit``: ``build_refit_step`` on
    ``refit_rows`` stepwise rows of a search over ``prompts`` prompts a round (``state``:
    ``planned_state``'s)."""
    rows = refit_rows(ctx.cfg, prompts)
    return programs_lib.Program(
        "prm_refit", build_refit_step(ctx, refit_optimizer(ctx, steps), state, rows),
        (state, batch_struct(ctx, rows, completion_len=programs_lib.completion_len(ctx.cfg))),
        programs_lib.shard_bytes(state))


class PRMRefit:
    """The refit of ``algo.mcts.refit_prm`` for a search over ``prompts`` prompts per round,
    over ``steps`` rounds (``build_refit_step``, compiled at the first round). ``scorer``: the
    search's PRM scorer, pointed at the state's PRM each round."""

    def __init__(self, ctx, prompts: int, steps: int):
        cfg = ctx.cfg
        self.ctx, self.updates = ctx, int(cfg.algo.mcts.refit_updates)
        self.rows_per_round = refit_rows(cfg, prompts)
        self.optimizer = refit_optimizer(ctx, steps)
        self.initial = load_prm(ctx)["critic_params"]
        self.scorer = PRMScorer(ctx, scorer_rows(ctx, prompts))
        self._step_fn = None

    def init_state(self, state):
        """``state`` with the PRM run's value model and a fresh optimizer state for it."""
        return with_prm(self.optimizer, state, jax.tree.map(jnp.asarray, self.initial))

    def rows(self, trees: list[Tree]) -> tuple[dict | None, int]:
        """The round's refit batch and its real rows (``refit_batch``; host arrays)."""
        cfg = self.ctx.cfg
        return refit_batch(trees, self.rows_per_round, int(cfg.data.max_prompt_length),
                           programs_lib.completion_len(cfg), self.ctx.tokenizer.pad_id)

    def __call__(self, state, trees: list[Tree]) -> tuple[object, dict]:
        """The round's refit on ``trees`` (``fit`` of their ``rows``)."""
        return self.fit(state, *self.rows(trees))

    def fit(self, state, batch: dict | None, count: int) -> tuple[object, dict]:
        """The refit on a round's ``rows``: ``(state with the refitted PRM, mcts/prm_*
        metrics)``: prm_rows (rows trained), prm_labels (step ends labelled), prm_loss (the
        first update's loss: the PRM before this round's refit against the round's values),
        prm_loss_last (the last update's), prm_grad_norm, prm_skipped."""
        t0 = time.perf_counter()
        metrics = {"mcts/prm_rows": int(count), "mcts/prm_labels": 0}
        if batch is None:   # nothing valued: no update (Adam would still move on zero grads)
            return state, metrics
        metrics["mcts/prm_labels"] = int((batch["label_mask"] & batch["row_mask"][:, None]).sum())
        if self._step_fn is None:
            self._step_fn = build_refit_step(self.ctx, self.optimizer, state,
                                             self.rows_per_round)
        device_batch = dist.device_batch(batch, self.ctx.mesh)
        losses, skipped, grad_norm = [], 0, 0.0
        for i in range(self.updates):
            state, m = self._step_fn(state, device_batch)
            m = to_host(m)
            losses.append(float(m["loss"]))
            skipped += int(m["skipped"])
            grad_norm = float(m["grad_norm"]) if i == 0 else grad_norm
        metrics.update({"mcts/prm_loss": losses[0], "mcts/prm_loss_last": losses[-1],
                        "mcts/prm_grad_norm": grad_norm, "mcts/prm_skipped": skipped,
                        "time/prm_refit": time.perf_counter() - t0})
        return state, metrics


REFIT_KEY = "prm_refit/"   # a pair batch's fields that carry its round's refit rows


def with_refit_rows(batch: dict, rows: dict | None, count: int) -> dict:
    """A sampled pair batch carrying its round's refit rows (``PRMRefit.rows``) as host
    arrays, so they travel with it (asynchronous DPO: in flight, and in checkpoints)."""
    out = {**batch, REFIT_KEY + "count": np.asarray([count], np.int32)}   # (1-d: encodable)
    return out if rows is None else {**out, **{REFIT_KEY + k: v for k, v in rows.items()}}


def split_refit_rows(batch: dict) -> tuple[dict, dict | None, int]:
    """``with_refit_rows``' inverse: ``(pair batch, refit rows or None, count)``."""
    pairs = {k: v for k, v in batch.items() if not k.startswith(REFIT_KEY)}
    rows = {k[len(REFIT_KEY):]: np.asarray(v) for k, v in batch.items()
            if k.startswith(REFIT_KEY) and k != REFIT_KEY + "count"}
    return pairs, rows or None, int(np.asarray(batch[REFIT_KEY + "count"]).reshape(-1)[0])
