"""VinePPO's values of multi-turn episodes (``env.name``): each fork finishes the model's turn,
then plays the rest of the episode out with the policy, environment steps included.

An episode row (``agent.EpisodeRounds``) is the prompt ++ a trajectory of model turns and
observations (``model_mask``, ``turn_ids``). Its steps are cut within the model's turns only
(``step_mc.turn_step_ends`` at ``algo.vine``'s splitter; every turn's end ends a step); an
observation token is in no step, so it gets no advantage (and the loss mask holds model
tokens only). Steps past ``algo.vine.max_steps`` join the last one, which may then span turns.

The fork of step t, which starts at trajectory token ``start`` inside model turn k, is an
episode of its own:

1. a fresh environment (``env.reset``) replays the episode's turns 0 .. k-1 through
   ``env.step`` (``episodes._Trajectories.replay``, as partial rollouts rebuild their carried
   episodes: it needs environments that answer the same turns the same way);
2. on the slot engine (``sampling.episode_engine``) the trajectory so far ++ turn k's tokens
   before ``start`` are fed, and the policy samples the rest of turn k (the budget the turn
   cap and the episode's token budget leave it);
3. the environment steps on the whole turn k (its earlier tokens ++ the continuation, cut after
   a tool call's closing text as any turn is), and the episode goes on to its end like any
   other.

Images in the prompt (a vision tower): each valued row's page is prefilled with its prompt's
images (the row's ``pixels``), so the replayed turns and the fork's own attend to them as the
row's turns did.

Its reward is an episode's (``agent.score``: the environment's rewards, the replayed turns'
included, plus ``reward.names`` on the final answer), as the valued row's own reward R is, and
V(s_t) is the mean of K such rewards. The cost is K x steps episodes per row; the metrics
count every fork token in ``vine/fork_tokens``.

Self-play rows (``env.selfplay``) fork their whole match: ``vine_matches``.

Randomness: fork q of step t of the stage's valued row i is engine row ``(i * max_steps + t)
* K + q``, and its noise is keyed by that id under the stage's key (the round's, folded with
``vine.FORK_STREAM``; ``episode_engine``: token j of turn k reads ``fold_in(fold_in(key, k),
j)``), so the forks depend on (seed, iteration, row, step, fork) only, not on the slots,
chunks or other rows: a resumed run values as the straight one.
"""
from __future__ import annotations

import numpy as np

from rljax import sampling
from rljax.sampling import multiturn
from rljax.train.core import episodes as ep
from rljax.train.core.sampler import engine_slots, rollout_temperatures, sampling_params
from rljax.train.methods import agent
from rljax.train.methods.step_mc import turn_step_ends


def episode_steps(ids, turns, decode, stop_ids, pattern, max_steps: int) -> list[tuple]:
    """The steps of one trajectory (``ids``, ``turns``: its real tokens' ids and turn ids, -1
    on observations) as (first, end) token columns, cut within the model's turns
    (``turn_step_ends``); steps past ``max_steps`` join the last one."""
    ends = turn_step_ends(ids, turns, decode, "", stop_ids, pattern)
    steps, prev = [], 0
    for end in ends:
        first = prev + int(np.argmax(np.asarray(turns[prev:end]) >= 0))   # skip observations
        steps.append((first, end))
        prev = end
    if len(steps) > max_steps:
        steps = steps[:max_steps - 1] + [(steps[max_steps - 1][0], steps[-1][1])]
    return steps


def step_layout(rnd: dict, decode, stop_ids, pattern, max_steps: int):
    """``(step_ids int [R, M], num_steps int [R], forks)``: each row's step of every model
    token (-1 elsewhere) and, per step, the fork point ``(row, step, start, turn)``: the
    trajectory column it starts at and the model turn it is in."""
    tokens, mask, turn_ids = rnd["tokens"], rnd["mask"], rnd["turn_ids"]
    step_ids = np.full(tokens.shape, -1, np.int32)
    num_steps, forks = np.ones(len(tokens), np.int32), []
    for i in range(len(tokens)):
        n = int(mask[i].sum())
        steps = episode_steps(tokens[i, :n].tolist(), turn_ids[i, :n].tolist(), decode,
                              stop_ids, pattern, max_steps)
        for t, (first, end) in enumerate(steps):
            cols = first + np.flatnonzero(turn_ids[i, first:end] >= 0)
            step_ids[i, cols] = t
            forks.append((i, t, first, int(turn_ids[i, first])))
        num_steps[i] = max(len(steps), 1)
    return step_ids, num_steps, forks


