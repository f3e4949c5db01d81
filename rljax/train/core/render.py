"""Conversations as the model sees them: ``Renderer`` turns messages into prompt and
observation text (the tokenizer's chat template, or a plain transcript), ``trace_tokens``
lays a scripted episode out as a rollout would, and ``cut_after`` finds where a tool call's
closing text ends a turn.
"""
from __future__ import annotations

from typing import Sequence

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


def cut_after(tokenizer, ids: list[int], marker: str) -> int:
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
