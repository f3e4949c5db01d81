"""Sampling for training: the ``rollout`` section (batch, decoding, per-position temperature
schedule, tree sampling), its checks, and the tree arithmetic the sampler shares."""
from __future__ import annotations

from typing import Any

from rljax.config.base import ConfigError, online_dpo_groups


def rollout() -> dict[str, Any]:
    return dict(
        batch_size=16,               # completions per step = prompts * algo.num_generations
        max_new_tokens=128,
        # Texts that end a completion besides the tokenizer's end-of-sequence token (kept in
        # it, like EOS): each must be one token of the tokenizer (e.g. "\n" for a base model's
        # plain-text prompts); single-turn rollouts, evals and `rljax sample` stop on them
        # (multi-turn episodes end turns with the environment's own stop texts).
        stop_strings=(),
        temperature=1.0,
        top_k=0,                     # 0 = off
        top_p=1.0,
        micro_batch_size=0,          # sampler chunk; 0 = whole batch at once
        # Concurrent decode streams: the prompts (of each chunk) split this many ways, decoded
        # by concurrent programs; same samples as one stream. 0 = auto (2 on a CPU with 2+
        # cores and one device, else 1; rljax.streams).
        streams=0,
        # Decoding (docs/internals.md): "static" decodes each batch until its longest row
        # stops; "slots" keeps `slots` decode slots busy, each taking the next row as soon as
        # its row stops (the same completions; faster when lengths are uneven, bench/RESULTS.md).
        engine="static",
        slots=0,                     # slot engine: decode slots; 0 = a quarter of the rows
        chunk_steps=32,              # slot engine: decode steps per program run
        # Partial rollouts (slot engine, GRPO; docs/internals.md): an iteration trains on the
        # first groups to complete; unfinished samples keep decoding in the next iteration
        # under the new weights (one extra prompt batch stays in flight). Tokens record the
        # policy version that drew them; the loss corrects with the decoupled objective
        # (docs/algorithms.md). A group holding a token more than `max_staleness` versions
        # old restarts from its prompt (counted in rollout/dropped_stale). With env.name,
        # groups of episodes are carried at turn boundaries.
        partial=False,
        max_staleness=2,
        # Per-position sampling temperature (exploratory annealed decoding; docs/search.md):
        # from `start` at the first completion token to `end` at token `tokens` (0 = all of
        # max_new_tokens), then `end`. "constant" = off (rollout.temperature everywhere);
        # otherwise it replaces rollout.temperature for rollouts, and training log-probs and
        # ratios use each token's own temperature. GRPO and online DPO only.
        temperature_schedule=dict(name="constant", start=1.0, end=1.0, tokens=0),
        # Samples per prompt (docs/curricula.md): "uniform" = algo.num_generations each;
        # "knapsack" = per-prompt group sizes from a knapsack over estimated pass rates
        # (Knapsack RL), `budget` samples in all (0 = rollout.batch_size; the update's rows
        # stay rollout.batch_size, unused rows weigh zero), each between `min_samples` and
        # `max_samples` (0 = the budget). Pass rates: the MoPPS posterior with
        # data.selection.name='predicted', else a Beta(1, 1) posterior per prompt.
        allocation="uniform",
        knapsack=dict(budget=0, min_samples=2, max_samples=0),
        # Tree sampling (docs/search.md): each prompt's group of algo.num_generations
        # completions is the leaves of one tree: `roots` paths decode `segment_tokens` tokens,
        # then every path forks into `branching` children sharing its KV cache, depth times,
        # until roots * branching**depth = max_leaves leaves; the leaves decode the rest.
        # Shared segments are decoded once. With engine="slots" every fork is a slot-engine
        # request that re-prefills its path (the same trees as the static tree sampler's);
        # with partial=true whole trees are carried across iterations at level boundaries.
        tree=dict(
            enabled=False,
            segment_tokens=2,        # L, tokens per segment before each fork
            branching=2,             # k, children per path at each fork
            roots=1,                 # independent paths per prompt before the first fork
            max_leaves=0,            # leaves per prompt; 0 = algo.num_generations (must agree)
        ),
    )


