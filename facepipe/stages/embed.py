"""The embed stage: a folder of photos + a trained model -> an embedding folder (facepipe.gallery.store).

Faces are found and cut by prepare's own code (:func:`facepipe.data.extract.process_chunk`) with the
model's training set's parameters (model.json ``faces``), encoded and decoded again exactly as the
training set stores them, then embedded in batches (PyTorch or ONNX, :mod:`facepipe.gallery.runtime`),
all in the workers: only embeddings and index lines come back. Chunks are cut from the sorted scan
as prepare cuts them, so the output is byte-identical for any number of workers.

Parts of ``files_per_part`` photos are the unit of resume: each is written as soon as its chunks are
back; a killed run leaves complete parts that the next run reuses when they are exactly what it would
write. A run over a committed folder with the same model and settings is an update: photos whose size
and mtime are unchanged keep their rows without being read; new and changed photos go to new parts;
parts that lost photos are rewritten without them (no photo embedded again).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from facepipe.cluster import chunk_runner, local_workers, ordered_results
from facepipe.config import EmbedParams, PrepareParams
from facepipe.data.extract import Outcome, process_chunk, warm_up
from facepipe.data.scan import ScanItem, escape_name, file_stats, looks_like_image, scan_raw
from facepipe.errors import FacepipeError
from facepipe.gallery import store
from facepipe.gallery.faces import training_faces
from facepipe.gallery.runtime import ModelRef, embedder, resolve_model
from facepipe.io.atomic import atomic_write, check_apart, check_replaceable, remove_stale_temporaries
from facepipe.io.manifest import dumps, recorded_params
from facepipe.io.records import decode_image
from facepipe.progress import Progress

log = logging.getLogger("facepipe.embed")


@dataclass(frozen=True)
class Work:
    """What a worker needs besides a chunk's paths (picklable; the same for every chunk)."""

    raw: str
    faces: PrepareParams
    model: ModelRef
    device: str
    flip: bool
    batch_size: int
    all_faces: bool


#: One chunk back from a worker: a line per photo (``faces`` or ``reason``) and its faces' embeddings.
ChunkResult = tuple[list[dict[str, Any]], np.ndarray]


def embed_chunks(chunks: list[list[str]], work: Work) -> list[ChunkResult]:
    """The chunk worker (picklable): every photo of each chunk read, detected, aligned, encoded and
    decoded as the training set stores faces, then embedded; one result per chunk, in order."""
    embed = embedder(work.model, device=_model_device(work.device), flip=work.flip, batch_size=work.batch_size)
    results = []
    for paths in chunks:
        outcomes = process_chunk(paths, work.raw, work.faces, work.device, all_faces=work.all_faces, identity_folders=False)
        lines, crops = [], []
        for outcome in outcomes:
            lines.append(_photo_line(outcome))
            crops.extend(decode_image(face.payload) for face in (outcome, *outcome.others) if face.payload is not None)
        embeddings = embed(np.stack(crops)) if crops else np.zeros((0, work.model.spec.embedding_size), np.float32)
        results.append((lines, embeddings))
    return results


def _photo_line(outcome: Outcome) -> dict[str, Any]:
    """A photo's line in its part: its faces (box, landmarks, score) or why it has none."""
    if not outcome.accepted:
        return {"path": outcome.path, "sha256": outcome.sha256, "reason": outcome.reason, "detail": outcome.detail}
    faces = [{key: face.header[key] for key in ("box", "landmarks", "score")} for face in (outcome, *outcome.others)]
    return {"path": outcome.path, "sha256": outcome.sha256, "faces": faces}


def _model_device(device: str) -> str:
    from facepipe.devices import resolve_device_name

    return resolve_device_name(device, what="embed.device")


def _warm(work: Work) -> None:
    """Load the detector and the model in this worker before its first chunk."""
    warm_up(work.faces, work.device)
    embedder(work.model, device=_model_device(work.device), flip=work.flip, batch_size=work.batch_size)


def settings_key(work: Work, batch_size: int) -> str:
    """What makes two runs' rows interchangeable: the model file, runtime, faces params, flip,
    all_faces, batch size and device kind. A committed folder with another key is embedded anew."""
    content = {
        "model_sha256": work.model.sha256,
        "runtime": work.model.runtime,
        "faces": work.faces.model_dump(mode="json"),
        "flip": work.flip,
        "all_faces": work.all_faces,
        "batch_size": batch_size,
        "device": _model_device(work.device).partition(":")[0],
    }
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Rewrite:
    """A committed part that lost photos: ``lines`` (its photos still there) copied from ``old``."""

    old: str
    lines: list[dict[str, Any]]


