"""Import an insightface RecordIO pack (``train.rec`` + ``train.idx``) into a shard set.

The same contract as prepare (docs/architecture.md, "A prepared shard set"): every image record of the pack
is scanned once and ends as a sample or a reject (``scanned == accepted + rejected``), duplicates by
content are rejected, the set is written into a temporary sibling and renamed into place, and the
manifest is deterministic. A record's source path is ``<identity>/<rec name>#<key>`` (its identity
folder first, as every facepipe path), or ``<rec name>#<key>`` when its label cannot be read.

Identities are the pack's integer labels (insightface readers take the float label, or the first
value of an array label: a whole number below 2^24, which float32 holds exactly); an identity's name
in labels.json is that integer (or the name that ``facepipe export-rec`` recorded in the pack's
export.json), and labels are given in order of first appearance, so a pack whose images are grouped
by label in ascending order (as ``facepipe export-rec`` writes them) keeps its label numbers. Labels
need not be dense or start at 0 (arcface_torch reads any). With a header record, each identity
record's range holds one label, that of its first readable image (insightface's packers write one
identity record per run of equal labels, in the order the labels change, not by value), and each
image's label is checked against it. Identity records that are missing or unusable are counted (one
warning): their images keep their own labels.

Every number of the pack is bounded by what the pack can hold before anything is allocated (the
header's ranges by the index's keys); a pack with nothing importable is refused, nothing written.

The ``.bin`` validation sets beside the ``.rec`` (``lfw.bin``, ``cfp_fp.bin`` …) come along into
``OUT/validation/``, each read with the restricted reader first: a hostile or damaged one stops the
import before anything is written (:mod:`facepipe.io.validation_sets`).

Images are checked as prepare checks photos (decodable, not truncated, pixel limit) and must be
aligned crops: an ``image_size`` square JPEG (PNG for ``encoding: png``) is stored byte for byte;
any other size is resized onto the output as ``prepare.detector: none`` does (and counted, with a
warning). insightface reads these payloads with ``mx.image.imdecode``, which gives RGB; Pillow
gives the same RGB, so colours carry over unchanged.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from facepipe.alignment import align_face
from facepipe.cluster import chunk_runner, default_workers, ordered_results
from facepipe.config import PrepareParams
from facepipe.data.decode import Reject, load_image
from facepipe.data.extract import Outcome
from facepipe.detection.prealigned import aligned_landmarks
from facepipe.detection.registry import aligned_detector
from facepipe.errors import FacepipeError
from facepipe.io.atomic import check_output
from facepipe.io.manifest import dumps
from facepipe.io.records import decode_image, encode_image, unsafe_path_reason
from facepipe.io.insightface_rec import FLOAT32_EXACT, RecordIOError, read_index, read_property, read_record, scan_offsets, unpack
from facepipe.io.validation_sets import MANIFEST_KEY, bin_files_beside, check_bin_files, copy_bin_files
from facepipe.progress import Progress
from facepipe.shardset import SHARD_SET, Built, SetBuilder, build_set, reasons_text, warn_resized

log = logging.getLogger("facepipe.import")

#: Reject reasons of this importer, besides prepare's image reasons and ``duplicate``.
REC_REASONS = ("bad_record", "truncated_record", "missing_record", "bad_label", "label_mismatch")

_SIGNATURES = {"jpeg": b"\xff\xd8\xff", "png": b"\x89PNG\r\n\x1a\n"}


@dataclass(frozen=True)
class RecPack:
    """Where a pack's files are: the .rec, its .idx (None: scan the .rec), property.txt (None: absent),
    and identity names by label when ``facepipe export-rec`` wrote the pack (None: names are labels)."""

    rec: Path
    idx: Path | None
    prop: tuple[int, int, int] | None
    names: tuple[str, ...] | None = None

    def identity(self, label: int) -> str:
        """The identity folder name of ``label``."""
        return self.names[label] if self.names and label < len(self.names) else str(label)


def is_pack(source: str | Path) -> bool:
    """True when ``source`` is a .rec file or a folder holding ``train.rec``."""
    source = Path(source)
    return (source.is_file() and source.suffix == ".rec") or (source / "train.rec").is_file()


def find_pack(source: str | Path) -> RecPack:
    """The pack at ``source`` (a .rec file, or a folder with ``train.rec``). Raises FacepipeError."""
    source = Path(source)
    rec = source / "train.rec" if source.is_dir() else source
    if not rec.is_file() or rec.suffix != ".rec":
        raise FacepipeError(f"no RecordIO pack at {source} (expected a .rec file or a folder with train.rec)")
    idx = rec.with_suffix(".idx")
    try:
        prop = read_property(rec.parent / "property.txt")
    except RecordIOError as error:
        raise FacepipeError(str(error)) from None
    return RecPack(rec, idx if idx.is_file() else None, prop, _export_names(rec.parent / "export.json"))


def _export_names(path: Path) -> tuple[str, ...] | None:
    """The identity names export-rec recorded, when they are usable as folder names (else None)."""
    from facepipe.stages.export_rec import EXPORT_FORMAT

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        names = data["identities"] if data.get("format") == EXPORT_FORMAT else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    if not isinstance(names, list) or len(set(map(str, names))) != len(names):
        return None
    if any(unsafe_path_reason(name) is not None or "/" in name for name in names):
        return None
    return tuple(names)


#: One image to read: (key, offset in the .rec or None when the .idx lacks the key, identity the
#: header's ranges give it or None).
ImageRef = tuple[int, int | None, int | None]

#: Image records per unit of parallel work (checking a 112x112 record takes about 2 ms).
CHUNK_RECORDS = 256
#: Without an explicit worker count, packs this small are read in this process: starting a Dask
#: cluster (~5-25 s on 2 busy cores) costs more than it saves.
IN_PROCESS_BELOW = 20_000


@dataclass(frozen=True)
class Layout:
    """What a pack holds, as arrays (16-24 bytes an image, whatever the pack's size): ``keys`` [N]
    int64 image keys in reading order, ``offsets`` [N] int64 (-1: the .idx lacks the key),
    ``expected`` [N] int64 label the header's identity ranges give (-1: none); whether the pack has a
    header record; ``stray`` [S] int64 keys that are neither header, image nor identity records; and
    how many identity records the header promised were ``read``, ``missing`` or ``unusable``."""

    keys: np.ndarray
    offsets: np.ndarray
    expected: np.ndarray
    header: bool
    stray: np.ndarray
    identity_records: dict[str, int]

    def chunks(self, size: int) -> Iterator[list[ImageRef]]:
        """The images in reading order, ``size`` at a time (made as they are asked for)."""
        for start in range(0, len(self.keys), size):
            part = slice(start, start + size)
            columns = (self.keys[part].tolist(), self.offsets[part].tolist(), self.expected[part].tolist())
            yield [(k, o if o >= 0 else None, e if e >= 0 else None) for k, o, e in zip(*columns)]


def read_layout(pack: RecPack, handle: IO[bytes]) -> Layout:
    """The pack's layout from its .idx and header record (arcface_torch's ``MXFaceDataset`` rules:
    record 0 with flag > 0 is a header, else every key is an image). Raises FacepipeError."""
    keys, offsets = _entries(pack)
    if not len(keys):
        raise FacepipeError(f"no records in {pack.idx or pack.rec}")
    unique, first_at = np.unique(keys, return_index=True)
    order = np.lexsort((offsets, keys))
    clash = (keys[order][1:] == keys[order][:-1]) & (offsets[order][1:] != offsets[order][:-1])
    if clash.any():
        raise FacepipeError(f"key {keys[order][1:][clash][0]} appears twice in {pack.idx} with different offsets")

    def offset_of(wanted: np.ndarray) -> np.ndarray:
        at = np.minimum(np.searchsorted(unique, wanted), len(unique) - 1)
        return np.where(unique[at] == wanted, offsets[first_at][at], -1)

    first = _header_record(handle, int(offset_of(np.array([0]))[0]), keys=len(unique))
    if first is None:
        in_file_order = np.sort(first_at)
        none = np.full(len(in_file_order), -1, dtype=np.int64)
        counts = {"read": 0, "missing": 0, "unusable": 0}
        return Layout(keys[in_file_order], offsets[in_file_order], none, False, np.zeros(0, dtype=np.int64), counts)
    images_end, identities_end = first
    image_keys = np.arange(1, images_end, dtype=np.int64)
    image_offsets = offset_of(image_keys)
    expected = np.full(len(image_keys), -1, dtype=np.int64)
    present = unique[(unique >= images_end) & (unique < identities_end)]
    problems: list[tuple[int, str]] = []
    for key, offset in zip(present.tolist(), offset_of(present).tolist()):
        try:
            start, end = _identity_range(handle, offset, images_end=images_end)
        except RecordIOError as error:
            problems.append((key, str(error)))
            continue
        label = _range_label(handle, image_offsets[start - 1 : end - 1])
        if label is not None:  # else every image of the range is rejected before its label is compared
            expected[start - 1 : end - 1] = label
    missing = identities_end - images_end - len(present)
    counts = {"read": len(present) - len(problems), "missing": missing, "unusable": len(problems)}
    _warn_identity_records(problems, counts, _missing_keys(present, images_end, identities_end))
    stray = unique[unique >= identities_end]
    return Layout(image_keys, image_offsets, expected, True, stray, counts)


def _entries(pack: RecPack) -> tuple[np.ndarray, np.ndarray]:
    """([N] int64 keys, [N] int64 offsets) of the pack's records: its .idx, or a scan of the .rec
    (keys are then positions; stretches that could not be framed are counted in one warning)."""
    gaps: list[tuple[int, int]] = []
    try:
        if pack.idx:
            entries = read_index(pack.idx)
            return entries[:, 0], entries[:, 1]
        offsets = np.fromiter(scan_offsets(pack.rec, gaps=gaps), dtype=np.int64)
    except RecordIOError as error:
        raise FacepipeError(str(error)) from None
    if gaps:
        log.warning(
            "%s has no index: %d bytes in %d place(s) could not be framed and were skipped to the next record (first at offset %d)",
            pack.rec.name, sum(length for _, length in gaps), len(gaps), gaps[0][0],
        )
    return np.arange(len(offsets), dtype=np.int64), offsets


def _header_record(handle: IO[bytes], offset: int, *, keys: int) -> tuple[int, int] | None:
    """``(first identity key, end of identity keys)`` of the header record 0 (at ``offset``, -1: no
    key 0), or None without one. ``keys``: how many keys the index holds; neither range may promise
    more than twice that (a few missing keys are rejects; more is a wrong header)."""
    if offset < 0:
        return None
    try:
        header, _ = unpack(read_record(handle, offset))
    except RecordIOError as error:
        raise FacepipeError(f"record 0 (the header of an insightface pack) is unreadable: {error}") from None
    if header.flag == 0:
        return None
    if not isinstance(header.label, tuple) or len(header.label) < 2:
        raise FacepipeError(f"header record 0 has flag {header.flag} but not the two labels [images end, identities end]")
    images_end, identities_end = header.label[:2]
    if not (_whole(images_end) and _whole(identities_end) and 1 <= images_end <= identities_end < 2**63):
        raise FacepipeError(f"header record 0 gives impossible ranges [{images_end!r}, {identities_end!r}]")
    images_end, identities_end = int(images_end), int(identities_end)
    if images_end - 1 > 2 * keys:
        raise FacepipeError(f"header record 0 promises {images_end - 1} images, the index holds {keys} keys")
    if identities_end - images_end > 2 * keys:
        raise FacepipeError(f"header record 0 promises {identities_end - images_end} identity records, the index holds {keys} keys")
    return images_end, identities_end


def _whole(value: float) -> bool:
    return math.isfinite(value) and value == int(value)


def _identity_range(handle: IO[bytes], offset: int, *, images_end: int) -> tuple[int, int]:
    """``[first, end)`` image keys of one identity record, within ``1 .. images_end``. Raises
    RecordIOError saying why the record is unusable."""
    header, _ = unpack(read_record(handle, offset))
    if not isinstance(header.label, tuple) or len(header.label) < 2:
        raise RecordIOError(f"label {header.label!r} is not a range [first, end)")
    first, end = header.label[:2]
    if not (_whole(first) and _whole(end) and 1 <= first < end <= images_end):
        raise RecordIOError(f"range [{first!r}, {end!r}] is not within the image keys 1..{images_end - 1}")
    return int(first), int(end)


def _range_label(handle: IO[bytes], offsets: np.ndarray) -> int | None:
    """The label of the first image at ``offsets`` (-1: not in the .idx) that reads with a valid
    label: the one label of an identity range. None when no image of the range has one."""
    for offset in offsets[offsets != -1].tolist():
        try:
            label = whole_label(unpack(read_record(handle, offset))[0].first_label)
        except RecordIOError:
            continue
        if label is not None:
            return label
    return None


def whole_label(value: float) -> int | None:
    """``value`` as a label: a whole number in ``[0, 2^24)``, which float32 holds exactly; else None."""
    return int(value) if math.isfinite(value) and 0 <= value < FLOAT32_EXACT and value == int(value) else None


def _missing_keys(present: np.ndarray, start: int, end: int) -> Iterator[int]:
    """The keys of ``start .. end-1`` not in ``present``, lazily (the first few cost ``len(present)``)."""
    held = set(present.tolist())
    return (key for key in range(start, end) if key not in held)


#: How many problems a warning that counts them shows.
_EXAMPLES = 3


def _warn_identity_records(problems: list[tuple[int, str]], counts: dict[str, int], missing: Iterator[int]) -> None:
    """One warning for all the identity records that are missing or unusable, with the first few."""
    bad = counts["missing"] + counts["unusable"]
    if not bad:
        return
    missing_few = [(key, "missing from the index") for key in itertools.islice(missing, _EXAMPLES)]
    examples = sorted(problems + missing_few)[:_EXAMPLES]
    log.warning(
        "%d of %d identity records of the header are missing (%d) or unusable (%d), e.g. %s: their images"
        " are checked against their own labels only",
        bad, bad + counts["read"], counts["missing"], counts["unusable"], "; ".join(f"key {key}: {why}" for key, why in examples),
    )


def import_chunk(chunk: list[ImageRef], pack: RecPack, params: PrepareParams) -> list[Outcome]:
    """One :class:`Outcome` per image of ``chunk``, in order: the unit of parallel work (a Dask task)."""
    with open(pack.rec, "rb") as handle:
        return [_image_outcome(handle, pack, key, offset, params, expected) for key, offset, expected in chunk]


def _stray_outcomes(pack: RecPack, layout: Layout) -> list[Outcome]:
    detail = "the key lies outside the header record's image and identity ranges"
    return [Outcome(f"{pack.rec.name}#{key}", None, reason="bad_record", detail=detail) for key in layout.stray.tolist()]


def _image_outcome(
    handle: IO[bytes], pack: RecPack, key: int, offset: int | None, params: PrepareParams, expected: int | None
) -> Outcome:
    name = pack.rec.name
    where = f"{name}#{key}"
    if offset is None:
        return Outcome(where, None, reason="missing_record", detail="the header's image range holds this key; the .idx does not")
    try:
        header, payload = unpack(read_record(handle, offset))
    except RecordIOError as error:
        return Outcome(where, None, reason="truncated_record" if error.truncated else "bad_record", detail=str(error))
    label = whole_label(header.first_label)
    if label is None:
        return Outcome(where, None, reason="bad_label", detail=f"label {header.first_label!r} is not a whole number in [0, 2^24)")
    path = f"{pack.identity(label)}/{where}"
    sha = hashlib.sha256(payload).hexdigest()
    if expected is not None and expected != label:
        detail = f"label {label}, but the header puts key {key} in the identity range of label {expected}"
        return Outcome(path, sha, reason="label_mismatch", detail=detail)
    try:
        stored, image = aligned_payload(payload, params)
    except Reject as reject:
        return Outcome(path, sha, reason=reject.reason, detail=reject.detail)
    height, width = image.shape[:2]
    record_header = {
        "path": path,
        "sha256": sha,
        "box": [0.0, 0.0, float(width), float(height)],
        "landmarks": [[round(float(x), 3), round(float(y), 3)] for x, y in aligned_landmarks(width, height)],
        "score": 1.0,
        "source_size": [width, height],
        "encoding": params.encoding,
        "size": [params.image_size, params.image_size],
        "source": {"file": name, "key": key, "label": label},
    }
    return Outcome(path, sha, header=record_header, payload=stored)


def aligned_payload(payload: bytes, params: PrepareParams) -> tuple[bytes, np.ndarray]:
    """(bytes to store, the decoded [H, W, 3] uint8 RGB source) of one aligned crop. ``payload`` is kept
    as it is when it is an ``image_size`` square in ``params.encoding`` that decodes to the same pixels
    (no second JPEG generation); otherwise it is aligned as ``detector: none`` aligns and encoded.
    Raises :class:`Reject` (prepare's decode reasons, ``image_too_small``)."""
    image = load_image(payload, max_pixels=params.max_pixels)
    height, width = image.shape[:2]
    if min(height, width) < params.min_face_size:
        raise Reject("image_too_small", f"{width}x{height} is smaller than min_face_size={params.min_face_size}")
    size = params.image_size
    same = (height, width) == (size, size) and payload.startswith(_SIGNATURES[params.encoding])
    if same and np.array_equal(decode_image(payload), image):
        return payload, image
    aligned = align_face(image, aligned_landmarks(width, height), size)
    return encode_image(aligned, encoding=params.encoding, quality=params.quality), image


def run(
    params: PrepareParams, source: str | Path, out: str | Path, *, workers: int | None = None, progress: bool = True
) -> dict[str, Any]:
    """Import the pack at ``source`` into the shard set ``out``; returns the report (also report.json).

    Uses the ``prepare`` section for the output (size, encoding, quality, shard size, pixel limit),
    with ``detector: none`` recorded in the manifest. ``workers``: local Dask worker processes
    (default: one per core, or none below :data:`IN_PROCESS_BELOW` images; 1 runs in this process).
    The output is byte-identical for any number.
    """
    started = time.perf_counter()
    params = params.model_copy(update={"detector": aligned_detector(), "detector_weights": None})
    pack = find_pack(source)
    out = Path(out)
    bins = bin_files_beside(pack.rec.parent)
    files = {"record file": pack.rec, **({"index file": pack.idx} if pack.idx else {})}
    files |= {f"validation set {path.name}": path for path in bins}
    check_output(out, kind=SHARD_SET, sources={"pack folder": source} if Path(source).is_dir() else files)
    bin_entries = check_bin_files(bins)  # before any record is read: a bad .bin stops the import at once
    with open(pack.rec, "rb") as handle:
        layout = read_layout(pack, handle)
    scanned = len(layout.keys) + len(layout.stray)
    n_workers = workers or (default_workers() if len(layout.keys) >= IN_PROCESS_BELOW else 1)

    def produce(builder: SetBuilder) -> dict[str, Any]:
        # each worker opens the .rec itself; names may be long: the pack is sent to a worker once, not per chunk
        runner = chunk_runner(import_chunk, pack, params, here=n_workers == 1, workers=n_workers, broadcast=True)
        with runner as (submit, _), Progress(scanned, desc="import", enabled=progress) as bar:
            for outcomes in ordered_results(submit, layout.chunks(CHUNK_RECORDS), window=2 * n_workers + 1):
                for outcome in outcomes:
                    builder.add(outcome)
                bar.update(len(outcomes))
        for outcome in _stray_outcomes(pack, layout):
            builder.add(outcome)
        manifest = builder.finish(scanned)
        if not manifest["counts"]["accepted"]:
            raise FacepipeError(f"nothing imported from {pack.rec}: all {scanned} records were rejected ({reasons_text(builder)})")
        manifest["source"] = _source_entry(pack, layout)
        if bins:
            copy_bin_files(bins, bin_entries, builder.root)
            manifest[MANIFEST_KEY] = bin_entries
        (builder.root / "manifest.json").write_text(dumps(manifest), encoding="utf-8")
        return manifest

    def report(built: Built) -> dict[str, Any]:
        return {
            **_report(built, workers=n_workers, elapsed=time.perf_counter() - started),
            "identity_records": layout.identity_records,
            "validation_sets": {entry["file"]: entry["num_pairs"] for entry in bin_entries},
        }

    # rejected records live inside the pack: report.html lists them by path
    summary, builder = build_set(out, params, produce, report)
    warn_resized(builder, params.image_size)
    return summary


def _source_entry(pack: RecPack, layout: Layout) -> dict[str, Any]:
    """What the manifest says of the pack (names only, no absolute paths)."""
    return {
        "format": "insightface-recordio",
        "file": pack.rec.name,
        "header_record": layout.header,
        "property": list(pack.prop) if pack.prop else None,
    }


def _report(built: Built, *, workers: int, elapsed: float) -> dict[str, Any]:
    scanned = built.manifest["counts"]["scanned"]
    return {
        **built.counts(),
        "payload_bytes": built.builder.payload_bytes,
        "shard_bytes": built.shard_bytes,
        "resized": len(built.builder.resized),
        "workers": workers,
        "scheduler": "in-process" if workers == 1 else "local",
        "timings_s": {"total": round(elapsed, 3)},
        "images_per_s": round(scanned / max(elapsed, 1e-9), 2),
    }