SECTIONS = {"rollout": rollout}

# The sampler's schedules (the same tuple as the sampling code's TEMPERATURE_SCHEDULES; a
# closed set: each is a formula in the decode loop).
CHOICES = {"rollout.temperature_schedule.name": ("constant", "linear", "cosine", "exp"),
           "rollout.engine": ("static", "slots"),
           "rollout.allocation": ("uniform", "knapsack")}

RANGES = (
    ("rollout.batch_size", 1, None), ("rollout.max_new_tokens", 1, None),
    ("rollout.temperature", 0.0, None), ("rollout.top_k", 0, None), ("rollout.top_p", 1e-9, 1.0),
    ("rollout.micro_batch_size", 0, None), ("rollout.streams", 0, None),
    ("rollout.slots", 0, None), ("rollout.chunk_steps", 1, None),
    ("rollout.max_staleness", 0, None), ("rollout.knapsack.budget", 0, None),
    ("rollout.knapsack.min_samples", 1, None), ("rollout.knapsack.max_samples", 0, None),
    ("rollout.tree.segment_tokens", 1, None), ("rollout.tree.branching", 1, None),
    ("rollout.tree.roots", 1, None), ("rollout.tree.max_leaves", 0, None),
)


def tree_depth(roots: int, branching: int, max_leaves: int) -> int | None:
    """The depth D with ``roots * branching**D == max_leaves``; None if there is none.
    Branching 1 never grows the tree: depth 0 when ``max_leaves == roots``."""
    if roots < 1 or branching < 1 or max_leaves < roots or max_leaves % roots:
        return None
    if branching == 1:
        return 0 if max_leaves == roots else None
    d, width = 0, roots
    while width < max_leaves:
        width, d = width * branching, d + 1
    return d if width == max_leaves else None


def check_temperature_schedule(cfg) -> None:
    """A schedule's temperatures are all > 0 and it runs where training scores tokens at it."""
    sched = cfg.rollout.temperature_schedule
    for key in ("start", "end"):
        if sched[key] <= 0:
            raise ConfigError(f"rollout.temperature_schedule.{key}={sched[key]!r} must be > 0 "
                              "(a schedule has no greedy position)")
    if sched.tokens < 0:
        raise ConfigError(f"rollout.temperature_schedule.tokens={sched.tokens} must be >= 0 "
                          "(0 = rollout.max_new_tokens)")
    if sched.name == "exp" and sched.start < sched.end:
        raise ConfigError(f"rollout.temperature_schedule: name='exp' anneals down, needs "
                          f"start >= end (got start={sched.start}, end={sched.end})")
    if sched.name != "constant" and cfg.algo.name not in ("grpo", "dpo", "ppo", "distill"):
        raise ConfigError(f"rollout.temperature_schedule.name='{sched.name}' shapes the RL "
                          f"rollout's sampling: algo.name='grpo', 'ppo', 'distill' or online "
                          f"'dpo', not '{cfg.algo.name}'")


def _uses_tree(estimator: str) -> bool:
    from rljax.algorithms import uses_tree  # the live registry's flag (user estimators too)

    return uses_tree(estimator)




def check_partial(cfg) -> None:
    """Partial rollouts need the slot engine and a GRPO step that takes groups as they
    complete: extra rounds (dynamic sampling, the online filter) take the next ones to
    complete; nothing may sample or pick groups per round of its own. (MoPPS learns each
    completed group's rewards for the prompt it was drawn for, whenever that was.)"""
    r, a = cfg.rollout, cfg.algo
    if not r.partial:
        return
    if r.engine != "slots":
        raise ConfigError(f"rollout.partial=true needs rollout.engine='slots' (got "
                          f"'{r.engine}'): add --config.rollout.engine=slots")
    if a.name not in ("grpo", "distill", "ppo") and not online_dpo_groups(cfg):
        raise ConfigError(f"rollout.partial=true needs algo.name='grpo', 'distill', 'ppo' or "
                          f"online 'dpo' with best-worst pairs (got '{a.name}')")
    if r.micro_batch_size:   # the pool holds its groups' prompts once and their tokens
        raise ConfigError("rollout.partial=true has no meaning with rollout.micro_batch_size: "
                          "the pool decodes on rollout.slots slots, which already bound its "
                          "memory; set rollout.micro_batch_size=0 (or fewer rollout.slots)")


