"""The prepare stage: a raw folder of face photos -> a shard set (DESIGN.md, "A prepared shard set").

Scan (sorted) -> fixed chunks -> Dask workers decode, detect, align and encode -> results come back
in chunk order -> one writer streams records into shards -> metadata -> atomic rename into place.
Chunks are cut from the sorted file list, not by worker, so the output is byte-identical for any
number of workers.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from facepipe.alignment import template
from facepipe.config import PrepareParams
from facepipe.data.extract import Outcome, process_chunk, warm_up, with_scan_rejects
from facepipe.data.scan import ScanItem, looks_like_image, scan_raw
from facepipe.errors import FacepipeError
from facepipe.io.atomic import OutputKind, atomic_output_dir, check_output, json_key_file
from facepipe.io.manifest import (
    SOURCES_FILE,
    SOURCES_KEY,
    SourcesDigest,
    build_manifest,
    dumps,
    duplicate_detail,
    reject_line,
    write_metadata,
)
from facepipe.io.records import encode_record
from facepipe.io.shards import SET_FORMAT, ShardInfo, ShardWriter
from facepipe.io.validation_sets import PATTERN as VALIDATION_PATTERN
from facepipe.parallel import FutureLike, default_workers, dask_client, ordered_results
from facepipe.progress import Progress
from facepipe.quality import REPORT_FILE, write_report
from facepipe.stages.update import NEW_SHARDS, NotGrowable, UpdatePlan, file_stats, has_set, link_shards, place_new_shards, plan_update

log = logging.getLogger("facepipe.prepare")

#: Runs :func:`process_chunks` on a group of chunks (scan paths) somewhere; the future's result is
#: one list of outcomes per chunk.
Submit = Callable[[list[list[str]]], FutureLike]


class ChunkFailed(RuntimeError):
    """A chunk broke outside the per-image rejects (a worker fault: memory, a lost file system, a bug);
    the message names the chunk's first and last file."""


def process_chunks(chunks: list[list[str]], raw: str, params: PrepareParams, device: str = "auto") -> list[list[Outcome]]:
    """The chunk worker (picklable, runs in Dask workers and Prefect tasks): every chunk of scan paths
    (relative to ``raw``) read, decoded, detected, aligned and encoded, in order; one list of
    outcomes per chunk, one outcome per path. Raises :class:`ChunkFailed` naming the chunk that broke."""
    results = []
    for paths in chunks:
        try:
            results.append(process_chunk(paths, raw, params, device))
        except Exception as error:
            raise ChunkFailed(
                f"chunk {paths[0]} .. {paths[-1]} ({len(paths)} files) failed: {type(error).__name__}: {error}"
            ) from error
    return results