@dataclass
class Plan:
    """What a run keeps, rewrites and embeds: ``parts`` in row order, each (name, source) where source
    is ``"keep"`` (a committed part as it is), a :class:`Rewrite`, or the scan items to embed."""

    parts: list[tuple[str, Any]] = field(default_factory=list)
    reused: int = 0
    removed: int = 0
    old_parts: dict[str, store.Part] = field(default_factory=dict)


def plan_parts(out: Path, items: list[ScanItem], stats: dict[str, tuple[int, int]], *, settings: str, files_per_part: int) -> Plan:
    """Decide the parts of this run from the committed folder ``out`` (if any, with the same settings):
    a part whose photos are all unchanged (size, mtime) is kept, one that lost some is rewritten
    under a new name, and every other photo is embedded into new parts of ``files_per_part``."""
    plan, kept_paths = Plan(), set()
    manifest = store.read_manifest(out) if (out / store.MANIFEST).is_file() else None
    # new parts are numbered after every committed one: until the new embed.json is written, the
    # committed parts stay exactly as it lists them, whatever this run does
    number = max((store.part_number(entry["name"]) + 1 for entry in manifest["parts"]), default=0) if manifest else 0
    if manifest is not None and manifest.get("settings") != settings:
        log.warning("embed: %s was embedded with another model or settings: every photo is embedded again", out)
    committed = manifest["parts"] if manifest is not None and manifest.get("settings") == settings else []
    for entry in committed:
        part = store.read_part(out, entry["name"])
        if part is None or part.header["embeddings_sha256"] != entry["sha256"]:
            log.warning("embed: %s is missing or corrupt: its photos are embedded again", entry["name"])
            continue
        plan.old_parts[entry["name"]] = part
        lines = [line for line in part.files if stats.get(line["path"]) == (line["size"], line["mtime_ns"])]
        plan.removed += sum(1 for line in part.files if line["path"] not in stats)
        plan.reused += len(lines)
        kept_paths.update(line["path"] for line in lines)
        if len(lines) == len(part.files):
            plan.parts.append((entry["name"], "keep"))
        elif lines:
            plan.parts.append((store.part_name(number), Rewrite(entry["name"], lines)))
            number += 1
    todo = [item for item in items if item.reason is None and item.path not in kept_paths]
    for start in range(0, len(todo), files_per_part):
        plan.parts.append((store.part_name(number), todo[start : start + files_per_part]))
        number += 1
    return plan


def run(
    params: EmbedParams,
    raw: str | Path,
    model: str | Path,
    out: str | Path,
    *,
    faces_params: PrepareParams | None = None,
    workers: int | None = None,
    scheduler_address: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Embed the faces of the photos under ``raw`` with the model in ``model`` (a model folder, or an
    export folder for ``runtime: onnx``) into the embedding folder ``out``; returns the run report
    (also report.json). A committed ``out`` with the same model and settings is updated: only new
    and changed photos are embedded. ``faces_params``: a params file's prepare section, which must
    agree with the model's training set (:func:`facepipe.gallery.faces.training_faces`)."""
    raw, out = Path(raw), Path(out)
    started = time.perf_counter()
    ref = resolve_model(model, params.runtime)
    work = Work(str(raw), training_faces(ref.spec, faces_params), ref, params.device, params.flip, params.batch_size, params.all_faces)
    items = _check(raw, out, Path(model), work.faces)
    stats = file_stats(raw, items)
    settings = settings_key(work, params.batch_size)
    plan = plan_parts(out, items, stats, settings=settings, files_per_part=params.files_per_part)
    todo = _resume(out, plan, stats, settings=settings)
    log.info("embed: %d photos, %d to embed in %d part(s) (%d reused, %d removed)", len(stats), sum(len(t) for _, t in todo), len(todo), plan.reused, plan.removed)
    timings = {"scan": time.perf_counter() - started}
    scheduler, n_workers = _embed_parts(
        out, todo, work, settings, stats, workers=workers, scheduler_address=scheduler_address, progress=progress, timings=timings
    )
    for name, source in plan.parts:
        if isinstance(source, Rewrite):
            _rewrite(out, name, plan.old_parts[source.old], source.lines, settings)
    manifest = _manifest(out, plan, items, ref=ref, work=work, settings=settings)
    report = {
        "raw": str(raw.resolve()),  # where the photos are (search shows thumbnails from there); not in embed.json
        "model": str(Path(model).resolve()),
        "counts": manifest["counts"],
        "files": {"reused": plan.reused, "embedded": sum(len(t) for _, t in todo), "removed": plan.removed},
        "workers": n_workers,
        "scheduler": scheduler,
        "timings_s": {key: round(value, 3) for key, value in timings.items()} | {"total": round(time.perf_counter() - started, 3)},
    }
    report["faces_per_s"] = round(report["files"]["embedded"] and manifest["counts"]["faces"] / max(timings.get("process", 0.0), 1e-9), 2)
    atomic_write(out / store.REPORT, lambda handle: handle.write(dumps(report).encode()))
    store.commit(out, manifest)
    return report


def _check(raw: Path, out: Path, model: Path, faces: PrepareParams) -> list[ScanItem]:
    """RAW, OUT and the scan, checked before any work; OUT is created. Raises FacepipeError."""
    if not raw.is_dir():
        raise FacepipeError(f"raw folder not found: {raw}")
    check_apart(out, {"raw folder": raw, "model folder": model})
    check_replaceable(out, store.EMBEDDING_FOLDER)
    items = scan_raw(raw, follow_symlinks=faces.follow_symlinks)
    if not any(looks_like_image(item.path) for item in items):
        raise FacepipeError(f"no images found under {raw}")
    (out / store.PARTS).mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out)
    remove_stale_temporaries(out / store.PARTS)
    return items


