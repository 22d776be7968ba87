"""The prepare stage: a raw folder of face photos -> a shard set (docs/architecture.md, "A prepared shard set").

Scan (sorted) -> fixed chunks -> Dask workers decode, detect, align and encode -> results come back
in chunk order -> one set builder streams records into shards -> metadata -> atomic rename into place
(:func:`facepipe.shardset.build_set`).
Chunks are cut from the sorted file list, not by worker, so the output is byte-identical for any
number of workers.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from functools import cached_property, partial
from pathlib import Path
from typing import Any, Literal

from facepipe.config import PrepareParams
from facepipe.data.extract import Outcome, process_chunk, warm_up, with_scan_rejects
from facepipe.data.scan import ScanItem, looks_like_image, scan_raw
from facepipe.errors import FacepipeError
from facepipe.io.atomic import check_output
from facepipe.cluster import FutureLike, chunk_runner, default_workers, local_workers, ordered_results
from facepipe.progress import Progress
from facepipe.shardset import SHARD_SET, Built, SetBuilder, build_set, manifest_params, reasons_text, warn_resized
from facepipe.shardset.builder import link_shards
from facepipe.shardset.update import NotGrowable, UpdatePlan, base_generation, base_payload, file_stats, has_set, plan_update

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
    and record the removed ones, reusing the rest without decoding (:mod:`facepipe.shardset.update`);
    an absent or empty ``out`` is prepared in full. ``update="auto"`` (what ``dvc repro`` runs): the
    same, except that a set which cannot be grown (written by an older facepipe, with other prepare
    params, or inconsistent) is prepared in full, with a warning, instead of refused. ``submit`` replaces the built-in Dask runner (the
    Prefect flow passes its task submission); it must run ``process_chunks(group, str(raw), params,
    device)`` and return a future. ``warm``, with ``submit``, readies the workers behind it (loads the
    detector) before the first chunk. ``chunks_per_task``: the most chunks one submission carries
    (:func:`task_groups`); the output is the same for any value. ``refuse_empty`` (``import``): a run
    that accepts no face raises FacepipeError and writes nothing, as an import of a pack does.
    Without ``submit`` or ``scheduler_address`` at most one local worker per chunk starts, and work
    that one worker can do runs in this process (:func:`_runner`); the output is the same.
    """
    raw, out = Path(raw), Path(out)
    job = _Job.scan(params, raw, out, update=update)
    log.info("prepare: %d files (%d to process) in %d chunks from %s", len(job.items), len(job.todo), len(job.chunks), raw)
    runner, scheduler = _runner(job, params, raw, workers=workers, scheduler_address=scheduler_address, device=device, submit=submit, warm=warm)
    report, builder = build_set(
        out,
        params,
        lambda builder: job.produce(builder, runner, chunks_per_task=chunks_per_task, progress=progress, refuse_empty=refuse_empty),
        lambda built: job.report(built, scheduler=scheduler),
        base=base_generation(job.plan),
        begin=None if job.plan is None else partial(link_shards, job.plan.base),
        raw=raw,
    )
    warn_resized(builder, params.image_size)
    return report


def _runner(
    job: _Job,
    params: PrepareParams,
    raw: Path,
    *,
    workers: int | None,
    scheduler_address: str | None,
    device: str,
    submit: Submit | None,
    warm: Callable[[], None] | None,
) -> tuple[AbstractContextManager[tuple[Submit, int]], str]:
    """Where the chunks run, and its name for the report: the given ``submit``, the Dask cluster at
    ``scheduler_address``, a local cluster of at most one worker per chunk, or this process when
    nothing is left to read or one worker is all the chunks can use (no cluster to wait for)."""
    if not job.todo:  # nothing to read: no cluster, no detector
        return chunk_runner(process_chunks, str(raw), params, device, here=True), "custom" if submit else "in-process"
    if submit is not None:
        return _given(submit, workers or default_workers(), warm), "custom"
    if scheduler_address is None:
        workers = local_workers(workers, chunks=len(job.chunks), device=device)
    if scheduler_address is None and workers == 1:
        return chunk_runner(process_chunks, str(raw), params, device, here=True, warm=partial(warm_up, params, device)), "in-process"
    runner = chunk_runner(
        process_chunks, str(raw), params, device,
        workers=workers, scheduler_address=scheduler_address, device=device, warm=partial(warm_up, params, device),
    )  # fmt: skip
    return runner, scheduler_address or "local"


