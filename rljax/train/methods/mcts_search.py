"""MCTS over reasoning steps in the rollout, and ReST-MCTS*-style self-training on its traces.

Each prompt gets a search (``rljax.algorithms.mcts``) whose nodes are step prefixes: a
completion's steps end at ``data.step_delimiter`` (``step_mc.step_ends``; a stop token ends the
last step). The searches of all the round's prompts advance in lockstep, one simulation each
per *wave*:

1. select: each tree follows PUCT (``mcts.select_child``) from its root to a leaf. A terminal
   leaf is valued by its reward (known since it was created) and backed up at once.
2. expand: every other leaf, of every prompt, is one prefix row of ONE batched sampler call
   (prompt ++ prefix left-padded to ``data.max_prompt_length + rollout.max_new_tokens``,
   prefilled once and forked ``max(children, rollouts)`` ways). The first step of each of
   the first ``algo.mcts.children`` continuations is a child; its prior is the policy's
   probability of the step (exp of the sum of its tokens' log-probs), normalised over the
   siblings by ``mcts.expand``. A child whose step ends the continuation (stop token or the
   completion budget, ``rollout.max_new_tokens`` tokens in all) is terminal, with that
   continuation's reward (``reward.names``; verified when >= ``algo.mcts.correct_reward``).
3. evaluate: the leaf's value is the mean reward of its first ``algo.mcts.rollouts``
   continuations (value 'mc': rollouts to the end, step_mc's prefix value), or the score of
   the PRM of ``algo.mcts.prm`` at the prefix's last step end (value 'prm'; with
   ``algo.mcts.refit_prm`` the PRM in the train state, ``methods.prm_refit``; Math-Shepherd's
   label there is the chance of reaching the right answer; the root, with no step, is valued
   by its rollouts). Children's PRM scores are computed in the wave that creates them.
4. backup: ``mcts.backup`` along the path.

A tree stops after ``algo.mcts.simulations`` simulations, or when a leaf would need expanding
and the tree already holds ``algo.mcts.max_nodes`` nodes.

On a mesh the wave's rows are split over the data-parallel axes (``mcts_programs``: rows
padded to a multiple of their size, keys and PRM batches split alike); each row draws from its
own key, so the trees are the ones one device grows (to float32 rounding of the logits).

Determinism: the sampler draws each row from its own key (``sampling.generate(row_keys)``);
the key of a node's fork j is ``fold_in(fold_in(fold_in(round key, hash(prompt)),
hash(node path)), j)``, so a prompt's tree does not depend on which other prompts share the
round, nor their order (identical prompts get identical trees). The round key is
``fold_in(fold_in(state.rng, MCTS_STREAM), step)``: a resumed run searches the same trees.

Self-training (``sft.traces='mcts'``): the best verified trace per prompt (``best_verified``:
the most visited verified terminal node; ties: its higher value, then the first found) is
prompt ++ trace, the loss on the trace; prompts without one get a row that counts for nothing.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from rljax import rewards, sampling
from rljax.models import lora as lora_lib
from rljax.algorithms import mcts
from rljax.train.core.buckets import build_sequences, prompt_buckets
from rljax.train.core.rollout import expand_fields
from rljax import sharding as shd
from rljax.train.core.sampler import generate
from rljax.train.methods import mcts_programs
from rljax.train.methods.step_mc import step_ends

MCTS_STREAM = 13   # rng stream of the search (fold_in of the train state's key)


# ----------------------------------------------------------------------------- pure helpers

def stable_hash(ids) -> int:
    """A 31-bit hash of a sequence of ints (crc32; the same in every process and run)."""
    return zlib.crc32(np.asarray(list(ids), np.int64).tobytes()) & 0x7FFFFFFF


@functools.partial(jax.jit, static_argnums=4)
def _fork_keys(round_key, prompt_hash, path_hash, forks, mesh=None):
    """Keys [R * S] of rows: prefix row r's fork j = fold_in(fold_in(fold_in(round_key,
    prompt_hash[r]), path_hash[r]), j); ``forks`` int [S] = arange(S). With ``mesh``, split
    over its data-parallel axes as the sampler's rows are (each device draws its rows' noise)."""
    def row(p, q):
        base = jax.random.fold_in(jax.random.fold_in(round_key, p), q)
        return jax.vmap(lambda j: jax.random.fold_in(base, j))(forks)
    keys = jax.vmap(row)(prompt_hash, path_hash).reshape((-1,) + round_key.shape)
    return shd.constrain(keys, ("batch",) + (None,) * (keys.ndim - 1), mesh)


def first_step(cont: list[int], decode, delimiter: str, stop_ids) -> tuple[tuple, bool]:
    """The first step of a continuation (token tuple) and whether it is all of it (the
    continuation ends there: a stop token or the budget; no delimiter before its end)."""
    ends = step_ends(cont, decode, delimiter, stop_ids)
    if not ends:
        return (), True
    return tuple(cont[:ends[0]]), len(ends) == 1


@dataclasses.dataclass
class Tree:
    """One prompt's search. ``info[node.steps]``: ``path`` (child indices from the root),
    ``reward`` (terminal nodes) and ``score`` (value 'prm': the PRM's, non-terminal nodes)."""
    example: dict
    prompt_ids: list
    root: mcts.Node = dataclasses.field(default_factory=mcts.Node)
    info: dict = dataclasses.field(default_factory=lambda: {(): {"path": ()}})
    nodes: int = 1
    simulations: int = 0
    done: bool = False
    root_rewards: np.ndarray | None = None   # f32 [forks]: the root's samples, once expanded

    def tokens(self, node: mcts.Node) -> list[int]:
        """The prefix's tokens (its steps joined)."""
        return [t for step in node.steps for t in step]

    def trace(self, node: mcts.Node) -> tuple[list[int], list[bool]]:
        """The node's tokens after the prompt and which of them train (all: the model's)."""
        ids = self.tokens(node)
        return ids, [True] * len(ids)

    def step_ends(self, node: mcts.Node) -> list[int]:
        """The position of each step's last token in ``tokens(node)`` (one per step)."""
        return (np.cumsum([len(step) for step in node.steps]) - 1).tolist()

    def terminal_value(self, node: mcts.Node) -> float:
        """The value a terminal node backs up: its reward."""
        return self.info[node.steps]["reward"]

    def backup_terminal(self, path: list) -> None:
        """Backs up the terminal leaf ``path[-1]``'s value along ``path`` (root first)."""
        mcts.backup(path, self.terminal_value(path[-1]))


def walk(root: mcts.Node):
    """Every node of a tree, depth first in expansion order (root first)."""
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(node.children))


