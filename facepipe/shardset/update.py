"""``prepare --update``: grow a shard set by one generation, reading only new and changed files.

How a file counts as unchanged: its scan path is in the set's ``sources.jsonl`` with the same size
and modification time (nanoseconds) — the hint — or, when either differs, its bytes hash to the
recorded sha256 — the truth (a touched but unchanged file is reused; its new time is recorded).
Unchanged files are reused without decoding: an accepted one keeps its record where it is stored,
a rejected one its reject line. New and changed files are decoded and detected; their records go
into new shards after the existing ones (a new generation). Records of files that disappeared,
changed, or are now the later copy of a file with the same bytes are listed in the generation's
``excluded`` map; readers skip them and existing shard files are never written.

Files the scan rejects (links, loops) are decided again each run (nothing is read). A file with no
recorded sha256 (an earlier I/O error, a file over the size limit) is read again. A duplicate is
reused only while an unchanged file before it (sorted order) holds the same bytes.

Outcomes are the same as a from-scratch prepare of RAW would give, file by file (same accept or
reject, reason and detail); the layout (shards, exclusions) and the labels' order differ, and
:mod:`facepipe.stages.compact` rewrites that into the canonical layout. A file rewritten with the
same size and modification time is not seen (the hint says unchanged): only a full prepare reads it.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from facepipe.data.extract import Outcome
from facepipe.data.scan import ScanItem, file_stats, read_raw_file, unescape_path
from facepipe.errors import FacepipeError
from facepipe.io.manifest import SOURCES_FILE, SOURCES_KEY, SourcesDigest, metadata_problems, read_jsonl
from facepipe.io.shards import SET_VERSION, ShardInfo, ShardSet, ShardSetError
from facepipe.shardset.builder import Generation

class NotGrowable(FacepipeError):
    """``out`` is a facepipe set, but not one this update may grow (older format, other params, inconsistent):
    ``prepare --update auto`` prepares it in full instead."""


def has_set(out: Path) -> bool:
    """True when ``out`` holds something to update (a manifest); an absent or empty OUT is prepared in full."""
    return (out / "manifest.json").is_file() or (out.is_dir() and any(out.iterdir()))


@dataclass
class UpdatePlan:
    """What an update reuses and what it sends to the workers (``todo``, in scan order)."""

    base: ShardSet
    sources: dict[str, SourceEntry]
    rejects: dict[str, dict[str, Any]]
    todo: list[ScanItem]
    removed: int
    stats: dict[str, tuple[int, int]] = field(default_factory=dict)

    def walk(self, builder: Any, items: list[ScanItem], processed: Iterator[Outcome]) -> Iterator[int]:
        """Feed every scanned item to ``builder`` in scan order: reused entries by ``keep``, the others
        from ``processed`` (the workers' outcomes of ``todo``, in order). Yields 1 per processed file."""
        todo = {item.path for item in self.todo}
        for item in items:
            if item.path in todo:
                outcome = next(processed)
                assert outcome.path == item.path, (outcome.path, item.path)
                builder.add(outcome)
                yield 1
            else:
                entry = self.sources[item.path]
                builder.keep(entry, self.rejects.get(item.path))
        if next(processed, None) is not None:
            raise RuntimeError("the workers returned more outcomes than files to process")

    def excluded(self, kept: list[int]) -> dict[str, list[int]]:
        """{shard file: [local index]} of the base's live records that ``kept`` (stored indexes) lacks."""
        live = {int(e["sample"]) for e in self.sources.values() if e["sample"] is not None}
        dropped = sorted(live - set(kept))
        files = [entry["file"] for entry in self.base.manifest["shards"]]
        out: dict[str, list[int]] = {}
        for stored in dropped:
            shard = int(self.base.offsets.searchsorted(stored, side="right") - 1)
            out.setdefault(files[shard], []).append(int(stored - self.base.offsets[shard]))
        return out


def plan_update(out: Path, items: list[ScanItem], *, raw: Path, manifest_params: dict[str, Any]) -> UpdatePlan:
    """Check that ``out`` is a set this update may grow, and decide which files to reuse. Raises
    FacepipeError (a folder that is not a facepipe set, an older set, changed params, an inconsistent set)."""
    base = _open_base(out, manifest_params)
    sources = read_sources(out / SOURCES_FILE, expected=base.manifest.get(SOURCES_KEY))
    rejects = {r["path"]: r for r in _read_jsonl(out / "rejects.jsonl")}
    stats = file_stats(raw, items)
    todo: list[ScanItem] = []
    shas: set[str] = set()  # bytes held by reused files so far (scan order): what a reused duplicate needs
    for item in items:
        entry = sources.get(item.path)
        if entry is None or not _reusable(item, entry, rejects, stats, raw=raw, shas=shas):
            todo.append(item)
        elif entry["reason"] != "duplicate" and entry["sha256"] is not None:
            shas.add(entry["sha256"])
    current = {item.path for item in items}
    removed = sum(1 for path in sources if path not in current)
    return UpdatePlan(base, sources, rejects, todo, removed, stats)


def _reusable(
    item: ScanItem, entry: SourceEntry, rejects: dict[str, dict[str, Any]], stats: dict[str, tuple[int, int]],
    *, raw: Path, shas: set[str],
) -> bool:
    if item.reason is not None:  # the scan's own reject: the same one again
        reject = rejects.get(item.path)
        return entry["reason"] == item.reason and reject is not None and reject.get("detail") == item.detail
    if entry["sha256"] is None or item.path not in stats:
        return False
    if entry["reason"] == "duplicate" and entry["sha256"] not in shas:
        return False  # its first copy is gone or changed: from scratch it would be read
    if (entry["size"], entry["mtime_ns"]) == stats[item.path]:
        return True
    try:
        data = read_raw_file(raw, item.path)
    except OSError:
        return False
    return hashlib.sha256(data).hexdigest() == entry["sha256"]  # touched, same bytes: the builder records the new time


def _open_base(out: Path, manifest_params: dict[str, Any]) -> ShardSet:
    try:
        base = ShardSet(out)
    except ShardSetError as error:
        raise FacepipeError(f"--update: {out} is not a facepipe shard set to grow ({error})") from None
    if base.manifest.get("version") != SET_VERSION or not (out / SOURCES_FILE).is_file():
        raise NotGrowable(
            f"--update: {out} was written by an older facepipe (set v{base.manifest.get('version')}, no {SOURCES_FILE}):"
            " run a full prepare (without --update) once"
        )
    if "source" in base.manifest:
        raise FacepipeError(f"--update: {out} was imported from a pack, not prepared from a raw folder")
    changed = sorted(k for k in {*manifest_params, *base.manifest["params"]} if manifest_params.get(k) != base.manifest["params"].get(k))
    if changed:
        what = ", ".join(f"{k}: {base.manifest['params'].get(k)!r} -> {manifest_params.get(k)!r}" for k in changed)
        raise NotGrowable(
            f"--update: the prepare params differ from those {out} was prepared with ({what}); a set must not mix"
            " two alignments or encodings: run a full prepare (without --update)"
        )
    problems = metadata_problems(base)
    if problems:
        raise NotGrowable(f"--update: {out} is inconsistent ({problems[0]}): see facepipe verify {out}")
    return base


class SourceEntry:
    """One ``sources.jsonl`` line, read as ``entry["sha256"]`` like the dict it was, in less than half
    its memory: an update holds one per file of the set (about 0.45 KB each instead of 1 KB; 1M files,
    benchmarks/README.md), and the repeated reasons share one string. Raises ValueError naming the
    first field of the wrong type (a ``sample`` of ``null`` for an accepted file, ``"x"``, ...)."""

    __slots__ = ("path", "sha256", "reason", "sample", "generation", "size", "mtime_ns")

    def __init__(self, line: dict[str, Any]) -> None:
        if not isinstance(line, dict):
            raise ValueError("a line is not a JSON object")
        reason = line["reason"]
        self.path, self.sha256, self.sample, self.generation = line["path"], line["sha256"], line["sample"], line["generation"]
        self.size, self.mtime_ns = line["size"], line["mtime_ns"]
        self.reason = None if reason is None else sys.intern(reason) if isinstance(reason, str) else reason
        problem = _entry_problem(self)
        if problem:
            raise ValueError(f"{self.path!r}: {problem}" if isinstance(self.path, str) else problem)

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry_problem(entry: SourceEntry) -> str | None:
    """Why ``entry`` cannot be a line prepare wrote, else None."""
    if not isinstance(entry.path, str) or not entry.path or "\0" in entry.path:
        return "path is not a file path"
    if entry.sha256 is not None and not (isinstance(entry.sha256, str) and len(entry.sha256) == 64):
        return f"sha256 {entry.sha256!r} is not a hex digest"
    if entry.reason is not None and not isinstance(entry.reason, str):
        return f"reason {entry.reason!r} is not a reason code"
    if (entry.sample is None) == (entry.reason is None) or not (entry.sample is None or _count(entry.sample)):
        return f"sample {entry.sample!r} with reason {entry.reason!r} (an accepted file has a sample number, a reject none)"
    if not _count(entry.generation):
        return f"generation {entry.generation!r} is not a generation number"
    if not all(value is None or _count(value) for value in (entry.size, entry.mtime_ns)):
        return "size and mtime_ns must be numbers"
    return None


def _read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """The lines of a JSONL file that the update reads, parsed one at a time."""
    try:
        yield from read_jsonl(path)
    except OSError as error:
        raise FacepipeError(f"--update: cannot read {path}: {error}") from None
    except ValueError as error:
        raise NotGrowable(f"--update: {path} is inconsistent (not JSON lines: {error}): run a full prepare (without --update)") from None


class SourcesError(FacepipeError):
    """``sources.jsonl`` cannot be trusted: damaged, or not what the manifest's hash says."""


def source_entries(path: Path, *, expected: str | None) -> Iterator[SourceEntry]:
    """``sources.jsonl``'s lines as entries, one at a time, each checked for types; at the end its
    lines must hash to ``expected`` (the manifest's :data:`SOURCES_KEY`): a removed line, two lines'
    samples swapped, a sha256 copied from another line are refused. Raises :class:`SourcesError`
    ("PATH is inconsistent (why)") or FacepipeError when it cannot be read; a caller acts on what it
    was given only once the iteration ends."""
    if expected is None:
        raise SourcesError(f"{path} is inconsistent (the manifest records no {SOURCES_KEY}: written by an earlier facepipe)")
    digest = SourcesDigest()
    try:
        for line in read_jsonl(path):
            entry = SourceEntry(line)
            digest.add(entry.path, entry.sha256, entry.reason, entry.sample, entry.generation)
            yield entry
    except OSError as error:
        raise FacepipeError(f"cannot read {path}: {error}") from None
    except KeyError as error:
        raise SourcesError(f"{path} is inconsistent (a line lacks {error})") from None
    except json.JSONDecodeError as error:
        raise SourcesError(f"{path} is inconsistent (not JSON lines: {error})") from None
    except ValueError as error:  # a field of the wrong type
        raise SourcesError(f"{path} is inconsistent (not lines prepare writes: {error})") from None
    if digest.hexdigest() != expected:
        raise SourcesError(f"{path} is inconsistent (its lines do not match the manifest's {SOURCES_KEY})")


def read_sources(path: Path, *, expected: str | None) -> dict[str, SourceEntry]:
    """``sources.jsonl`` as {scan path: entry}, line by line (never all lines' dicts at once), checked
    by :func:`source_entries`. Raises :class:`NotGrowable` in one line: ``--update auto`` then prepares in full."""
    collecting = gc.isenabled()
    gc.disable()  # a million new acyclic objects would otherwise set off full collections over and over
    sources: dict[str, SourceEntry] = {}
    try:
        for entry in source_entries(path, expected=expected):
            if sources.setdefault(entry.path, entry) is not entry:
                raise SourcesError(f"{path} is inconsistent ({entry.path!r} appears twice)")
    except SourcesError as error:
        raise NotGrowable(f"--update: {error}: run a full prepare (without --update)") from None
    finally:
        if collecting:
            gc.enable()
    return sources


def base_generation(plan: UpdatePlan | None) -> Generation | None:
    """The :class:`Generation` an update builds on (None: a from-scratch build)."""
    if plan is None:
        return None
    manifest = plan.base.manifest
    shards = tuple(
        ShardInfo(e["file"], int(e["num_samples"]), e["sha256"], 0, int(e["bytes"])) for e in manifest["shards"]
    )
    return Generation(
        number=len(manifest["generations"]),
        stored=int(plan.base.offsets[-1]),
        shards=shards,
        identities=tuple(plan.base.identities),
        generations=tuple(manifest["generations"]),
        params=manifest["params"],
    )


def base_payload(plan: UpdatePlan) -> int:
    """The payload bytes the base's report recorded (0 when it has none)."""
    try:
        return int(json.loads((plan.base.root / "report.json").read_text(encoding="utf-8"))["payload_bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0
