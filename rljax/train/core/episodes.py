"""Multi-turn episodes on the host: render messages to text, run the turn loop around the
on-device sampler (``rljax.sampling.multiturn``), step the environments, and lay the trajectories
out for training.

    eps = run_episodes(model_cfg, params, tokenizer, envs, renderer=Renderer(tok, chat=False,
                       call_end="</call>"), limits=EpisodeLimits(...), rng=key, num_samples=G)
    eps["tokens"]      int32 [R, M]  the trajectory after the prompt: model turns and
                                     observations, compact, right-padded (M = max_total_tokens)
    eps["mask"]        bool  [R, M]  real tokens (attention)
    eps["model_mask"]  bool  [R, M]  tokens the model generated (the ones that train)
    eps["logps"]       f32   [R, M]  sampler log-probs of model tokens, 0 elsewhere
    eps["turn_ids"]    int32 [R, M]  the model turn (0, 1, ...) each model token belongs to,
                                     -1 elsewhere (observations, padding)
    eps["turn_rewards"] f32  [R, T]  each turn's environment reward (T = max_turns; 0 for
                                     turns not played)

A turn ends on EOS, a tool call's closing text (``renderer.call_end``: stopped on device when it
tokenizes to a fixed id sequence, and always cut on the host after its first occurrence in the
decoded text, the tokens after it dropped), the per-turn cap, or the episode's token budget.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from rljax import sampling
from rljax.sampling import multiturn

_SENTINEL = "\x00RLJAX_TURN\x00"


class Renderer:
    """Messages -> text. ``chat``: the tokenizer's chat template (the observation chunk is what
    the template adds after an assistant turn: the turn's closing, the new messages, the next
    assistant header); otherwise a plain transcript (message contents verbatim, one after
    another: the environment's plain format delimits its own text)."""

    def __init__(self, tokenizer, *, chat: bool, call_end: str = ""):
        self.tokenizer, self.chat, self.call_end = tokenizer, bool(chat), call_end
        self._closer = ""
        if self.chat:
            t = tokenizer.apply_chat_template(
                [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}],
                add_generation_prompt=False)
            self._closer = t[t.index(_SENTINEL) + len(_SENTINEL):]

    def prompt(self, messages: Sequence[dict], model_turn: bool = True) -> str:
        """The prompt text. ``model_turn=False``: the model does not answer it directly (a
        seat that moves second): no assistant header, its first observation follows."""
        if self.chat:
            return self.tokenizer.apply_chat_template(list(messages),
                                                      add_generation_prompt=model_turn)
        return "".join(m["content"] for m in messages)

    def observation(self, messages: Sequence[dict], turn_ended_with_eos: bool,
                    after_prompt: bool = False) -> str:
        """Text appended after a model turn: (closing of the turn +) messages (+ next header).
        ``after_prompt``: appended to a ``prompt(..., model_turn=False)`` instead, which has
        no turn to close."""
        if not self.chat:
            return "".join(m["content"] for m in messages)
        head = [{"role": "user", "content": "x"}]
        if not after_prompt:
            head.append({"role": "assistant", "content": "y"})
        before = self.tokenizer.apply_chat_template(head, add_generation_prompt=False)
        after = self.tokenizer.apply_chat_template(head + list(messages),
                                                   add_generation_prompt=True)
        if not after.startswith(before):
            raise ValueError("chat template: rendering more messages changed the earlier text; "
                             "cannot render observations incrementally")
        if after_prompt:
            return after[len(before):]
        closer = self._closer
        eos = self.tokenizer.decode([self.tokenizer.eos_id], skip_special=False)
        if turn_ended_with_eos and eos and closer.startswith(eos):
            closer = closer[len(eos):]   # the model already closed its turn
        return closer + after[len(before):]


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
    """turn_tokens: per-turn cap N; chunk_tokens: chunk width O, the observation's tokens
    plus one (a longer observation ends the episode, truncated); max_turns; max_total_tokens: the trajectory's
    length after the prompt (model + observation tokens); prompt_buckets: allowed prompt
    widths."""
    turn_tokens: int
    chunk_tokens: int
    max_turns: int
    max_total_tokens: int
    prompt_buckets: tuple[int, ...] = sampling.DEFAULT_BUCKETS


def _cut_after(tokenizer, ids: list[int], marker: str) -> int:
    """Number of leading tokens of ``ids`` whose decoded text first contains ``marker``
    (``len(ids)`` when it never does). Binary search: containment grows with the prefix."""
    if not marker or marker not in tokenizer.decode(ids):
        return len(ids)
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if marker in tokenizer.decode(ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _count(info: Any, totals: dict) -> None:
    """Adds a step's numeric ``info`` counters into an episode's totals."""
    for k, v in dict(info or {}).items():
        if isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool):
            totals[k] = totals.get(k, 0) + v