def _part_files(items: list[ScanItem], stats: dict[str, tuple[int, int]]) -> list[tuple[str, int | None, int | None]]:
    return [(item.path, *stats.get(item.path, (None, None))) for item in items]


def _resume(out: Path, plan: Plan, stats: dict[str, tuple[int, int]], *, settings: str) -> list[tuple[str, list[ScanItem]]]:
    """The parts left to embed: the plan's new parts, less those a killed run of the same plan wrote."""
    todo = []
    for name, source in plan.parts:
        if source == "keep" or isinstance(source, Rewrite):
            continue
        done = store.read_part(out, name)
        if done is not None and done.header["settings"] == settings:
            if [(line["path"], line["size"], line["mtime_ns"]) for line in done.files] == _part_files(source, stats):
                log.info("embed: %s is complete from an interrupted run: reused", name)
                continue
        todo.append((name, source))
    return todo


def _runner(work: Work, chunks: int, *, workers: int | None, scheduler_address: str | None) -> tuple[AbstractContextManager[Any], str]:
    """Where the chunks run: this process when one worker is all they can use, else Dask (local or
    at ``scheduler_address``), every worker warmed up (detector and model loaded) first."""
    warm = partial(_warm, work)
    if scheduler_address is None:
        workers = local_workers(workers, chunks=chunks, device=work.device)
        if workers == 1:
            return chunk_runner(embed_chunks, work, here=True, warm=warm), "in-process"
    runner = chunk_runner(embed_chunks, work, workers=workers, scheduler_address=scheduler_address, device=work.device, warm=warm)
    return runner, scheduler_address or "local"


def _embed_parts(
    out: Path,
    todo: list[tuple[str, list[ScanItem]]],
    work: Work,
    settings: str,
    stats: dict[str, tuple[int, int]],
    *,
    workers: int | None,
    scheduler_address: str | None,
    progress: bool,
    timings: dict[str, float],
) -> tuple[str, int]:
    """Embed the photos of ``todo``'s parts chunk by chunk on the workers, writing each part as soon
    as its last chunk is back; returns the scheduler's name and the number of workers."""
    if not todo:
        return "none", 0
    size = work.faces.chunk_size
    chunks = [(name, items[i : i + size]) for name, items in todo for i in range(0, len(items), size)]
    runner, scheduler = _runner(work, len(chunks), workers=workers, scheduler_address=scheduler_address)
    startup = time.perf_counter()
    with runner as (submit, n_workers), Progress(sum(len(items) for _, items in todo), desc="embed", enabled=progress) as bar:
        timings["startup"] = time.perf_counter() - startup
        process_started = time.perf_counter()
        results = ordered_results(lambda chunk: submit([[item.path for item in chunk]]), [c for _, c in chunks], window=2 * n_workers + 1)
        lines: list[dict[str, Any]] = []
        blocks: list[np.ndarray] = []
        for position, ((name, chunk), result) in enumerate(zip(chunks, results)):
            chunk_lines, embeddings = result[0]
            lines.extend(chunk_lines)
            blocks.append(embeddings)
            bar.update(len(chunk))
            if position + 1 == len(chunks) or chunks[position + 1][0] != name:
                _write_new_part(out, name, lines, blocks, work, settings, stats)
                lines, blocks = [], []
        timings["process"] = time.perf_counter() - process_started
    return scheduler, n_workers


