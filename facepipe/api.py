"""The library calls for notebooks and scripts: ``facepipe.embed``, ``facepipe.compare``,
``facepipe.load_embeddings``, ``facepipe.search``. Each is the stage function the CLI calls, with the
params file's section and keyword overrides merged as the CLI merges its options."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from facepipe.config import EmbedParams, PrepareParams, load_section
from facepipe.gallery.store import Embeddings, load_embeddings

__all__ = ["embed", "compare", "search", "load_embeddings", "Embeddings"]


def _params(params_file: str | Path | None, overrides: dict[str, Any]) -> tuple[EmbedParams, PrepareParams | None]:
    params = load_section(params_file, "embed")
    faces = load_section(params_file, "prepare") if params_file is not None else None
    return EmbedParams.model_validate(params.model_dump() | overrides), faces


def embed(
    raw: str | Path,
    model: str | Path,
    out: str | Path,
    *,
    params_file: str | Path | None = None,
    workers: int | None = None,
    progress: bool = True,
    **overrides: Any,
) -> Embeddings:
    """Embed the faces of the photos under ``raw`` with ``model`` into the embedding folder ``out``
    (created, or updated: only new and changed photos are embedded) and return it in memory.
    ``overrides``: keys of the params file's ``embed`` section (``runtime="onnx"``, ``all_faces=True``, ...)."""
    from facepipe.stages import embed as stage

    params, faces = _params(params_file, overrides)
    stage.run(params, raw, model, out, faces_params=faces, workers=workers, progress=progress)
    return load_embeddings(out)


def compare(
    a: str | Path,
    b: str | Path,
    model: str | Path,
    *,
    thresholds: str | Path | None = None,
    far: float | None = None,
    params_file: str | Path | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """The similarity of the faces of photos ``a`` and ``b``, and ``same`` at evaluate's threshold
    (``thresholds``: its thresholds.json; ``far``: which rate, default the lowest measured)."""
    from facepipe.stages import compare as stage

    params, faces = _params(params_file, overrides)
    return stage.run(params, a, b, model, thresholds=thresholds, far=far, faces_params=faces)


def search(
    gallery: str | Path,
    probes: str | Path,
    *,
    model: str | Path | None = None,
    thresholds: str | Path | None = None,
    params_file: str | Path | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """The top-k identities (``top_k=``) of each probe face in ``gallery`` (an embedding folder):
    ``probes`` is another embedding folder, or photos (a file or folder) embedded with ``model``, the
    gallery's. Returns the summary; ``results`` holds one entry per probe face, best match first."""
    from facepipe.stages import search as stage

    params, faces = _params(params_file, overrides)
    return stage.run(params, gallery, probes, model=model, thresholds=thresholds, faces_params=faces)