def run_episodes(model_cfg, params, tokenizer, envs: Sequence[Any], *, renderer: Renderer,
                 limits: EpisodeLimits, rng: jax.Array, num_samples: int = 1,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, mesh=None,
                 step_all: Callable | None = None) -> dict:
    """Runs ``len(envs)`` episodes together (prompt-major groups of ``num_samples`` rows: the
    G environments of a group must reset to the same messages, their prompt is prefilled once).

    Returns a dict of numpy arrays (R rows): ``tokens``, ``mask``, ``model_mask``, ``logps``
    [R, M] (see the module docstring), ``lengths`` int32 [R] (real trajectory tokens),
    ``model_tokens`` int32 [R], ``truncated`` bool [R] (turns, tokens or chunk width ran out
    before the environment said done), ``turns`` int32 [R], ``env_rewards`` f32 [R] (sum of
    the turns' rewards), ``turn_rewards`` f32 [R, T] and ``turn_ids`` int32 [R, M] (see the
    module docstring),
    ``prompt_ids`` (list of id lists, one per row), ``prompt_len`` (bucket P), ``prompts`` /
    ``final_turns`` / ``transcripts`` (lists of str), ``counters`` (one dict per episode: the
    sum of its steps' ``info`` counters), ``info`` (their totals), ``time_env``.

    ``step_all(envs, turns) -> results`` steps the active episodes (default
    ``rljax.envs.step_all``: concurrently, in threads).
    """
    if step_all is None:
        from rljax.envs import step_all
    r, g = len(envs), int(num_samples)
    if r % g:
        raise ValueError(f"{r} environments are not groups of {g}")
    n, o, t_max, m_max = (limits.turn_tokens, limits.chunk_tokens, limits.max_turns,
                          limits.max_total_tokens)
    prompts = [renderer.prompt(env.reset()) for env in envs]
    if any(prompts[i] != prompts[i - i % g] for i in range(r)):
        raise ValueError("the environments of one group reset to different prompts")
    prompt_ids = [tokenizer.encode(p) for p in prompts]
    p_tok, p_mask = sampling.pad_to_bucket(prompt_ids[::g], pad_id=tokenizer.pad_id,
                                           buckets=limits.prompt_buckets)
    layout = multiturn.SlotLayout(prompt_len=p_tok.shape[1], turn_len=n, chunk_len=o,
                                  max_turns=t_max)
    options = dict(temperature=temperature, top_k=top_k, top_p=top_p, eos_id=tokenizer.eos_id,
                   pad_id=tokenizer.pad_id, mesh=mesh,
                   stop_sequences=multiturn.stop_sequences_of(
                       tokenizer, [renderer.call_end] if renderer.call_end else []))

    tokens = np.full((r, m_max), tokenizer.pad_id, np.int32)
    model_mask = np.zeros((r, m_max), bool)
    turn_ids = np.full((r, m_max), -1, np.int32)
    logps = np.zeros((r, m_max), np.float32)
    length = np.zeros(r, np.int64)                      # trajectory tokens so far
    cache = multiturn.start(model_cfg, params, p_tok, p_mask, layout=layout, num_samples=g,
                            mesh=mesh)
    chunk, chunk_mask, slot_mask = multiturn.first_chunk(p_tok, p_mask, layout, g)
    active = np.ones(r, bool)
    done = np.zeros(r, bool)                            # the environment ended the episode
    turns = np.zeros(r, np.int32)
    env_rewards = np.zeros(r, np.float32)
    turn_rewards = np.zeros((r, t_max), np.float32)
    final_turns = [""] * r
    counters: list[dict] = [{} for _ in range(r)]
    time_env = 0.0
    for turn in range(t_max):
        budget = np.where(active, np.minimum(n, m_max - length), 0).astype(np.int32)
        cache, out = multiturn.turn(model_cfg, params, cache, slot_mask, chunk, chunk_mask,
                                    turn=turn, active=active, budget=budget,
                                    rng=jax.random.fold_in(rng, turn), layout=layout, **options)
        out_tok, out_lp, out_len = (np.asarray(x) for x in jax.device_get(
            (out.tokens, out.logps, out.lengths)))
        rows = np.flatnonzero(active)
        texts, kept = [], np.zeros(r, np.int64)
        for i in rows:
            ids = out_tok[i, :out_len[i]].tolist()
            k = _cut_after(tokenizer, ids, renderer.call_end)
            kept[i] = k
            tokens[i, length[i]:length[i] + k] = ids[:k]
            model_mask[i, length[i]:length[i] + k] = True
            turn_ids[i, length[i]:length[i] + k] = turn
            logps[i, length[i]:length[i] + k] = out_lp[i, :k]
            texts.append(tokenizer.decode(ids[:k]))
            final_turns[i] = texts[-1]
        length += kept
        turns[rows] += 1
        slot_mask |= multiturn.kept_slots(layout, turn, kept)
        t0 = time.perf_counter()
        results = step_all([envs[i] for i in rows], texts)
        time_env += time.perf_counter() - t0
        chunk = np.full((r, o), tokenizer.pad_id, np.int32)
        chunk_mask = np.zeros((r, o), bool)
        for i, res in zip(rows, results):
            env_rewards[i] += float(res.reward)
            turn_rewards[i, turn] = float(res.reward)
            _count(res.info, counters[i])
            if res.done:
                active[i], done[i] = False, True
                continue
            last = int(out_tok[i, kept[i] - 1])
            ids = tokenizer.encode(renderer.observation(res.observation,
                                                        last == tokenizer.eos_id))
            room = m_max - length[i] - len(ids)
            if turn + 1 >= t_max or not ids or len(ids) >= o or room < 1:
                active[i] = False          # out of turns / chunk width / tokens: truncated
                continue
            # The turn's last token has no keys/values yet: it leads the chunk.
            chunk[i, o - len(ids) - 1:] = [last] + ids
            chunk_mask[i, o - len(ids) - 1:] = True
            tokens[i, length[i]:length[i] + len(ids)] = ids
            length[i] += len(ids)
        if not active.any():
            break
        if turn + 1 < t_max:
            start = layout.chunk_start(turn + 1)
            slot_mask[:, start:start + o] = chunk_mask
    mask = np.arange(m_max)[None, :] < length[:, None]
    transcripts = [tokenizer.decode(tokens[i, :length[i]].tolist()) for i in range(r)]
    info: dict[str, float] = {}
    for c in counters:
        _count(c, info)
    return dict(tokens=tokens, mask=mask, model_mask=model_mask, logps=logps,
                lengths=length.astype(np.int32), model_tokens=model_mask.sum(1).astype(np.int32),
                truncated=~done, turns=turns, env_rewards=env_rewards,
                turn_rewards=turn_rewards, turn_ids=turn_ids,
                prompt_ids=[list(map(int, ids)) for ids in prompt_ids],
                prompt_len=int(layout.prompt_len), prompts=prompts, final_turns=final_turns,
                transcripts=transcripts, counters=counters, info=info, time_env=time_env)


