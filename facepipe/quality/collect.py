"""What the data-quality report shows, gathered from a shard set at a bounded cost.

Nothing here reads every record: labels come from the per-shard label indexes (4 bytes a sample),
faces and detection scores from a seeded random sample of records, rejects from one pass over
``rejects.jsonl`` keeping a bounded reservoir per reason. A 10M-face set costs one read of its label
indexes (40 MB), an argsort of them and a few thousand record reads.

The same set, source folder, seed and limits give the same :class:`QualityData` (and report bytes,
wherever the set lies: the page names no folder of its own).
"""

from __future__ import annotations

import io
import os
import random
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from facepipe.data.scan import read_raw_file, unescape_path
from facepipe.io import ShardSet
from facepipe.io.manifest import duplicate_of, read_jsonl
from facepipe.io.records import decode_header

#: Reject reasons whose source is never opened for a thumbnail: nothing to see (folders, empty or
#: missing files), or reading it is what the reject guards against (links out of RAW, FIFOs, bombs).
UNREAD_REASONS = frozenset({
    "empty_file", "io_error", "not_a_file", "symlink_loop", "outside_raw_root", "file_too_large",
    "too_many_pixels",
})
_THUMB_MAX_BYTES = 64 << 20  # a source file larger than this is not read for a thumbnail
_THUMB_MAX_PIXELS = 50_000_000  # nor one whose header promises more pixels


@dataclass(frozen=True)
class Limits:
    """Upper bounds on what one report reads and shows (its size grows with these, not with the set)."""

    identities: int = 40  # identities with a face sample
    faces_per_identity: int = 6
    rejects_per_reason: int = 8  # thumbnails per reject reason
    duplicates: int = 12  # cross-identity duplicate pairs shown (all are counted)
    scores: int = 2000  # records read for the detection-score histogram
    thumb_px: int = 96  # longest side of a rejected file's thumbnail


@dataclass(frozen=True)
class Thumb:
    """A source file as shown: its escaped path, and a JPEG thumbnail or why there is none."""

    path: str
    jpeg: bytes | None
    note: str = ""


@dataclass(frozen=True)
class RejectSample:
    reason: str
    detail: str
    thumb: Thumb


@dataclass(frozen=True)
class QualityData:
    """Everything the HTML shows. ``faces``: (identity, [aligned face payloads]) per sampled identity."""

    image: dict[str, Any]
    counts: dict[str, int]
    num_samples: int
    num_identities: int
    rejected_by_reason: dict[str, int]
    reject_samples: dict[str, list[RejectSample]]
    faces: list[tuple[str, list[bytes]]]
    faces_per_identity: np.ndarray = field(repr=False)  # [num_identities] int64 counts
    scores: np.ndarray = field(repr=False)  # [<= Limits.scores] float64 detection scores of sampled records
    cross_duplicates: int = 0
    duplicate_pairs: list[tuple[Thumb, Thumb]] = field(default_factory=list)
    raw_available: bool = False
    limits: Limits = Limits()


def collect(root: str | Path, *, raw: str | Path | None = None, seed: int = 0, limits: Limits = Limits()) -> QualityData:
    """Gather the report's content from the shard set ``root``; ``raw``: its source folder, for
    thumbnails of rejected files (None: paths only)."""
    root = Path(root)
    shard_set = ShardSet(root)
    try:
        labels = shard_set.labels()
        per_identity = np.bincount(labels, minlength=shard_set.num_identities) if len(labels) else np.zeros(shard_set.num_identities, np.int64)
        rng = np.random.default_rng(seed)
        faces = _face_sample(shard_set, labels, rng=rng, limits=limits)
        scores = _score_sample(shard_set, rng=rng, limit=limits.scores)
    finally:
        shard_set.close()
    raw_root = Path(raw) if raw is not None and Path(raw).is_dir() else None
    reasons, samples, cross, pairs = _scan_rejects(root / "rejects.jsonl", raw=raw_root, seed=seed, limits=limits)
    return QualityData(
        image=dict(shard_set.manifest.get("image", {})),
        counts=dict(shard_set.manifest.get("counts", {})),
        num_samples=len(labels),
        num_identities=shard_set.num_identities,
        rejected_by_reason=dict(sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))),
        reject_samples=samples,
        faces=faces,
        faces_per_identity=per_identity,
        scores=scores,
        cross_duplicates=cross,
        duplicate_pairs=pairs,
        raw_available=raw_root is not None,
        limits=limits,
    )


def _face_sample(shard_set: ShardSet, labels: np.ndarray, *, rng: np.random.Generator, limits: Limits) -> list[tuple[str, list[bytes]]]:
    """Seeded random identities (shown in label order), each with seeded random faces in set order."""
    if not len(labels):
        return []
    order = np.argsort(labels, kind="stable")  # samples grouped by label, set order within a label
    starts = np.searchsorted(labels[order], np.arange(shard_set.num_identities + 1))
    present = np.flatnonzero(np.diff(starts) > 0)
    chosen = np.sort(rng.choice(present, size=min(limits.identities, len(present)), replace=False))
    faces = []
    for label in chosen.tolist():
        members = order[starts[label] : starts[label + 1]]
        picked = np.sort(rng.choice(members, size=min(limits.faces_per_identity, len(members)), replace=False))
        faces.append((shard_set.identities[label], [shard_set.record(int(i)).payload for i in picked]))
    return faces


