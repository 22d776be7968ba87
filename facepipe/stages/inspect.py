"""``facepipe inspect`` and ``facepipe verify``: look at, and re-check, a prepared shard set."""

from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path
from typing import Any

from PIL import Image

from facepipe.errors import FacepipeError
from facepipe.io import ShardSet
from facepipe.io.manifest import SOURCES_FILE, SOURCES_KEY, metadata_problems, read_jsonl
from facepipe.io.records import Record, decode_image, unsafe_path_reason
from facepipe.io.shards import CorruptRecordError, ShardReader, ShardSetError, sha256_file, shard_path
from facepipe.io.validation_sets import MANIFEST_KEY, verify_bin_sets
from facepipe.shardset.update import source_entries

_SHOWN_PER_SHARD = 20  # record problems listed per shard; the rest are counted


def summarize(root: str | Path) -> dict[str, Any]:
    """Identities, samples, rejects by reason, shard sizes and storage overhead of a shard set."""
    shard_set = ShardSet(root)
    root = Path(root)
    shard_bytes = {s["file"]: shard_path(root, s["file"]).stat().st_size for s in shard_set.manifest["shards"]}
    report_path = root / "report.json"
    payload = json.loads(report_path.read_text(encoding="utf-8")).get("payload_bytes") if report_path.is_file() else None
    if payload is None:
        payload = sum(len(reader.record(i).payload) for reader in shard_set.readers for i in range(len(reader)))
    reasons: Counter[str] = Counter()
    rejects_path = root / "rejects.jsonl"
    if rejects_path.is_file():
        reasons.update(reject["reason"] for reject in read_jsonl(rejects_path))
    total = sum(shard_bytes.values())
    per_identity = Counter(shard_set.labels().tolist())
    return {
        "identities": shard_set.num_identities,
        "samples": len(shard_set),
        "samples_per_identity": {
            "min": min(per_identity.values(), default=0),
            "max": max(per_identity.values(), default=0),
        },
        "counts": shard_set.manifest.get("counts", {}),
        "rejected_by_reason": dict(sorted(reasons.items())),
        "image": shard_set.manifest["image"],
        "shards": [{"file": f, "num_samples": s["num_samples"], "bytes": shard_bytes[f]}
                   for f, s in zip(shard_bytes, shard_set.manifest["shards"])],
        "shard_bytes": total,
        "payload_bytes": payload,
        "storage_overhead": round(total / payload - 1.0, 4) if payload else None,
        # prepare --update: generations so far, and stored samples they excluded (compact drops them)
        "generations": len(shard_set.manifest.get("generations", [])) or 1,
        "excluded_samples": int(shard_set.offsets[-1]) - len(shard_set),
        **({"validation_sets": {e["file"]: e["num_pairs"] for e in carried}} if (carried := shard_set.manifest.get(MANIFEST_KEY)) else {}),
    }


def dump_faces(root: str | Path, out: str | Path, *, limit: int | None = None) -> int:
    """Write aligned faces as PNG files under ``out``, one file per sample; returns the count.

    A face goes to ``out/<source path>.png`` (``a/b.jpg`` -> ``a/b.jpg.png``: sources that differ
    only by extension stay apart). A source path that could leave ``out`` (absolute, ``..``), or a
    name this dump has used already (compared case-insensitively, for file systems that do), goes to
    ``out/_renamed/<shard>-<key>.png`` instead. Every target is resolved and checked to lie under
    ``out``. What ``out`` may already hold is the caller's check (the CLI allows earlier dumps only).
    """
    shard_set = ShardSet(root)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    base = out.resolve()
    taken: set[str] = set()
    written = 0
    for reader in shard_set.readers:
        excluded = set(map(int, shard_set.excluded.get(reader.path.name, ())))  # removed by a later generation
        for key, record in enumerate(reader):
            if limit is not None and written >= limit:
                return written
            if key in excluded:
                continue
            fallback = f"_renamed/{Path(reader.path.name).stem}-{key:08d}.png"
            path = record.header.get("path")
            names = [fallback] if unsafe_path_reason(path) else [f"{path}.png", fallback]
            png = _encode_png(record)
            if not any(_write_new(base, name, png, taken=taken) for name in names):
                raise FacepipeError(f"cannot dump {reader.path.name} key {key}: {fallback} is taken under {out}")
            written += 1
    return written


