"""Multi-turn (agentic) training with ``env.name`` set: episodes as parts of the GRPO and PPO
rollouts (the round source ``EpisodeRounds`` and the credit stages of ``credit_stages``), the
SFT warm-up on scripted episodes, and held-out evaluation of episodes.

    rollout = Rollout(ctx, iterator, rounds=EpisodeRounds(ctx),
                      stages=episode_credit.credit_stages(cfg))

An episode's training row is the prompt ++ the whole trajectory after it (model turns and
observations, ``env.max_total_tokens`` slots); ``loss_mask`` holds only the tokens the model
generated, so the policy loss, KL, entropy and importance ratios never see an observation
token. The reward of an episode is the sum of its environment rewards plus ``reward.names``
applied to the final model turn's text (an episode cut short by the turn or token limits has
no final answer: they see ""); GRPO normalises it over the G episodes of a prompt, PPO puts
it on the episode's last model token. With ``env.turn_discount`` each turn keeps its own reward
instead (``rljax.algorithms.turn_credit``).
Episodes start and end within one iteration, so a checkpoint never holds an open episode
(with ``rollout.partial`` they are carried across iterations: ``methods.episode_partial``).
"""
from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

from rljax.errors import UserError
from rljax.sampling import tree as tree_sampling
from rljax.train.core import episodes as ep
from rljax.train.core import evaluate, image_inputs, sampler
from rljax.train.core.partial import drawn_indices
from rljax.train.core.render import Renderer, trace_tokens
from rljax.train.core.verifier import verify
from rljax.train.core.rollout import Rollout, RoundSource, expand_fields, prompt_buckets


def turn_tokens(cfg) -> int:
    """Per-turn token cap: ``env.max_turn_tokens``, else ``rollout.max_new_tokens``."""
    return int(cfg.env.max_turn_tokens or cfg.rollout.max_new_tokens)


def make_renderer(cfg, tokenizer) -> Renderer:
    """Chat template when ``tokenizer.chat_template``; a tool call ends at its format's
    closing text when the environment has tools."""
    call_end = ""
    if cfg.env.tools:
        from rljax.envs import get_tool_format
        call_end = get_tool_format(cfg.env.tool_format).call_end
    return Renderer(tokenizer, chat=bool(cfg.tokenizer.chat_template), call_end=call_end)


def env_kwargs(cfg) -> dict:
    """Factory options: ``env.kwargs``, plus ``tools`` / ``tool_format`` when tools are set."""
    kw = {k: (v.to_dict() if hasattr(v, "to_dict") else v) for k, v in dict(cfg.env.kwargs).items()}
    if cfg.env.tools:
        kw.update(tools=tuple(cfg.env.tools), tool_format=cfg.env.tool_format)
    return kw


def make_envs(cfg, examples: list[dict], g: int) -> list:
    """G fresh environments per example, prompt-major."""
    from rljax.envs import make_env
    kw = env_kwargs(cfg)
    return [make_env(cfg.env.name, ex, **kw) for ex in examples for _ in range(g)]


def check_episode_prompts(ctx, examples: list[dict]) -> None:
    """UserError (one line, before anything compiles) when an episode's prompt as its
    environment renders it (the first messages: a scripted opponent's opening move, a tool
    list) is longer than ``data.max_prompt_length`` for one of ``examples``; otherwise the
    run would stop the first time such an example is drawn, maybe at its last evaluation."""
    cfg, tok = ctx.cfg, ctx.tokenizer
    renderer, limit = make_renderer(cfg, tok), int(cfg.data.max_prompt_length)
    for i, env in enumerate(make_envs(cfg, examples, 1)):
        n = len(tok.encode(renderer.prompt(env.reset())))
        if n > limit:
            raise UserError(f"env.name={cfg.env.name!r}: the prompt of held-out example {i} "
                            f"has {n} tokens as the environment renders it, over "
                            f"data.max_prompt_length={limit}; raise data.max_prompt_length")


def limits(cfg) -> ep.EpisodeLimits:
    e = cfg.env
    return ep.EpisodeLimits(turn_tokens=turn_tokens(cfg), chunk_tokens=int(e.max_obs_tokens) + 1,
                            max_turns=int(e.max_turns), max_total_tokens=int(e.max_total_tokens),
                            prompt_buckets=prompt_buckets(cfg.data.max_prompt_length))


