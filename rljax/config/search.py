"""Checks of the step-level methods' keys that span sections: VinePPO's forked values
(``algo.vine``), MCTS over steps (``algo.mcts``) and GRPO with a process reward model's step
scores (``algo.adv_estimator='grpo_process'``, ``algo.process_reward``)."""
from __future__ import annotations

from rljax.config.base import ConfigError


def check_process_reward(cfg) -> None:
    """``grpo_process`` reads a PRM run (``algo.process_reward.prm``) and cuts samples (or
    episodes' model turns) into steps at ``data.step_delimiter``; its advantage is per
    token, over groups of one prompt's samples (of any sizes), with the outcome and step
    rewards undiscounted."""
    a = cfg.algo
    on = a.adv_estimator == "grpo_process"
    if not on:
        if a.process_reward.prm:
            raise ConfigError("algo.process_reward.prm is read only with "
                              "algo.adv_estimator='grpo_process'")
        return
    if not a.process_reward.prm:
        raise ConfigError("algo.adv_estimator='grpo_process' needs algo.process_reward.prm="
                          "<workdir of an algo.name='prm' run>")
    if not cfg.data.step_delimiter:
        raise ConfigError("data.step_delimiter must not be empty with algo.adv_estimator="
                          "'grpo_process' (the PRM scores each step's last token)")
    for key, bad, why in (
            ("algo.kl_in_reward", a.kl_in_reward, "the KL to the reference is the loss's "
             "term (algo.beta) here"),
            ("algo.gamma", a.gamma != 1.0, "step rewards are summed undiscounted")):
        if bad:
            raise ConfigError(f"algo.adv_estimator='grpo_process' cannot be combined with "
                              f"{key}: {why}")


def check_vine(cfg) -> None:
    """VinePPO: the GRPO phase, values of the task reward only (no KL in the reward, gamma
    1), completions or episodes (the rows that train are valued as they train: hinted,
    demonstrations, after group filters, groups of the knapsack's sizes, a tree's leaves,
    episodes whose forks replay the environment, self-play rows whose forks replay the
    match, a demonstration's the scripted one), and a regex that compiles."""
    algo = cfg.algo
    if algo.adv_estimator != "vineppo":
        return
    if algo.name != "grpo":
        raise ConfigError(f"algo.adv_estimator='vineppo' runs in the GRPO phase; algo.name="
                          f"{algo.name!r}")
    for key, on in (("algo.kl_in_reward", algo.kl_in_reward), ("algo.gamma", algo.gamma != 1.0)):
        if on:
            raise ConfigError(f"algo.adv_estimator='vineppo' cannot be combined with {key} "
                              "(a step's value is the mean task reward of its forks, "
                              "undiscounted, with no KL term)")
    if algo.vine.splitter == "regex":
        import re
        try:
            re.compile(algo.vine.regex)
        except re.error as e:
            raise ConfigError(f"algo.vine.regex={algo.vine.regex!r} does not compile: {e}")
        if not algo.vine.regex:
            raise ConfigError("algo.vine.splitter='regex' needs algo.vine.regex")


def check_mcts(cfg) -> None:
    """MCTS over steps (``sft.traces='mcts'``: the main SFT phase; ``data.pairs='mcts'``:
    online DPO, checked with step_mc's pairs): steps cut at a delimiter, the static sampler
    (each node's steps drawn from its own key), a PRM workdir with value 'prm' (refitted in
    either phase with ``algo.mcts.refit_prm``, with LoRA too: adapters and head); with
    ``env.name`` over the environment's turns, valued by episode rewards (with
    ``env.turn_discount`` each node by its discounted return) or a frozen PRM at turn ends;
    with ``env.selfplay`` over the learner seat's turns in matches."""
    traces = cfg.sft.traces == "mcts"
    if not traces and cfg.data.pairs != "mcts":
        if cfg.algo.mcts.refit_prm:
            raise ConfigError("algo.mcts.refit_prm=true refits the PRM of the search; it needs "
                              "sft.traces='mcts' or data.pairs='mcts'")
        return
    m, r = cfg.algo.mcts, cfg.rollout
    what = "sft.traces='mcts'" if traces else "data.pairs='mcts'"
    if traces and cfg.algo.name != "sft":
        raise ConfigError(f"sft.traces='mcts' trains the SFT phase on the search's traces; "
                          f"algo.name={cfg.algo.name!r} (set algo.name='sft')")
    if not cfg.data.step_delimiter:
        raise ConfigError(f"data.step_delimiter must not be empty with {what} (the "
                          "search's nodes are step prefixes)")
    if m.value == "prm" and not m.prm:
        raise ConfigError("algo.mcts.value='prm' needs algo.mcts.prm=<workdir of a "
                          "algo.name='prm' run>")
    if m.refit_prm and m.value != "prm":
        raise ConfigError(f"algo.mcts.refit_prm=true refits the PRM that values the leaves; "
                          f"algo.mcts.value={m.value!r} has none (set algo.mcts.value='prm')")
    if traces and cfg.sft.max_length <= cfg.data.max_prompt_length:
        raise ConfigError(f"sft.max_length={cfg.sft.max_length} must exceed "
                          f"data.max_prompt_length={cfg.data.max_prompt_length} (the traces "
                          "train in the columns after the prompt)")
    if m.max_nodes < 1 + m.children:
        raise ConfigError(f"algo.mcts.max_nodes={m.max_nodes} holds no expansion of "
                          f"algo.mcts.children={m.children} (needs >= {1 + m.children})")
    for key, on in (("rollout.engine", r.engine != "static"), ("rollout.tree.enabled",
                                                                r.tree.enabled),
                    ("rollout.partial", r.partial),
                    ("rollout.temperature_schedule.name",
                     r.temperature_schedule.name != "constant")):
        if on:
            raise ConfigError(f"{what} cannot be combined with {key} (the search samples "
                              "steps with the static sampler at rollout.temperature)")
