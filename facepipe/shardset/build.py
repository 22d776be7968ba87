"""``build_set``: the one skeleton that writes a shard set (docs/architecture.md, "A prepared shard set").

A temporary sibling of OUT -> a :class:`~facepipe.shardset.builder.SetBuilder` fed by the stage's
outcome stream -> the builder aborted on any error -> report.html -> report.json -> the rename into
place (:func:`facepipe.io.atomic.atomic_output_dir`): a run killed at any point leaves OUT as it was.
prepare (and ``--update``), both imports and compact are producers of outcomes that call it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from facepipe.config import PrepareParams
from facepipe.io.atomic import atomic_output_dir
from facepipe.io.manifest import dumps
from facepipe.io.shards import shard_bytes
from facepipe.quality import REPORT_FILE, write_report
from facepipe.shardset.builder import SHARD_SET, Generation, SetBuilder


@dataclass(frozen=True)
class Built:
    """A finished set, before it is renamed into place: its ``manifest``, the ``builder`` that wrote it,
    the bytes of its shards and how long report.html took."""

    manifest: dict[str, Any]
    builder: SetBuilder
    shard_bytes: int
    report_html_s: float

    def counts(self) -> dict[str, Any]:
        """The report's first lines, the same for every producer: counts, reasons, identities, shards."""
        return {
            "counts": self.manifest["counts"],
            "rejected_by_reason": self.manifest["rejected_by_reason"],
            "num_identities": self.manifest["num_identities"],
            "num_shards": len(self.manifest["shards"]),
        }


def build_set(
    out: Path,
    params: PrepareParams,
    produce: Callable[[SetBuilder], dict[str, Any]],
    report: Callable[[Built], dict[str, Any]],
    *,
    base: Generation | None = None,
    begin: Callable[[Path], None] | None = None,
    raw: Path | None = None,
) -> tuple[dict[str, Any], SetBuilder]:
    """Write the set ``out`` atomically; returns its report (also report.json) and the builder.

    ``produce`` feeds the builder its outcomes and returns ``builder.finish(...)``'s manifest;
    ``begin`` readies the temporary folder before (an update links the base's shards into it);
    ``report`` makes report.json's content from what was built. ``raw``: where report.html takes
    its thumbnails of rejects (None: rejects are listed by path).
    """
    with atomic_output_dir(out, kind=SHARD_SET) as tmp:
        builder = SetBuilder(tmp, params, base=base)
        try:
            if begin is not None:
                begin(tmp)
            manifest = produce(builder)
        except BaseException:
            builder.abort()
            raise
        started = time.perf_counter()
        write_report(tmp, tmp / REPORT_FILE, raw=raw)  # bounded: a sample through the label index
        built = Built(manifest, builder, shard_bytes(tmp, manifest), round(time.perf_counter() - started, 3))
        summary = report(built)
        (tmp / "report.json").write_text(dumps(summary), encoding="utf-8")
    return summary, builder
