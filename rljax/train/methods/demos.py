"""Mixed-policy demonstrations (``algo.mixed_policy``, LUFFY / RL-PLUS style): the reference
solution takes the place of a failed group's last sample, trained with mu = 1. The rollout's
``guidance.Guide`` stage picks the failed groups (of G rows, or of the sizes knapsack
allocation gave them); this module writes the demonstrations into the round.
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from rljax import algorithms


def insert_demos(rollout, rnd: dict, examples: Sequence[dict], rows: Sequence[int],
                 solution: Callable[[dict], str]) -> dict:
    """Mixed-policy groups (LUFFY / RL-PLUS style, ``algo.mixed_policy``): in each failed
    group (of ``examples``), the last sample (its row of ``rows``) is replaced by the reference
    solution (+ EOS, cut to the completion slot), scored by the reward functions.
    ``rnd["demo"]`` bool [R] marks these rows; the rollout sets their ``old_logps`` to 0 (the
    demonstrator's probabilities are unknown; it is taken to be certain, mu = 1), so their
    importance ratio is pi_theta(token) <= 1: bounded, and never clipped for a positive
    advantage (the PPO clip only binds above 1 + epsilon). Their ``sampler_logps`` are 0 as
    well. ``rollout/tokens`` counts the replaced (sampled) completions, not the
    demonstrations."""
    tok, rows = rollout.ctx.tokenizer, [int(r) for r in rows]
    n = rnd["tokens"].shape[1]
    rnd["demo"] = np.zeros(len(rnd["rewards"]), bool)
    rnd.setdefault("extra_tokens", 0)
    if not rows:
        return rnd
    texts, lengths = [], []
    for row, ex in zip(rows, examples):
        text = solution(ex)
        ids = (tok.encode(text) + [tok.eos_id])[:n]
        # rollout/tokens counts sampled tokens: the replaced sample's, not the demo's.
        rnd["extra_tokens"] += int(rnd["lengths"][row]) - len(ids)
        rnd["tokens"][row] = tok.pad_id
        rnd["tokens"][row, :len(ids)] = ids
        rnd["mask"][row] = np.arange(n) < len(ids)
        rnd["lengths"][row], rnd["truncated"][row] = len(ids), ids[-1] != tok.eos_id
        rnd["logps"][row] = 0.0
        rnd["demo"][row] = True
        texts.append(tok.decode(ids))
        lengths.append(len(ids))
    keys = [k for k in examples[0] if k != "prompt"]
    result = rollout.reward_fn([ex["prompt"] for ex in examples], texts,
                               completion_lengths=lengths,
                               **{k: [ex.get(k) for ex in examples] for k in keys})
    total = np.asarray(result.total, np.float32)
    for name, values in result.per_function.items():
        rnd["scores"][name][rows] = np.asarray(values, np.float32)
    cfg = rollout.cfg
    if cfg.algo.overlong_buffer:  # the same DAPO length penalty as sampled completions get
        pen = np.asarray(algorithms.overlong_penalty(
            np.asarray(lengths), cfg.rollout.max_new_tokens, int(cfg.algo.overlong_buffer),
            cfg.algo.overlong_penalty_factor), np.float32)
        rnd["scores"]["overlong"][rows] = pen
        total = total + pen
    rnd["rewards"][rows] = total
    return rnd


def demo_old_logps(old_logps, demo: np.ndarray):
    """``old_logps`` [R, N] with the demonstration rows (``demo`` bool [R]) set to 0."""
    return jnp.where(jnp.asarray(demo)[:, None], 0.0, old_logps)


def episode_demo(cfg, tokenizer, example: dict, width: int, max_turns: int,
                 match_shape: tuple | None = None) -> dict:
    """The example's scripted episode (``agent.trace_messages``) as a rollout row: its
    ``prompt`` ids, ``tokens`` int32 [M] (model turns and observations, right-padded to
    ``width``), ``model_mask`` bool [M], ``turn_ids`` int32 [M] (-1 off model tokens), ``length``,
    ``turns``, ``cut`` (longer than ``width``), the ``final`` turn's text, and the environment's
    ``turn_rewards`` f32 [max_turns]: a fresh environment replays the scripted turns, so the
    demonstration earns what it would have earned if sampled (self-play: the seat's rewards in
    the scripted match, ``selfplay.seat_trace``). ``match_shape`` (self-play rows that record
    their matches, (plies, N)): adds ``match_turns`` int32 [plies, N], the scripted match's
    turns, every seat's (the seat's own as its row has them; another's, its move's ids and
    EOS), -1 after each: what a VinePPO fork of it replays (``vine_matches``)."""
    from rljax.train.core.render import trace_tokens
    from rljax.train.methods import agent

    rng, moves = np.random.default_rng(0), []
    if cfg.env.selfplay.mode != "off":
        from rljax.train.methods.selfplay import seat_trace
        messages, earned = seat_trace(cfg, example, agent.env_kwargs(cfg), rng, moves)
    else:
        messages, earned = agent.trace_messages(cfg, example, rng), None
    prompt, ids, is_model = trace_tokens(tokenizer, agent.make_renderer(cfg, tokenizer),
                                         messages)
    model = np.asarray(is_model[:width], bool)
    # Turn t's tokens: the t-th run of model tokens.
    starts = model & ~np.concatenate([[False], model[:-1]])
    turn_ids = np.where(model, np.cumsum(starts) - 1, -1).astype(np.int32)
    said = [m["content"] for m in messages if m["role"] == "assistant"][:max_turns]
    rewards = np.zeros(max_turns, np.float32)
    if earned is None:
        earned = _replayed_rewards(cfg, example, said)
    rewards[:len(said)] = earned[:len(said)]
    row = dict(prompt=prompt, tokens=np.full(width, tokenizer.pad_id, np.int32),
               model_mask=np.zeros(width, bool), turn_ids=np.full(width, -1, np.int32),
               length=min(len(ids), width), turns=int(starts.sum()), cut=len(ids) > width,
               final=said[-1], turn_rewards=rewards)
    row["tokens"][:row["length"]] = ids[:width]
    row["model_mask"][:len(model)], row["turn_ids"][:len(model)] = model, turn_ids
    if match_shape is not None:
        from rljax.envs.board_games import get_game
        from rljax.train.methods.selfplay import seat_of
        own = seat_of(get_game(cfg.env.name), example)
        row["match_turns"] = _match_turns(tokenizer, moves, own, row, match_shape)
    return row


def _match_turns(tokenizer, moves, own: int, row: dict, shape: tuple) -> np.ndarray:
    """The scripted match's turns (``moves``: each ply's (seat, text)) as a self-play row's
    ``match_turns`` int32 ``shape`` (plies, N): seat ``own``'s turn t is its row's t-th turn's
    ids, another seat's its move's ids and EOS; -1 after each."""
    out = np.full(shape, -1, np.int32)
    mine = iter(row["tokens"][row["turn_ids"] == t].tolist() for t in range(row["turns"]))
    for ply, (seat, text) in enumerate(moves[:shape[0]]):
        ids = (next(mine, []) if seat == own else
               tokenizer.encode(text) + [tokenizer.eos_id])[:shape[1]]
        out[ply, :len(ids)] = ids
    return out


def _replayed_rewards(cfg, example: dict, said: Sequence[str]) -> list[float]:
    """The rewards a fresh environment of ``example`` pays for the model turns ``said``."""
    from rljax.envs import make_env
    from rljax.train.methods.agent import env_kwargs
    env = make_env(cfg.env.name, example, **env_kwargs(cfg))
    env.reset()
    return [float(env.step(text).reward) for text in said]


def insert_episode_demos(rollout, rnd: dict, examples: Sequence[dict], rows: Sequence[int],
                         prompt_ids: Sequence[list]) -> dict:
    """``insert_demos`` for multi-turn episodes: the last episode of each failed group (its row
    of ``rows``) is replaced by the example's scripted episode (``episode_demo``), trained
    with mu = 1 on its model turns (observations stay context). Its reward is the replayed
    environment's plus ``reward.names`` on its final answer. A demonstration whose prompt
    differs from the group's (``prompt_ids``, one per row of ``rows``) is left out."""
    cfg, tok = rollout.cfg, rollout.ctx.tokenizer
    rnd["demo"] = np.zeros(len(rnd["rewards"]), bool)
    rnd.setdefault("extra_tokens", 0)
    width, max_turns = rnd["tokens"].shape[1], rnd["turn_rewards"].shape[1]
    done = []
    for row, ex, prompt in zip(rows, examples, prompt_ids):
        d = episode_demo(cfg, tok, ex, width, max_turns, rnd["match_turns"].shape[1:]
                         if "match_turns" in rnd else None)
        if list(d["prompt"]) != list(prompt):
            continue
        row = int(row)
        rnd["extra_tokens"] += int(rnd["model_mask"][row].sum()) - int(d["model_mask"].sum())
        rnd["tokens"][row], rnd["model_mask"][row] = d["tokens"], d["model_mask"]
        rnd["turn_ids"][row], rnd["turn_rewards"][row] = d["turn_ids"], d["turn_rewards"]
        rnd["mask"][row] = np.arange(width) < d["length"]
        rnd["lengths"][row], rnd["truncated"][row] = d["length"], d["cut"]
        rnd["turns"][row], rnd["logps"][row] = d["turns"], 0.0
        if "match_turns" in d:   # self-play: the scripted match, for VinePPO's forks
            rnd["match_turns"][row] = d["match_turns"]
        rnd["scores"]["env"][row] = rnd["rewards"][row] = d["turn_rewards"].sum()
        rnd["demo"][row] = True
        done.append((row, ex, d))
    if done and rollout.reward_fn is not None:   # as ``agent.score``: the final answer's score
        result = rollout.reward_fn([ex["prompt"] for _, ex, _ in done],
                                   ["" if d["cut"] else d["final"] for _, _, d in done],
                                   completion_lengths=[int(d["model_mask"].sum())
                                                       for _, _, d in done],
                                   **{k: [ex.get(k) for _, ex, _ in done]
                                      for k in done[0][1] if k != "prompt"})
        for j, (row, _, d) in enumerate(done):
            answer = float(result.total[j])
            rnd["rewards"][row] += answer
            rnd["turn_rewards"][row, max(d["turns"] - 1, 0)] += answer
            for name, values in result.per_function.items():
                rnd["scores"][name][row] = values[j]
    return rnd
