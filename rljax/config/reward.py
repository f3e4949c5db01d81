"""What a sample is scored by and the episodes it is sampled in: the ``reward`` section
(functions, weights, failure handling) and the ``env`` section (multi-turn environments and
tools), with their checks against the live reward and environment registries."""
from __future__ import annotations

import difflib
from typing import Any

from rljax.config.base import ConfigError, online_dpo_groups, opt_float, step_pairs

# Environments with scripted episodes for SFT warm-up (``sft.env_traces``).
ENV_TRACES = ("tool", "guess_number", "tictactoe", "kuhn_poker", "negotiation", "propose_solve")
# Environments whose traces take ``sft.trace_noise`` (random moves among the scripted ones).
NOISY_TRACES = ("guess_number", "tictactoe", "kuhn_poker", "negotiation", "propose_solve")
# Board games with seats and their seat counts (rljax.envs.game_env.GAME_ENVS, the games'
# ``seats``; config loads without the envs).
GAME_SEATS = {"tictactoe": 2, "kuhn_poker": 2, "negotiation": 2, "propose_solve": 5}
GAME_ENVS = tuple(GAME_SEATS)


def reward() -> dict[str, Any]:
    return dict(
        names=("arithmetic",),       # rewards.get names, summed with `weights`
        weights=(),                  # () = all 1.0
        model_path="",               # reward-model checkpoint for the "model" reward
        kwargs={},                   # free-form options: {function name: {option: value}}
        default_score=0.0,           # score of a sample its function failed on (error/NaN/timeout)
        timeout_s=30.0,              # per batch; 0 = none (calls run on the main thread)
        isolation="thread",          # "thread": a hung call is abandoned (counted, cannot be
                                     # killed); "process": spawned workers, killed on timeout
        max_consecutive_error_steps=10,  # stop when a function fails on every sample of this
                                         # many steps in a row; 0 = never
    )


def env() -> dict[str, Any]:
    return dict(                     # multi-turn episodes (docs/agents.md); "" = single-turn
        name="",                     # environment: "tool", "guess_number", "tictactoe",
                                     # "kuhn_poker", "negotiation", "propose_solve",
                                     # path/to/file.py:fn
        tools=(),                    # tool names for the "tool" environment (calculator, ...)
        tool_format="plain",         # how calls are written: "plain" or "json" (chat template)
        max_turns=4,                 # model turns per episode
        max_total_tokens=128,        # trajectory tokens after the prompt (model + observations)
        max_turn_tokens=0,           # tokens per model turn; 0 = rollout.max_new_tokens
        max_obs_tokens=31,           # tokens of one rendered observation (longer: the episode
                                     # ends, truncated); the cache holds O = this + 1 per turn
        kwargs={},                   # free-form options of the environment's factory
        turn_discount=opt_float(),   # None = outcome: the episode's summed reward for every
                                     # turn; gamma in [0, 1] = per-turn rewards, turn t judged
                                     # by sum_k gamma^k r_{t+k} (docs/multiturn.md)
        selfplay=dict(               # games with seats (GAME_ENVS), GRPO training:
            mode="off",              # off: the env's scripted opponent (env.kwargs.opponent);
                                     # self: the policy in every seat, each seat its own
                                     # episode; checkpoint: a frozen earlier run in the
                                     # other seats. Eval always plays the scripted opponent
            workdir="",              # checkpoint: the rljax workdir of the opponent
            step=0,                  # checkpoint: its checkpoint step; 0 = the latest
            temperature=0.0,         # checkpoint: the opponent's sampling; 0 = greedy
            forfeit_reward=0.0,      # what the other seats get when one seat forfeits
        ),
    )


SECTIONS = {"reward": reward, "env": env}

CHOICES = {"reward.isolation": ("thread", "process"),
           "env.selfplay.mode": ("off", "self", "checkpoint")}