def _write_new_part(
    out: Path, name: str, lines: list[dict[str, Any]], blocks: list[np.ndarray], work: Work, settings: str, stats: dict[str, tuple[int, int]]
) -> None:
    """A part of freshly embedded photos, each line with the size and mtime the scan saw before the
    photo was read (a photo changed while it was read is then seen as changed by the next run)."""
    stamped = []
    for line in lines:
        size, mtime_ns = stats.get(line["path"], (None, None))
        stamped.append({**line, "size": size, "mtime_ns": mtime_ns})
    store.write_part(out, name, settings, stamped, np.concatenate(blocks) if blocks else np.zeros((0, work.model.spec.embedding_size), np.float32))


def _rewrite(out: Path, name: str, old: store.Part, lines: list[dict[str, Any]], settings: str) -> None:
    """Part ``name``: the rows of ``old``'s photos that are still in ``lines`` (none embedded again)."""
    keep, rows, row = {line["path"] for line in lines}, [], 0
    for line in old.files:
        faces = len(line.get("faces", ()))
        if line["path"] in keep:
            rows.extend(range(row, row + faces))
        row += faces
    store.write_part(out, name, settings, lines, old.embeddings[np.asarray(rows, dtype=np.int64)])


def _manifest(out: Path, plan: Plan, items: list[ScanItem], *, ref: ModelRef, work: Work, settings: str) -> dict[str, Any]:
    """Write index.jsonl and rejects.jsonl from the parts in row order; returns embed.json's content."""
    parts, rejects = [], [{"path": i.path, "reason": i.reason, "detail": i.detail} for i in items if i.reason]
    photos = 0

    def index() -> Iterator[dict[str, Any]]:
        nonlocal photos
        for name, _ in plan.parts:
            header, files = store.read_part_lines(out, name)
            parts.append({"name": name, "photos": len(files), "faces": header["faces"], "sha256": header["embeddings_sha256"]})
            rejects.extend({"path": f["path"], "reason": f["reason"], "detail": f["detail"]} for f in files if "reason" in f)
            photos += sum(1 for f in files if "faces" in f)
            yield from store.index_lines(files)

    index_sha256 = store.write_jsonl(out / store.INDEX, index())
    rejects.sort(key=lambda line: line["path"])
    store.write_jsonl(out / store.REJECTS, rejects)
    return {
        "format": store.FORMAT,
        "version": store.VERSION,
        "model": ref.describe(),
        "faces": recorded_params(work.faces),
        "embed": {"flip": work.flip, "all_faces": work.all_faces, "batch_size": work.batch_size},
        "settings": settings,
        "counts": {"scanned": len(items), "photos": photos, "faces": sum(p["faces"] for p in parts), "rejected": len(rejects)},
        "parts": parts,
        "index_sha256": index_sha256,
    }


def summary_line(report: dict[str, Any]) -> str:
    """``embed: scanned N, F faces from P photos, rejected R; embedded E (reused U, removed D) in T s``."""
    counts, files = report["counts"], report["files"]
    return (
        f"embed: scanned {counts['scanned']}, {counts['faces']} face(s) from {counts['photos']} photo(s), rejected {counts['rejected']};"
        f" embedded {files['embedded']} photo(s), reused {files['reused']}, removed {files['removed']}"
        f" in {report['timings_s']['total']:.1f} s ({report['faces_per_s']} faces/s)"
    )


def embed_files(files: list[Path], work: Work) -> list[tuple[dict[str, Any], np.ndarray]]:
    """Each photo of ``files`` (anywhere) embedded in this process, as :func:`run` would: its line
    (faces, or reason and detail) and its faces' embeddings ``[faces, E]``, in order."""
    results = []
    for file in files:
        name = escape_name(os.fsencode(file.name))
        [(lines, embeddings)] = embed_chunks([[name]], replace(work, raw=str(file.parent)))
        results.append(({**lines[0], "path": str(file)}, embeddings))
    return results
