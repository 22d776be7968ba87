"""The compare stage: two photos, one trained model -> their similarity, and "same" or "different"
at the threshold the model's evaluation found for a false accept rate (its ``thresholds.json``).

The faces are found, cut and embedded exactly as ``embed`` does (the training set's parameters); the
score is the cosine similarity of the two embeddings, which evaluate's thresholds are thresholds of.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from facepipe.config import EmbedParams, PrepareParams
from facepipe.errors import FacepipeError
from facepipe.gallery.faces import training_faces
from facepipe.gallery.runtime import resolve_model
from facepipe.stages.embed import Work, embed_files


def read_thresholds(path: str | Path, far: float | None) -> tuple[float | None, float | None, str | None]:
    """(threshold, its false accept rate, why there is none) from evaluate's ``thresholds.json``:
    at ``far`` when given (it must be one the file lists), else at the lowest rate measured."""
    path = Path(path)
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
        table = {float(key): value for key, value in content["thresholds"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise FacepipeError(f"{path}: not a thresholds.json of facepipe evaluate ({error})") from None
    if far is not None:
        if far not in table:
            rates = ", ".join(f"{key:g}" for key in sorted(table))
            raise FacepipeError(f"{path} has no threshold at FAR {far:g} (it has: {rates})")
        candidates = [far]
    else:
        candidates = sorted(table)
    for rate in candidates:
        value = table[rate]
        if isinstance(value, (int, float)) and math.isfinite(value):
            return float(value), rate, None
    measured = content.get("measured_on", {})
    at = f"FAR {far:g}" if far is not None else "any of its false accept rates"
    return None, None, (
        f"{path} has no threshold at {at}: {measured.get('num_different', '?')} different pairs are too few to measure it"
    )


def run(
    params: EmbedParams,
    a: str | Path,
    b: str | Path,
    model: str | Path,
    *,
    thresholds: str | Path | None = None,
    far: float | None = None,
    faces_params: PrepareParams | None = None,
) -> dict[str, Any]:
    """Compare the faces of photos ``a`` and ``b`` with the model in ``model``. Returns the score and,
    with ``thresholds`` (evaluate's thresholds.json), the threshold, its FAR and ``same``; without one,
    ``same`` is None and ``why`` says why. A photo without a usable face is a FacepipeError."""
    files = [Path(a), Path(b)]
    for file in files:
        if not file.is_file():
            raise FacepipeError(f"photo not found: {file}")
    ref = resolve_model(model, params.runtime)
    work = Work("", training_faces(ref.spec, faces_params), ref, params.device, params.flip, params.batch_size, False)
    threshold, rate, why = read_thresholds(thresholds, far) if thresholds is not None else (None, None, "no thresholds.json given (evaluate writes one: --thresholds)")
    embedded = []
    for line, embeddings in embed_files(files, work):
        if "reason" in line:
            raise FacepipeError(f"{line['path']}: no usable face ({line['reason']}: {line['detail']})")
        embedded.append((line["faces"][0], embeddings[0]))
    score = float(np.dot(embedded[0][1].astype(np.float64), embedded[1][1].astype(np.float64)))
    return {
        "a": {"path": str(files[0]), **embedded[0][0]},
        "b": {"path": str(files[1]), **embedded[1][0]},
        "score": round(score, 6),
        "threshold": threshold,
        "far": rate,
        "same": None if threshold is None else score >= threshold,
        "why": why,
    }


def summary_line(result: dict[str, Any]) -> str:
    """``compare: score 0.7123 >= 0.3141 (FAR 1e-3): same person`` or the score and why alone."""
    if result["same"] is None:
        return f"compare: score {result['score']:.4f} (no same/different answer: {result['why']})"
    relation, answer = (">=", "same person") if result["same"] else ("<", "different people")
    return f"compare: score {result['score']:.4f} {relation} {result['threshold']:.4f} (threshold at FAR {result['far']:g}): {answer}"
