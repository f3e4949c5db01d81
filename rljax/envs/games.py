"""Text games with feedback. ``guess_number``: find a secret integer from "higher"/"lower" hints.

    env = make_env("guess_number", {"prompt": "Guess my number from 1 to 100.", "secret": 37,
                                    "low": 1, "high": 100})
    env.reset()       # [user: the prompt]
    env.step("50")    # observation [user: "lower"], reward 0.0, not done
    env.step("37")    # reward 1.0, done

Examples come from the built-in task ``data.source="guess_number"`` (``GuessNumberTask``: the
secret is a pure function of seed, split and index). The guess is the last integer in the
model's turn. Reward 1.0 when solved, minus ``turn_penalty`` per guess before the right one (not
below 0); the episode's turn limit is the rollout's (``env.max_turns``), and ``max_guesses``
optionally ends it here too. ``guess_trace`` plays a bisection, for SFT warm-up.

The hint is the observation's whole content, so chat templates frame it. A plain transcript
(message contents one after another) reads better with a delimiter: ``hint_format=" {hint}\n"``
turns ``50lower25`` into ``50 lower\n25``.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

import numpy as np

from rljax.envs.base import Message, StepResult, register_env
from rljax.envs.tool_env import example_prompt

__all__ = ["GuessNumberEnv", "guess_trace", "parse_guess"]

_INTEGER = re.compile(r"-?\d+")


_HUGE = 10 ** 18  # a guess with more digits is clamped (int() refuses > 4300 digits)


def parse_guess(text: str) -> int | None:
    """The last integer in ``text`` (None if there is none), clamped to ``[-10**18, 10**18]``."""
    found = _INTEGER.findall(text)
    if not found:
        return None
    digits = found[-1].lstrip("-")
    if len(digits) > 18:
        return -_HUGE if found[-1].startswith("-") else _HUGE
    return int(found[-1])


class GuessNumberEnv:
    """One game. ``example``: ``secret`` (int), ``prompt`` or ``question`` (the user message),
    optional ``low``/``high`` (only for the trace's bisection)."""

    HIGHER, LOWER, INVALID = "higher", "lower", "Answer with a number."

    def __init__(self, example: Mapping[str, Any], turn_penalty: float = 0.0,
                 max_guesses: int | None = None, system_prompt: str | None = None,
                 hint_format: str = "{hint}"):
        if "secret" not in example:
            raise KeyError(f"guess_number needs an example with a 'secret'; got {sorted(example)}")
        self.example, self.secret = dict(example), int(example["secret"])
        if turn_penalty < 0 or (max_guesses is not None and max_guesses < 1):
            raise ValueError("guess_number: turn_penalty must be >= 0 and max_guesses >= 1")
        self.turn_penalty, self.max_guesses = float(turn_penalty), max_guesses
        if "{hint}" not in hint_format:
            raise ValueError(f"guess_number: hint_format must contain {{hint}}, got {hint_format!r}")
        self.system_prompt, self.hint_format = system_prompt, hint_format
        self.guesses = 0

    def reset(self) -> list[Message]:
        self.guesses = 0
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [{"role": "user", "content": example_prompt(self.example)}]

    def step(self, model_turn: str) -> StepResult:
        guess = parse_guess(model_turn)
        self.guesses += 1
        info = {"guesses": 1, "invalid_guesses": int(guess is None), "solved": 0}
        if guess == self.secret:
            reward = max(0.0, 1.0 - self.turn_penalty * (self.guesses - 1))
            return StepResult((), reward, True, {**info, "solved": 1})
        if self.max_guesses is not None and self.guesses >= self.max_guesses:
            return StepResult((), 0.0, True, info)
        hint = self.INVALID if guess is None else (self.HIGHER if self.secret > guess else self.LOWER)
        return StepResult([{"role": "user", "content": self.hint_format.format(hint=hint)}],
                          0.0, False, info)


def guess_trace(example: Mapping[str, Any], noise: float = 0.0,
                rng: np.random.Generator | None = None, **env_kwargs) -> list[Message]:
    """A solved game by bisection over ``[low, high]`` (the example's, default 1..100), played
    on the real environment: ``[user, assistant: guess, user: hint, ..., assistant: secret]``.

    ``noise`` in [0, 1]: each guess is, with this probability, a uniform random integer of the
    interval still consistent with the hints instead of its midpoint (drawn from ``rng``), so
    the game is still solved and never repeats a guess, only in more turns; a warm-up on such
    games sees states off the bisection tree and leaves RL turns to save."""
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"guess_trace: noise must be in [0, 1], got {noise}")
    if noise and rng is None:
        raise ValueError("guess_trace: noise > 0 needs an rng (numpy Generator)")
    env = GuessNumberEnv(example, **env_kwargs)
    low, high = int(example.get("low", 1)), int(example.get("high", 100))
    if not low <= env.secret <= high:
        raise ValueError(f"secret {env.secret} is outside [{low}, {high}]")
    messages = env.reset()
    while True:
        noisy = noise and rng.random() < noise
        guess = int(rng.integers(low, high + 1)) if noisy else (low + high) // 2
        result = env.step(str(guess))
        messages += [{"role": "assistant", "content": str(guess)}, *result.observation]
        if result.done:
            return messages
        higher = result.observation[0]["content"] == env.hint_format.format(hint=env.HIGHER)
        low, high = (guess + 1, high) if higher else (low, guess - 1)


register_env("guess_number", GuessNumberEnv)
