"""The ijb command: a trained backbone + an IJB-B/C folder (insightface's layout) -> 1:1 verification.

Each face is decoded from ``loose_crop/`` and aligned with its given 5 points onto the template the
model was trained on (threads decode and align while the model embeds the previous batch), embedded
with its mirror (optionally weighted by its detector score), pooled by media then template
(:mod:`facepipe.evaluation.templates`), and the template pairs scored by cosine.

Outputs::

    OUT/metrics.json     TAR at each far_targets rate (FPR <= rate, facepipe's convention; and
                         insightface_tar_at_far_*: the ROC point nearest the rate, insightface's), AUC, counts
    OUT/roc.csv          fpr,tpr,threshold, thinned to the curve's corners
    OUT/roc.png          the same curve, drawn
    OUT/thresholds.json  the score threshold at each rate
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from facepipe.alignment import align_face
from facepipe.config import IjbParams
from facepipe.data.decode import Reject, load_image
from facepipe.devices import resolve_device
from facepipe.errors import FacepipeError
from facepipe.evaluation.embed import embed_images
from facepipe.evaluation.templates import pair_scores, template_features
from facepipe.evaluation.insightface_ijb import insightface_tar_at_far
from facepipe.evaluation.verification import roc_auc, roc_curve, tar_at_far, thin_roc
from facepipe.io.atomic import OutputKind, atomic_output_dir, check_output, json_key_file
from facepipe.io.ijb import IjbProtocol, read_ijb
from facepipe.io.manifest import dumps
from facepipe.io.model_dir import load_backbone
from facepipe.plots import roc_png
from facepipe.stages.evaluate import ROC_FILE, ROC_PLOT, THRESHOLDS_FILE, check_arcface_crop, far_key, roc_csv_rows

log = logging.getLogger("facepipe.ijb")

METRICS_FILE = "metrics.json"
IJB_OUTPUT = OutputKind(
    "IJB evaluation folder",
    patterns=(METRICS_FILE, ROC_FILE, ROC_PLOT, THRESHOLDS_FILE),
    identify=json_key_file(METRICS_FILE, "protocol", "num_templates"),
)
#: Loose crops are small photos; anything bigger is not one (decompression bombs).
_MAX_PIXELS = 40_000_000


def aligned_face(protocol: IjbProtocol, index: int, *, size: int) -> np.ndarray:
    """[size, size, 3] uint8 RGB: face ``index`` decoded and aligned with its 5 points."""
    path = protocol.image_path(index)
    try:
        image = load_image(path.read_bytes(), max_pixels=_MAX_PIXELS)
    except OSError as error:
        raise FacepipeError(f"cannot read {path}: {error.strerror}") from None
    except Reject as reject:
        raise FacepipeError(f"{path}: {reject.reason} ({reject.detail})") from None
    return align_face(image, protocol.landmarks[index], size)


def aligned_faces(protocol: IjbProtocol, *, size: int, workers: int, window: int) -> Iterator[np.ndarray]:
    """Every face in order, decoded and aligned by ``workers`` threads, at most ``window`` ahead
    (PIL's decoder and OpenCV's warp release the GIL; the window bounds memory at 470k faces)."""
    count = len(protocol.images)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ijb-decode") as pool:
        pending: deque = deque()
        for index in range(count):
            pending.append(pool.submit(aligned_face, protocol, index, size=size))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def resolve_workers(workers: int | str) -> int:
    return (os.cpu_count() or 1) if workers == "auto" else int(workers)


def face_features(
    params: IjbParams,
    model: Any,
    protocol: IjbProtocol,
    *,
    image_size: int,
    normalization: tuple[float, float],
    device: Any,
    progress: bool = True,
) -> np.ndarray:
    """[F, E] float32 unit embeddings (face + mirror with ``flip``), times the detector score if asked."""
    workers = resolve_workers(params.workers)
    features = embed_images(
        model,
        aligned_faces(protocol, size=image_size, workers=workers, window=2 * params.batch_size + 4 * workers),
        count=len(protocol.images),
        batch_size=params.batch_size,
        flip=params.flip,
        device=device,
        progress=progress,
        normalization=normalization,
    )
    return features * protocol.scores[:, None].astype(np.float32) if params.detector_score else features


def ijb_metrics(params: IjbParams, protocol: IjbProtocol, features: np.ndarray) -> tuple[dict[str, Any], tuple]:
    """metrics.json and the exact ROC (fpr, tpr, thresholds) of the protocol's template pairs."""
    ids, pooled = template_features(features, protocol.templates, protocol.medias)
    scores = pair_scores(ids, pooled, protocol.pairs)
    fpr, tpr, thresholds = roc_curve(scores, protocol.same)
    num_negative = int((~protocol.same).sum())
    metrics: dict[str, Any] = {
        "protocol": protocol.target,
        "num_faces": len(protocol.images),
        "num_templates": len(ids),
        "num_media": len(np.unique(np.stack([protocol.templates, protocol.medias]), axis=1)[0]),
        "num_pairs": len(scores),
        "num_same": int(protocol.same.sum()),
        "num_different": num_negative,
        "flip": params.flip,
        "detector_score": params.detector_score,
        "auc": round(roc_auc(fpr, tpr), 6),
        "tar_convention": "TPR at the most permissive threshold whose FPR <= the rate (facepipe's)",
    }
    thresholds_at: dict[str, float | None] = {}
    for far in params.far_targets:
        tar = tar_at_far(fpr, tpr, thresholds, far=far, num_negative=num_negative)
        metrics[f"tar_at_far_{far_key(far)}"] = None if tar is None else round(tar.tar, 6)
        thresholds_at[far_key(far)] = None if tar is None else tar.threshold
    metrics["insightface_tar_convention"] = "TPR of the ROC point nearest the rate, as insightface's IJB evaluation"
    for far, tar_nearest in insightface_tar_at_far(scores, protocol.same, fars=tuple(params.far_targets)).items():
        metrics[f"insightface_tar_at_far_{far_key(far)}"] = round(tar_nearest, 6)
    return metrics | {"thresholds": thresholds_at}, (fpr, tpr, thresholds)


