"""The parts a rollout (``core.rollout.Rollout``) is composed of, as protocols: method stages
run at fixed points of every call (``RolloutStage``: hints, ReLIFT, demonstrations, a teacher's
or a PRM's scores, episodes' credit) and the source of its sampling rounds when it does not
sample them itself (``RoundSource``: partial rollouts' pool, multi-turn episodes, knapsack
allocation's group sizes). The phase composes them:
``Rollout(ctx, iterator, rounds=..., stages=[...])``."""
from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np


class RolloutStage(Protocol):
    """A method feature the rollout runs at fixed points of every call, composed by the phase
    (``Rollout(ctx, iterator, stages=[...])``) instead of a subclass per feature. A stage owns
    its host state; the phase checkpoints it under ``name``. A stage may subclass this to take
    the defaults below (nothing to check, the round as it is, the estimator's advantages, no
    metrics, no state). ``rollout`` in a hook is the ``Rollout`` calling it."""

    name: str

    def check(self, example: dict) -> None:
        """Before the first step, with the first training example (one ConfigError line)."""

    def after_round(self, rollout, params, rnd: dict, rng) -> dict:
        """A sampling round's dict after scoring -> the round the batch is built from;
        ``rng`` is the round's key (a stage folds in its own stream)."""
        return rnd

    def picked(self, rollout, params, rounds: Sequence[dict], groups: list, rng) -> None:
        """After the call's last round: ``groups``, (round, group) pairs, are the groups that
        train, in batch order (their rows come first in the batch); ``rng`` is the call's
        key."""

    def finish_batch(self, batch: dict, rows: dict) -> None:
        """Edits the assembled training batch in place, before advantages."""

    def advantages(self, rollout, state, rewards: np.ndarray, mask: np.ndarray,
                   rows: dict, batch: dict) -> np.ndarray | None:
        """The batch's advantages in place of the rollout's estimator (episodes: per-turn
        returns, role baselines from ``state``; it may add outputs to ``batch``), or None to
        leave them to the estimator. ``rewards`` [R] (any sequence KL taken off), ``mask``
        [R, N] the tokens that train."""
        return None

    def metrics(self, rounds: Sequence[dict], rows: dict) -> dict:
        """The stage's metrics over one call's rounds."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class RoundSource(Protocol):
    """Where a rollout's sampling rounds come from when it does not sample them itself
    (``Rollout(ctx, iterator, rounds=...)``): partial rollouts' pool of groups in flight
    (``core.partial.PartialRounds``), multi-turn episodes (``methods.agent.EpisodeRounds``),
    per-prompt group sizes (``methods.allocation.KnapsackRounds``). Its round dict has
    ``Rollout.score_round``'s fields; ``row_keys`` names more per-row arrays the batch rows
    carry (``rows``, for stages). A round with ``group_sizes`` int [P] has groups of those
    sizes, and its source picks the groups of a call's rounds and lays out the batch too:
    ``pick_groups(rounds, kept, dropped)`` (as ``Rollout._pick_groups``) and
    ``assemble(rollout, rounds, groups) -> (batch, rows)``. The phase checkpoints a
    non-empty ``state_dict``. ``rollout`` in a hook is the ``Rollout`` calling it. A source
    may subclass this to take the defaults below (nothing before a call, no metrics, no
    state)."""

    def begin(self, state, step: int) -> None:
        """Before a rollout call at ``step``."""

    def sample_round(self, rollout, params, rng) -> dict:
        """The next round, drawn from ``rollout.iterator`` and scored; ``rng`` is the round's
        key."""

    def metrics(self, rounds: Sequence[dict], step: int) -> dict:
        """The source's metrics over one call's rounds."""
        return {}

    def state_dict(self) -> dict:
        """Host state to checkpoint ({}: none)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
