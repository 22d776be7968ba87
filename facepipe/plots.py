"""Curves as PNG files a person can open offline: the training curves and the ROC.

``dvc plots show`` writes an HTML page that loads Vega from a CDN (blank without a network); these
PNGs, drawn with matplotlib's Agg canvas (no pyplot, no display, no global backend switch), need
nothing. The same data give the same bytes (no date or software version in the PNG).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from facepipe.io.atomic import atomic_write

DPI = 100
TRAINING_SIZE = (1200, 800)  # pixels: a 3 x 2 grid of panels
ROC_SIZE = (600, 600)
#: Panels in this order, then any other metric the run logged (a grid holds six).
PREFERRED = ("loss", "accuracy", "lr", "samples_per_s", "epoch_time_s", "epoch")
_LABELS = {
    "loss": "training loss",
    "accuracy": "top-1 accuracy (training batches)",
    "lr": "learning rate",
    "samples_per_s": "samples / s",
    "epoch_time_s": "epoch time (s)",
    "epoch": "epoch",
}


def read_series(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """A dvclive TSV (``step`` and one value column) -> ([N] steps, [N] values), float64."""
    with open(path, newline="", encoding="utf-8") as handle:
        rows = list(csv.reader(handle, delimiter="\t"))
    if len(rows) < 2:
        return np.zeros(0), np.zeros(0)
    column = rows[0].index("step")
    value = 1 - column if len(rows[0]) == 2 else len(rows[0]) - 1
    data = np.asarray([[float(row[column]), float(row[value])] for row in rows[1:]], dtype=np.float64)
    return data[:, 0], data[:, 1]


def training_curves_png(series_dir: str | Path, target: str | Path) -> Path | None:
    """Draw every ``*.tsv`` under ``series_dir`` (dvclive's ``plots/metrics/train``) as one panel
    of a ``TRAINING_SIZE`` PNG at ``target``; None (nothing written) when there is no series."""
    series = {path.stem: read_series(path) for path in sorted(Path(series_dir).glob("*.tsv"))}
    series = {name: xy for name, xy in series.items() if len(xy[0])}
    if not series:
        return None
    names = [n for n in PREFERRED if n in series] + sorted(n for n in series if n not in PREFERRED)
    figure, canvas = _figure(TRAINING_SIZE)
    for index, name in enumerate(names[:6]):
        axes = figure.add_subplot(2, 3, index + 1)
        steps, values = series[name]
        axes.plot(steps, values, marker="." if len(steps) < 50 else None, color="#2b6cb0")
        axes.set_title(_LABELS.get(name, name), fontsize=11)
        axes.set_xlabel("optimizer step")
        axes.grid(alpha=0.3)
    figure.tight_layout()
    return _save(canvas, target)


def roc_png(fpr: Sequence[float], tpr: Sequence[float], target: str | Path, *, title: str) -> Path:
    """The ROC (true-positive rate against false-positive rate, both in [0, 1]) as a ``ROC_SIZE`` PNG."""
    figure, canvas = _figure(ROC_SIZE)
    axes = figure.add_subplot(1, 1, 1)
    axes.plot([0, 1], [0, 1], linestyle="--", color="#999999", label="chance")
    axes.plot(fpr, tpr, color="#c05621", linewidth=2, label="model")
    axes.set_xlim(0, 1)
    axes.set_ylim(0, 1.01)
    axes.set_xlabel("false positive rate (different pairs accepted)")
    axes.set_ylabel("true positive rate (same pairs accepted)")
    axes.set_title(title, fontsize=11)
    axes.legend(loc="lower right")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    return _save(canvas, target)


def _figure(size: tuple[int, int]):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(size[0] / DPI, size[1] / DPI), dpi=DPI)
    return figure, FigureCanvasAgg(figure)


def _save(canvas, target: str | Path) -> Path:
    buffer = io.BytesIO()
    # no "Software" (the matplotlib version) in the file: the same curves give the same bytes
    canvas.print_png(buffer, metadata={"Software": None})
    data = buffer.getvalue()
    return atomic_write(target, lambda handle: handle.write(data))
