"""The end-of-run console summary: where the held-out results went (the first or labelled
eval -> the last), where the metrics, curves and checkpoints are, and the commands that use
them (``run_summary``)."""
from __future__ import annotations

from typing import Mapping

from rljax.train.core import paths
from rljax.train.core.metrics import METRICS_FILE


def compared_evals(evals: list[tuple[int, dict]], key: str,
                   labels: Mapping[int, str] | None = None) -> list[tuple[int, float, str]]:
    """The ``(step, value, label)`` points the summary compares for ``key``, oldest first: the
    evals at the steps ``labels`` names (global step -> what it is: "before training", "end of
    the sft warm-up", "end of grpo"), or the first eval when none of them has one, then the
    last eval. Unlabelled points are called "first eval" / "last eval"."""
    labels = dict(labels or {})
    points = [(step, float(m[key])) for step, m in evals
              if isinstance(m.get(key), (int, float)) and not isinstance(m.get(key), bool)]
    if not points:
        return []
    last = points[-1]
    out = [p for p in points[:-1] if p[0] in labels] or points[:1]
    if out[-1] != last:
        out.append(last)
    fallback = {out[0][0]: "first eval", last[0]: "last eval"}
    return [(step, value, labels.get(step, fallback.get(step, ""))) for step, value in out]


def run_summary(workdir: str, evals: list[tuple[int, dict]], checkpoint_steps: list[int],
                checkpoint_dir: str, max_to_keep: int, tensorboard: bool = True,
                labels: Mapping[int, str] | None = None) -> str:
    """The end-of-run console summary: held-out results (``compared_evals``: where the run
    started -> its last eval, each labelled with its step and what it is), where the metrics,
    curves and checkpoints are, and the commands that use them."""
    lines = ["rljax: done."]
    for key in ("eval/accuracy", "eval/pref_accuracy"):
        points = compared_evals(evals, key, labels)
        if points:
            lines.append(f"  {key}: " + " -> ".join(
                f"{value:.4g} (step {step}{', ' + label if label else ''})"
                for step, value, label in points))
    tb = f"; TensorBoard: tensorboard --logdir {workdir}" if tensorboard else ""
    lines.append(f"  metrics:     {paths.join(workdir, METRICS_FILE)}{tb}")
    lines.append(f"  curves:      rljax plot {workdir}")
    kept = ", ".join(map(str, checkpoint_steps)) or "none"
    lines.append(f"  checkpoints: {checkpoint_dir} (steps {kept}; the last {max_to_keep} are "
                 "kept, checkpoint.max_to_keep)")
    lines.append(f"  next:        rljax eval --workdir {workdir}  |  rljax sample --workdir "
                 f"{workdir} --prompt '...'  |  rljax export --workdir {workdir} --out DIR")
    return "\n".join(lines)