def step_values(stage, params, rnd: dict, rng) -> dict:
    """``VineValues.step_values`` for a round of episode rows (``vine.valued_rows`` with
    ``turn_ids``): the step layout and MC values, the forks (``fork_rows``: (row, step,
    start) of each; ``fork_rewards`` f32 [forks, K]; ``fork_texts``: prompt ++ trajectory;
    ``fork_episodes``: the forks' ``run_episodes``-style record, K rows per fork) and their
    decoded tokens."""
    k, s = stage.k, stage.max_steps
    step_ids, num_steps, forks = step_layout(rnd, stage.decode, stage.stop_ids, stage.pattern,
                                            s)
    values = np.zeros((len(step_ids), s), np.float32)
    if not forks:   # no episode has a model token: nothing to value
        return {"step_ids": step_ids, "step_values": values, "num_steps": num_steps,
                "fork_rows": [], "fork_rewards": np.zeros((0, k), np.float32),
                "fork_texts": [], "fork_tokens": 0, "fork_padding_tokens": 0}
    if "match_turns" in rnd:   # self-play: a fork replays and plays on its whole match
        from rljax.train.methods import vine_matches
        eps, decoded = vine_matches.play_forks(stage.ctx, params, rnd, forks, k, rng,
                                               *vine_matches.players(stage.rollout))
    else:
        eps, decoded = play_forks(stage.ctx, params, rnd, forks, k, s, rng, stage.rollout.images)
    owners = [rnd["examples"][i] for i, *_ in forks for _ in range(k)]
    total, _, result = agent.score(stage.rollout.reward_fn, eps, owners, 1)
    if result is not None:
        stage.rollout.monitor.observe(result)
    fork_rewards = np.asarray(total, np.float32).reshape(len(forks), k)
    for (i, t, _, _), rs in zip(forks, fork_rewards):
        values[i, t] = rs.mean()
    return {"step_ids": step_ids, "step_values": values, "num_steps": num_steps,
            "fork_rows": [f[:3] for f in forks], "fork_rewards": fork_rewards,
            "fork_texts": [p + t for p, t in zip(eps["prompts"], eps["transcripts"])],
            "fork_episodes": eps, "fork_tokens": decoded, "fork_padding_tokens": 0}