def _score_sample(shard_set: ShardSet, *, rng: np.random.Generator, limit: int) -> np.ndarray:
    """Detection scores of up to ``limit`` seeded random records (headers only are parsed)."""
    total = len(shard_set)
    picked = np.sort(rng.choice(total, size=min(limit, total), replace=False)) if total else np.zeros(0, np.int64)
    scores = []
    for index in picked.tolist():
        header, _ = decode_header(shard_set.get(index), verify=False)  # get() checked the CRC
        if isinstance(header.get("score"), (int, float)):
            scores.append(float(header["score"]))
    return np.asarray(scores, dtype=np.float64)


def _scan_rejects(
    path: Path, *, raw: Path | None, seed: int, limits: Limits
) -> tuple[Counter[str], dict[str, list[RejectSample]], int, list[tuple[Thumb, Thumb]]]:
    """One pass over rejects.jsonl: counts by reason, a seeded reservoir of rejects per reason, and
    the cross-identity duplicates (counted; the first few kept). Thumbnails are made at the end."""
    reasons: Counter[str] = Counter()
    reservoirs: dict[str, list[dict[str, Any]]] = {}
    cross: list[tuple[str, str]] = []
    cross_total = 0
    pick = random.Random(seed)
    for reject in map(_parse, read_jsonl(path, lenient=True) if path.is_file() else ()):
        if reject is None:
            continue
        reason = reject["reason"]
        reasons[reason] += 1
        _reservoir(reservoirs.setdefault(reason, []), reject, seen=reasons[reason], size=limits.rejects_per_reason, rng=pick)
        copied = duplicate_of(reject["detail"], reject["path"]) if reason == "duplicate" else None
        if copied is not None and copied[1]:
            cross_total += 1
            if len(cross) < limits.duplicates:
                cross.append((copied[0], reject["path"]))
    samples = {
        reason: [
            RejectSample(reason, r["detail"], thumbnail(raw, r["path"], reason=reason, size=limits.thumb_px))
            for r in sorted(reservoirs[reason], key=lambda r: r["path"])
        ]
        for reason in sorted(reservoirs, key=lambda k: (-reasons[k], k))
    }
    pairs = [(thumbnail(raw, a, size=limits.thumb_px), thumbnail(raw, b, size=limits.thumb_px)) for a, b in cross]
    return reasons, samples, cross_total, pairs


def _parse(reject: Any) -> dict[str, str] | None:
    """A rejects.jsonl line's value as {path, reason, detail}, or None when it is not a reject."""
    try:
        return {"path": str(reject["path"]), "reason": str(reject["reason"]), "detail": str(reject.get("detail", ""))}
    except (TypeError, KeyError, AttributeError):
        return None  # verify reports malformed lines; the report shows what it can


def _reservoir(kept: list[dict[str, Any]], item: dict[str, Any], *, seen: int, size: int, rng: random.Random) -> None:
    """Algorithm R: after ``seen`` items, ``kept`` is a uniform sample of ``size`` of them."""
    if len(kept) < size:
        kept.append(item)
    else:
        slot = rng.randrange(seen)
        if slot < size:
            kept[slot] = item


def thumbnail(raw: Path | None, path: str, *, reason: str | None = None, size: int = 96) -> Thumb:
    """A JPEG thumbnail (longest side ``size``) of the source file ``path`` under ``raw``, when it is
    a regular file that resolves inside ``raw`` and decodes; otherwise why not."""
    if raw is None:
        return Thumb(path, None, "source folder not given")
    if reason in UNREAD_REASONS or path.endswith("/"):
        return Thumb(path, None, "not opened")
    base = os.path.realpath(os.fsencode(raw))
    target = os.path.realpath(os.path.join(base, unescape_path(path)))
    if os.path.commonpath([base, target]) != base:
        return Thumb(path, None, "outside the source folder")
    try:
        data = read_raw_file(raw, path, max_bytes=_THUMB_MAX_BYTES)
        return Thumb(path, _small_jpeg(data, size))
    except Exception as error:  # noqa: BLE001 - a rejected file may be anything; the report says so
        return Thumb(path, None, f"not decodable ({type(error).__name__})")


def _small_jpeg(data: bytes, size: int) -> bytes:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Image.open(io.BytesIO(data)) as pil:
            if pil.width * pil.height > _THUMB_MAX_PIXELS:
                raise ValueError(f"{pil.width}x{pil.height} pixels")
            pil.draft("RGB", (size, size))  # JPEG: decode at 1/2..1/8 scale, far cheaper than full size
            pil.load()
            image = ImageOps.exif_transpose(pil).convert("RGB")
    image.thumbnail((size, size))
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=80)
    return buffer.getvalue()
