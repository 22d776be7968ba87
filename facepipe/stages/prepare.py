"""The prepare stage: a raw folder of face photos -> a shard set (DESIGN.md, "A prepared shard set").

Scan (sorted) -> fixed chunks -> Dask workers decode, detect, align and encode -> results come back
in chunk order -> one writer streams records into shards -> metadata -> atomic rename into place.
Chunks are cut from the sorted file list, not by worker, so the output is byte-identical for any
number of workers.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from facepipe.alignment import template
from facepipe.config import PrepareParams, load_section
from facepipe.data.extract import Outcome, process_chunk, warm_up, with_scan_rejects
from facepipe.data.scan import ScanItem, looks_like_image, scan_raw
from facepipe.errors import FacepipeError
from facepipe.io.atomic import OutputKind, atomic_output_dir, check_output, json_key_file
from facepipe.io.manifest import build_manifest, dumps, reject_line, write_metadata
from facepipe.io.records import encode_record
from facepipe.io.shards import SET_FORMAT, ShardWriter
from facepipe.parallel import FutureLike, default_workers, dask_client, ordered_results
from facepipe.progress import Progress
from facepipe.quality import REPORT_FILE, write_report

log = logging.getLogger("facepipe.prepare")

Submit = Callable[[list[str]], FutureLike]

#: An existing OUT is replaced only when it is a shard set (manifest format) holding nothing else.
SHARD_SET = OutputKind(
    "shard set",
    patterns=("manifest.json", "labels.json", "rejects.jsonl", "report.json", REPORT_FILE, "shards/shard-*.lmdb"),
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
    """Consumes outcomes in input order: dedupes by content, assigns labels, writes shards and rejects."""

    def __init__(self, root: Path, params: PrepareParams) -> None:
        self.root = root
        self.params = params
        self.writer = ShardWriter(root / "shards", samples_per_shard=params.samples_per_shard)
        self.rejects = open(root / "rejects.jsonl", "w")
        self.identities: list[str] = []
        self.labels: dict[str, int] = {}
        self.first_seen: dict[str, str] = {}  # sha256 -> first path (sorted order) with those bytes
        self.reasons: Counter[str] = Counter()
        self.accepted = 0
        self.payload_bytes = 0
        self.resized: list[str] = []  # detector none: paths of crops that were not image_size squares

    def add(self, outcome: Outcome) -> None:
        if outcome.sha256 is not None:
            first = self.first_seen.setdefault(outcome.sha256, outcome.path)
            if first != outcome.path:
                crosses = first.split("/", 1)[0] != outcome.path.split("/", 1)[0]
                detail = f"same bytes as {first}" + (" (another identity)" if crosses else "")
                return self._reject(outcome.path, "duplicate", detail)
        if not outcome.accepted:
            return self._reject(outcome.path, outcome.reason or "unknown", outcome.detail)
        assert outcome.header is not None and outcome.payload is not None
        identity = outcome.path.split("/", 1)[0]
        if identity not in self.labels:
            self.labels[identity] = len(self.identities)
            self.identities.append(identity)
        label = self.labels[identity]
        record = encode_record({**outcome.header, "label": label}, outcome.payload)
        self.writer.write(record, label=label, payload_bytes=len(outcome.payload))
        self.accepted += 1
        self.payload_bytes += len(outcome.payload)
        if self.params.detector == "none" and outcome.header.get("source_size") != outcome.header.get("size"):
            self.resized.append(outcome.path)

    def _reject(self, path: str, reason: str, detail: str) -> None:
        self.reasons[reason] += 1
        self.rejects.write(reject_line({"path": path, "reason": reason, "detail": detail}))

    def finish(self, scanned: int) -> dict[str, Any]:
        """Close shards and write labels.json and, last, manifest.json; returns the manifest."""
        shards = self.writer.close()
        self.rejects.close()
        rejected = sum(self.reasons.values())
        if self.accepted + rejected != scanned:
            raise RuntimeError(f"accounting broken: {self.accepted} + {rejected} != {scanned} scanned")
        p = self.params
        manifest = build_manifest(
            shards,
            image={
                "size": p.image_size,
                "encoding": p.encoding,
                "quality": p.quality if p.encoding == "jpeg" else None,
                "template": "arcface",
                "template_points": template(p.image_size).round(4).tolist(),
            },
            num_identities=len(self.identities),
            counts={"scanned": scanned, "accepted": self.accepted, "rejected": rejected},
            params=_manifest_params(p),
        )
        manifest["rejected_by_reason"] = dict(sorted(self.reasons.items()))
        return write_metadata(self.root, manifest=manifest, identities=self.identities, rejects=None)

    def abort(self) -> None:
        self.writer.abort()
        self.rejects.close()


def _manifest_params(params: PrepareParams) -> dict[str, Any]:
    """The resolved parameters for the manifest; weights given by path are recorded by name and sha256."""
    resolved = params.model_dump()
    if params.detector_weights is not None:
        from facepipe.detection.weights import weights_record

        resolved["detector_weights"] = weights_record(params.detector_weights)
    return resolved


@contextmanager
def dask_submitter(
    raw: Path, params: PrepareParams, *, workers: int | None, scheduler_address: str | None, device: str
) -> Iterator[tuple[Submit, int]]:
    """A submit function that runs :func:`process_chunk` on Dask, and the number of workers behind it."""
    with dask_client(workers=workers, scheduler_address=scheduler_address) as client:
        n_workers = max(1, sum(client.nthreads().values()))
        # Every worker imports torch and loads the detector at once, before the first chunk is timed.
        client.run(warm_up, params, device)

        def submit(paths: list[str]) -> FutureLike:
            return client.submit(process_chunk, paths, str(raw), params, device, pure=False)

        yield submit, n_workers


def run(
    params: PrepareParams,
    raw: str | Path,
    out: str | Path,
    *,
    workers: int | None = None,
    scheduler_address: str | None = None,
    device: str = "auto",
    submit: Submit | None = None,
    warm: Callable[[], None] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Prepare ``raw`` into the shard set ``out``; returns the run report (also written to report.json).

    ``submit`` replaces the built-in Dask runner (the Prefect flow passes its task submission);
    it must run ``process_chunk(paths, str(raw), params, device)`` and return a future. ``warm``,
    with ``submit``, readies the workers behind it (loads the detector) before the first chunk.
    """
    raw, out = Path(raw), Path(out)
    started = time.perf_counter()
    items = check_inputs(raw, out, follow_symlinks=params.follow_symlinks)
    scan_s = time.perf_counter() - started
    paths = [item.path for item in items]
    # chunks of scan items; the scan's own rejects (loops, links out of RAW, ...) never go to a worker
    chunks = [items[i : i + params.chunk_size] for i in range(0, len(items), params.chunk_size)]
    log.info("prepare: %d files in %d chunks from %s", len(paths), len(chunks), raw)
    with atomic_output_dir(out, kind=SHARD_SET) as tmp:
        builder = SetBuilder(tmp, params)
        try:
            startup_started = time.perf_counter()
            if submit is None:
                runner = dask_submitter(raw, params, workers=workers, scheduler_address=scheduler_address, device=device)
            else:
                runner = _given(submit, workers or default_workers(), warm)
            with runner as (submit_chunk, n_workers), Progress(len(paths), desc="prepare", enabled=progress) as bar:
                process_started = time.perf_counter()
                startup_s = process_started - startup_started

                def to_read(chunk: list[ScanItem]) -> FutureLike:
                    return submit_chunk([item.path for item in chunk if item.reason is None])

                for chunk, processed in zip(chunks, ordered_results(to_read, chunks, window=2 * n_workers + 1)):
                    outcomes = with_scan_rejects(chunk, processed)
                    for outcome in outcomes:
                        builder.add(outcome)
                    bar.update(len(outcomes))
                process_s = time.perf_counter() - process_started
            manifest = builder.finish(len(paths))
        except BaseException:
            builder.abort()
            raise
        report_started = time.perf_counter()
        write_report(tmp, tmp / REPORT_FILE, raw=raw)  # bounded: a sample through the label index
        report_s = time.perf_counter() - report_started
        elapsed = time.perf_counter() - started
        report = {
            "counts": manifest["counts"],
            "rejected_by_reason": manifest["rejected_by_reason"],
            "num_identities": manifest["num_identities"],
            "num_shards": len(manifest["shards"]),
            "payload_bytes": builder.payload_bytes,
            **({"resized": len(builder.resized)} if params.detector == "none" else {}),
            "shard_bytes": sum((tmp / "shards" / s["file"]).stat().st_size for s in manifest["shards"]),
            "workers": n_workers,
            "scheduler": scheduler_address or ("local" if submit is None else "custom"),
            "timings_s": {
                "scan": round(scan_s, 3),
                "startup": round(startup_s, 3),  # cluster start and detector load in every worker
                "process": round(process_s, 3),
                "report_html": round(report_s, 3),
                "total": round(elapsed, 3),
            },
            "images_per_s": round(len(paths) / max(process_s, 1e-9), 2),
        }
        (tmp / "report.json").write_text(dumps(report))
    warn_resized(builder, params.image_size)
    return report


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
        + f" {report['timings_s']['total']:.1f} s, {report['images_per_s']:.1f} images/s on {report['workers']} worker(s)"
    )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from facepipe.cli import add_params_argument

    parser = subparsers.add_parser("prepare", help="raw face photos -> aligned faces in LMDB shards")
    parser.add_argument("raw", type=Path, metavar="RAW", help="folder with one sub-folder per identity")
    parser.add_argument("out", type=Path, metavar="OUT", help="shard set to write (replaced atomically)")
    add_params_argument(parser)
    parser.add_argument("--workers", type=int, default=None, metavar="N", help="local worker processes (default: one per core)")
    parser.add_argument("--scheduler-address", default=None, metavar="ADDR", help="use an existing Dask cluster")
    parser.add_argument("--device", default="auto", help="detector device: auto, cpu, cuda, cuda:N")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if args.workers is not None and args.workers < 1:
        raise FacepipeError(f"--workers must be >= 1, got {args.workers}")
    params = load_section(args.params, "prepare")
    report = run(
        params, args.raw, args.out, workers=args.workers, scheduler_address=args.scheduler_address, device=args.device
    )
    print(summary_line(report))
    return 0