def best_verified(tree: Tree, correct_reward: float):
    """The tree's best verified terminal node: reward >= ``correct_reward``; the most visited,
    ties to the higher mean value, then the first in ``walk`` order. None if there is none."""
    found = [(n.visits, n.value, -i, n) for i, n in enumerate(walk(tree.root))
             if n.terminal and tree.info[n.steps].get("reward", -np.inf) >= correct_reward]
    return max(found, key=lambda f: f[:3])[3] if found else None


def tree_stats(trees: list[Tree], correct_reward: float) -> dict:
    """``mcts/*`` metrics of a round's trees: solved_frac (a verified trace found),
    nodes_mean, depth_mean (deepest node, in steps), value_root_mean (root Q),
    simulations_mean."""
    return {
        "mcts/solved_frac": float(np.mean([best_verified(t, correct_reward) is not None
                                           for t in trees])),
        "mcts/nodes_mean": float(np.mean([t.nodes for t in trees])),
        "mcts/depth_mean": float(np.mean([max(len(n.steps) for n in walk(t.root))
                                          for t in trees])),
        "mcts/value_root_mean": float(np.mean([t.root.value for t in trees])),
        "mcts/simulations_mean": float(np.mean([t.simulations for t in trees])),
    }


# ----------------------------------------------------------------------------- the search