def trace_tokens(tokenizer, renderer: Renderer, messages: Sequence[dict]):
    """A scripted episode (``[system?, user, assistant, observation..., assistant, ...]``) as a
    rollout would lay it out: ``(prompt ids, trajectory ids, model mask)`` (lists).

    A model turn that ends with the tool call's closing text ends there (as the sampler stops
    it); any other model turn ends with EOS. Observation messages after a turn are rendered as
    the rollout renders them (context: not in the model mask). Messages after the first user
    message and before the first assistant one are a first observation (a game seat that
    moves second): the prompt ends with that user message, as the rollout's does.
    """
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None:
        raise ValueError("a trace needs at least one assistant message")
    user = next((i for i, m in enumerate(messages[:first]) if m["role"] == "user"), first - 1)
    waits = user + 1 < first
    prompt = tokenizer.encode(renderer.prompt(messages[:user + 1], model_turn=not waits))
    ids: list[int] = []
    model: list[bool] = []
    if waits:
        ids = tokenizer.encode(renderer.observation(messages[user + 1:first], False,
                                                    after_prompt=True))
        model = [False] * len(ids)
    i = first
    while i < len(messages):
        text = messages[i]["content"]
        turn = tokenizer.encode(text)
        eos = not (renderer.call_end and text.endswith(renderer.call_end))
        turn += [tokenizer.eos_id] if eos else []
        ids += turn
        model += [True] * len(turn)
        j = i + 1
        while j < len(messages) and messages[j]["role"] != "assistant":
            j += 1
        if j > i + 1:
            obs = tokenizer.encode(renderer.observation(messages[i + 1:j], eos))
            ids += obs
            model += [False] * len(obs)
        i = j
    return prompt, ids, model
