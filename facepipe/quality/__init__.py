"""The data-quality report a person can look at: ``OUT/report.html`` of a shard set.

:func:`write_report` gathers a bounded, seeded sample of the set (:mod:`facepipe.quality.collect`,
reading through :mod:`facepipe.io`) and renders one self-contained HTML page
(:mod:`facepipe.quality.render`): counts by reject reason, thumbnails of rejected files per reason
with their source paths, random aligned faces per identity, histograms of faces per identity and
of detection scores, and cross-identity duplicates. ``prepare``/``import`` write it into the set;
``facepipe inspect --html FILE`` writes it for any set.
"""

from __future__ import annotations

from pathlib import Path

from facepipe.errors import FacepipeError
from facepipe.io.atomic import atomic_write
from facepipe.quality.collect import Limits, QualityData, collect
from facepipe.quality.render import GENERATOR, render

#: Where prepare and import put the report inside a shard set.
REPORT_FILE = "report.html"

__all__ = ["REPORT_FILE", "Limits", "QualityData", "collect", "render", "write_report"]


def write_report(
    root: str | Path, target: str | Path, *, raw: str | Path | None = None, seed: int = 0, limits: Limits = Limits()
) -> Path:
    """Write the report of the shard set ``root`` to ``target`` (atomically); returns ``target``.

    ``raw``: the set's source folder, for thumbnails of rejected files. An existing ``target`` is
    replaced only when it is a report facepipe wrote; anything else raises :class:`FacepipeError`.
    """
    target = Path(target)
    if target.is_symlink() or (target.exists() and not _is_report(target)):
        raise FacepipeError(f"refusing to replace {target}: it is not a facepipe report")
    if not target.parent.is_dir():
        raise FacepipeError(f"folder for the report not found: {target.parent}")
    page = render(collect(root, raw=raw, seed=seed, limits=limits)).encode("utf-8")
    return atomic_write(target, lambda handle: handle.write(page))


def _is_report(path: Path) -> bool:
    if not path.is_file():
        return False
    with open(path, "rb") as handle:
        return GENERATOR.encode() in handle.read(512)
