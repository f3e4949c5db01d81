"""Board-game evaluation against fixed opponents: win, draw and loss rates with 95% Wilson
intervals (``envs.wilson_interval``) over held-out games.

    metrics = evaluate_games(ctx, params, examples, "optimal", rng)   # or "random", or an
                                                                        # Opponent (checkpoint)
    metrics["games/wins"], metrics["games/wins_ci95"] == [low, high], ...

A scripted opponent (``"random"``, ``"optimal"``: minimax / Kuhn Nash) plays inside the
environment (``agent.run_eval_batches`` with ``env.kwargs.opponent`` set); a frozen checkpoint
(``selfplay.Opponent``, ``selfplay.load_opponent``) plays the other seats as a model, through
``selfplay.play``. The policy plays each example's seat; ``temperature`` 0 is greedy.
``bench/games_eval.py`` is the command line.
"""
from __future__ import annotations

import copy
import dataclasses

import jax
import numpy as np

from rljax.envs import env_metrics, wilson_interval
from rljax.train.methods import agent, selfplay

SCRIPTED = ("random", "optimal", "fair")   # fair: Negotiation's


def _scripted_counters(ctx, params, examples, kind, rng, temperature, batch_size):
    cfg = copy.deepcopy(ctx.cfg)
    with cfg.unlocked():
        cfg.env.kwargs["opponent"] = kind
    run = agent.run_eval_batches(dataclasses.replace(ctx, cfg=cfg), params, rng, examples,
                                 num_samples=1, temperature=temperature, batch_size=batch_size)
    eps = run["episodes"]
    return [c for e in eps for c in e["counters"]], np.concatenate([e["truncated"] for e in eps])


def _checkpoint_counters(ctx, params, examples, opponent, rng, temperature, batch_size):
    from rljax import data as data_lib
    template = data_lib.make_template(ctx.data_config(), ctx.tokenizer)
    counters, truncated = [], []
    for i, start in enumerate(range(0, len(examples), batch_size)):
        chunk = examples[start:start + batch_size]
        padded = chunk + [chunk[-1]] * (batch_size - len(chunk))   # static shapes
        eps, _ = selfplay.play(ctx, params, padded, jax.random.fold_in(rng, i), num_samples=1,
                               temperature=temperature, template=template, opponent=opponent,
                               **agent.match_options(ctx.cfg, ctx))
        counters += eps["counters"][:len(chunk)]
        truncated.append(eps["truncated"][:len(chunk)])
    return counters, np.concatenate(truncated)


def evaluate_games(ctx, params, examples: list[dict], opponent, rng, *,
                   temperature: float = 0.0, batch_size: int = 0) -> dict:
    """One game per example, the policy (``params``) in the example's seat against
    ``opponent`` ("random", "optimal" or a ``selfplay.Opponent``). Returns ``games/*``:
    ``games`` (count), ``wins`` / ``draws`` / ``losses`` (rates of all games; a forfeit is a
    loss for the seat that forfeits and is also counted in ``illegal_moves``) each with
    ``_ci95`` [low, high], ``illegal_moves``, ``opponent_forfeits`` (a model opponent's
    illegal moves: neither a win nor a loss), ``truncated``, ``win_rate_<seat>`` with
    ``_ci95``, and ``payoff_played`` (the mean return of the games played to the end: chips
    in poker)."""
    if not examples:
        raise ValueError("evaluate_games: no examples")
    if isinstance(opponent, str) and opponent not in SCRIPTED:
        raise ValueError(f"evaluate_games: opponent must be one of {SCRIPTED} or a "
                         f"checkpoint Opponent, got {opponent!r}")
    batch_size = int(batch_size or len(examples))
    if isinstance(opponent, str):
        counters, truncated = _scripted_counters(ctx, params, examples, opponent, rng,
                                                 temperature, batch_size)
    else:
        counters, truncated = _checkpoint_counters(ctx, params, examples, opponent, rng,
                                                   temperature, batch_size)
    return game_outcomes(counters, truncated)


def game_outcomes(counters: list[dict], truncated) -> dict:
    """``games/*`` rates with Wilson intervals from one counter dict per game (a seat
    environment's or ``GameEnv``'s) and truncated bool [n]. A forfeit (``illegal_moves``)
    counts as a loss."""
    n = len(counters)
    wins = sum(c.get("wins", 0) for c in counters)
    draws = sum(c.get("draws", 0) for c in counters)
    losses = sum(c.get("losses", 0) + c.get("illegal_moves", 0) for c in counters)
    out = {"games/games": n}
    for key, k in (("wins", wins), ("draws", draws), ("losses", losses)):
        out[f"games/{key}"] = k / n
        out[f"games/{key}_ci95"] = list(wilson_interval(k, n))
    out["games/illegal_moves"] = sum(c.get("illegal_moves", 0) for c in counters) / n
    out["games/opponent_forfeits"] = sum(c.get("opponent_forfeits", 0) for c in counters) / n
    out["games/truncated"] = float(np.mean(truncated))
    played = wins + draws + sum(c.get("losses", 0) for c in counters)
    out["games/payoff_played"] = (sum(c.get("payoff", 0) for c in counters) / played
                                  if played else 0.0)
    seats = env_metrics(counters, prefix="games")
    for key, value in seats.items():
        if key.startswith("games/win_rate_") and not key.endswith(("_low", "_high")):
            out[key] = value
            out[f"{key}_ci95"] = [seats[f"{key}_ci95_low"], seats[f"{key}_ci95_high"]]
    return out
