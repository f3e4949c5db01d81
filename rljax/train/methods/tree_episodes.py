"""Tree rollouts of multi-turn episodes (``rollout.tree`` with ``env.name``): the tree forks
within the first model turn, every ``rollout.tree.segment_tokens`` tokens; each leaf's first
turn is then played on as an episode of its own (the environment steps on it, later turns are
sampled one episode per slot, ``episodes.run_episodes``' ``first_turn``). An episode's reward
is its leaf's, so the tree estimators (``treepo`` ...) read the leaves' rewards as the static
tree sampler's.

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


def first_turn(ctx, params, rng, tree: dict, turn_tokens: int, pixels=None, images=None,
               **options):
    """``run_episodes``' ``first_turn`` for tree rollouts: ``(p_tok, p_mask) -> (tokens int32
    [B*G, turn_tokens], logps f32 [B*G, turn_tokens], lengths int [B*G])``, the G leaves of
    one tree per prompt row (``tree``: ``tree_sampling.options_from_config``'s), grown by the
    rollout's tree sampler (``sampler.generate``: static, or on the slot engine).
    ``pixels`` [B, I, 3, S, S] with ``images`` (``image_inputs.ImageInputs``; a model with a
    vision tower): each prompt row's images, prefilled with every path of its tree (the later
    turns see them through the episode engine's prompt prefill).
    ``options``: temperature, top_k, top_p and ``temperatures`` (a schedule over an episode's
    model tokens, or None: a first turn's tokens are its first model tokens)."""
    temps = options.pop("temperatures", None)
    g = tree_sampling.num_leaves(tree["roots"], tree["branching"], tree["depth"])

    def sample(p_tok, p_mask):
        out = sampler.generate(ctx, params, np.asarray(p_tok), np.asarray(p_mask),
                               jax.random.fold_in(rng, TREE_STREAM), num_samples=g,
                               max_new_tokens=turn_tokens, tree=tree,
                               temperatures=None if temps is None else temps[:turn_tokens],
                               pixels=pixels, images=images, **options)
        return out["tokens"], out["logps"], out["lengths"]

    return sample
