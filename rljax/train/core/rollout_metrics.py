"""The metrics of one rollout call (``Rollout.__call__``): rewards per function, advantages,
lengths, sampling work and slot use (``batch_metrics``), and the staleness of a batch's tokens
under asynchronous or partial rollouts (``staleness_metrics``); and the samples it prints on the
console (``print_completions``)."""
from __future__ import annotations

import sys
from typing import Callable, Sequence

import numpy as np


def staleness_metrics(stale: np.ndarray) -> dict:
    """Staleness of a batch's tokens (int [T]: the training version minus each token's): mean,
    max and a histogram, the share of tokens 0, 1, 2 and 3 or more versions old."""
    stale = np.asarray(stale).reshape(-1)
    if not stale.size:
        stale = np.zeros(1, np.int64)
    hist = {f"rollout/staleness_frac_{k}": float(np.mean(stale == k)) for k in range(3)}
    hist["rollout/staleness_frac_3plus"] = float(np.mean(stale >= 3))
    return {"rollout/staleness_mean": float(stale.mean()),
            "rollout/staleness_max": int(stale.max()), **hist}


def carried_metrics(drawn: Sequence[dict], step: int, carried_groups: int) -> dict:
    """Metrics of a round source that carries groups across iterations, over the sampling
    rounds of one rollout call (``drawn``: per round, ``versions`` int [T] of its model
    tokens, ``dropped`` samples restarted as too stale, ``drawn`` tokens decoded): staleness
    at the update of ``step``, ``rollout/dropped_stale``, ``rollout/carried_groups`` (left in
    flight) and ``rollout/decoded_tokens`` (carried groups' tokens included)."""
    versions = np.concatenate([np.asarray(d["versions"]).reshape(-1) for d in drawn])
    stale = int(step) - versions if versions.size else np.zeros(1, np.int64)
    return {**staleness_metrics(stale),
            "rollout/dropped_stale": int(sum(d["dropped"] for d in drawn)),
            "rollout/carried_groups": int(carried_groups),
            "rollout/decoded_tokens": int(sum(d["drawn"] for d in drawn))}


def batch_metrics(rounds: Sequence[dict], adv: np.ndarray, loss_mask: np.ndarray, filler: int,
                  informative_groups: Callable) -> dict:
    """Reward (every sampled completion of this step), advantage, length and sampling metrics
    of one rollout call: ``rounds`` its sampling rounds, ``adv`` f32 [R] or [R, N] the batch's
    advantages, ``loss_mask`` bool [R, N], ``filler`` the groups that only pad the batch,
    ``informative_groups(rewards, sizes) -> bool [groups]``."""
    # float64: statistics of float32 rewards near their limits stay finite
    total = np.concatenate([r["rewards"] for r in rounds]).astype(np.float64)
    m = {"reward/mean": float(total.mean()), "reward/std": float(total.std())}
    for name in rounds[0]["scores"]:
        s = np.concatenate([r["scores"][name] for r in rounds]).astype(np.float64)
        m[f"reward/{name}/mean"], m[f"reward/{name}/std"] = float(s.mean()), float(s.std())
    m["reward/errors"] = float(sum(r["errors"] for r in rounds))
    if "skipped_images" in rounds[0]:   # examples whose images were corrupt or too large
        m["data/skipped_images"] = int(sum(r["skipped_images"] for r in rounds))
    for name in rounds[0]["reward_counts"]:  # failed samples (timeouts included), timeouts
        m[f"reward/{name}/errors"] = float(sum(r["reward_counts"][name][0] for r in rounds))
        m[f"reward/{name}/timeouts"] = float(sum(r["reward_counts"][name][1] for r in rounds))
    lengths = np.concatenate([r["lengths"] for r in rounds])
    truncated = np.concatenate([r["truncated"] for r in rounds])
    trains = loss_mask.any(axis=1)
    # Samples that carry a gradient: they train and their advantage is not 0.
    moving = (adv != 0).any(axis=1) if adv.ndim == 2 else adv != 0
    m["rollout/effective_samples"] = int((trains & moving).sum())
    if adv.ndim == 2:  # token-level: statistics over the tokens that train
        adv = adv[loss_mask] if loss_mask.any() else np.zeros(1, np.float32)
    m.update({
        "adv/mean": float(adv.mean()), "adv/std": float(adv.std()),
        "adv/abs_mean": float(np.abs(adv).mean()),
        "completion/length_mean": float(lengths.mean()),
        "completion/length_max": int(lengths.max()),
        "completion/truncated_frac": float(truncated.mean()),
        "rollout/rounds": len(rounds),
        "rollout/informative_groups_frac": float(np.mean(
            np.concatenate([informative_groups(r["rewards"], r.get("group_sizes"))
                            for r in rounds]))),
        "rollout/filler_groups": filler,
        "rollout/train_tokens": int(loss_mask.sum()),
        # Sampled tokens, failed groups that hints replaced included.
        "rollout/tokens": int(lengths.sum()) + sum(r.get("extra_tokens", 0) for r in rounds),
        # Tokens the sampler decoded (a tree's shared segments once): the sampling cost.
        "rollout/decoded_tokens": int(sum(r["decoded"].sum() + r.get("extra_decoded", 0)
                                          for r in rounds)),
        "time/sample": sum(r["time_sample"] for r in rounds),
        "time/reward": sum(r["time_reward"] for r in rounds),
    })
    if all("slot_steps" in r for r in rounds):   # the slot engine: its busy slot-steps,
        busy, run = (sum(r["slot_steps"][i] for r in rounds) for i in (0, 1))
        m["rollout/slot_utilisation"] = busy / max(1, run)
        # and what a static batch of these lengths would have kept busy
        m["rollout/static_utilisation"] = float(np.mean([
            r["lengths"].sum() / max(1, r["lengths"].size * r["lengths"].max())
            for r in rounds]))
    return m


def print_completions(prompts, completions, rewards=None, file=None) -> None:
    """Prompt and completion of each sample, separated by marker lines (``rljax sample`` and
    ``logging.num_completions_to_print``)."""
    file = file if file is not None else sys.stderr
    for i, (prompt, text) in enumerate(zip(prompts, completions)):
        score = "" if rewards is None else f" (reward {float(rewards[i]):.3g})"
        print(f"--- prompt ---\n{prompt}\n--- completion{score} ---\n{text}", file=file,
              flush=True)