RANGES = (
    ("reward.timeout_s", 0.0, None), ("reward.max_consecutive_error_steps", 0, None),
    ("env.max_turns", 1, None), ("env.max_total_tokens", 1, None),
    ("env.max_turn_tokens", 0, None), ("env.max_obs_tokens", 1, None),
    ("env.selfplay.step", 0, None), ("env.selfplay.temperature", 0.0, None),
)


def check_rewards(cfg) -> None:
    """As many weights as functions, and every name registered (``rljax.rewards.register``)
    or user code (``file.py:function``, loaded and checked when the run is set up)."""
    if cfg.reward.weights and len(cfg.reward.weights) != len(cfg.reward.names):
        raise ConfigError(f"reward.weights has {len(cfg.reward.weights)} entries but "
                          f"reward.names has {len(cfg.reward.names)}")
    from rljax import rewards, usercode

    known = rewards.names()
    for name in cfg.reward.names:
        if name in known or usercode.is_spec(name):
            continue
        close = difflib.get_close_matches(str(name), known, n=1, cutoff=0.6)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"reward.names: unknown reward {name!r}; known: {', '.join(known)} "
                          "(or your own function as path/to/file.py:function or "
                          f"package.module:function){hint}")
    kwargs = dict(cfg.reward.kwargs)
    for name in cfg.reward.names:   # a factory's missing options, before anything is built
        if name not in known:
            continue
        options = kwargs.get(name, {})
        options = options.to_dict() if hasattr(options, "to_dict") else options
        problem = rewards.option_problem(name, options) if isinstance(options, dict) else None
        if problem:
            raise ConfigError(problem)


def check_env(cfg) -> None:
    """The ``env`` section: known environment/tools/format (``envs.check_env_config``, which
    reads the live registries and imports user code), an algorithm that samples episodes, and a
    chat template for ``json``."""
    env = cfg.env
    if cfg.sft.trace_noise and not (cfg.sft.env_traces and env.name in NOISY_TRACES):
        raise ConfigError(f"sft.trace_noise={cfg.sft.trace_noise} applies to "
                          f"env.name={' / '.join(map(repr, NOISY_TRACES))} with "
                          "sft.env_traces=True")
    if not env.name:
        if cfg.sft.env_traces:
            raise ConfigError("sft.env_traces=True needs an environment (env.name)")
        if env.turn_discount is not None:
            raise ConfigError("env.turn_discount needs multi-turn episodes (env.name)")
        return
    from rljax.envs import check_env_config   # host-only module; imported when used

    check_env_config(env.name, tuple(env.tools), env.tool_format)
    call_reward = dict(env.kwargs).get("call_reward", 0.0)
    if env.name == "tool" and not (isinstance(call_reward, (int, float))
                                   and 0.0 <= call_reward < 1.0):
        raise ConfigError(f"env.kwargs.call_reward: must be a number in [0, 1) (an episode is "
                          f"correct when its total reward is >= 1), got {call_reward!r}")
    # MCTS over turns: self-training's traces, DPO's sibling turns (and step-MC's)
    searched = (cfg.algo.name == "sft" and cfg.sft.traces == "mcts") or step_pairs(cfg)
    if (cfg.algo.name not in ("grpo", "ppo", "distill") and not online_dpo_groups(cfg)
            and not searched):
        raise ConfigError(f"env.name={env.name!r}: multi-turn episodes train with "
                          f"algo.name='grpo', 'ppo', 'distill' or online 'dpo' (got "
                          f"{cfg.algo.name!r})")
    if cfg.algo.name == "dpo" and env.turn_discount is not None:
        raise ConfigError("env.turn_discount has no meaning with DPO: a pair compares two "
                          "whole episodes by their outcome, with no per-turn credit")
    _check_turn_discount(cfg)
    if env.tool_format == "json" and env.tools and not cfg.tokenizer.chat_template:
        raise ConfigError("env.tool_format='json' renders tool results with the chat "
                          "template: set tokenizer.chat_template=True (or env.tool_format="
                          "'plain')")
    if cfg.sft.env_traces and env.name not in ENV_TRACES:
        raise ConfigError(f"sft.env_traces: environment {env.name!r} has no scripted traces "
                          f"(known: {', '.join(ENV_TRACES)})")
    # ReLIFT's SFT rows and mixed-policy demonstrations are the scripted episodes.
    for key, on in (("algo.relift.every", cfg.algo.relift.every > 0),
                    ("algo.mixed_policy", cfg.algo.mixed_policy)):
        if on and env.name not in ENV_TRACES:
            raise ConfigError(f"{key} trains on the environment's scripted episodes: "
                              f"env.name={env.name!r} has none (known: "
                              f"{', '.join(ENV_TRACES)})")


