"""``facepipe compact OUT``: rewrite a set of several generations into the canonical layout.

Against a from-scratch ``prepare`` of the same RAW with the same params: the same labels.json,
rejects.jsonl and sources.jsonl byte for byte, the same manifest but for the shards' sha256 and
sizes, the same records in the same order. Live records are copied (not decoded again) in scan order
(sources.jsonl) through the same :class:`SetBuilder` a prepare uses; excluded records are dropped.
A record is the one the grown set holds: where an update detected a face in another batch than a
from-scratch run would, a real detector's output differs in the last bits, and so may the pixels
(README, Growing a dataset; ``detector: none`` gives the same shard bytes). Labels are renumbered into the canonical order (first accepted
file of each identity in scan order), so a model trained on the old numbering needs the mapping that
the report's ``relabel`` gives ({old label: new label}; identities with no live sample drop out).

Written into a temporary sibling and published by :func:`facepipe.shardset.build_set`: a
compaction killed at any point leaves the old set as it was.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

from facepipe.config import PrepareParams
from facepipe.data.extract import Outcome
from facepipe.errors import FacepipeError
from facepipe.io.manifest import SOURCES_FILE, SOURCES_KEY, metadata_problems, read_jsonl
from facepipe.io.shards import SET_VERSION, ShardSet, ShardSetError
from facepipe.progress import Progress
from facepipe.shardset import Built, Generation, SetBuilder, build_set
from facepipe.shardset.update import SourceEntry, source_entries


def run(out: str | Path, *, progress: bool = True) -> dict[str, Any]:
    """Compact the set at ``out`` in place (atomically); returns the report (also report.json)."""
    out = Path(out)
    started = time.perf_counter()
    shard_set = _open(out)
    recorded = shard_set.manifest["params"]
    params = PrepareParams.model_validate({**recorded, "detector_weights": None})  # recorded below as it was
    scanned = shard_set.manifest["counts"]["scanned"]
    generations = len(shard_set.manifest["generations"])

    def produce(builder: SetBuilder) -> dict[str, Any]:
        # one line at a time: memory does not grow with sources.jsonl (the builder's own needs do)
        lines = 0
        with Progress(scanned, desc="compact", enabled=progress) as bar, closing(read_jsonl(out / "rejects.jsonl")) as rejects:
            for entry in _sources(out, shard_set):
                builder.stats = {entry.path: (entry.size, entry.mtime_ns)}  # what the builder records
                builder.add(_outcome(shard_set, entry, rejects))
                lines += 1
                bar.update(1)
        return builder.finish(lines)

    def report(built: Built) -> dict[str, Any]:
        new_label = {name: label for label, name in enumerate(built.builder.identities)}
        return {
            **built.counts(),
            "generation": 0,
            "compacted_generations": generations,
            "dropped_records": int(shard_set.offsets[-1]) - len(shard_set),
            "relabel": {str(old): new_label.get(name) for old, name in enumerate(shard_set.identities)},
            "payload_bytes": built.builder.payload_bytes,
            "shard_bytes": built.shard_bytes,
            "timings_s": {"total": round(time.perf_counter() - started, 3)},
        }

    # no RAW here: report.html lists rejects by path, without thumbnails
    return build_set(out, params, produce, report, base=Generation(params=recorded))[0]


def _open(out: Path) -> ShardSet:
    try:
        shard_set = ShardSet(out)
    except ShardSetError as error:
        raise FacepipeError(f"compact: {error}") from None
    if shard_set.manifest.get("version") != SET_VERSION or not (out / SOURCES_FILE).is_file():
        raise FacepipeError(f"compact: {out} was written by an older facepipe (no {SOURCES_FILE}): run a full prepare")
    if "source" in shard_set.manifest:
        raise FacepipeError(f"compact: {out} was imported from a pack: it has one generation already")
    problems = metadata_problems(shard_set)
    if problems:
        raise FacepipeError(f"compact: {out} is inconsistent ({problems[0]}): see facepipe verify {out}")
    return shard_set


def _outcome(shard_set: ShardSet, entry: SourceEntry, rejects: Iterator[Any]) -> Outcome:
    """The outcome a from-scratch prepare had for ``entry``: its stored record, or its reject line
    (the next of ``rejects``, whose hash the manifest holds)."""
    path, sha256 = entry.path, entry.sha256
    if entry.sample is None:
        reject = next(rejects, None)
        if reject is None or reject["path"] != path:
            raise FacepipeError(f"compact: rejects.jsonl and {SOURCES_FILE} disagree at {path!r}: see facepipe verify")
        return Outcome(path, sha256, reason=reject["reason"], detail=reject["detail"])
    stored = entry.sample
    if stored >= int(shard_set.offsets[-1]):
        raise FacepipeError(f"compact: {SOURCES_FILE} places {path!r} at sample {stored}, past the set's end: see facepipe verify")
    shard = int(shard_set.offsets.searchsorted(stored, side="right") - 1)
    record = shard_set.readers[shard].record(stored - int(shard_set.offsets[shard]))
    if record.path != path:
        raise FacepipeError(f"compact: {SOURCES_FILE} places {path!r} where {record.path!r} is stored: see facepipe verify")
    header = {key: value for key, value in record.header.items() if key != "label"}
    return Outcome(path, sha256, header=header, payload=record.payload)


def _sources(out: Path, shard_set: ShardSet) -> Iterator[SourceEntry]:
    """sources.jsonl's entries, checked (:func:`~facepipe.shardset.update.source_entries`; the hash at the end)."""
    try:
        yield from source_entries(out / SOURCES_FILE, expected=shard_set.manifest.get(SOURCES_KEY))
    except FacepipeError as error:
        raise FacepipeError(f"compact: {error}: run a full prepare") from None


def summary_line(report: dict[str, Any]) -> str:
    counts = report["counts"]
    return (
        f"compact: {report['compacted_generations']} generation(s) -> 1; {counts['accepted']} samples of"
        f" {report['num_identities']} identities in {report['num_shards']} shard(s), {counts['rejected']} rejects;"
        f" {report['dropped_records']} excluded record(s) dropped; labels renumbered (report.json: relabel)"
    )
