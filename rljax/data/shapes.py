"""``shapes``: a synthetic visual task no text model can solve. Each example is a small RGB
image of coloured squares on black and a question about it whose answer is one number:

* ``count``: "How many shapes?" (1 .. ``max_shapes``);
* ``compare``: "More red or blue? 1=red 2=blue" (the picture holds a different number of
  red and blue squares, and maybe others);
* ``locate``: "Where? 1=TL 2=TR 3=BL 4=BR" (one square; top/bottom, left/right quadrant).

The prompt text is ``image_tokens`` copies of ``image_token`` (the model's image placeholder,
one per embedding of the image), a newline and the question; the question alone does not
determine the answer. Examples are a pure function of ``(seed, split, index)``; the image is
a uint8 ``[S, S, 3]`` array in the example's ``images`` field. ``blank=True`` draws every
image black: the text-only twin of the task (the same questions and answers).
"""
from __future__ import annotations

import numpy as np

from rljax.data.splits import _belongs_to, _rng

COLOURS = {"red": (230, 40, 40), "green": (40, 200, 60), "blue": (50, 80, 240),
           "yellow": (235, 220, 40)}
KINDS = ("count", "compare", "locate")
QUESTIONS = {"count": "How many shapes?",
             "compare": "More red or blue? 1=red 2=blue",
             "locate": "Where? 1=TL 2=TR 3=BL 4=BR"}


class ShapesTask:
    """Coloured squares on a ``grid x grid`` board of ``image_size`` pixels (see the module
    docstring); ``kinds`` a comma-separated subset of count, compare, locate."""

    name = "shapes"

    def __init__(self, kinds: str = "count", max_shapes: int = 4, image_size: int = 32,
                 grid: int = 4, image_tokens: int = 4, image_token: str = "@",
                 blank: bool = False, seed: int = 0):
        self.kinds = tuple(k.strip() for k in kinds.split(",") if k.strip())
        if not self.kinds or set(self.kinds) - set(KINDS):
            raise ValueError(f"shapes: kinds must be a subset of {KINDS}, got {kinds!r}")
        if not 2 <= max_shapes <= grid * grid or image_size % grid:
            raise ValueError(f"shapes: need 2 <= max_shapes <= grid**2 and grid dividing "
                             f"image_size, got {max_shapes}, {grid}, {image_size}")
        self.max_shapes, self.image_size, self.grid = int(max_shapes), int(image_size), int(grid)
        self.prefix = image_token * int(image_tokens) + "\n"
        self.seed, self.blank = int(seed), bool(blank)

    def _draw(self, cells, colours) -> np.ndarray:
        s, c = self.image_size, self.image_size // self.grid
        image = np.zeros((s, s, 3), np.uint8)
        if self.blank:   # the text-only twin: the same prompts and answers, nothing to see
            return image
        pad = max(1, c // 8)
        for cell, colour in zip(cells, colours):
            r, q = divmod(int(cell), self.grid)
            image[r * c + pad:(r + 1) * c - pad, q * c + pad:(q + 1) * c - pad] = COLOURS[colour]
        return image

    def _scene(self, kind: str, rng: np.random.Generator):
        names = list(COLOURS)
        if kind == "count":
            n = int(rng.integers(1, self.max_shapes + 1))
            colours = [names[int(i)] for i in rng.integers(0, len(names), n)]
            return colours, n
        if kind == "locate":
            return [names[int(rng.integers(len(names)))]], None
        red, blue = rng.choice(np.arange(0, self.max_shapes), 2, replace=False)
        if red + blue == 0 or red + blue > self.max_shapes:
            red, blue = (1, 0) if rng.random() < 0.5 else (0, 1)
        others = int(rng.integers(0, self.max_shapes - red - blue + 1))
        colours = ["red"] * int(red) + ["blue"] * int(blue) + \
            [names[int(i)] for i in rng.choice([1, 3], others)]
        return colours, 1 if red > blue else 2

    def example(self, index: int, split: str = "train") -> dict:
        rng = _rng(self.seed, split, index)
        while True:
            kind = self.kinds[int(rng.integers(len(self.kinds)))]
            colours, answer = self._scene(kind, rng)
            cells = rng.choice(self.grid * self.grid, len(colours), replace=False)
            if kind == "locate":
                r, q = divmod(int(cells[0]), self.grid)
                half = self.grid // 2
                answer = 1 + (r >= half) * 2 + (q >= half)
            key = f"{kind}:{sorted(zip(cells.tolist(), colours))}"
            if _belongs_to(split, key, self.seed):
                return {"question": self.prefix + QUESTIONS[kind], "answer": str(answer),
                        "images": self._draw(cells, colours), "kind": kind}

    def solution(self, example: dict) -> str:
        return str(example["answer"])