def match_options(cfg, ctx) -> dict:
    """``selfplay.play``'s run options: renderer, limits, env kwargs."""
    return dict(renderer=make_renderer(cfg, ctx.tokenizer), limits=limits(cfg),
                env_kwargs=env_kwargs(cfg))


def play(ctx, params, examples: list[dict], rng, *, num_samples: int, temperature: float,
         top_k: int = 0, top_p: float = 1.0, weights=None, prefixes=None,
         temperatures=None, record_routes: bool = False, images=None, locations=None,
         tree: dict | None = None) -> dict:
    """``episodes.run_episodes`` for the run's environment on ``examples``, plus ``roles``
    int32 [R]: each episode's role key (``env.role_key``: game and seat, for RAE), -1 for an
    environment without one. ``weights``: in-flight weight updates (the slot engine's);
    ``prefixes``: hint token ids after each example's prompt (``guidance``);
    ``temperatures``: the schedule over each episode's model tokens, f32 [M], or None;
    ``record_routes``: every fed token's experts (routing replay).
    ``images`` (``image_inputs.ImageInputs``, a model with a vision tower): each example's
    images are embedded once and prefilled with its prompt; adds the round's image fields
    (``image_inputs.round_fields``: ``pixels`` [B, I, 3, S, S] per example, ``image_ok``,
    ``skipped_images``); ``locations``: the examples' ``file:line``, for its warnings.
    ``tree`` (``sampling.tree.options_from_config``): the first turns are a tree's leaves
    per group (``tree_episodes``)."""
    cfg = ctx.cfg
    envs = make_envs(cfg, examples, num_samples)
    pixels = None if images is None else images.pixels(examples, locations)
    engine, first = sampler.episode_engine(cfg, len(envs)), None
    if tree is not None:   # the tree's leaves are the first turns; the engine plays them on
        from rljax.train.methods import tree_episodes
        first = tree_episodes.FirstTurns(ctx, params, rng, tree, turn_tokens(cfg),
                                         pixels=pixels, images=images, weights=weights,
                                         temperature=temperature, top_k=top_k, top_p=top_p,
                                         temperatures=temperatures)
        engine = engine or ep.EngineOptions(slots=sampler.engine_slots(cfg, len(envs)),
                                            chunk_steps=int(cfg.rollout.chunk_steps))
    eps = ep.run_episodes(ctx.model_cfg, params, ctx.tokenizer, envs,
                          renderer=make_renderer(cfg, ctx.tokenizer), limits=limits(cfg),
                          rng=rng, num_samples=num_samples, temperature=temperature,
                          top_k=top_k, top_p=top_p, mesh=ctx.mesh,
                          engine=engine, weights=weights, first_turn=first,
                          prefixes=prefixes, temperatures=temperatures,
                          record_routes=record_routes,
                          image_embeds=None if pixels is None else images.embeds(params, pixels))
    if first is not None:   # the first turns' routes and versions: the tree's
        first.fill(eps)
    if pixels is not None:
        eps.update(image_inputs.round_fields(pixels, images.usable))
    eps["roles"] = np.array([getattr(env, "role_key", -1) for env in envs], np.int32)
    return eps


def env_metrics(eps_list: list[dict], prefix: str = "env") -> dict:
    """``env/turns_mean``, ``env/truncated_frac``, ``env/model_tokens_mean`` and the
    environments' counters (``rljax.envs.env_metrics``: tool calls, errors, timeouts,
    per-tool counts, ...) over every episode of ``eps_list``."""
    from rljax.envs import env_metrics as counter_metrics
    turns = np.concatenate([e["turns"] for e in eps_list])
    m = {f"{prefix}/turns_mean": float(turns.mean()),
         f"{prefix}/truncated_frac": float(np.concatenate(
             [e["truncated"] for e in eps_list]).mean()),
         f"{prefix}/model_tokens_mean": float(np.concatenate(
             [e["model_tokens"] for e in eps_list]).mean())}
    counters = [c for e in eps_list for c in e["counters"]]
    m.update(counter_metrics(counters, prefix=prefix))
    solved = np.array([c.get("solved", 0) > 0 for c in counters])
    if solved.any():  # games: turns to solve, over solved episodes only
        m[f"{prefix}/solved_turns_mean"] = float(turns[solved].mean())
    return m