class MCTSSearch:
    """``search(params, examples, round_key) -> [Tree]``: one tree per example, built in
    waves of one sampler call each (``algo.mcts``; ``rows`` prefix rows per call, static,
    rounded up to a multiple of the data-parallel size: ``mcts_programs.search_rows``)."""

    def __init__(self, ctx, rows: int, prm_scorer=None):
        cfg = ctx.cfg
        m = cfg.algo.mcts
        self.ctx, self.cfg, self.m = ctx, cfg, m
        self.rows = mcts_programs.search_rows(rows, ctx.dp_size)
        self.k, self.m_rollouts = int(m.children), int(m.rollouts)
        self.forks = mcts_programs.forks(cfg)
        self.n = int(cfg.rollout.max_new_tokens)
        self.prefix_bucket = mcts_programs.prefix_len(cfg)
        self.reward_fn = ctx.reward_fn() if cfg.reward.names else None   # (episodes: env)
        self.monitor = rewards.RewardMonitor(cfg.reward.max_consecutive_error_steps)
        self.decode = ctx.tokenizer.decode
        self.stop_ids = tuple(ctx.stop_ids)
        self.prm_scorer = prm_scorer   # (prompt ids, prefix ids) lists -> scores [R]
        self.sampler_calls = 0
        self.tokens = 0

    def search(self, params, examples: list[dict], round_key) -> list[Tree]:
        self.start_round()
        trees = [self.new_tree(ex) for ex in examples]
        return self.simulate(params, trees, round_key, int(self.m.simulations))

    def start_round(self) -> None:
        """Called before a round's first simulation (its keys derive from the round key)."""

    def simulate(self, params, trees: list[Tree], round_key, simulations: int) -> list[Tree]:
        """``simulations`` more simulations of each of ``trees`` (in place; returned). The
        first expands each root (``Tree.root_rewards``)."""
        for _ in range(int(simulations)):
            leaves = []
            for t in trees:
                if t.done:
                    continue
                path = [t.root]
                while path[-1].expanded and path[-1].children and not path[-1].terminal:
                    path.append(mcts.select_child(path[-1], float(self.m.c_puct),
                                                  float(self.m.unvisited_value)))
                leaf = path[-1]
                if leaf.terminal:
                    t.backup_terminal(path)
                    t.simulations += 1
                elif t.nodes >= int(self.m.max_nodes):
                    t.done = True
                else:
                    leaves.append((t, path))
            if leaves:
                self._wave(params, leaves, round_key)
        return trees

    def new_tree(self, example: dict) -> Tree:
        """The example's tree: a root holding its prompt."""
        return Tree(example, self.ctx.tokenizer.encode(example["prompt"]))

    def _wave(self, params, leaves: list[tuple[Tree, list]], round_key) -> None:
        """Expands and evaluates every leaf (one sampler call), then backs up."""
        tok, s, n = self.ctx.tokenizer, self.forks, self.n
        prefixes = [t.tokens(path[-1]) for t, path in leaves]
        rows = [t.prompt_ids + p for (t, _), p in zip(leaves, prefixes)]
        hashes = [(stable_hash(t.prompt_ids), stable_hash(t.info[path[-1].steps]["path"]))
                  for t, path in leaves]
        for start in range(0, len(rows), self.rows):   # static: `rows` prefixes per call
            part = slice(start, start + self.rows)
            pad = self.rows - len(rows[part])
            p_tok, p_mask = sampling.pad_to_bucket(rows[part] + [rows[part][-1]] * pad,
                                                   pad_id=tok.pad_id,
                                                   buckets=(self.prefix_bucket,))
            h = np.asarray(hashes[part] + [hashes[part][-1]] * pad, np.uint32)
            keys = _fork_keys(round_key, jnp.asarray(h[:, 0]), jnp.asarray(h[:, 1]),
                              jnp.arange(s, dtype=jnp.uint32), self.ctx.mesh)
            cfg = self.cfg
            out = generate(self.ctx, params, p_tok, p_mask, round_key, num_samples=s,
                           max_new_tokens=n, temperature=cfg.rollout.temperature,
                           top_k=cfg.rollout.top_k, top_p=cfg.rollout.top_p,
                           row_keys=keys)
            self.sampler_calls += 1
            real = len(rows[part]) * s
            self.tokens += int(out["lengths"][:real].sum())
            self._expand_part(leaves[part], prefixes[part], out)

    def _expand_part(self, leaves, prefixes, out) -> None:
        s, n = self.forks, self.n
        conts, logps, texts, prompts, owners, lengths = [], [], [], [], [], []
        for (t, _), prefix in zip(leaves, prefixes):
            room = n - len(prefix)
            for j in range(s):
                i = len(conts)
                keep = out["mask"][i]
                conts.append(out["tokens"][i][keep].tolist()[:room])
                logps.append(out["logps"][i][keep][:room])
                texts.append(self.decode(prefix + conts[-1]))
                prompts.append(t.example["prompt"])
                owners.append(t.example)
                lengths.append(len(prefix) + len(conts[-1]))
        result = self.reward_fn(prompts, texts, completion_lengths=lengths,
                                **expand_fields(owners, 1))
        self.monitor.observe(result)
        reward = np.asarray(result.total, np.float32)
        new_children = []
        for li, ((t, path), prefix) in enumerate(zip(leaves, prefixes)):
            leaf, proposals, terminal_reward = path[-1], [], {}
            for j in range(self.k):
                i = li * s + j
                step, last = first_step(conts[i], self.decode, self.ctx.cfg.data.step_delimiter,
                                        self.stop_ids)
                if not step:
                    continue
                prior = float(np.exp(np.sum(logps[i][:len(step)], dtype=np.float64)))
                proposals.append((step, prior, last))
                if last:
                    terminal_reward.setdefault(step, float(reward[i]))
            if not leaf.steps:   # the root: its forks are samples of the prompt's outcome
                t.root_rewards = reward[li * s:(li + 1) * s]
            if proposals:
                mcts.expand(leaf, proposals)
            else:   # nothing sampled (cannot happen with N >= 1 tokens): a dead end
                leaf.expanded, leaf.terminal = True, True
                t.info[leaf.steps]["reward"] = float(np.mean(reward[li * s:(li + 1) * s]))
            base = t.info[leaf.steps]["path"]
            for c, child in enumerate(leaf.children):
                t.info[child.steps] = {"path": base + (c,)}
                if child.terminal:
                    t.info[child.steps]["reward"] = terminal_reward[child.steps[-1]]
                else:
                    new_children.append((t, child))
            t.nodes += len(leaf.children)
        scores = self._prm_scores(new_children)
        for (t, child), sc in zip(new_children, scores):
            t.info[child.steps]["score"] = float(sc)
        for li, (t, path) in enumerate(leaves):
            leaf = path[-1]
            mc = float(np.mean(reward[li * s:li * s + self.m_rollouts]))
            value = mc if self.m.value == "mc" or not leaf.steps else t.info[leaf.steps]["score"]
            mcts.backup(path, value)
            t.simulations += 1

    def _prm_scores(self, nodes: list[tuple[Tree, mcts.Node]]) -> np.ndarray:
        """PRM scores of new non-terminal children (value 'prm'; else zeros)."""
        if self.m.value != "prm" or not nodes:
            return np.zeros(len(nodes), np.float32)
        return np.asarray(self.prm_scorer(*self._prm_rows(nodes)), np.float32)

    def _prm_rows(self, nodes: list[tuple[Tree, mcts.Node]]) -> tuple:
        """The PRM scorer's arguments for ``nodes``: their prompts and step prefixes."""
        return [t.prompt_ids for t, _ in nodes], [t.tokens(c) for t, c in nodes]


