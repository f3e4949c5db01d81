"""Prompts: the ``data`` section (source, template, DPO pairs, prompt selection), its checks,
and the live registry of prompt selectors (``rljax.data.selection.SELECTORS``)."""
from __future__ import annotations

from typing import Any

from rljax.config.base import ConfigError, online_dpo_groups, registered, step_pairs


def data() -> dict[str, Any]:
    return dict(
        source="arithmetic",         # task name, "jsonl", "parquet" or "tfds:<name>"
        path="",                     # file for jsonl/parquet
        eval_path="",                # "" = same source, `eval_split`
        split="train",
        eval_split="test",
        template="plain",            # prompt template name
        max_prompt_length=256,
        images_field="images",       # column with a row's image(s), for a model with a tower
        max_images=1,                # most images in one prompt (docs/vision.md)
        max_image_pixels=50_000_000,  # most pixels of one image, from its header (0: no cap)
        shuffle=True,
        kwargs={},                   # free-form options for the source
        pairs="auto",                # DPO pairs: "auto" = the data's (offline) or best vs worst
                                     # of num_generations (algo.online); "step_mc" = step-level
                                     # pairs from Monte-Carlo step values; "mcts" = sibling
                                     # steps of an MCTS over steps (docs/tree_search.md)
        step_delimiter="\n",         # step_mc: a solution's steps end with this text
        # Which prompts an RL step trains on (rljax.data.selection, docs/curricula.md):
        # uniform (as drawn), online_filter (groups with pass rate in [low, high]; more
        # sampling rounds, algo.max_sampling_rounds), predicted (MoPPS: Beta posteriors per
        # prompt, Thompson-sampled near `target`), curriculum (task knob `knob` moved to keep
        # the training accuracy in [low, high]). Success: reward >= threshold (fractional:
        # the reward clipped to [0, 1]).
        selection=dict(
            name="uniform",
            low=0.1,                 # band of pass rates (online_filter) / accuracy (curriculum)
            high=0.9,
            threshold=1.0,           # a sample succeeds when its reward >= threshold
            fractional=False,        # or counts min(max(reward, 0), 1) as its success
            target=0.5,              # predicted: success rate to pick prompts near
            pool_factor=4,           # predicted: candidates per step = pool_factor x prompts
            prior_a=1.0,             # predicted: Beta prior of every prompt
            prior_b=1.0,
            decay=0.9,               # predicted: evidence kept per update (1 = no forgetting)
            max_tracked=100_000,     # predicted: posteriors kept (least recent dropped)
            knob="digits",           # curriculum: the built-in task's difficulty knob
            min_level=1,             # curriculum: easiest level (training starts there)
            window=10,               # curriculum: steps between level decisions
        ),
    )


SECTIONS = {"data": data}

CHOICES = {"data.pairs": ("auto", "step_mc", "mcts")}


def _selectors():
    from rljax.data.selection import SELECTORS  # numpy only

    return registered(SELECTORS)


REGISTRIES = {"data.selection.name": _selectors}

RANGES = (
    ("data.max_prompt_length", 1, None),
    ("data.selection.low", 0.0, 1.0), ("data.selection.high", 0.0, 1.0),
    ("data.selection.target", 0.0, 1.0), ("data.selection.pool_factor", 1, None),
    ("data.selection.prior_a", 1e-9, None), ("data.selection.prior_b", 1e-9, None),
    ("data.selection.decay", 1e-9, 1.0), ("data.selection.max_tracked", 1, None),
    ("data.selection.window", 1, None),
)


def check_path(cfg) -> None:
    if cfg.data.source in ("jsonl", "parquet") and not cfg.data.path:
        raise ConfigError(f"data.path is required when data.source='{cfg.data.source}'")


