"""The PNG every training run writes: ``curves.png``, its training loss, validation metric and (for
an MoE model) each weighted aux term against the step, drawn from the run's ``log.csv`` (so a
resumed run draws the same figure)."""

from __future__ import annotations

import csv
import io
import math
import os
from pathlib import Path

from ..io.atomic import atomic_write_png

__all__ = ["CURVES_NAME", "plot_log"]

#: the file name of the figure in a run directory
CURVES_NAME = "curves.png"


def _column(rows: list[dict[str, str]], name: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of the rows whose ``name`` holds a finite number."""
    steps, values = [], []
    for row in rows:
        try:
            step, value = int(row["step"]), float(row.get(name) or "nan")
        except (KeyError, TypeError, ValueError):
            continue
        if math.isfinite(value):
            steps.append(step)
            values.append(value)
    return steps, values


def plot_log(log: str | os.PathLike, path: str | os.PathLike, metric: str, title: str = "") -> Path | None:
    """Draw ``log`` (a run's ``log.csv``: ``step``, ``loss``, ``val_{metric}``) into ``path`` (PNG,
    written atomically): the training loss on the left, the validation ``metric`` on the right.
    ``None`` (nothing written) when the log holds no row."""
    log = Path(log)
    rows = list(csv.DictReader(io.StringIO(log.read_text(encoding="utf-8")))) if log.is_file() else []
    if not rows:
        return None
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no backend switch

    terms = [k for k in rows[0] if k.startswith("aux_") and k != "aux_loss"]
    fig = Figure(figsize=(13.5 if terms else 9, 3.6))
    axes = fig.subplots(1, 3 if terms else 2)
    left, right = axes[0], axes[1]
    steps, loss = _column(rows, "loss")
    left.plot(steps, loss, linewidth=1)
    left.set_xlabel("step")
    left.set_ylabel("training loss (task)")
    val_steps, val = _column(rows, f"val_{metric}")
    right.plot(val_steps, val, marker="o", markersize=3)
    right.set_xlabel("step")
    right.set_ylabel(f"validation {metric}")
    if terms:  # the weighted aux terms one by one (CompeteSMoE (2025) App. D.2 Fig. 7)
        for name in terms:
            term_steps, values = _column(rows, name)
            axes[2].plot(term_steps, values, linewidth=1, label=name[4:])
        axes[2].set_xlabel("step")
        axes[2].set_ylabel("weighted aux term")
        axes[2].legend(fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return atomic_write_png(path, fig, dpi=100)  # the same bytes on a resume
