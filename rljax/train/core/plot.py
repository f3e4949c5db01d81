"""``rljax plot``: learning curves from a run's ``metrics.jsonl`` as one PNG.

One subplot per numeric key, in a grid, most useful keys first (rewards, eval, losses, KL,
lengths, then the rest alphabetically). Noisy per-step series get a moving average on top of
the raw points; sparse series (evaluations) are drawn with markers. Series that never change
(``train/skipped_total`` at 0, an unused clip fraction) get no panel: they are listed with their
value under the title instead.
"""
from __future__ import annotations

import math
import os

from rljax.errors import UserError
from rljax.train.core.metrics import METRICS_FILE, numeric_series, read_metrics

# Key substrings in display order; keys matching none come after, alphabetically.
ORDER = ("reward", "eval/", "loss", "kl", "entropy", "clip", "length", "grad_norm", "lr")
MAX_PANELS = 24
NCOLS = 3


def _rank(key: str) -> tuple[int, str]:
    for i, tag in enumerate(ORDER):
        if tag in key:
            return i, key
    return len(ORDER), key


def _moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def panels(series: dict[str, tuple[list, list]]) -> tuple[list[str], dict[str, float]]:
    """(keys to draw, most useful first; {key: value} of the flat series left out)."""
    keys, flat = [], {}
    for key in sorted(series, key=_rank):
        values = series[key][1]
        if min(values) == max(values) and (len(values) > 1 or values[0] == 0):
            flat[key] = values[0]
        else:
            keys.append(key)
    return keys[:MAX_PANELS], flat


def plot_metrics(path: str, out: str | None = None) -> str:
    """Draws ``path`` (workdir or metrics.jsonl) to ``out`` (default ``<dir>/curves.png``).

    Returns the PNG's path. Raises UserError when there is nothing to plot.
    """
    file = os.path.join(path, METRICS_FILE) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise UserError(f"no {METRICS_FILE} found at {path}")
    series = numeric_series(read_metrics(file))
    series = {k: v for k, v in series.items() if not k.startswith("time/") and v[0]}
    if not series:
        raise UserError(f"{file} has no numeric metrics to plot")
    keys, flat = panels(series)
    if not keys:
        raise UserError(f"{file}: every metric is constant; nothing to plot "
                        f"({', '.join(f'{k}={v:g}' for k, v in flat.items())})")
    out = out or os.path.join(os.path.dirname(os.path.abspath(file)), "curves.png")

    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    ncols = min(NCOLS, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 2.8 * nrows), squeeze=False,
                             layout="constrained")  # leaves room for the title
    for ax, key in zip(axes.flat, keys):
        steps, values = series[key]
        if len(steps) <= 30:
            ax.plot(steps, values, marker="o", markersize=3, linewidth=1)
        else:
            ax.plot(steps, values, linewidth=0.8, alpha=0.35)
            ax.plot(steps, _moving_average(values, max(len(values) // 30, 2)), linewidth=1.5)
        ax.set_title(key, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    title = os.path.basename(os.path.dirname(os.path.abspath(file)))
    if flat:
        items = [f"{k}={v:g}" for k, v in flat.items()]
        lines = [", ".join(items[i:i + 4]) for i in range(0, len(items), 4)]
        title += "\nconstant, not drawn: " + "\n".join(lines)
    fig.suptitle(title, fontsize=10 if not flat else 8)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