def searcher(ctx, prompts: int, prm_scorer=None, search=None) -> MCTSSearch:
    """The run's search (class ``search``, default ``MCTSSearch``) over ``prompts`` prompts
    per round (value 'prm': ``prm_scorer``, by default the frozen PRM of ``algo.mcts.prm``,
    scoring ``scorer_rows`` rows a batch: a wave's new children at most)."""
    m = ctx.cfg.algo.mcts
    if m.value == "prm" and prm_scorer is None:
        prm_scorer = mcts_programs.load_prm_scorer(ctx, mcts_programs.scorer_rows(ctx, prompts))
    return (search or MCTSSearch)(ctx, mcts_programs.search_rows(prompts, ctx.dp_size),
                                  prm_scorer)


def round_key(state, step: int):
    """The key of round ``step``'s search: ``fold_in(fold_in(state.rng, MCTS_STREAM), step)``."""
    return jax.random.fold_in(jax.random.fold_in(state.rng, MCTS_STREAM), step)


@contextlib.contextmanager
def refitted(refit_scorer, state):
    """With ``refit_scorer`` (``algo.mcts.refit_prm``) the leaves are valued by the PRM in
    ``state.critic_params``, as refitted so far (with LoRA its adapters and head on the
    policy's frozen base), while the block runs; None: nothing to do."""
    if refit_scorer is None:
        yield
        return
    refit_scorer.value = lora_lib.value_on_base(state.params, state.critic_params)
    try:
        yield
    finally:   # the next update donates the state's buffers
        refit_scorer.value = None


def round_trees(search: MCTSSearch, state, examples: list[dict], step: int,
                refit_scorer=None) -> list[Tree]:
    """Round ``step``'s trees of ``examples`` under ``state``'s policy (``round_key``; the
    PRM ``refitted``)."""
    with refitted(refit_scorer, state):
        return search.search(state.params, examples, round_key(state, step))