@dataclass
class _Job:
    """One prepare run: what it scanned, what an update reuses (``plan``), and what it measured."""

    raw: Path
    params: PrepareParams
    items: list[ScanItem]
    plan: UpdatePlan | None
    stats: dict[str, tuple[int, int]]
    started: float
    timings: dict[str, float] = field(default_factory=dict)
    workers: int = 1

    @classmethod
    def scan(cls, params: PrepareParams, raw: Path, out: Path, *, update: bool | Literal["auto"]) -> _Job:
        """Check RAW and OUT, scan RAW and, for an update, decide what to reuse."""
        started = time.perf_counter()
        items = check_inputs(raw, out, follow_symlinks=params.follow_symlinks)
        plan = _plan(out, params, items, raw=raw, update=update)
        stats = plan.stats if plan is not None else file_stats(raw, items)
        job = cls(raw, params, items, plan, stats, started)
        job.timings["scan"] = time.perf_counter() - started  # with an update: also the comparison with sources.jsonl
        return job

    @property
    def todo(self) -> list[ScanItem]:
        """The items the workers read, in scan order (an update's new and changed files)."""
        return self.plan.todo if self.plan is not None else self.items

    @cached_property
    def chunks(self) -> list[list[ScanItem]]:
        """``todo`` in chunks of ``chunk_size``; the scan's own rejects (loops, links out of RAW, ...)
        ride along but never go to a worker."""
        size = self.params.chunk_size
        return [self.todo[i : i + size] for i in range(0, len(self.todo), size)]

    def produce(
        self,
        builder: SetBuilder,
        runner: AbstractContextManager[tuple[Submit, int]],
        *,
        chunks_per_task: int,
        progress: bool,
        refuse_empty: bool,
    ) -> dict[str, Any]:
        """Feed ``builder`` every scanned file in scan order (read by ``runner``'s workers or reused);
        returns the manifest. ``refuse_empty``: a set with no accepted face raises FacepipeError."""
        builder.stats = self.stats
        startup_started = time.perf_counter()
        with runner as (submit_chunk, n_workers), Progress(len(self.todo), desc="prepare", enabled=progress) as bar:
            process_started = time.perf_counter()
            self.timings["startup"] = process_started - startup_started  # cluster start, detector load in every worker
            self.workers = n_workers
            outcomes = self._outcomes(submit_chunk, n_workers=n_workers, most=chunks_per_task)
            for _ in self.plan.walk(builder, self.items, outcomes) if self.plan is not None else _add_all(builder, outcomes):
                self.timings.setdefault("first_photo_since_launch", _since_launch())
                bar.update(1)
            self.timings["process"] = time.perf_counter() - process_started
        if self.plan is None:
            manifest = builder.finish(len(self.items))
        else:
            excluded = self.plan.excluded(builder.kept)
            manifest = builder.finish(len(self.items), processed=len(self.todo), removed=self.plan.removed, excluded=excluded)
        if refuse_empty and not manifest["counts"]["accepted"]:
            raise FacepipeError(f"nothing imported from {self.raw}: all {len(self.items)} files were rejected ({reasons_text(builder)})")
        return manifest

    def _outcomes(self, submit_chunk: Submit, *, n_workers: int, most: int) -> Iterator[Outcome]:
        """The workers' outcomes of ``todo``, in scan order, with the scan's own rejects in place."""

        def to_read(group: list[list[ScanItem]]) -> FutureLike:
            return submit_chunk([[item.path for item in chunk if item.reason is None] for chunk in group])

        groups = task_groups(self.chunks, workers=n_workers, most=most)
        done = ordered_results(to_read, groups, window=2 * n_workers + 1)
        results = (chunk_done for group_done in done for chunk_done in group_done)
        return (o for chunk, done in zip(self.chunks, results) for o in with_scan_rejects(chunk, done))

    def report(self, built: Built, *, scheduler: str) -> dict[str, Any]:
        """report.json: what was built, from where, and how long each phase took."""
        builder, manifest = built.builder, built.manifest
        generation = manifest["generations"][-1]
        process_s = self.timings["process"]
        return {
            **built.counts(),
            "generation": generation["generation"],
            # files reused without decoding, processed (read, decoded, detected) and gone from RAW
            "files": {
                "reused": len(self.items) if builder.unchanged else generation["reused"],
                "processed": len(self.todo),
                "removed": 0 if builder.unchanged else generation["removed"],
            },
            **({"unchanged": True} if builder.unchanged else {}),
            "payload_bytes": builder.payload_bytes + (base_payload(self.plan) if self.plan is not None else 0),
            **({} if self.params.needs_alignment else {"resized": len(builder.resized)}),
            "shard_bytes": built.shard_bytes,
            "workers": self.workers,
            "scheduler": scheduler,
            "timings_s": {
                **{phase: round(self.timings[phase], 3) for phase in ("scan", "startup", "process")},
                # from this process's launch (interpreter and imports included) to the first file done
                **({"first_photo_since_launch": round(first, 3)} if (first := self.timings.get("first_photo_since_launch")) else {}),
                "report_html": built.report_html_s,
                "total": round(time.perf_counter() - self.started, 3),
            },
            "images_per_s": round(len(self.todo) / max(process_s, 1e-9), 2),
        }


