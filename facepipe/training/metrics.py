"""Training metrics with dvclive: ``OUT/metrics.json`` (latest values) and ``OUT/plots/metrics/**.tsv``.

``dvc metrics show`` reads the JSON and ``dvc plots show`` renders the TSV files (x = optimizer step);
:func:`draw_curves` also draws them into ``OUT/plots/training.png``, which opens offline.
dvclive only writes files here: it never opens the DVC or Git repository (which would ``dvc init`` a
bare Git repository or ``git add`` files under ``dvc exp run``) and never posts to Studio. DVC
itself records the outputs when it runs the stage.
"""

from __future__ import annotations

import csv
import logging
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from facepipe.plots import training_curves_png

if TYPE_CHECKING:
    from dvclive import Live

log = logging.getLogger("facepipe.training")

PREFIX = "train"
CURVES_FILE = "plots/training.png"


@cache
def _files_only_live() -> type[Live]:
    """dvclive's ``Live`` minus its repository and Studio integrations (imported on first use: 0.5 s)."""
    from dvclive import Live

    class FilesOnlyLive(Live):
        def _init_dvc(self) -> None:
            self._dvc_file = "dvc.yaml"  # never written: dvcyaml=None

        def _init_studio(self) -> None:
            self._studio_events_to_skip.update({"start", "data", "done"})

        def post_data_to_studio(self) -> None:
            return None

    return FilesOnlyLive


def trim_history(directory: str | Path, *, last_step: int) -> None:
    """Drop metric rows after ``last_step`` (logged after the checkpoint a resumed run restarts from)."""
    for path in (Path(directory) / "plots" / "metrics").rglob("*.tsv"):
        with open(path, newline="", encoding="utf-8") as handle:
            rows = list(csv.DictReader(handle, delimiter="\t"))
            fields = list(rows[0]) if rows else None
        if fields is None:
            continue
        kept = [row for row in rows if int(float(row["step"])) <= last_step]
        with open(path, "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=fields, delimiter="\t")
            writer.writeheader()
            writer.writerows(kept)


def draw_curves(directory: str | Path) -> Path | None:
    """``directory/plots/training.png`` from the run's metric history; None when it has none yet."""
    directory = Path(directory)
    return training_curves_png(directory / "plots" / "metrics" / PREFIX, directory / CURVES_FILE)


class TrainMetrics:
    """Metric history of one run; a no-op on every rank but 0.

    ``resume_step`` continues the history of an interrupted run from that step; ``None`` starts it
    afresh (removing an older one).
    """

    def __init__(self, directory: str | Path, *, enabled: bool = True, resume_step: int | None = None) -> None:
        self.directory = Path(directory)
        self._live: Live | None = None
        if not enabled:
            return
        if resume_step is not None:
            trim_history(self.directory, last_step=resume_step)
        self._live = _files_only_live()(
            dir=str(self.directory),
            resume=resume_step is not None,
            save_dvc_exp=False,
            dvcyaml=None,
            report=None,
        )

    def log(self, step: int, values: Mapping[str, float], *, prefix: str = PREFIX) -> None:
        """Record ``values`` (plain floats) at optimizer ``step`` as ``prefix/name`` and rewrite metrics.json."""
        if self._live is None:
            return
        self._live.step = step
        for name, value in values.items():
            self._live.log_metric(f"{prefix}/{name}", float(value))
        self._live.make_summary()

    def close(self) -> None:
        if self._live is not None:
            self._live.make_summary()
            self._live = None
