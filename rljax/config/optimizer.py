"""The optimizer: the ``optimizer`` section (rule, learning-rate schedule, clipping) and its
ranges."""
from __future__ import annotations

from typing import Any

from rljax.config.base import opt_float


def optimizer() -> dict[str, Any]:
    return dict(
        name="adamw",
        learning_rate=1e-6,
        critic_learning_rate=opt_float(),  # None = learning_rate
        schedule="constant",
        warmup_steps=0,
        min_lr_ratio=0.0,            # end of linear/cosine decay, as a fraction of the peak
        b1=0.9,
        b2=0.999,
        eps=1e-8,
        momentum=0.0,                # sgd only
        weight_decay=0.0,            # decoupled for adamw, L2 for adam/sgd; skips norms/biases
        max_grad_norm=1.0,           # global-norm clipping; 0 = off
        max_consecutive_nonfinite=5,  # stop after this many skipped (non-finite) steps in a row
    )


SECTIONS = {"optimizer": optimizer}

# Closed sets: each name is a branch of rljax.train.core.optim.
CHOICES = {
    "optimizer.name": ("adamw", "adam", "sgd"),
    "optimizer.schedule": ("constant", "linear", "cosine"),
}

RANGES = (
    ("optimizer.learning_rate", 1e-30, None), ("optimizer.warmup_steps", 0, None),
    ("optimizer.min_lr_ratio", 0.0, 1.0), ("optimizer.weight_decay", 0.0, None),
    ("optimizer.max_grad_norm", 0.0, None), ("optimizer.max_consecutive_nonfinite", 1, None),
)
# Optional numbers: None (derived) or above the bound.
ABOVE = (("optimizer.critic_learning_rate", 0),)