def grow_trees(search: MCTSSearch, state, trees: list[Tree], step: int, simulations: int,
               refit_scorer=None) -> list[Tree]:
    """``simulations`` more simulations of round ``step``'s ``trees`` (as ``round_trees``)."""
    with refitted(refit_scorer, state):
        return search.simulate(state.params, trees, round_key(state, step), simulations)


# ----------------------------------------------------------------------------- self-training

def trace_batch(ctx, trees: list[Tree], correct_reward: float, completion_len: int):
    """The SFT batch of the best verified traces: ``(batch, traces)`` with one row per tree
    (prompt ++ trace, the trace cut to ``completion_len``; ``loss_mask`` on the trace's
    model tokens (``Tree.trace``: an episode's observations are context), all False for a
    tree without a verified trace) and ``traces[i]`` the token list or None."""
    tok = ctx.tokenizer
    traces = []
    for t in trees:
        node = best_verified(t, correct_reward)
        traces.append(None if node is None else t.trace(node))
    p_tok, p_mask = sampling.pad_to_bucket([t.prompt_ids for t in trees], pad_id=tok.pad_id,
                                           buckets=prompt_buckets(ctx.cfg.data.max_prompt_length))
    c_tok = np.full((len(trees), completion_len), tok.pad_id, np.int32)
    c_mask = np.zeros((len(trees), completion_len), bool)
    loss = np.zeros((len(trees), completion_len), bool)
    for i, trace in enumerate(traces):
        if trace and trace[0]:
            ids, trains = trace[0][:completion_len], trace[1][:completion_len]
            c_tok[i, :len(ids)], c_mask[i, :len(ids)], loss[i, :len(ids)] = ids, True, trains
    tokens, mask = build_sequences(p_tok, p_mask, c_tok, c_mask)
    return {"tokens": tokens, "mask": mask, "loss_mask": loss}, [
        None if tr is None else tr[0] for tr in traces]


class MCTSTraces:
    """Callable ``(state, step) -> (SFT batch, metrics)``: searches the next batch of prompts
    with the current policy and returns their best verified traces (``trace_batch``); its only
    host state is the iterator's (keys derive from ``state.rng`` and ``step``). With
    ``refit_scorer`` (``algo.mcts.refit_prm``) the leaves are valued by the PRM in
    ``state.critic_params``, as refitted so far. ``search``: the search to run (default
    ``searcher``'s; over an environment's turns ``mcts_matches.turn_searcher``'s)."""

    def __init__(self, ctx, iterator, completion_len: int, refit_scorer=None, search=None):
        self.ctx, self.iterator, self.completion_len = ctx, iterator, int(completion_len)
        self.refit_scorer = refit_scorer
        self.searcher = search or searcher(ctx, int(ctx.cfg.sft.batch_size), refit_scorer)
        self.last = None   # the last round's trees (for inspection and tests)

    def __call__(self, state, step: int) -> tuple[dict, dict]:
        t0 = time.perf_counter()
        examples = next(self.iterator)
        calls, tokens = self.searcher.sampler_calls, self.searcher.tokens
        trees = round_trees(self.searcher, state, examples, step, self.refit_scorer)
        correct = float(self.ctx.cfg.algo.mcts.correct_reward)
        batch, traces = trace_batch(self.ctx, trees, correct, self.completion_len)
        self.last = trees
        m = tree_stats(trees, correct)
        m.update({"mcts/sampler_calls": self.searcher.sampler_calls - calls,
                  "mcts/traces": sum(tr is not None for tr in traces),
                  "rollout/tokens": self.searcher.tokens - tokens,
                  "time/search": time.perf_counter() - t0})
        return batch, m


# ----------------------------------------------------------------------------- step pairs