def run(
    params: IjbParams,
    model_dir: str | Path,
    root: str | Path,
    out: str | Path,
    *,
    target: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """IJB-B/C 1:1 verification of the backbone in ``model_dir``; returns metrics.json."""
    check_output(out, kind=IJB_OUTPUT, sources={"model folder": model_dir, "IJB folder": root})
    device = resolve_device(params.device, what="ijb.device")
    protocol = read_ijb(root, target=target)
    if protocol.same.all() or not protocol.same.any():
        raise FacepipeError(f"{root}: the template pairs need both same and different pairs")
    model, spec = load_backbone(model_dir, device=device)
    log.info("ijb: %s, %d faces, %d pairs on %s", protocol.target, len(protocol.images), len(protocol.pairs), device)
    check_arcface_crop(spec, what="IJB faces aligned on their 5 points")
    features = face_features(
        params, model, protocol, image_size=spec.image_size, device=device, progress=progress,
        normalization=(spec.normalization.mean, spec.normalization.std),
    )
    metrics, (fpr, tpr, thresholds) = ijb_metrics(params, protocol, features)
    at = metrics.pop("thresholds")
    with atomic_output_dir(out, kind=IJB_OUTPUT) as tmp:
        (tmp / METRICS_FILE).write_text(dumps(metrics), encoding="utf-8")
        (tmp / ROC_FILE).write_text(roc_csv_rows(fpr, tpr, thresholds), encoding="utf-8")
        (tmp / THRESHOLDS_FILE).write_text(
            dumps({"score": "cosine similarity of template features", "accept": "same person when score >= threshold",
                   "thresholds": at}),
            encoding="utf-8",
        )
        thin = thin_roc(fpr, tpr, thresholds)
        roc_png(thin[0], thin[1], tmp / ROC_PLOT, title=f"{protocol.target.upper()} 1:1, AUC {metrics['auc']:.4f}")
    return metrics


def summary_line(metrics: dict[str, Any]) -> str:
    tars = ", ".join(
        f"{key.removeprefix('tar_at_far_')} {'n/a' if value is None else f'{value:.4f}'}"
        for key, value in metrics.items()
        if key.startswith("tar_at_far_")
    )
    return f"ijb: {metrics['protocol']} TAR@FAR {tars} ({metrics['num_pairs']} pairs, {metrics['num_templates']} templates)"
