"""The set builder: outcomes in input order -> shards, rejects.jsonl, sources.jsonl, labels.json and,
last, manifest.json (docs/architecture.md, "A prepared shard set").

Every stage that writes a shard set (prepare, ``prepare --update``, both imports, compact) feeds
one :class:`SetBuilder`, through :func:`facepipe.shardset.build.build_set`; only this room and
:mod:`facepipe.io` name, link or rename shard files.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from facepipe.alignment import template
from facepipe.config import PrepareParams
from facepipe.data.extract import Outcome
from facepipe.io.atomic import OutputKind, json_key_file
from facepipe.io.manifest import (
    SOURCES_FILE,
    SOURCES_KEY,
    SourcesDigest,
    build_manifest,
    duplicate_detail,
    reject_line,
    write_metadata,
)
from facepipe.io.manifest import recorded_params as manifest_params
from facepipe.io.records import encode_record
from facepipe.io.shards import SET_FORMAT, SHARD_PATTERN, SHARDS_DIR, ShardInfo, ShardSet, ShardWriter, shard_name
from facepipe.io.validation_sets import PATTERN as VALIDATION_PATTERN
from facepipe.quality import REPORT_FILE

log = logging.getLogger("facepipe.prepare")

#: Where a generation's new shards are written inside the temporary output before they are renamed.
NEW_SHARDS = ".new-shards"

#: An existing OUT is replaced only when it is a shard set (manifest format) holding nothing else.
SHARD_SET = OutputKind(
    "shard set",
    patterns=(
        "manifest.json", "labels.json", "rejects.jsonl", SOURCES_FILE, "report.json", REPORT_FILE, f"{SHARDS_DIR}/{SHARD_PATTERN}",
        VALIDATION_PATTERN,  # the .bin sets an import of an insightface folder brings along
    ),
    identify=json_key_file("manifest.json", "version", format=SET_FORMAT),
)


class SetBuilder:
    """Consumes outcomes in input order: dedupes by content, assigns labels, writes shards, rejects and
    sources.jsonl (:data:`~facepipe.io.manifest.SOURCES_FILE`).

    ``base``: the set a ``prepare --update`` grows (its identities keep their labels; new records are
    stored after its samples, in shards numbered after its shards).
    """

    def __init__(self, root: Path, params: PrepareParams, *, base: Generation | None = None) -> None:
        self.root = root
        self.params = params
        self.base = base or Generation()
        # a generation's shards are numbered after the base's: written aside, renamed by finish()
        new_shards = root / NEW_SHARDS if self.base.shards else root / SHARDS_DIR
        self.writer = ShardWriter(new_shards, samples_per_shard=params.samples_per_shard)
        self.rejects = open(root / "rejects.jsonl", "w", encoding="utf-8")
        self.sources = open(root / SOURCES_FILE, "w", encoding="utf-8")
        self.sources_digest = SourcesDigest()
        self.stats: dict[str, tuple[int, int]] = {}  # path -> (size, mtime_ns) taken before it was read
        self.identities: list[str] = list(self.base.identities)
        self.labels: dict[str, int] = {name: label for label, name in enumerate(self.identities)}
        self.first_seen: dict[str, str] = {}  # sha256 -> first path (sorted order) with those bytes
        self.reasons: Counter[str] = Counter()
        self.accepted = 0  # live samples of the set: written now or kept from the base
        self.written = 0  # records written by this builder
        self.rejected_now = 0  # rejects decided in this generation (not kept from the base)
        self.redecided = 0  # base files decided again without reading them (now a later copy of new bytes)
        self.kept: list[int] = []  # stored indexes of the base's records that stay live
        self.payload_bytes = 0
        self.resized: list[str] = []  # aligned input (detector none): paths of crops that were not image_size squares
        self.unchanged = False  # set by finish(): an update that found nothing to add or remove

    def _duplicate_of(self, path: str, sha256: str | None) -> str | None:
        """The earlier path (sorted order) with the same bytes, else None (and ``path`` is first)."""
        if sha256 is None:
            return None
        first = self.first_seen.setdefault(sha256, path)
        return None if first == path else first

    def add(self, outcome: Outcome) -> None:
        first = self._duplicate_of(outcome.path, outcome.sha256)
        if first is not None:
            return self._reject(outcome.path, outcome.sha256, "duplicate", duplicate_detail(first, outcome.path))
        if not outcome.accepted:
            return self._reject(outcome.path, outcome.sha256, outcome.reason or "unknown", outcome.detail)
        assert outcome.header is not None and outcome.payload is not None
        label = self.label_of(outcome.path.split("/", 1)[0])
        record = encode_record({**outcome.header, "label": label}, outcome.payload)
        self.writer.write(record, label=label, payload_bytes=len(outcome.payload))
        self._source(outcome.path, outcome.sha256, None, self.base.stored + self.written, self.base.number)
        self.accepted += 1
        self.written += 1
        self.payload_bytes += len(outcome.payload)
        if not self.params.needs_alignment and outcome.header.get("source_size") != outcome.header.get("size"):
            self.resized.append(outcome.path)

    def keep(self, entry: dict[str, Any], reject: dict[str, Any] | None) -> bool:
        """Reuse a base entry (a sources.jsonl line) whose file is unchanged, without reading it:
        its record stays live, or its reject line (``reject``) is written again. False when it is now
        a duplicate of an earlier file (recorded as such: its record, if any, is then excluded)."""
        path, sha256 = entry["path"], entry["sha256"]
        first = self._duplicate_of(path, sha256)
        if first is not None:
            was = entry["reason"] == "duplicate"  # else a new file before it holds its bytes: decided now
            self._reject(path, sha256, "duplicate", duplicate_detail(first, path), generation=entry["generation"] if was else None)
            self.redecided += not was
            return was
        if entry["sample"] is None:
            assert reject is not None and reject["path"] == path
            self._reject(path, sha256, reject["reason"], reject["detail"], generation=entry["generation"])
            return True
        self.kept.append(int(entry["sample"]))
        self._source(path, sha256, None, int(entry["sample"]), entry["generation"])
        self.accepted += 1
        return True

    def label_of(self, identity: str) -> int:
        """The identity's label; a new identity gets the next one (labels are never reused)."""
        if identity not in self.labels:
            self.labels[identity] = len(self.identities)
            self.identities.append(identity)
        return self.labels[identity]

    def _reject(self, path: str, sha256: str | None, reason: str, detail: str, *, generation: int | None = None) -> None:
        self.reasons[reason] += 1
        self.rejects.write(reject_line({"path": path, "reason": reason, "detail": detail}))
        self._source(path, sha256, reason, None, self.base.number if generation is None else generation)
        self.rejected_now += generation is None

    def _source(self, path: str, sha256: str | None, reason: str | None, sample: int | None, generation: int) -> None:
        size, mtime_ns = self.stats.get(path, (None, None))
        line = {"path": path, "sha256": sha256, "reason": reason, "sample": sample, "generation": generation,
                "size": size, "mtime_ns": mtime_ns}
        self.sources.write(json.dumps(line, sort_keys=True, ensure_ascii=False) + "\n")
        self.sources_digest.add(path, sha256, reason, sample, generation)

    def finish(self, scanned: int, *, processed: int | None = None, removed: int = 0, excluded: dict[str, list[int]] | None = None) -> dict[str, Any]:
        """Close shards and write labels.json and, last, manifest.json; returns the manifest.

        ``processed``: files decided in this generation (default: all ``scanned``); ``removed``:
        base files gone from RAW; ``excluded``: base records no longer live ({shard file: [index]}).
        """
        shards = self.writer.close()
        if self.base.shards:
            shards = place_new_shards(shards, root=self.root, first=len(self.base.shards))
        self.rejects.close()
        self.sources.close()
        rejected = sum(self.reasons.values())
        processed = scanned if processed is None else processed
        decided = processed + self.redecided  # this generation's files: read, or found to be copies
        if self.accepted + rejected != scanned or self.written + self.rejected_now != decided:
            raise RuntimeError(
                f"accounting broken: {self.accepted} + {rejected} != {scanned} scanned,"
                f" or {self.written} + {self.rejected_now} != {decided} decided in this generation"
            )
        p = self.params
        generation = {
            "generation": self.base.number,
            "shards": [s.file for s in shards],
            "counts": {"scanned": decided, "accepted": self.written, "rejected": self.rejected_now},
            "reused": scanned - decided,
            "removed": removed,
            "labels": [len(self.base.identities), len(self.identities)],
            "excluded": dict(sorted((excluded or {}).items())),
        }
        # an update that found nothing new, changed or removed adds no generation: the set stays as it
        # was (manifest, labels, shards), so nothing downstream of it (DVC stages, a training run) is stale
        self.unchanged = self.base.number > 0 and decided == 0 and removed == 0 and not shards and not excluded
        manifest = build_manifest(
            [*self.base.shards, *shards],
            image={
                "size": p.image_size,
                "encoding": p.encoding,
                "quality": p.quality if p.encoding == "jpeg" else None,
                "template": "arcface",
                "template_points": template(p.image_size).round(4).tolist(),
            },
            num_identities=len(self.identities),
            counts={"scanned": scanned, "accepted": self.accepted, "rejected": rejected},
            params=self.base.params or manifest_params(p),
            generations=[*self.base.generations] if self.unchanged else [*self.base.generations, generation],
        )
        manifest["rejected_by_reason"] = dict(sorted(self.reasons.items()))
        manifest[SOURCES_KEY] = self.sources_digest.hexdigest()
        return write_metadata(self.root, manifest=manifest, identities=self.identities, rejects=None)

    def abort(self) -> None:
        self.writer.abort()
        self.rejects.close()
        self.sources.close()