def check_selfplay(cfg) -> None:
    """``env.selfplay``: a board game, GRPO, PPO, distillation, online DPO (its step pairs
    over the learner seat's turns too: ``data.pairs='mcts'`` or ``'step_mc'``, a tree or a
    trajectory per example, its seat's) or the MCTS search's ``sft.traces='mcts'``, a
    workdir exactly for the checkpoint opponent, no difficulty curriculum, and (self-play
    rollouts) a batch of whole examples: G rows per seat."""
    sp, env = cfg.env.selfplay, cfg.env
    if sp.mode == "off":
        if sp.workdir:
            raise ConfigError("env.selfplay.workdir is read with env.selfplay.mode='checkpoint'")
        return
    what = f"env.selfplay.mode='{sp.mode}'"
    if env.name not in GAME_ENVS:
        raise ConfigError(f"{what} plays board games: env.name must be one of {GAME_ENVS}, "
                          f"got {env.name!r}")
    # A tree or step-MC trajectory per example, its learner seat's: no groups of every seat.
    search = "mcts" in (cfg.sft.traces, cfg.data.pairs) or cfg.data.pairs == "step_mc"
    if (cfg.algo.name not in ("grpo", "ppo", "distill") and not online_dpo_groups(cfg)
            and not search):
        raise ConfigError(f"{what} trains with algo.name='grpo', 'ppo', 'distill', online "
                          f"'dpo' (step pairs data.pairs='mcts' or 'step_mc' too) or the "
                          f"search's sft.traces='mcts', got algo.name={cfg.algo.name!r}")
    if (sp.mode == "checkpoint") != bool(sp.workdir):
        raise ConfigError("env.selfplay.workdir (the opponent's run) goes with "
                          "env.selfplay.mode='checkpoint'")
    if cfg.data.selection.name == "curriculum":   # the other selectors observe games
        raise ConfigError(f"{what} cannot be combined with data.selection.name='curriculum' "
                          "(its knob sets a task's difficulty; a game has none)")
    seats = GAME_SEATS[env.name]
    rows = cfg.algo.num_generations * seats
    if sp.mode == "self" and not search and cfg.rollout.batch_size % rows:
        raise ConfigError(f"rollout.batch_size={cfg.rollout.batch_size} must be divisible by "
                          f"algo.num_generations * seats = {rows} ({what}: G rows per seat "
                          "of each game)")


def _check_turn_discount(cfg) -> None:
    """``env.turn_discount``: in [0, 1]; with GRPO an estimator with a group baseline
    (``algorithms.turn_credit.TURN_ESTIMATORS``)."""
    from rljax.config.algo import TURN_ESTIMATORS

    gamma, algo = cfg.env.turn_discount, cfg.algo
    if gamma is None:
        return
    if not 0.0 <= gamma <= 1.0:
        raise ConfigError(f"env.turn_discount={gamma!r} must be in [0, 1] (or None: outcome)")
    if algo.name == "grpo" and algo.adv_estimator not in TURN_ESTIMATORS:
        raise ConfigError(f"env.turn_discount (per-turn returns) needs algo.adv_estimator in "
                          f"{TURN_ESTIMATORS}, got '{algo.adv_estimator}'")