def check_step_mc(cfg) -> None:
    """Step-level MC pairs are built from the policy's own samples by the DPO phase."""
    algo = cfg.algo
    if algo.step_mc.max_steps < 1:
        raise ConfigError(f"algo.step_mc.max_steps={algo.step_mc.max_steps} must be >= 1")
    if algo.step_mc.min_value_gap < 0:
        raise ConfigError(f"algo.step_mc.min_value_gap={algo.step_mc.min_value_gap} must be >= 0")
    pairs = cfg.data.pairs
    if pairs not in ("step_mc", "mcts"):
        return
    if algo.name != "dpo" or not algo.online:
        raise ConfigError(f"data.pairs='{pairs}' samples its pairs: set algo.name='dpo' and "
                          "algo.online=True")
    if not cfg.data.step_delimiter:
        raise ConfigError(f"data.step_delimiter must not be empty with data.pairs='{pairs}'")
    if cfg.rollout.temperature_schedule.name != "constant":
        raise ConfigError(f"data.pairs='{pairs}' samples continuations at "
                          "rollout.temperature; set rollout.temperature_schedule.name="
                          "'constant'")


def check_prm(cfg) -> None:
    """The process reward model reads stepwise JSONL rows or samples labels on a task (the
    task check is at run time: ``check_step_delimiter``), with a step delimiter; its labels
    sit at step ends, so a step needs a delimiter token."""
    if cfg.algo.name != "prm":
        return
    if cfg.data.source == "parquet" or cfg.data.source.startswith("tfds:"):
        raise ConfigError(f"algo.name='prm' reads stepwise rows from data.source='jsonl' (or "
                          f"samples them on a built-in task), not {cfg.data.source!r}")
    if not cfg.data.step_delimiter:
        raise ConfigError("data.step_delimiter must not be empty with algo.name='prm' (the "
                          "token that ends each step carries its label)")
    if cfg.data.pairs != "auto":
        raise ConfigError("data.pairs is for DPO; algo.name='prm' takes stepwise labels")


def check_selection(cfg) -> None:
    """``data.selection``: a band with low <= high, an RL rollout to select for, and for
    ``curriculum`` a built-in task with the named difficulty knob."""
    sel, algo = cfg.data.selection, cfg.algo
    if sel.name == "uniform":
        return
    if sel.low > sel.high:
        raise ConfigError(f"data.selection.low={sel.low} must be <= data.selection.high="
                          f"{sel.high}")
    pairs = step_pairs(cfg)   # the selector picks the prompts whose step pairs are built
    if algo.name not in ("grpo", "ppo", "distill") and not online_dpo_groups(cfg) and not pairs:
        offline = " with algo.online=False" if algo.name == "dpo" else ""
        raise ConfigError(f"data.selection.name='{sel.name}' selects prompts for RL "
                          f"rollouts: algo.name='{algo.name}'{offline} samples none (use "
                          "'uniform')")
    if sel.name == "online_filter" and algo.dynamic_sampling:
        raise ConfigError("data.selection.name='online_filter' and algo.dynamic_sampling both "
                          "filter groups: use one (dynamic sampling = the band (0, 1))")
    if sel.name == "curriculum":
        from rljax.data.selection import DIFFICULTY_KNOBS  # noqa: PLC0415 (light module)
        knobs = DIFFICULTY_KNOBS.get(cfg.data.source)
        if knobs is None:
            tasks = "; ".join(f"{t}: {', '.join(k)}" for t, k in DIFFICULTY_KNOBS.items())
            raise ConfigError(f"data.selection.name='curriculum' needs a difficulty knob, and "
                              f"data.source='{cfg.data.source}' has none (built-in tasks: "
                              f"{tasks})")
        if sel.knob not in knobs:
            raise ConfigError(f"data.selection.knob='{sel.knob}' is not a difficulty knob of "
                              f"data.source='{cfg.data.source}' (one of: {', '.join(knobs)})")
        top = dict(cfg.data.kwargs).get(sel.knob)
        if sel.min_level < knobs[sel.knob] or (isinstance(top, int) and sel.min_level > top):
            upper = f" and <= data.kwargs.{sel.knob}={top}" if isinstance(top, int) else ""
            raise ConfigError(f"data.selection.min_level={sel.min_level} must be >= "
                              f"{knobs[sel.knob]}{upper}")
