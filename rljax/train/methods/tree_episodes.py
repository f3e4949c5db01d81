"""Tree rollouts of multi-turn episodes (``rollout.tree`` with ``env.name``): the tree forks
within the first model turn, every ``rollout.tree.segment_tokens`` tokens; each leaf's first
turn is then played on as an episode of its own (the environment steps on it, later turns are
sampled one episode per slot, ``episodes.run_episodes``' ``first_turn``). An episode's reward
is its leaf's, so the tree estimators (``treepo`` ...) read the leaves' rewards as the static
tree sampler's. With routing replay a row's routes are the tree's for its prompt and first
turn and the episode engine's after it (``with_tree_routes``).

A group is the G leaves of one tree (prompt-major, ``sampling.tree``'s row order), so the
rollout's ``tree_structure`` holds for the episodes' rows as for single-turn leaves.
"""
from __future__ import annotations

import jax
import numpy as np

from rljax.sampling import tree as tree_sampling
from rljax.train.core import sampler

# The first turns' noise is the round key's folded with this (the later turns' read the key
# itself, per episode and turn), so the tree and the episodes draw apart.
TREE_STREAM = 0x7EE


class FirstTurns:
    """``run_episodes``' ``first_turn`` for tree rollouts: ``(p_tok, p_mask) -> (tokens int32
    [B*G, turn_tokens], logps f32 [B*G, turn_tokens], lengths int [B*G])``, the G leaves of
    one tree per prompt row (``tree``: ``tree_sampling.options_from_config``'s), grown by the
    rollout's tree sampler (``sampler.generate``: static, or on the slot engine).
    ``pixels`` [B, I, 3, S, S] with ``images`` (``image_inputs.ImageInputs``; a model with a
    vision tower): each prompt row's images, prefilled with every path of its tree (the later
    turns see them through the episode engine's prompt prefill).
    ``options``: temperature, top_k, top_p, ``temperatures`` (a schedule over an episode's
    model tokens, or None: a first turn's tokens are its first model tokens) and ``weights``
    (in-flight weight updates, polled between the tree's levels and decode chunks, or None).
    After the call, ``out``: the tree sampler's outputs, whose ``routes`` (routing replay),
    ``versions`` (in-flight updates) and ``decoded`` ``fill`` puts into the episodes'."""

    def __init__(self, ctx, params, rng, tree: dict, turn_tokens: int, pixels=None,
                 images=None, **options):
        self.ctx, self.params, self.rng, self.tree = ctx, params, rng, tree
        self.turn_tokens, self.pixels, self.images = turn_tokens, pixels, images
        self.temps = options.pop("temperatures", None)
        self.options = options
        self.out: dict = {}

    def __call__(self, p_tok, p_mask):
        g = tree_sampling.num_leaves(self.tree["roots"], self.tree["branching"],
                                     self.tree["depth"])
        out = sampler.generate(self.ctx, self.params, np.asarray(p_tok), np.asarray(p_mask),
                               jax.random.fold_in(self.rng, TREE_STREAM), num_samples=g,
                               max_new_tokens=self.turn_tokens, tree=self.tree,
                               temperatures=None if self.temps is None else
                               self.temps[:self.turn_tokens],
                               pixels=self.pixels, images=self.images, **self.options)
        self.out = out
        return out["tokens"], out["logps"], out["lengths"]

    def fill(self, eps: dict) -> None:
        """The played episodes ``eps`` (``run_episodes``' fields) given what the tree drew
        their first turns with: routing replay's ``routes`` (``with_tree_routes``); with
        in-flight updates each first-turn token's version (the episode engine's record none
        for the turns it was fed) and the tree's weight swaps added to the engine's;
        ``decoded`` per group (``group_decoded``)."""
        turn_ids = eps["turn_ids"]
        eps["decoded"] = group_decoded(self.out["decoded"], eps["model_mask"], turn_ids)
        if "routes" in eps:
            eps["routes"] = with_tree_routes(eps["routes"], self.out["routes"], turn_ids)
        if "versions" in eps:
            eps["versions"] = with_first_turns(eps["versions"], self.out["versions"],
                                               turn_ids)
            eps["swaps"] += self.out["swaps"]


def group_decoded(tree_decoded, model_mask: np.ndarray, turn_ids: np.ndarray) -> np.ndarray:
    """int64 [B]: the tokens sampled for each of B groups (trees) of rows: its tree's first
    turns, shared segments once (``tree_decoded`` int [B], the tree sampler's ``decoded``),
    plus its rows' model tokens after their first turn (``model_mask`` bool [B*G, M],
    ``turn_ids`` int [B*G, M]). A leaf's first turn would count its shared segments once per
    leaf."""
    tree_decoded = np.asarray(tree_decoded, np.int64)
    later = (np.asarray(model_mask, bool) & (np.asarray(turn_ids) > 0)).sum(axis=1)
    return tree_decoded + later.reshape(len(tree_decoded), -1).sum(axis=1)


def with_tree_routes(routes: np.ndarray, tree_routes: np.ndarray,
                     turn_ids: np.ndarray) -> np.ndarray:
    """Routing replay: the episodes' routes int32 [R, P+M, L, k] (the episode engine's, every
    token it fed: ``run_episodes``' ``routes``) with each row's prompt and first turn, but the
    turn's last token, taken from the tree's ``tree_routes`` [R, P+N, L, k] (the same
    columns: prompt bucket P, then the turn), the routes that drew the first turn's tokens.
    A first turn of n tokens (``turn_ids`` int32 [R, M] == 0) covers columns [0, P + n - 1);
    its last token is fed by the engine with the observation after it (or never, where the
    episode ended: its routes stay 0, as the episodes' last token's do). A row whose episode
    ended after its first turn never reached the engine, so the tree's are its only routes."""
    out = np.array(routes, copy=True)
    p = routes.shape[1] - turn_ids.shape[1]
    for i, n in enumerate((np.asarray(turn_ids) == 0).sum(1)):
        out[i, :p + n - 1] = tree_routes[i, :p + n - 1]
    return out


def with_first_turns(values: np.ndarray, first: np.ndarray, turn_ids: np.ndarray) -> np.ndarray:
    """Per-token ``values`` [R, M] of the episodes' trajectories (e.g. ``versions``) with each
    row's first turn, its first n tokens (``turn_ids`` int32 [R, M] == 0), taken from the
    tree's ``first`` [R, N] (the turn's tokens from column 0)."""
    out = np.array(values, copy=True)
    for i, n in enumerate((np.asarray(turn_ids) == 0).sum(1)):
        out[i, :n] = first[i, :n]
    return out
