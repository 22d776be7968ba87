"""``facepipe import SOURCE OUT``: datasets people already hold, into the shard set contract.

SOURCE is either an insightface RecordIO pack (a ``.rec`` file, or a folder with ``train.rec``:
:mod:`facepipe.stages.import_rec`) or a folder of pre-aligned face crops in the ``identity/image``
layout, which is prepare with ``detector: none`` (no detection; the crops are checked, resized to
``image_size`` when they are not that size, and everything else is prepare: rejects, duplicates,
accounting, Dask workers, atomic output). Both read the ``prepare`` section of the params file, and
both refuse a source of which nothing is accepted (an empty set is never what an import is for).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from facepipe.config import PrepareParams
from facepipe.detection.registry import aligned_detector
from facepipe.errors import FacepipeError
from facepipe.stages import import_rec, prepare


def run(
    params: PrepareParams,
    source: str | Path,
    out: str | Path,
    *,
    workers: int | None = None,
    progress: bool = True,
    **prepare_options: Any,
) -> dict[str, Any]:
    """Import ``source`` (a RecordIO pack or a folder of aligned crops) into the shard set ``out``;
    returns the run report. ``prepare_options`` go to :func:`facepipe.stages.prepare.run` (folders only)."""
    if import_rec.is_pack(source):
        return import_rec.run(params, source, out, workers=workers, progress=progress)
    if not Path(source).is_dir():
        raise FacepipeError(f"nothing to import at {source}: expected a .rec file, a folder with train.rec, or a folder of aligned faces")
    aligned = params.model_copy(update={"detector": aligned_detector(), "detector_weights": None})
    return prepare.run(aligned, source, out, workers=workers, progress=progress, refuse_empty=True, **prepare_options)


def summary_line(report: dict[str, Any]) -> str:
    """prepare's one line (:func:`facepipe.stages.prepare.summary_line`), said by ``import``, and the
    ``.bin`` validation sets a pack brought along."""
    carried = report.get("validation_sets")
    sets = ", ".join(f"{name} ({pairs} pairs)" for name, pairs in carried.items()) if carried else ""
    return prepare.summary_line(report, stage="import") + (f"; validation sets: {sets}" if sets else "")