@dataclass(frozen=True)
class Generation:
    """What a new generation builds on: nothing (a from-scratch prepare), or an existing set's
    shards, identities, generations and recorded params; ``number``: the new generation's number,
    ``stored``: how many samples the base stores (the new records' stored indexes start there)."""

    number: int = 0
    stored: int = 0
    shards: tuple[ShardInfo, ...] = ()
    identities: tuple[str, ...] = ()
    generations: tuple[dict[str, Any], ...] = ()
    params: dict[str, Any] | None = None


def reasons_text(builder: SetBuilder) -> str:
    """``reason n, ...`` of the run's rejects, most frequent first."""
    return ", ".join(f"{reason} {n}" for reason, n in sorted(builder.reasons.items(), key=lambda kv: (-kv[1], kv[0])))


def warn_resized(builder: SetBuilder, size: int) -> None:
    """One warning for the pre-aligned crops (detector none) that had to be resized to ``size``."""
    if builder.resized:
        first = builder.resized[0]
        log.warning("%d aligned face(s) were not %dx%d and were resized (first: %s)", len(builder.resized), size, size, first)


def link_shards(base: ShardSet, tmp: Path) -> None:
    """The base's shard files into ``tmp/shards`` as hard links (same bytes, no copy); a copy where
    the file system refuses links. The base set itself is never written."""
    (tmp / SHARDS_DIR).mkdir(parents=True, exist_ok=True)
    for entry in base.manifest["shards"]:
        source, target = base.root / SHARDS_DIR / entry["file"], tmp / SHARDS_DIR / entry["file"]
        try:
            os.link(source, target)
        except OSError:
            shutil.copy2(source, target)


def place_new_shards(shards: list[ShardInfo], *, root: Path, first: int) -> list[ShardInfo]:
    """Rename a generation's shards from ``root/NEW_SHARDS`` to ``root/shards``, numbered from ``first``."""
    placed = []
    for offset, info in enumerate(shards):
        name = shard_name(first + offset)
        if os.path.lexists(root / SHARDS_DIR / name):  # never replace a base shard's link: refuse, lose nothing
            raise RuntimeError(f"shard {name} already exists in {root / SHARDS_DIR}: the base set's shards are not numbered 0..{first - 1}")
        (root / NEW_SHARDS / info.file).rename(root / SHARDS_DIR / name)
        placed.append(ShardInfo(name, info.num_samples, info.sha256, info.payload_bytes, info.bytes))
    shutil.rmtree(root / NEW_SHARDS, ignore_errors=True)
    return placed
