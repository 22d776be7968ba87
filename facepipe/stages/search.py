"""The search stage: a gallery (an embedding folder) and probes -> each probe's top-k identities.

Probes are another embedding folder, or photos (one file or a folder) embedded here with the
gallery's own model and settings, so both sides went through the same preprocessing. The answer is
a JSONL file (one line per probe face), a table on the console, and optionally a self-contained
HTML page of thumbnails (:mod:`facepipe.gallery.page`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from facepipe.config import EmbedParams, PrepareParams
from facepipe.data.scan import looks_like_image, scan_raw
from facepipe.errors import FacepipeError
from facepipe.gallery import store
from facepipe.gallery.faces import training_faces
from facepipe.gallery.page import MatchView, ProbeView, render_page
from facepipe.gallery.runtime import resolve_model
from facepipe.gallery.search import Gallery, Match
from facepipe.gallery.thumbs import face_thumbnail
from facepipe.io.atomic import atomic_write, check_apart
from facepipe.stages.compare import read_thresholds
from facepipe.stages.embed import Work, embed_chunks, embed_files

log = logging.getLogger("facepipe.search")


@dataclass(frozen=True)
class Probes:
    """The probe faces: ``matrix`` [P, E], their index lines, and where their photos are (thumbnails)."""

    matrix: np.ndarray
    rows: list[dict[str, Any]]
    raw: Path | None


def run(
    params: EmbedParams,
    gallery: str | Path,
    probes: str | Path,
    *,
    model: str | Path | None = None,
    jsonl: str | Path | None = None,
    html: str | Path | None = None,
    thresholds: str | Path | None = None,
    far: float | None = None,
    gallery_raw: str | Path | None = None,
    faces_params: PrepareParams | None = None,
) -> dict[str, Any]:
    """Search ``probes`` in ``gallery``; returns the summary and the results (``results``: one entry
    per probe face, its ``matches`` best first). ``jsonl`` and ``html``: files to write them to."""
    found = store.load_embeddings(gallery)
    if not len(found.rows):
        raise FacepipeError(f"the gallery {gallery} holds no face: there is nothing to search")
    for output in (jsonl, html):
        if output is not None:
            check_apart(output, {"gallery": gallery, "probes": probes})
    asked = _probes(params, found, Path(probes), model=model, faces_params=faces_params)
    threshold, rate, why = read_thresholds(thresholds, far) if thresholds is not None else (None, None, None)
    matches = Gallery(found.matrix, found.keys).search(asked.matrix, k=params.top_k, method=params.search_method)
    results = [_result(row, found.rows, hits) for row, hits in zip(asked.rows, matches)]
    if jsonl is not None:
        text = "".join(json.dumps(line, sort_keys=True) + "\n" for line in results)
        atomic_write(Path(jsonl), lambda handle: handle.write(text.encode()))
    if html is not None:
        photos = Path(gallery_raw) if gallery_raw is not None else _photos_of(Path(gallery))
        _write_page(Path(html), results, len(found.rows), asked, gallery_raw=photos, threshold=threshold)
    known = [r for r in results if r["identity"] is not None and r["identity"] in set(found.keys)]
    return {
        "gallery": {"rows": len(found.rows), "identities": len(set(found.keys))},
        "probes": len(results),
        "top_k": params.top_k,
        "method": params.search_method,
        "threshold": threshold,
        "far": rate,
        **({"why_no_threshold": why} if why else {}),
        "top1_correct": sum(1 for r in known if r["matches"] and r["matches"][0]["identity"] == r["identity"]),
        "top1_checked": len(known),
        "results": results,
    }


def _result(row: dict[str, Any], gallery_rows: list[dict[str, Any]], hits: list[Match]) -> dict[str, Any]:
    """A probe face and its matches, each with the gallery face that gave the identity its score."""
    return {
        "probe": row["path"],
        "face": row["face"],
        "identity": row["identity"],
        "box": row["box"],
        "matches": [
            {"identity": hit.identity, "score": round(hit.score, 6), "path": gallery_rows[hit.row]["path"],
             "face": gallery_rows[hit.row]["face"], "box": gallery_rows[hit.row]["box"]}
            for hit in hits
        ],
    }  # fmt: skip


def _probes(params: EmbedParams, gallery: store.Embeddings, probes: Path, *, model: str | Path | None, faces_params: PrepareParams | None) -> Probes:
    """The probe faces: an embedding folder of the gallery's model, or photos embedded with it."""
    recorded = gallery.manifest["model"]
    if (probes / store.MANIFEST).is_file():
        found = store.load_embeddings(probes)
        if found.manifest["model"]["sha256"] != recorded["sha256"]:
            raise FacepipeError(
                f"{probes} was embedded by another model file (sha256 {found.manifest['model']['sha256'][:12]}) than the gallery"
                f" ({recorded['sha256'][:12]}): their embeddings cannot be compared"
            )
        return Probes(found.matrix, found.rows, _photos_of(probes))
    if not probes.exists():
        raise FacepipeError(f"probes not found: {probes} (an embedding folder, a photo or a folder of photos)")
    if model is None:
        raise FacepipeError("photos as probes need --model: the gallery's model (a model folder, or an export folder with --runtime onnx)")
    ref = resolve_model(model, recorded["runtime"])
    if ref.sha256 != recorded["sha256"]:
        raise FacepipeError(f"{model} is not the model the gallery was embedded with ({recorded['file']}, sha256 {recorded['sha256'][:12]})")
    settings = gallery.manifest["embed"]
    work = Work(str(probes), training_faces(ref.spec, faces_params), ref, params.device, settings["flip"], settings["batch_size"], params.all_faces)
    return _embed_photos(probes, work)