def knapsack_limits(cfg) -> tuple[int, int, int]:
    """(budget, min samples, max samples) of ``rollout.allocation='knapsack'``, defaults
    filled in."""
    k = cfg.rollout.knapsack
    budget = int(k.budget or cfg.rollout.batch_size)
    return budget, int(k.min_samples), int(k.max_samples or budget)


def knapsack_step(cfg) -> int:
    """What the knapsack's group sizes are multiples of: with tree sampling, a prompt's group
    is whole trees of ``branching**depth`` leaves (the configured tree, one root each; the
    knapsack gives each prompt its number of roots); else 1."""
    t = cfg.rollout.tree
    if not t.enabled:
        return 1
    depth = tree_depth(t.roots, t.branching, t.max_leaves or cfg.algo.num_generations)
    return int(t.branching) ** int(depth or 0)


def check_allocation(cfg) -> None:
    """Knapsack allocation: GRPO (or distillation) with an estimator that takes ragged groups, a budget the
    prompts can share, and nothing else that samples or picks groups its own way. Hints,
    ReLIFT, mixed-policy demonstrations and group filters (dynamic sampling, the online
    filter) act on each group, whatever its size; with multi-turn episodes a group is G_i
    episodes (not in self-play, where the seats of a match share its rows), with tree
    sampling whole trees (``knapsack_step``), with partial rollouts of either carried
    groups of those sizes."""
    r, a = cfg.rollout, cfg.algo
    if r.allocation == "uniform":
        return
    from rljax.algorithms import takes_group_ids   # the live registry's flag

    if a.name not in ("grpo", "distill", "ppo"):   # (distillation: GRPO's loop and a teacher)
        raise ConfigError(f"rollout.allocation='knapsack' needs algo.name='grpo', 'distill' or "
                          f"'ppo' (got '{a.name}')")
    if a.name != "ppo" and not takes_group_ids(a.adv_estimator):   # (PPO: GAE per row)
        raise ConfigError(f"rollout.allocation='knapsack' needs a group estimator that takes "
                          f"groups of different sizes, not algo.adv_estimator="
                          f"'{a.adv_estimator}'")
    if cfg.env.name and cfg.env.selfplay.mode == "self":
        raise ConfigError("rollout.allocation='knapsack' has no meaning with "
                          "env.selfplay.mode='self': a match gives every seat one row, and one "
                          "seat's win is another's loss, so a game has no pass rate to size by")
    budget, lo, hi = knapsack_limits(cfg)
    prompts = r.batch_size // a.num_generations
    if budget > r.batch_size:
        raise ConfigError(f"rollout.knapsack.budget={budget} must be <= rollout.batch_size="
                          f"{r.batch_size} (the update's rows)")
    if prompts * lo > budget or prompts * hi < budget or hi < lo:
        raise ConfigError(f"rollout.knapsack: {prompts} prompts cannot share a budget of "
                          f"{budget} samples with min_samples={lo}, max_samples={hi}")
    if r.partial and prompts * hi > r.batch_size:
        raise ConfigError(f"rollout.knapsack.max_samples={hi}: with rollout.partial any "
                          f"{prompts} groups to complete must fit rollout.batch_size="
                          f"{r.batch_size} rows, so at most {r.batch_size // prompts}")
    step = knapsack_step(cfg)   # tree sampling: groups of whole trees
    small, large = -(-lo // step) * step, hi // step * step
    if step > 1 and (budget % step or small > large or prompts * small > budget
                     or prompts * large < budget):
        raise ConfigError(f"rollout.knapsack: with rollout.tree.enabled a group is whole trees "
                          f"of {step} leaves: budget={budget}, min_samples={lo} and "
                          f"max_samples={hi} leave {prompts} prompts no sizes in multiples of "
                          f"{step} that share the budget")


def check_tree(cfg) -> None:
    """rollout.tree: a tree whose leaves are the group and whose segments fit max_new_tokens."""
    tree, algo = cfg.rollout.tree, cfg.algo
    if not tree.enabled and _uses_tree(algo.adv_estimator):
        raise ConfigError(f"algo.adv_estimator='{algo.adv_estimator}' uses the sampled tree: "
                          "set rollout.tree.enabled=true")
    if not tree.enabled:
        return
    # With episodes the tree forks within the first model turn, and each leaf plays on as an
    # episode (``train.methods.tree_episodes``). (Partial rollouts carry whole trees:
    # ``sampling.tree_partial``. In-flight weights enter the slot engine's tree between its
    # levels and decode chunks: check_async asks for the slot engine. Hints re-sample a failed
    # group as a new tree grown from the hinted prompt; a temperature schedule reaches each
    # segment at its completion positions.)
    if cfg.env.name:   # the tree forks within the first turn (train.methods.tree_episodes)
        _check_tree_episodes(cfg)
    if algo.name not in ("grpo", "distill", "ppo"):   # (distillation: the teacher scores the
        # leaves; PPO: the critic values them)
        raise ConfigError(f"rollout.tree.enabled=true needs algo.name='grpo', 'distill' or "
                          f"'ppo' (got '{algo.name}')")
    g = algo.num_generations
    if tree.max_leaves and tree.max_leaves != g:
        raise ConfigError(f"rollout.tree.max_leaves={tree.max_leaves} must equal "
                          f"algo.num_generations={g} (a prompt's group is its tree's leaves)")
    leaves, k, r = tree.max_leaves or g, tree.branching, tree.roots
    depth = tree_depth(r, k, leaves)
    if depth is None:
        raise ConfigError(f"rollout.tree.max_leaves={leaves} is not reachable: it must be "
                          f"rollout.tree.roots={r} * rollout.tree.branching={k} ** depth")
    # With episodes the tree is of first turns: the per-turn cap (``agent.turn_tokens``).
    room = ("env.max_turn_tokens", cfg.env.max_turn_tokens) if (
        cfg.env.name and cfg.env.max_turn_tokens) else ("rollout.max_new_tokens",
                                                        cfg.rollout.max_new_tokens)
    if depth * tree.segment_tokens >= room[1]:
        raise ConfigError(f"rollout.tree.segment_tokens={tree.segment_tokens}: {depth} forks "
                          f"* {tree.segment_tokens} tokens must be < {room[0]}={room[1]} "
                          "(the leaves need a segment)")
    if algo.adv_estimator == "rover" and algo.kl_in_reward:
        raise ConfigError("algo.kl_in_reward=true is not supported with "
                          "algo.adv_estimator='rover' (tree values carry no per-token KL)")
    if algo.adv_estimator == "rover" and algo.gamma != 1.0:
        raise ConfigError(f"algo.gamma={algo.gamma} must be 1.0 with algo.adv_estimator='rover'")


def _check_tree_episodes(cfg) -> None:
    """Tree rollouts of episodes: the tree's leaves are first turns the episode engine plays
    on one episode per slot, each alone. (Knapsack allocation sizes the groups in whole trees
    of first turns, as for single-turn trees: ``knapsack_step``; routing replay takes the
    tree's routes for the first turns, the engine's for the later ones; with in-flight
    updates each token records the version that drew it, in the tree or after; partial
    rollouts carry a group's trees whole, at the first-turn boundary.) Against a checkpoint
    opponent the tree is of the learner seat's first turns, its matches sharing their
    opening (``train.methods.tree_matches``; routing replay takes the tree's routes for
    the prompt, opening and first turn; partial rollouts record the opening and the tree
    as a fresh place's first steps, so the tree is carried whole and a carried place is
    rebuilt by replay: ``partial_matches``). Self-play has no tree of first turns."""
    mode = cfg.env.selfplay.mode
    if mode == "self":
        raise ConfigError("rollout.tree.enabled=true with env.name has no meaning with "
                          "env.selfplay.mode='self': row j of every seat's group plays match j, "
                          "so a later seat's first turn follows an earlier seat's different "
                          "leaves and its group shares no prefix to fork (use mode='checkpoint')")
