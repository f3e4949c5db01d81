"""Checks of the search-and-process-reward keys that span sections: GRPO with a process
reward model's step scores (``algo.adv_estimator='grpo_process'``, ``algo.process_reward``)."""
from __future__ import annotations

from rljax.config.base import ConfigError


def check_process_reward(cfg) -> None:
    """``grpo_process`` reads a PRM run (``algo.process_reward.prm``) and cuts samples into
    steps at ``data.step_delimiter``; its advantage is per token, over groups of one prompt's
    samples, with the outcome and step rewards undiscounted."""
    a, r = cfg.algo, cfg.rollout
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
            ("algo.gamma", a.gamma != 1.0, "step rewards are summed undiscounted"),
            ("rollout.allocation", r.allocation != "uniform", "groups of different sizes "
             "have no group statistic here"),
            ("env.name", bool(cfg.env.name), "the PRM scores single completions, not "
             "episodes with observations between the model's turns")):
        if bad:
            raise ConfigError(f"algo.adv_estimator='grpo_process' cannot be combined with "
                              f"{key}: {why}")