def _embed_photos(probes: Path, work: Work) -> Probes:
    """Photos embedded in this process: one file, or every image under a folder (scan order)."""
    if probes.is_file():
        [(line, embeddings)] = embed_files([probes], work)
        lines, blocks, raw = [{**line, "path": probes.name}], [embeddings], probes.parent
    else:
        paths = [item.path for item in scan_raw(probes, follow_symlinks=work.faces.follow_symlinks) if item.reason is None and looks_like_image(item.path)]
        if not paths:
            raise FacepipeError(f"no images found under {probes}")
        chunk = work.faces.chunk_size
        done = embed_chunks([paths[i : i + chunk] for i in range(0, len(paths), chunk)], work)
        lines, blocks, raw = [line for chunk_lines, _ in done for line in chunk_lines], [e for _, e in done], probes
    for line in lines:
        if "reason" in line:
            log.warning("search: probe %s has no usable face (%s: %s)", line["path"], line["reason"], line["detail"])
    rows = list(store.index_lines(lines))
    return Probes(np.concatenate(blocks) if rows else np.zeros((0, work.model.spec.embedding_size), np.float32), rows, raw)


def _photos_of(folder: Path) -> Path | None:
    """Where an embedding folder's photos were (its report.json), if that folder still exists."""
    try:
        raw = Path(json.loads((folder / store.REPORT).read_text(encoding="utf-8"))["raw"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return raw if raw.is_dir() else None


def _write_page(html: Path, results: list[dict[str, Any]], faces: int, probes: Probes, *, gallery_raw: Path | None, threshold: float | None) -> None:
    """The search page: each probe face beside its matches, thumbnails cut from the photos
    (``gallery_raw``: the gallery's photo folder; without it, placeholders)."""
    raw = gallery_raw
    views = [
        ProbeView(
            name=f"{r['probe']}#{r['face']}" if r["face"] else r["probe"],
            identity=r["identity"],
            thumbnail=face_thumbnail(probes.raw, r["probe"], r["box"]) if probes.raw is not None else None,
            matches=[MatchView(m["identity"], m["score"], face_thumbnail(raw, m["path"], m["box"]) if raw is not None else None) for m in r["matches"]],
        )
        for r in results
    ]
    title = f"search: {len(results)} probe face(s) in a gallery of {faces} face(s)"
    page = render_page(views, title=title, threshold=threshold)
    atomic_write(html, lambda handle: handle.write(page.encode()))


def summary_line(summary: dict[str, Any]) -> str:
    """``search: P probe faces in N faces of I identities (method); top-1 correct c of n``."""
    gallery = summary["gallery"]
    line = f"search: {summary['probes']} probe face(s) in {gallery['rows']} face(s) of {gallery['identities']} identities ({summary['method']})"
    if summary["top1_checked"]:
        line += f"; top-1 correct for {summary['top1_correct']} of {summary['top1_checked']} probes of known identity"
    return line


def table(summary: dict[str, Any], *, limit: int = 50) -> str:
    """The first ``limit`` probes with their matches, one line each (the whole list is in the JSONL)."""
    lines = []
    for result in summary["results"][:limit]:
        name = f"{result['probe']}#{result['face']}" if result["face"] else result["probe"]
        found = ", ".join(f"{m['identity']} {m['score']:.3f}" for m in result["matches"])
        lines.append(f"{name}: {found}")
    if len(summary["results"]) > limit:
        lines.append(f"... {len(summary['results']) - limit} more (--jsonl FILE writes them all)")
    return "\n".join(lines)
