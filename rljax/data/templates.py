"""Prompt templates: ``{field}`` format strings, optionally wrapped in the tokenizer's chat template.

``PromptTemplate("Question: {question}\\nAnswer:")`` renders an example dict to prompt text.
With ``chat=True`` the rendered text becomes the user message (after an optional system
message) and the tokenizer's chat template produces the final prompt, ending with the
assistant turn's opening so the model answers next.
"""
from __future__ import annotations

import string
from typing import Mapping

__all__ = ["PromptTemplate", "DEFAULT_TEMPLATE"]

DEFAULT_TEMPLATE = "{question}"


class PromptTemplate:
    """Renders example dicts to prompt strings."""

    def __init__(self, template: str = DEFAULT_TEMPLATE, chat: bool = False,
                 system_prompt: str | None = None, tokenizer=None):
        self.template, self.chat, self.system_prompt, self.tokenizer = template, chat, system_prompt, tokenizer
        # Field names the template uses, so a missing one is reported up front by name. A
        # function (user code: example dict -> prompt text) checks its own fields.
        self.fields = [] if callable(template) else sorted(
            {name for _, name, _, _ in string.Formatter().parse(template) if name})
        if chat:
            if tokenizer is None:
                raise ValueError("chat=True needs a tokenizer (its chat template renders the prompt)")
            if not tokenizer.has_chat_template:
                raise ValueError(f"chat=True but {type(tokenizer).__name__} has no chat template")
        elif system_prompt is not None:
            raise ValueError("system_prompt needs chat=True (plain templates can include it as text)")

    def messages(self, example: Mapping) -> list[dict]:
        """The chat messages for ``example`` (system message first when configured)."""
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return msgs + [{"role": "user", "content": self.format(example)}]

    def format(self, example: Mapping) -> str:
        """The plain template filled with the example's fields."""
        if callable(self.template):
            from rljax import usercode
            from rljax.errors import UserError

            text = usercode.call(self.template, "data.template", dict(example))
            if not isinstance(text, str):
                raise UserError(f"data.template: {self.template.__name__} returned "
                                         f"{type(text).__name__}, not the prompt text")
            return text
        missing = [f for f in self.fields if f not in example]
        if missing:
            raise KeyError(f"prompt template {self.template!r} needs field(s) {missing}; "
                           f"the example has {sorted(example)}")
        return self.template.format(**example)

    def __call__(self, example: Mapping) -> str:
        if not self.chat:
            return self.format(example)
        return self.tokenizer.apply_chat_template(self.messages(example), add_generation_prompt=True)
