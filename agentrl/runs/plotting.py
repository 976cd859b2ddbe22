"""The end-of-run PNG: reward, validation score, KL, entropy and response length over steps.

Reads the records `Tracker.history` / `read_metrics_history` return. Drawn on a bare
`matplotlib.figure.Figure` with the Agg canvas, so it never opens a window and never changes
the pyplot backend of a notebook that imports agentrl.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

__all__ = ["plot_training_curves"]

_STEP_KEY = "training/global_step"
# (panel title, y label, metric keys or a key prefix ending in '/*')
_PANELS = (
    ("Reward", "critic/full-score/mean", ("critic/full-score/mean",)),
    ("Validation score", "val/test_score", ("val/test_score/*",)),
    ("KL", "KL", ("actor/kl_loss", "actor/ppo_kl")),
    ("Entropy", "actor/entropy", ("actor/entropy",)),
    ("Response length", "tokens (mean)", ("response_length/mean",)),
)


def _series(history: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for record in history:
        value = record.get(key)
        if value is None or not math.isfinite(value):
            continue
        xs.append(record.get(_STEP_KEY, record.get("step")))
        ys.append(value)
    return xs, ys


def _expand(history: Sequence[dict[str, Any]], keys: Sequence[str]) -> list[str]:
    found: list[str] = []
    for key in keys:
        if key.endswith("/*"):
            prefix = key[:-1]
            found += sorted({k for rec in history for k in rec if k.startswith(prefix)})
        elif any(key in rec for rec in history):
            found.append(key)
    return found


def plot_training_curves(history: Sequence[dict[str, Any]], path: Path, *, title: str | None = None) -> Path:
    """Write a PNG of the run's curves to `path` and return it.

    The x axis is `training/global_step` (or the record's `step`). A panel whose metrics were
    never logged says "not logged" instead of disappearing, so a missing metric is noticed.
    The sixth panel summarises first and last values.
    """
    fig = Figure(figsize=(13, 7.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 3).flatten()
    summary = []
    for ax, (panel, ylabel, keys) in zip(axes, _PANELS, strict=False):
        ax.set_title(panel, fontsize=11)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel, fontsize=9)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        plotted = 0
        for key in _expand(history, keys):
            xs, ys = _series(history, key)
            if not xs:
                continue
            marker = "o" if len(xs) <= 30 else None
            label = key.removeprefix("val/test_score/") if panel == "Validation score" else key
            ax.plot(xs, ys, marker=marker, markersize=3.5, linewidth=1.5, label=label)
            summary.append(f"{label}: {ys[0]:.4g} -> {ys[-1]:.4g}")
            plotted += 1
        if plotted:
            if plotted > 1 or panel in ("Validation score", "KL"):
                ax.legend(fontsize=8, loc="best")
        else:
            ax.text(
                0.5,
                0.5,
                "not logged\n" + ", ".join(keys),
                ha="center",
                va="center",
                transform=ax.transAxes,
                fontsize=13,
                color="0.45",
            )
            ax.set_xticks([])
            ax.set_yticks([])
    steps = [rec.get(_STEP_KEY, rec.get("step")) for rec in history]
    steps = [s for s in steps if s is not None]
    info = axes[-1]
    info.axis("off")
    header = f"steps {min(steps)}-{max(steps)} ({len(steps)} logged)" if steps else "no steps logged"
    info.text(
        0.0,
        1.0,
        "\n".join([header, "", *summary]),
        va="top",
        ha="left",
        family="monospace",
        fontsize=9,
        transform=info.transAxes,
    )
    if title:
        fig.suptitle(title, fontsize=13)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