def _encode_png(record: Record) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(record.image()).save(buffer, format="PNG")
    return buffer.getvalue()


def _write_new(base: Path, name: str, data: bytes, *, taken: set[str]) -> bool:
    """Write ``data`` to ``base/name`` unless this dump used the name already or a file stands where
    a folder of it should (False). Raises FacepipeError if the resolved target leaves ``base``."""
    if name.casefold() in taken:
        return False
    target = (base / name).resolve()
    if not target.is_relative_to(base):
        raise FacepipeError(f"dump path {name!r} leaves {base}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    except (FileExistsError, NotADirectoryError, IsADirectoryError):
        return False
    taken.add(name.casefold())
    return True


def verify(root: str | Path) -> list[str]:
    """Every problem found (empty when the set is sound), each one line.

    The cheap checks of :func:`facepipe.io.manifest.metadata_problems` (hashes of the small files,
    counts, shard sizes and label indexes), then every shard's sha256 and every record: CRC-32,
    header, label against the label index and labels.json, path (safe, under its identity's folder,
    never twice in the set) and image decoding; rejects.jsonl line by line; and each validation set
    the set carries (sha256, a restricted read, its number of pairs).
    """
    shard_set = ShardSet(root)
    problems = metadata_problems(shard_set)
    seen: dict[str, str] = {}  # path -> where it was seen first
    live: dict[str, tuple[int, Any]] = {}  # path -> (stored index, sha256) of each live record
    for shard, (entry, reader) in enumerate(zip(shard_set.manifest["shards"], shard_set.readers)):
        if reader.path.is_file():
            excluded = set(map(int, shard_set.excluded.get(entry["file"], ())))  # removed by a later generation
            problems += _verify_shard(
                entry, reader, identities=shard_set.identities, seen=seen, excluded=excluded,
                live=live, first=int(shard_set.offsets[shard]),
            )
    problems += _verify_rejects(Path(root) / "rejects.jsonl", shard_set.manifest, seen=seen)
    if (Path(root) / SOURCES_FILE).is_file():
        problems += _verify_sources(Path(root), shard_set.manifest, live=live)
    return problems + verify_bin_sets(Path(root), shard_set.manifest)


def _verify_shard(
    entry: dict[str, Any],
    reader: ShardReader,
    *,
    identities: list[str],
    seen: dict[str, str],
    excluded: set[int] = frozenset(),
    live: dict[str, tuple[int, Any]] | None = None,
    first: int = 0,
) -> list[str]:
    name = entry["file"]
    problems = []
    if sha256_file(reader.path) != entry["sha256"]:
        problems.append(f"{name}: sha256 differs from the manifest")
    try:
        labels = reader.labels()
    except (ShardSetError, ValueError) as error:
        return problems + [f"{name}: label index unreadable ({error})"]
    found = []
    for key in range(int(entry["num_samples"])):
        try:
            record = reader.record(key)
        except IndexError:
            found.append(f"{name} key {key}: record missing")
            continue
        except CorruptRecordError as error:
            found.append(f"{name} key {key}: {error.reason}")
            continue
        found += [f"{name} key {key}: {problem}" for problem in _record_problems(record, key, labels, identities)]
        if key in excluded:
            continue  # checked, but no longer in the set: its path may be accepted again later
        path = str(record.header.get("path"))
        if path in seen:
            found.append(f"{name} key {key}: path {path!r} also at {seen[path]}")
        seen.setdefault(path, f"{name} key {key}")
        if live is not None:
            live.setdefault(path, (first + key, record.header.get("sha256")))
    hidden = len(found) - _SHOWN_PER_SHARD
    return problems + found[:_SHOWN_PER_SHARD] + ([f"{name}: {hidden} more record problems"] if hidden > 0 else [])


def _record_problems(record: Record, key: int, labels: Any, identities: list[str]) -> list[str]:
    """What is wrong with one record (``labels``: its shard's label index)."""
    label = record.header.get("label")
    if not isinstance(label, int) or not 0 <= label < len(identities):
        return [f"label {label!r} outside labels.json's {len(identities)} identities"]
    problems = []
    indexed = int(labels[key]) if key < len(labels) else None
    if indexed != label:
        problems.append(f"label {label} != label index {indexed}")
    reason = unsafe_path_reason(record.header.get("path"))
    if reason is not None:
        problems.append(f"unsafe path {record.header.get('path')!r} ({reason})")
    elif record.header["path"].split("/", 1)[0] != identities[label]:
        problems.append(f"path {record.header['path']!r} is not under {identities[label]!r}, label {label} in labels.json")
    try:
        decode_image(record.payload)
    except (OSError, ValueError) as error:
        problems.append(f"payload does not decode ({error})")
    return problems


def _verify_sources(root: Path, manifest: dict[str, Any], *, live: dict[str, tuple[int, Any]]) -> list[str]:
    """sources.jsonl against the manifest's hash and the shards: each accepted file's line names the
    stored index and sha256 of its record, each live record has a line, each reject line a rejects.jsonl
    line with its path and reason, in order."""
    problems: list[str] = []
    accepted = 0
    rejects = _jsonl_objects(root / "rejects.jsonl")
    try:
        for entry in source_entries(root / SOURCES_FILE, expected=manifest.get(SOURCES_KEY)):
            if entry.sample is None:
                reject = next(rejects, None)
                if not isinstance(reject, dict) or (reject.get("path"), reject.get("reason")) != (entry.path, entry.reason):
                    problems.append(f"{SOURCES_FILE}: reject {entry.path!r} is not the next line of rejects.jsonl")
                continue
            accepted += 1
            if live.get(entry.path) != (entry.sample, entry.sha256):
                held = live.get(entry.path)
                problems.append(
                    f"{SOURCES_FILE}: {entry.path!r} at sample {entry.sample}, sha256 {str(entry.sha256)[:12]}; the shards: "
                    + ("no live record" if held is None else f"sample {held[0]}, sha256 {str(held[1])[:12]}")
                )
    except FacepipeError as error:
        problems.append(str(error))
    if not problems and accepted != len(live):
        problems.append(f"{SOURCES_FILE}: {accepted} accepted files, the shards hold {len(live)} live records")
    hidden = len(problems) - _SHOWN_PER_SHARD
    return problems[:_SHOWN_PER_SHARD] + ([f"{SOURCES_FILE}: {hidden} more problems"] if hidden > 0 else [])


def _jsonl_objects(path: Path) -> Any:
    """The lines of a JSONL file as parsed values (None for a line that does not parse), one at a time."""
    if path.is_file():
        yield from read_jsonl(path, lenient=True)


def _verify_rejects(path: Path, manifest: dict[str, Any], *, seen: dict[str, str]) -> list[str]:
    """rejects.jsonl line by line: readable, no path also accepted or rejected twice, reasons as the manifest says."""
    if not path.is_file():
        return []  # metadata_problems names it
    problems: list[str] = []
    reasons: Counter[str] = Counter()
    for number, reject in enumerate(read_jsonl(path, lenient=True), start=1):
        try:
            reject_path, reason = reject["path"], reject["reason"]
        except (TypeError, KeyError):
            problems.append(f"rejects.jsonl line {number}: not a JSON object with path and reason")
            continue
        reasons[str(reason)] += 1
        if reject_path in seen:
            problems.append(f"rejects.jsonl line {number}: {reject_path!r} also at {seen[reject_path]}")
        seen.setdefault(reject_path, f"rejects.jsonl line {number}")
    recorded = manifest.get("rejected_by_reason")
    if recorded is not None and recorded != dict(reasons):
        problems.append("manifest rejected_by_reason differs from the reasons in rejects.jsonl")
    return problems