def episode_correct(total_rewards: np.ndarray, counters: list[dict]) -> np.ndarray:
    """Whether each episode counts as correct, bool [R] from rewards f32 [R] and R counter
    dicts: its total reward is >= 1, or its environment reported it ``solved`` (a game under a
    turn penalty is solved with a reward below 1 after its first guess)."""
    solved = np.array([c.get("solved", 0) > 0 for c in counters], bool)
    return (np.asarray(total_rewards, np.float64) >= 1.0) | solved


def final_answers(eps: dict) -> list[str]:
    """The text reward functions judge: the final model turn of an episode the environment
    ended, and "" for a truncated one (its last turn was e.g. a tool call, not an answer:
    scoring it would pay a call whose arguments end with the right number)."""
    return ["" if cut else text for text, cut in zip(eps["final_turns"], eps["truncated"])]


def score(reward_fn, eps: dict, examples: list[dict], g: int):
    """Episode rewards f32 [R] (environment rewards + ``reward.names`` on the final answer,
    ``final_answers``), per-turn rewards f32 [R, T] (each step's environment reward on its
    turn, the answer's score on the last turn played) and the ``rewards.combine`` result
    (None without reward functions)."""
    total = eps["env_rewards"].astype(np.float32)
    per_turn = eps["turn_rewards"].astype(np.float32).copy()
    if reward_fn is None:
        return total, per_turn, None
    result = reward_fn(eps["prompts"], final_answers(eps),
                       completion_lengths=list(eps["model_tokens"]),
                       **expand_fields(examples, g))
    answer = np.asarray(result.total, np.float32)
    per_turn[np.arange(len(answer)), np.maximum(eps["turns"] - 1, 0)] += answer
    return total + answer, per_turn, result