def sibling_pairs(tree: Tree, min_gap: float, max_pairs: int) -> list[tuple]:
    """Step-DPO pairs from sibling nodes: at each expanded node (``walk`` order), among its
    children with a value (visited: Q; terminal and unvisited: ``Tree.terminal_value``),
    chosen = the highest, rejected = the lowest (first of ties), when they differ by more than
    ``min_gap``. Returns up to ``max_pairs`` of ``(context ids = prompt ++ prefix, chosen
    step ids, rejected step ids, value gap, depth)``."""
    pairs = []
    for node in walk(tree.root):
        valued = [(c.value if c.visits else tree.terminal_value(c), c)
                  for c in node.children if c.visits or c.terminal]
        if len(valued) < 2:
            continue
        best = max(valued, key=lambda v: v[0])
        worst = min(valued, key=lambda v: v[0])
        if best[0] - worst[0] > min_gap:
            pairs.append((tree.prompt_ids + tree.tokens(node), list(best[1].steps[-1]),
                          list(worst[1].steps[-1]), best[0] - worst[0], len(node.steps)))
        if len(pairs) == max_pairs:
            break
    return pairs


class MCTSPairs:
    """Callable ``(state, step) -> (preference batch, metrics)`` for online DPO with
    ``data.pairs='mcts'``: searches ``rollout.batch_size / algo.num_generations`` prompts and
    pairs sibling steps (``sibling_pairs``; ``algo.step_mc.max_steps`` pairs per prompt at
    most, ``algo.step_mc.min_value_gap``), in step-DPO's layout (``StepMCPairs.encode_pairs``).
    ``refit_scorer``: as ``MCTSTraces``'s; ``make_search(ctx, prompts, prm_scorer)``: the
    search to run (default ``searcher``; over an environment's turns
    ``mcts_matches.turn_searcher``).

    Prompt selection and dynamic sampling act on the first simulation, which expands each
    root: its forks' rewards are the prompt's group (``step_mc.selected_rounds``); only the
    prompts kept are searched on, and up to ``algo.max_sampling_rounds`` more rounds of root
    expansions fill the batch. The search runs on ``ctx`` as it is when called (asynchronous
    DPO moves the source to the sampler's)."""

    def __init__(self, ctx, iterator, refit_scorer=None, make_search=None):
        from rljax.train.methods.step_mc import StepMCPairs, prompt_filter

        cfg = ctx.cfg
        self.ctx, self.iterator, self.refit_scorer = ctx, iterator, refit_scorer
        self.make_search = make_search or searcher
        self.num_prompts = cfg.rollout.batch_size // int(cfg.algo.num_generations)
        self.layout = StepMCPairs(ctx, iterator)   # its pair encoding (static shapes)
        self.selector, self.keep = prompt_filter(cfg, iterator, mcts_programs.forks(cfg))
        self._searcher = None
        self.last = None   # the last round's searched trees

    @property
    def searcher(self) -> MCTSSearch:
        """The search on the current ``ctx`` (``make_search``'s), built on first use and
        again if the source moved to another context since."""
        if self._searcher is None or self._searcher.ctx is not self.ctx:
            self._searcher = self.make_search(self.ctx, self.num_prompts, self.refit_scorer)
        return self._searcher

    def __call__(self, state, step: int) -> tuple[dict, dict]:
        from rljax.train.methods.step_mc import selected_rounds

        t0 = time.perf_counter()
        cfg, search = self.ctx.cfg, self.searcher
        calls, tokens = search.sampler_calls, search.tokens
        search.start_round()

        def draw(_):   # a round: the next prompts' roots expanded (the first simulation)
            trees = [search.new_tree(ex) for ex in next(self.iterator)]
            grow_trees(search, state, trees, step, 1, self.refit_scorer)
            return trees, np.concatenate([t.root_rewards for t in trees])
        picked, trains, selected = selected_rounds(
            draw, search.forks, self.num_prompts, self.keep, self.selector,
            int(cfg.algo.max_sampling_rounds))
        trees = [t for t, ok in zip(picked, trains) if ok]
        grow_trees(search, state, trees, step, int(cfg.algo.mcts.simulations) - 1,
                   self.refit_scorer)
        gap, most = float(cfg.algo.step_mc.min_value_gap), int(cfg.algo.step_mc.max_steps)
        pairs = [p for t in trees for p in sibling_pairs(t, gap, most)]
        self.last = trees
        m = tree_stats(picked, float(cfg.algo.mcts.correct_reward))
        m.update(selected)
        m.update({"mcts/sampler_calls": search.sampler_calls - calls,
                  "mcts/pairs": len(pairs),
                  "mcts/value_gap_mean": float(np.mean([p[3] for p in pairs])) if pairs else 0.0,
                  "rollout/tokens": search.tokens - tokens,
                  "time/search": time.perf_counter() - t0})
        return self.layout.encode_pairs(pairs), m