def play_forks(ctx, params, rnd: dict, forks: list, k: int, max_steps: int, rng,
               images=None):
    """The K fork episodes of each fork point of ``forks`` ((row, step, start, turn)),
    fork-major: ``(record.result(...) of the K x len(forks) episodes, tokens sampled)``.
    ``images`` (``image_inputs.ImageInputs``, a vision tower): each valued row's page is
    prefilled with its prompt's images (``rnd["pixels"]``), so the replayed and forked turns
    attend to them as the row's own turns did."""
    from rljax.envs import step_all
    from rljax.models import paged
    from rljax.sampling import episode_engine as ee
    cfg, tok = ctx.cfg, ctx.tokenizer
    lim, renderer = agent.limits(cfg), agent.make_renderer(cfg, tok)
    points = [f for f in forks for _ in range(k)]
    envs = agent.make_envs(cfg, [rnd["examples"][i] for i, *_ in points], 1)
    prompts = [renderer.prompt(env.reset()) for env in envs]
    # A hinted row's first turn continues its hint: the replay and the forks judge it whole.
    hints = rnd.get("hint_prefixes", {})
    record = ep._Trajectories(tok, envs, renderer, lim, step_all,
                              [hints.get(i, []) for i, *_ in points])
    tokens, turn_ids = rnd["tokens"], rnd["turn_ids"]
    record.replay([[{"ids": tokens[i][turn_ids[i] == j].tolist()} for j in range(turn)]
                   for i, _, _, turn in points])
    record.schedule = rollout_temperatures(cfg)   # a fork's k-th model token at schedule[k]
    # Turn k's tokens before the fork: the engine feeds them, the environment gets them back.
    lead_in = [tokens[i, int(np.argmax(turn_ids[i] == turn)):start].tolist()
               for i, _, start, turn in points]
    # A page per valued row, padded to a multiple of the update's rows (few programs).
    ids = [list(p) for p in rnd["prompt_ids"]]
    ids += ids[-1:] * (-len(ids) % int(cfg.rollout.batch_size))
    p_tok, p_mask = sampling.pad_to_bucket(ids, pad_id=tok.pad_id, buckets=lim.prompt_buckets)
    params = sampling_params(ctx, params)
    embeds = None
    if images is not None:   # (the padding pages repeat the last row's images too)
        pixels = rnd["pixels"]
        embeds = images.embeds(params, np.concatenate(
            [pixels, np.repeat(pixels[-1:], len(ids) - len(pixels), 0)]))
    pages = ee.prefill(ctx.model_cfg, params, p_tok, p_mask, image_embeds=embeds)
    width = max_steps * k          # engine rows per page: row i's forks
    slots = max(1, min(engine_slots(cfg, len(ids) * width), len(points)))
    cache = paged.init_slot_cache(ctx.model_cfg, slots, lim.max_total_tokens + 1)
    state = ee.empty_state(slots, max(lim.chunk_tokens, lim.max_total_tokens), lim.turn_tokens,
                           tok.pad_id)
    if record.schedule is not None:   # each slot's turn at its own temperatures
        state["temp"] = np.ones((slots, lim.turn_tokens), np.float32)
    r = cfg.rollout
    options = dict(num_samples=width, chunk_steps=int(r.chunk_steps), temperature=r.temperature,
                   top_k=r.top_k, top_p=r.top_p, stop_ids=sampling.merge_stop_ids(tok.eos_id, ()),
                   stop_sequences=multiturn.stop_sequences_of(
                       tok, [renderer.call_end] if renderer.call_end else []))
    engine_row = [(i * max_steps + t) * k + n % k for n, (i, t, _, _) in enumerate(points)]
    fork_of = {row: n for n, row in enumerate(engine_row)}
    first = np.asarray(p_tok)[:, -1]
    waiting, decoded = list(range(len(points)))[::-1], 0
    while True:
        for slot in np.flatnonzero(state["row"] < 0):
            if not waiting:
                break
            n = waiting.pop()
            feed = record.tokens[n, :record.length[n]].tolist() + lead_in[n]
            ee.resume(state, slot, row=engine_row[n], lead=int(first[points[n][0]]),
                      observation=feed, cursor=0, turn=points[n][3],
                      budget=record.budget(n) - len(lead_in[n]))
            # (the turn's tokens before the fork are fed, not drawn)
            ep.set_slot_temperatures(state, slot, record.turn_temperatures([n], len(lead_in[n])))
        if not state["live"].any():
            break
        cache, state, _ = ee.run_chunk(ctx.model_cfg, params, *pages, cache, state, rng,
                                       **options)
        ended = np.flatnonzero((state["row"] >= 0) & ~state["live"])
        if not ended.size:
            continue
        rows = [fork_of[int(row)] for row in state["row"][ended]]
        turn_tok = np.full((len(ended), lim.turn_tokens), tok.pad_id, np.int32)
        turn_lp = np.zeros(turn_tok.shape, np.float32)   # sampled tokens' (the lead-in: 0)
        lengths = []
        for j, (slot, n) in enumerate(zip(ended, rows)):
            t = int(state["t"][slot])
            decoded += t
            turn = lead_in[n] + state["tokens"][slot, :t].tolist()
            turn_lp[j, len(lead_in[n]):len(turn)] = state["logps"][slot, :t]
            lead_in[n] = []   # the fork's own turn is whole now
            turn_tok[j, :len(turn)] = turn
            lengths.append(len(turn))
        kept, observations = record.turn_ended(rows, state["turn"][ended].tolist(), turn_tok,
                                               turn_lp, lengths)
        for j, (slot, n) in enumerate(zip(ended, rows)):
            obs = observations[j]
            if obs is None:
                ee.free(state, slot)
                continue
            ee.resume(state, slot, row=engine_row[n], lead=int(turn_tok[j, kept[j] - 1]),
                      observation=obs, cursor=int(record.length[n]) - len(obs),
                      turn=int(state["turn"][slot]) + 1, budget=record.budget(n))
            ep.set_slot_temperatures(state, slot, record.turn_temperatures([n]))
    prompt_ids = [tok.encode(p) for p in prompts]
    return record.result(prompts, prompt_ids, p_tok.shape[1]), decoded