def task_groups(chunks: list[list[ScanItem]], *, workers: int, most: int = 1) -> list[list[list[ScanItem]]]:
    """Consecutive chunks grouped into tasks of at most ``most`` chunks: fewer tasks where each one has
    a fixed cost (a Prefect task run), while the workers still finish together. Guided
    self-scheduling: a group takes at most 1/(2 x workers) of the chunks still left, so groups shrink
    to single chunks at the end of the run; ``most`` 1 gives one task per chunk."""
    groups, start = [], 0
    while start < len(chunks):
        size = max(1, min(most, (len(chunks) - start) // (2 * workers)))
        groups.append(chunks[start : start + size])
        start += size
    return groups

#: An existing OUT is replaced only when it is a shard set (manifest format) holding nothing else.
SHARD_SET = OutputKind(
    "shard set",
    patterns=(
        "manifest.json", "labels.json", "rejects.jsonl", SOURCES_FILE, "report.json", REPORT_FILE, "shards/shard-*.lmdb",
        VALIDATION_PATTERN,  # the .bin sets an import of an insightface folder brings along
    ),
    identify=json_key_file("manifest.json", "version", format=SET_FORMAT),
)


def check_paths(raw: str | Path, out: str | Path) -> None:
    """Cheap checks of RAW and OUT, before any scan, cluster or server starts. Raises FacepipeError."""
    raw, out = Path(raw), Path(out)
    if not raw.is_dir():
        raise FacepipeError(f"raw folder not found: {raw}")
    check_output(out, kind=SHARD_SET, sources={"raw folder": raw})


def check_inputs(raw: Path, out: Path, *, follow_symlinks: bool = False) -> list[ScanItem]:
    """Validate RAW and OUT before any work; returns the scan. Raises FacepipeError."""
    check_paths(raw, out)
    items = scan_raw(raw, follow_symlinks=follow_symlinks)
    if not any(looks_like_image(item.path) for item in items):
        raise FacepipeError(f"no images found under {raw}")
    return items


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
        new_shards = root / NEW_SHARDS if self.base.shards else root / "shards"
        self.writer = ShardWriter(new_shards, samples_per_shard=params.samples_per_shard)
        self.rejects = open(root / "rejects.jsonl", "w")
        self.sources = open(root / SOURCES_FILE, "w")
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
        self.resized: list[str] = []  # detector none: paths of crops that were not image_size squares
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
        if self.params.detector == "none" and outcome.header.get("source_size") != outcome.header.get("size"):
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
            params=self.base.params or _manifest_params(p),
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


def _manifest_params(params: PrepareParams) -> dict[str, Any]:
    """The resolved parameters for the manifest; weights given by path are recorded by name and sha256."""
    resolved = params.model_dump()
    if params.crop == "arcface":
        # recorded only when it differs from the one crop there was before: earlier sets keep their
        # manifest byte for byte (and stay growable by --update)
        del resolved["crop"], resolved["margin"]
    if params.detector_weights is not None:
        from facepipe.detection.weights import weights_record

        resolved["detector_weights"] = weights_record(params.detector_weights)
    return resolved


@contextmanager
def dask_submitter(
    raw: Path, params: PrepareParams, *, workers: int | None, scheduler_address: str | None, device: str
) -> Iterator[tuple[Submit, int]]:
    """A submit function that runs :func:`process_chunks` on Dask, and the number of workers behind it."""
    with dask_client(workers=workers, scheduler_address=scheduler_address, device=device) as client:
        n_workers = max(1, sum(client.nthreads().values()))
        # Every worker imports torch and loads the detector at once, before the first chunk is timed.
        client.run(warm_up, params, device)

        def submit(group: list[list[str]]) -> FutureLike:
            return client.submit(process_chunks, group, str(raw), params, device, pure=False)

        yield submit, n_workers


def run(
    params: PrepareParams,
    raw: str | Path,
    out: str | Path,
    *,
    update: bool | Literal["auto"] = False,
    workers: int | None = None,
    scheduler_address: str | None = None,
    device: str = "auto",
    submit: Submit | None = None,
    warm: Callable[[], None] | None = None,
    chunks_per_task: int = 1,
    progress: bool = True,
    refuse_empty: bool = False,
) -> dict[str, Any]:
    """Prepare ``raw`` into the shard set ``out``; returns the run report (also written to report.json).

    ``update``: when ``out`` holds a set, add one generation for the files that are new or changed
    and record the removed ones, reusing the rest without decoding (:mod:`facepipe.stages.update`);
    an absent or empty ``out`` is prepared in full. ``update="auto"`` (what ``dvc repro`` runs): the
    same, except that a set which cannot be grown (written by an older facepipe, with other prepare
    params, or inconsistent) is prepared in full, with a warning, instead of refused. ``submit`` replaces the built-in Dask runner (the
    Prefect flow passes its task submission); it must run ``process_chunks(group, str(raw), params,
    device)`` and return a future. ``warm``, with ``submit``, readies the workers behind it (loads the
    detector) before the first chunk. ``chunks_per_task``: the most chunks one submission carries
    (:func:`task_groups`); the output is the same for any value. ``refuse_empty`` (``import``): a run
    that accepts no face raises FacepipeError and writes nothing, as an import of a pack does.
    """
    raw, out = Path(raw), Path(out)
    started = time.perf_counter()
    items = check_inputs(raw, out, follow_symlinks=params.follow_symlinks)
    plan = None
    if update and has_set(out):
        try:
            plan = plan_update(out, params, items, raw=raw, manifest_params=_manifest_params(params))
        except NotGrowable as error:
            if update != "auto":
                raise
            log.warning("prepare: %s cannot be grown (%s): preparing it in full", out, str(error).removeprefix("--update: "))
    stats = plan.stats if plan is not None else file_stats(raw, items)
    todo = plan.todo if plan is not None else items
    scan_s = time.perf_counter() - started
    # chunks of scan items; the scan's own rejects (loops, links out of RAW, ...) never go to a worker
    chunks = [todo[i : i + params.chunk_size] for i in range(0, len(todo), params.chunk_size)]
    log.info("prepare: %d files (%d to process) in %d chunks from %s", len(items), len(todo), len(chunks), raw)
    with atomic_output_dir(out, kind=SHARD_SET) as tmp:
        builder = SetBuilder(tmp, params, base=_base(plan))
        builder.stats = stats
        if plan is not None:
            link_shards(plan.base, tmp)
        try:
            startup_started = time.perf_counter()
            if not todo:  # nothing to read: no cluster, no detector
                runner = _given(_nothing_to_submit, 1, None)
            elif submit is None:
                runner = dask_submitter(raw, params, workers=workers, scheduler_address=scheduler_address, device=device)
            else:
                runner = _given(submit, workers or default_workers(), warm)
            with runner as (submit_chunk, n_workers), Progress(len(todo), desc="prepare", enabled=progress) as bar:
                process_started = time.perf_counter()
                startup_s = process_started - startup_started

                def to_read(group: list[list[ScanItem]]) -> FutureLike:
                    return submit_chunk([[item.path for item in chunk if item.reason is None] for chunk in group])

                groups = task_groups(chunks, workers=n_workers, most=chunks_per_task)
                done = ordered_results(to_read, groups, window=2 * n_workers + 1)
                results = (chunk_done for group_done in done for chunk_done in group_done)
                outcomes = (o for chunk, done in zip(chunks, results) for o in with_scan_rejects(chunk, done))
                for _ in plan.walk(builder, items, outcomes) if plan is not None else _add_all(builder, outcomes):
                    bar.update(1)
                process_s = time.perf_counter() - process_started
            if plan is None:
                manifest = builder.finish(len(items))
            else:
                excluded = plan.excluded(builder.kept)
                manifest = builder.finish(len(items), processed=len(todo), removed=plan.removed, excluded=excluded)
        except BaseException:
            builder.abort()
            raise
        if refuse_empty and not manifest["counts"]["accepted"]:
            raise FacepipeError(f"nothing imported from {raw}: all {len(items)} files were rejected ({reasons_text(builder)})")
        report_started = time.perf_counter()
        write_report(tmp, tmp / REPORT_FILE, raw=raw)  # bounded: a sample through the label index
        report_s = time.perf_counter() - report_started
        elapsed = time.perf_counter() - started
        generation = manifest["generations"][-1]
        report = {
            "counts": manifest["counts"],
            "rejected_by_reason": manifest["rejected_by_reason"],
            "num_identities": manifest["num_identities"],
            "num_shards": len(manifest["shards"]),
            "generation": generation["generation"],
            # files reused without decoding, processed (read, decoded, detected) and gone from RAW
            "files": {
                "reused": len(items) if builder.unchanged else generation["reused"],
                "processed": len(todo),
                "removed": 0 if builder.unchanged else generation["removed"],
            },
            **({"unchanged": True} if builder.unchanged else {}),
            "payload_bytes": builder.payload_bytes + (_base_payload(plan) if plan is not None else 0),
            **({"resized": len(builder.resized)} if params.detector == "none" else {}),
            "shard_bytes": sum((tmp / "shards" / s["file"]).stat().st_size for s in manifest["shards"]),
            "workers": n_workers,
            "scheduler": scheduler_address or ("local" if submit is None else "custom"),
            "timings_s": {
                "scan": round(scan_s, 3),  # with an update: also the comparison with sources.jsonl
                "startup": round(startup_s, 3),  # cluster start and detector load in every worker
                "process": round(process_s, 3),
                "report_html": round(report_s, 3),
                "total": round(elapsed, 3),
            },
            "images_per_s": round(len(todo) / max(process_s, 1e-9), 2),
        }
        (tmp / "report.json").write_text(dumps(report))
    warn_resized(builder, params.image_size)
    return report


def _nothing_to_submit(group: list[list[str]]) -> FutureLike:
    raise AssertionError(f"no chunk was to be processed, got {len(group)} chunk(s)")


def _add_all(builder: SetBuilder, outcomes: Iterator[Outcome]) -> Iterator[int]:
    for outcome in outcomes:
        builder.add(outcome)
        yield 1


def _base(plan: UpdatePlan | None) -> Generation | None:
    """The :class:`Generation` an update builds on."""
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


def _base_payload(plan: UpdatePlan) -> int:
    """The payload bytes the base's report recorded (0 when it has none)."""
    try:
        return int(json.loads((plan.base.root / "report.json").read_text())["payload_bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def reasons_text(builder: SetBuilder) -> str:
    """``reason n, ...`` of the run's rejects, most frequent first."""
    return ", ".join(f"{reason} {n}" for reason, n in sorted(builder.reasons.items(), key=lambda kv: (-kv[1], kv[0])))


def warn_resized(builder: SetBuilder, size: int) -> None:
    """One warning for the pre-aligned crops (detector none) that had to be resized to ``size``."""
    if builder.resized:
        first = builder.resized[0]
        log.warning("%d aligned face(s) were not %dx%d and were resized (first: %s)", len(builder.resized), size, size, first)


@contextmanager
def _given(submit: Submit, n_workers: int, warm: Callable[[], None] | None) -> Iterator[tuple[Submit, int]]:
    if warm is not None:
        warm()
    yield submit, n_workers


def summary_line(report: dict[str, Any]) -> str:
    """``scanned N, accepted A, rejected R (reason n, ...) in T s, X images/s``."""
    counts = report["counts"]
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(report["rejected_by_reason"].items(), key=lambda kv: -kv[1]))
    return (
        f"prepare: scanned {counts['scanned']}, accepted {counts['accepted']}, rejected {counts['rejected']}"
        + (f" ({reasons})" if reasons else "")
        + f"; {report['num_identities']} identities in {report['num_shards']} shard(s);"
        + (f" generation {report['generation']}: reused {files['reused']}, processed {files['processed']},"
           f" removed {files['removed']} file(s);" if (files := report.get("files")) and report.get("generation") and not report.get("unchanged") else "")
        + (f" unchanged (generation {report['generation']}): reused {report['files']['reused']} file(s);"
           if report.get("unchanged") else "")
        + f" {report['timings_s']['total']:.1f} s, {report['images_per_s']:.1f} images/s on {report['workers']} worker(s)"
    )