def _plan(out: Path, params: PrepareParams, items: list[ScanItem], *, raw: Path, update: bool | Literal["auto"]) -> UpdatePlan | None:
    """What an update of ``out`` reuses; None for a full prepare (no update asked, nothing to grow, or
    with ``update="auto"`` a set that cannot be grown)."""
    if not (update and has_set(out)):
        return None
    try:
        return plan_update(out, items, raw=raw, manifest_params=manifest_params(params))
    except NotGrowable as error:
        if update != "auto":
            raise
        log.warning("prepare: %s cannot be grown (%s): preparing it in full", out, str(error).removeprefix("--update: "))
        return None


def _since_launch() -> float:
    """Seconds since this process started (the command's launch, for the CLI): on Linux from the
    kernel's start time of the process (10 ms ticks since boot), elsewhere psutil's (1 s resolution)."""
    try:
        fields = Path("/proc/self/stat").read_text(encoding="utf-8").rsplit(")", 1)[1].split()
        return time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, AttributeError, IndexError, ValueError):
        import psutil

        return time.time() - psutil.Process().create_time()


def _add_all(builder: SetBuilder, outcomes: Iterator[Outcome]) -> Iterator[int]:
    for outcome in outcomes:
        builder.add(outcome)
        yield 1


@contextmanager
def _given(submit: Submit, n_workers: int, warm: Callable[[], None] | None) -> Iterator[tuple[Submit, int]]:
    if warm is not None:
        warm()
    yield submit, n_workers


def summary_line(report: dict[str, Any], *, stage: str = "prepare") -> str:
    """``STAGE: scanned N, accepted A, rejected R (reason n, ...) in T s, X images/s``."""
    counts = report["counts"]
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(report["rejected_by_reason"].items(), key=lambda kv: -kv[1]))
    return (
        f"{stage}: scanned {counts['scanned']}, accepted {counts['accepted']}, rejected {counts['rejected']}"
        + (f" ({reasons})" if reasons else "")
        + f"; {report['num_identities']} identities in {report['num_shards']} shard(s);"
        + (f" generation {report['generation']}: reused {files['reused']}, processed {files['processed']},"
           f" removed {files['removed']} file(s);" if (files := report.get("files")) and report.get("generation") and not report.get("unchanged") else "")
        + (f" unchanged (generation {report['generation']}): reused {report['files']['reused']} file(s);"
           if report.get("unchanged") else "")
        + f" {report['timings_s']['total']:.1f} s, {report['images_per_s']:.1f} images/s on {report['workers']} worker(s)"
    )