class EpisodeRounds(RoundSource):
    """Multi-turn episodes as a rollout's round source (``core.parts.RoundSource``):
    ``Rollout(ctx, iterator, rounds=EpisodeRounds(ctx))`` for GRPO, ``RewardRollout`` for PPO.
    Each round plays G episodes of each prompt the iterator draws (``play``, or with
    ``env.selfplay`` the matches, ``selfplay.play``) and scores them (``score``); the batch
    layout is the single-completion one plus ``model_mask``, so dynamic sampling, TIS, KL and
    exact accumulation are the rollout's. The round's ``row_keys`` (``ROW_KEYS``) reach the
    batch rows for the credit stages (``credit_stages``); metrics add the episodes'
    (``env_metrics``) and ``time/env``. Episodes start and end within one round: no state
    (``episode_partial.EpisodePartialRounds`` carries them across rounds)."""

    ROW_KEYS = ("model_mask", "turn_rewards", "turn_ids", "turns", "roles")

    def __init__(self, ctx):
        self.ctx = ctx
        self.selfplay = ctx.cfg.env.selfplay.mode != "off"
        self.template, self.opponent = None, None
        if self.selfplay:   # other seats played by a model (rljax.train.methods.selfplay)
            from rljax import data as data_lib
            from rljax.train.methods import selfplay
            self.template = data_lib.make_template(ctx.data_config(), ctx.tokenizer)
            self.opponent = selfplay.load_opponent(ctx)

    def play_groups(self, params, examples, rng, g: int, weights=None,
                    prefixes=None, images=None, locations=None,
                    tree: dict | None = None) -> tuple[dict, list[dict]]:
        """This round's episodes and the example of each group: ``play``, or with
        ``env.selfplay`` the matches' (``selfplay.play``). ``weights``: the rollout's
        in-flight weight updates, or None; ``prefixes``: hints (``sample_hinted``);
        ``images``/``locations``: the rollout's image inputs (``play``); ``tree``: the tree
        of each group's first turns (default: the configured one, ``rollout.tree``, of ``g``
        leaves; the knapsack's groups pass their trees of one root)."""
        cfg = self.ctx.cfg
        r = cfg.rollout
        opts = dict(num_samples=g, temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
                    weights=weights)
        if tree is None:
            tree = tree_sampling.options_from_config(cfg.rollout.tree, g)
        if not self.selfplay:
            return play(self.ctx, params, examples, rng, prefixes=prefixes,
                        temperatures=sampler.rollout_temperatures(cfg), **opts,
                        record_routes=bool(cfg.algo.get("routing_replay")), images=images,
                        locations=locations, tree=tree), examples
        from rljax.train.methods import selfplay
        return selfplay.play(self.ctx, params, examples, rng, template=self.template,
                             opponent=self.opponent, prefixes=prefixes, tree=tree,
                             **match_options(cfg, self.ctx), **opts)

    def sample_round(self, rollout: Rollout, params, rng) -> dict:
        """The round of the iterator's next prompts: their episodes, scored with
        ``rollout``'s reward functions (failures reported to its monitor). Self-play: the
        round's ``indices`` give each learner seat's group its game's dataset index, so prompt
        selection observes every learner group of a game for that game."""
        g = rollout.g
        examples = next(rollout.iterator)
        drawn = drawn_indices(rollout.iterator, len(examples))
        t0 = time.perf_counter()
        eps, groups = self.play_groups(params, examples, rng, g, rollout.weights,
                                       images=rollout.images,
                                       locations=rollout._locations(examples))
        rnd = self.scored_round(rollout, eps, groups, time.perf_counter() - t0)
        if self.selfplay:   # a group per learner seat: each is observed as its game's
            rnd["indices"] = np.repeat(drawn, len(groups) // len(examples)).tolist()
        return rnd

    def sample_hinted(self, rollout: Rollout, params, rng, examples, prefixes) -> dict:
        """Hints (``guidance``): G new episodes of each of ``examples`` (failed groups), each
        group's first turn continuing its hint ``prefixes`` (token ids after the prompt; in
        self-play after the seat's first observation, in fresh matches: ``selfplay.play``):
        the same task, replayed from a fresh environment, scored as any round."""
        t0 = time.perf_counter()
        eps, groups = self.play_groups(params, examples, rng, rollout.g, rollout.weights,
                                       prefixes, images=rollout.images)
        return self.scored_round(rollout, eps, groups, time.perf_counter() - t0)

    def scored_round(self, rollout: Rollout, eps: dict, examples: list[dict],
                     time_play: float, g: int | None = None) -> dict:
        """The round dict of played episodes ``eps`` (``play``'s fields) of the groups of
        ``examples``, ``g`` episodes each (default ``algo.num_generations``), scored with
        ``rollout``'s reward functions; ``time_play``: seconds the episodes took, the
        environments' steps included."""
        g = rollout.g if g is None else g
        t1 = time.perf_counter()
        total, per_turn, result = score(rollout.reward_fn, eps, examples, g)
        scores = {"env": eps["env_rewards"]}
        counts: dict[str, list[int]] = {}
        if result is not None:
            rollout.monitor.observe(result)
            scores.update({k: np.asarray(v, np.float32) for k, v in result.per_function.items()})
            counts = {k: [result.errors[k], result.timeouts.get(k, 0), len(total)]
                      for k in result.per_function}
        rollout._maybe_print_completions(eps["prompts"], eps["transcripts"], total)
        return dict(tokens=eps["tokens"], logps=eps["logps"], mask=eps["mask"],
                    model_mask=eps["model_mask"], lengths=eps["lengths"],
                    # (a tree's rows: its shared segments once, ``tree_episodes``)
                    decoded=eps["decoded"] if "decoded" in eps else
                    eps["model_mask"].sum(axis=1).reshape(-1, g).sum(axis=1),
                    truncated=eps["truncated"], prompt_ids=eps["prompt_ids"][::g],
                    prompt_len=eps["prompt_len"], rewards=total, scores=scores,
                    turn_rewards=per_turn, turn_ids=eps["turn_ids"], turns=eps["turns"],
                    roles=eps["roles"], examples=examples,
                    # Self-play: each row's match's turns, every seat's (VinePPO's forks).
                    row_keys=self.ROW_KEYS + (("match_turns",) if "match_turns" in eps else ()),
                    errors=sum(c[0] for c in counts.values()), reward_counts=counts,
                    episodes=eps, time_sample=time_play - eps["time_env"],
                    time_env=eps["time_env"], time_reward=time.perf_counter() - t1,
                    **{k: eps[k] for k in ("slot_steps", "versions", "swaps", "routes", "pixels",
                                           "image_ok", "skipped_images", "match_turns")
                       if k in eps})

    def metrics(self, rounds, step: int) -> dict:
        m = env_metrics([r["episodes"] for r in rounds])
        m["time/env"] = sum(r["time_env"] for r in rounds)
        return m


# ----------------------------------------------------------------------------- SFT traces

def has_script(env_name: str) -> bool:
    """Whether the environment has scripted episodes (``trace_messages``)."""
    from rljax import envs
    return env_name in ("tool", "guess_number") or env_name in envs.GAME_ENVS


def trace_messages(cfg, example: dict, rng: np.random.Generator | None = None) -> list[dict]:
    """The environment's scripted, verified episode for ``example`` (``sft.env_traces``);
    ``rng`` draws the random guesses / moves of ``sft.trace_noise`` (``guess_number``, games)."""
    from rljax import envs
    kw = env_kwargs(cfg)
    if cfg.env.name == "tool":
        kw.pop("tools", None)   # the scripted episode uses the calculator
        return envs.trace_messages(example, kw.pop("tool_format", cfg.env.tool_format), **kw)
    if cfg.env.name == "guess_number":
        return envs.guess_trace(example, noise=float(cfg.sft.trace_noise), rng=rng, **kw)
    if cfg.env.name in envs.GAME_ENVS:
        return envs.game_trace(cfg.env.name, example, noise=float(cfg.sft.trace_noise), rng=rng,
                               **kw)
    raise ValueError(f"environment {cfg.env.name!r} has no scripted traces")


def guide_trace(cfg, example: dict, rng: np.random.Generator | None = None) -> list[dict]:
    """The scripted episode guidance (ReLIFT, hints, demonstrations) trains on: in self-play
    the example seat's, laid out as its match rows are (``selfplay.seat_trace``), else
    ``trace_messages``."""
    if cfg.env.selfplay.mode != "off":
        from rljax.train.methods.selfplay import seat_trace
        return seat_trace(cfg, example, env_kwargs(cfg), rng)[0]
    return trace_messages(cfg, example, rng)


def trace_batch(cfg, tokenizer, examples: list[dict], completion_len: int,
                rng: np.random.Generator | None = None, trace=trace_messages):
    """SFT rows from scripted episodes: ``(prompt ids per row, tokens int32 [B, C],
    trajectory mask bool [B, C], model mask bool [B, C], number cut)``; traces longer than
    ``completion_len`` are cut. ``rng``: for noisy traces (``trace_messages``); ``trace``:
    what writes an example's episode (``guide_trace`` for guidance)."""
    renderer = make_renderer(cfg, tokenizer)
    tok = np.full((len(examples), completion_len), tokenizer.pad_id, np.int32)
    mask = np.zeros(tok.shape, bool)
    model = np.zeros(tok.shape, bool)
    prompts, cut = [], 0
    for i, ex in enumerate(examples):
        prompt, ids, is_model = trace_tokens(tokenizer, renderer, trace(cfg, ex, rng))
        if len(ids) > completion_len:
            cut += 1
            ids, is_model = ids[:completion_len], is_model[:completion_len]
        prompts.append(prompt)
        tok[i, :len(ids)], mask[i, :len(ids)], model[i, :len(ids)] = ids, True, is_model
    return prompts, tok, mask, model, cut


def trace_sft_batch(cfg, tokenizer, examples: list[dict], completion_len: int,
                    rng: np.random.Generator | None = None, rows: int | None = None,
                    trace=trace_messages):
    """Prompt ++ scripted episode (``trace_batch``, written by ``trace``) in the shared
    sequence layout, the loss on the model's turns only: ``(batch, number cut)``. ``rows``
    pads the batch with rows that count for nothing (``loss_mask`` all False)."""
    from rljax.sampling import pad_to_bucket
    from rljax.train.core.buckets import build_sequences
    n = len(examples)
    rows = n if rows is None else rows
    prompts, c_tok, c_mask, model, cut = trace_batch(
        cfg, tokenizer, list(examples) + [examples[0]] * (rows - n), completion_len, rng, trace)
    p_tok, p_mask = pad_to_bucket(prompts, pad_id=tokenizer.pad_id,
                                  buckets=prompt_buckets(cfg.data.max_prompt_length))
    tokens, mask = build_sequences(p_tok, p_mask, c_tok, c_mask)
    model[n:] = False
    return {"tokens": tokens, "mask": mask, "loss_mask": model}, cut


def reference_turn(cfg, example: dict) -> str:
    """The first model turn of the environment's scripted episode for ``example`` (a tool
    call, a first guess or move): what an episode's hint is cut from (``guidance``)."""
    messages = guide_trace(cfg, example, np.random.default_rng(0))
    return next(m["content"] for m in messages if m["role"] == "assistant")


# ----------------------------------------------------------------------------- evaluation

def run_eval_batches(ctx, params, rng, examples: list[dict], *, num_samples: int,
                     temperature: float, batch_size: int) -> dict[str, Any]:
    """Episodes on held-out ``examples`` (batches of ``batch_size`` prompts, the last padded so
    shapes stay static). An episode is correct when its reward (environment rewards + the
    first reward function on the final turn) is >= 1 or its environment says it is solved
    (``episode_correct``). Returns ``{"correct": bool [E, n],
    "lengths", "truncated", "episodes": [...]}``."""
    cfg = ctx.cfg
    images = image_inputs.image_inputs(ctx)   # None: a text model
    correct, lengths, truncated, eps_list = [], [], [], []
    for i, start in enumerate(range(0, len(examples), batch_size)):
        chunk = examples[start:start + batch_size]
        padded = chunk + [chunk[-1]] * (batch_size - len(chunk))
        eps = play(ctx, params, padded, jax.random.fold_in(rng, i), num_samples=num_samples,
                   temperature=temperature,
                   top_k=cfg.rollout.top_k if temperature else 0,
                   top_p=cfg.rollout.top_p if temperature else 1.0, images=images)
        keep = len(chunk) * num_samples
        total = eps["env_rewards"][:keep].astype(np.float64)
        if cfg.reward.names:  # called as training calls rewards (fields it names, isolation)
            total = total + verify(ctx, eps["prompts"][:keep], final_answers(eps)[:keep],
                                   expand_fields(chunk, num_samples),
                                   eps["model_tokens"][:keep])
        correct.append(episode_correct(total, eps["counters"][:keep]))
        lengths.append(eps["lengths"][:keep])
        truncated.append(eps["truncated"][:keep])
        eps_list.append({k: (v[:keep] if isinstance(v, (np.ndarray, list)) else v)
                         for k, v in eps.items()})
    return {"correct": np.concatenate(correct).reshape(-1, num_samples),
            "lengths": np.concatenate(lengths), "truncated": np.concatenate(truncated),
            "episodes": eps_list}


def run_agent_eval(ctx, params, rng, examples: list[dict]) -> dict:
    """Held-out episodes (``env.name`` set): ``eval/accuracy`` (episode reward >= 1: the
    environment's rewards plus the first reward function on the final model turn; or the
    environment reported the episode ``solved``: ``agent.episode_correct``), pass@k,
    trajectory lengths, and the episodes' ``eval/turns_mean``, tool counts, ..."""
    e, t0 = ctx.cfg.eval, time.perf_counter()
    out = run_eval_batches(ctx, params, rng, examples, num_samples=e.num_samples,
                                 temperature=e.temperature, batch_size=e.batch_size)
    ok = out["correct"]
    m = {"eval/accuracy": float(ok.mean()), "eval/num_examples": int(ok.shape[0]),
         "eval/length_mean": float(out["lengths"].mean()),
         "eval/truncated_frac": float(out["truncated"].mean())}
    m.update({k: v for k, v in env_metrics(out["episodes"], prefix="eval").items()
              if k != "eval/truncated_frac"})
    m.update(evaluate.pass_at_k_metrics(ok))
    m["time/eval"] = time.perf_counter() - t0
    return m
