"""The evaluate stage: a trained backbone + a shard set + verification pairs -> metrics and a ROC.

Pairs come from the split stage (``pairs.jsonl``: global sample indexes, checked against the
samples' paths) or from an LFW-format ``pairs.txt`` (names and 1-based image numbers, matched to
records whose path ends in ``name/name_000N.jpg``). Each image is embedded once however many pairs
it is in.

Outputs::

    OUT/metrics.json      10-fold accuracy (mean, std, per fold), best threshold, AUC, TAR@FAR, counts
    OUT/roc.csv           fpr,tpr,threshold (thinned to the curve's corners), for ``dvc plots``
    OUT/roc.png           the same curve, drawn (opens offline)
    OUT/thresholds.json   the score threshold at each ``far_targets`` rate, to deploy the model at it

insightface's validation sets (``lfw.bin``, ``cfp_fp.bin`` …, :mod:`facepipe.io.insightface_bin`) are
evaluated by :func:`run_bin_sets`, several in one call: ``OUT/metrics.json`` holds each set's metrics
under ``sets``, facepipe's own beside insightface's (``insightface_*``), and ``OUT/<set>/`` its ROC
and thresholds.
"""

from __future__ import annotations

import csv
import io
import logging
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from facepipe.config import EvaluateParams
from facepipe.devices import resolve_device
from facepipe.errors import FacepipeError
from facepipe.evaluation.bin_sets import decode_bin_faces
from facepipe.evaluation.embed import embed_images
from facepipe.evaluation.insightface_protocol import insightface_verification
from facepipe.evaluation.pairs import lfw_image_key, parse_lfw_pairs, parse_pairs_jsonl
from facepipe.evaluation.verification import VerificationResult, cosine_scores, thin_roc, verification_metrics
from facepipe.io.atomic import OutputKind, atomic_output_dir, check_output, json_key_file
from facepipe.io.insightface_bin import BinSet, read_bin_set
from facepipe.io.manifest import check_shard_set, dumps, shard_set_crop
from facepipe.io.model_dir import ModelSpec, load_backbone
from facepipe.io.shards import ShardSet
from facepipe.plots import roc_png

log = logging.getLogger("facepipe.evaluate")

METRICS_FILE = "metrics.json"
ROC_FILE = "roc.csv"
ROC_PLOT = "roc.png"
THRESHOLDS_FILE = "thresholds.json"
#: An existing OUT is replaced only when it holds these files and nothing else.
EVALUATE_OUTPUT = OutputKind(
    "evaluation folder",
    patterns=(METRICS_FILE, ROC_FILE, ROC_PLOT, THRESHOLDS_FILE),
    identify=json_key_file(METRICS_FILE, "accuracy_mean"),
)
#: What :func:`run_bin_sets` writes: OUT/metrics.json, and per set OUT/<set>/{roc.csv, roc.png, thresholds.json}.
BIN_SETS_OUTPUT = OutputKind(
    "validation-set evaluation folder",
    patterns=(METRICS_FILE, f"*/{ROC_FILE}", f"*/{ROC_PLOT}", f"*/{THRESHOLDS_FILE}"),
    identify=json_key_file(METRICS_FILE, "sets"),
)

_SHOWN = 3  # example images named in an error


def _examples(items: list[str]) -> str:
    return ", ".join(items[:_SHOWN]) + (", ..." if len(items) > _SHOWN else "")


def resolve_split_pairs(text: str, source: Path, shard_set: ShardSet) -> tuple[np.ndarray, np.ndarray]:
    """``pairs.jsonl`` -> ([P, 2] int64 sample indexes, [P] bool same), every index checked by its path."""
    try:
        pairs = parse_pairs_jsonl(text)
    except ValueError as error:
        raise FacepipeError(f"{source}: {error}") from None
    expected = {(p.index1, p.path1) for p in pairs} | {(p.index2, p.path2) for p in pairs}
    unknown = []
    for index, path in sorted(expected):
        if not 0 <= index < len(shard_set):
            unknown.append(f"#{index} {path} (out of range)")
        elif shard_set.record(index).path != path:
            unknown.append(f"#{index} {path}")
    if unknown:
        raise FacepipeError(
            f"{source}: {len(unknown)} of {len(expected)} images are not in {shard_set.root} "
            f"({_examples(unknown)}); were the pairs made from this shard set?"
        )
    indexes = np.asarray([(p.index1, p.index2) for p in pairs], dtype=np.int64).reshape(-1, 2)
    return indexes, np.asarray([p.same for p in pairs], dtype=bool)


def resolve_lfw_pairs(text: str, source: Path, shard_set: ShardSet) -> tuple[np.ndarray, np.ndarray]:
    """LFW ``pairs.txt`` -> ([P, 2] int64 sample indexes, [P] bool same).

    Only the records of the named identities are read (found through the label index), and only
    their headers are used.
    """
    try:
        named = parse_lfw_pairs(text)
    except ValueError as error:
        raise FacepipeError(f"{source}: {error}") from None
    label_of = {name: label for label, name in enumerate(shard_set.identities)}
    wanted = [label_of[n] for n in sorted({p.name1 for p in named} | {p.name2 for p in named}) if n in label_of]
    index_of = {}
    for index in np.flatnonzero(np.isin(shard_set.labels(), wanted)).tolist():
        # The raw root may sit above the LFW folder: match on "name/name_000N.jpg" only.
        key = "/".join(PurePosixPath(shard_set.record(index).path).parts[-2:])
        index_of[key] = index
    keys = [(lfw_image_key(p.name1, p.number1), lfw_image_key(p.name2, p.number2)) for p in named]
    missing = sorted({key for pair in keys for key in pair if key not in index_of})
    if missing:
        total = len({key for pair in keys for key in pair})
        raise FacepipeError(
            f"{source}: {len(missing)} of {total} images are not in {shard_set.root} ({_examples(missing)}); "
            f"prepare may have rejected them (see its rejects.jsonl)"
        )
    indexes = np.asarray([(index_of[a], index_of[b]) for a, b in keys], dtype=np.int64).reshape(-1, 2)
    return indexes, np.asarray([p.same for p in named], dtype=bool)


def load_pairs(path: Path, shard_set: ShardSet) -> tuple[str, np.ndarray, np.ndarray]:
    """(format, [P, 2] int64 sample indexes, [P] bool same) of the pairs file at ``path``."""
    if not path.is_file():
        raise FacepipeError(f"pairs file not found: {path}")
    readers = {".jsonl": ("facepipe", resolve_split_pairs), ".txt": ("lfw", resolve_lfw_pairs)}
    if path.suffix not in readers:
        raise FacepipeError(f"{path}: unknown pairs format; expected split's .jsonl or an LFW-style .txt")
    kind, resolve = readers[path.suffix]
    indexes, same = resolve(path.read_text(encoding="utf-8"), path, shard_set)
    return kind, indexes, same


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def far_key(far: float) -> str:
    """``0.001`` -> ``"1e-3"``, ``0.0015`` -> ``"1.5e-3"``: the suffix of the TAR@FAR entries of metrics.json."""
    return np.format_float_scientific(far, trim="-", exp_digits=1)


def metrics_dict(result: VerificationResult, **extra: Any) -> dict[str, Any]:
    """metrics.json: flat scalars for ``dvc metrics`` (``extra`` among them), per-fold lists and notes."""
    metrics: dict[str, Any] = {
        "accuracy_mean": _round(result.accuracy_mean),
        "accuracy_std": _round(result.accuracy_std),
        "fold_accuracies": [_round(a) for a in result.fold_accuracies],
        "fold_thresholds": [_round(t) for t in result.fold_thresholds],
        "best_threshold": _round(result.best_threshold),
        "best_accuracy": _round(result.best_accuracy),
        "auc": _round(result.auc),
        "num_same": result.num_positive,
        "num_different": result.num_negative,
        **extra,
    }
    notes = []
    for far, tar in result.tar_at_far.items():
        metrics[f"tar_at_far_{far_key(far)}"] = None if tar is None else _round(tar.tar)
        metrics[f"threshold_at_far_{far_key(far)}"] = None if tar is None else _round(tar.threshold)
        if tar is None:
            notes.append(
                f"TAR@FAR={far_key(far)} not measurable: needs >= {int(np.ceil(1 / far))} different pairs, "
                f"have {result.num_negative}"
            )
    metrics["notes"] = notes
    return metrics


def thresholds_dict(result: VerificationResult) -> dict[str, Any]:
    """thresholds.json: the cosine-score threshold reaching each false accept rate (None: not measurable).

    Unrounded (metrics.json rounds to 6 places): a threshold rounded down could accept a pair more.
    """
    return {
        "score": "cosine similarity of L2-normalised embeddings",
        "accept": "same person when score >= threshold",
        "thresholds": {
            far_key(far): None if tar is None else tar.threshold for far, tar in result.tar_at_far.items()
        },
        "measured_on": {"num_same": result.num_positive, "num_different": result.num_negative},
    }


def roc_csv(result: VerificationResult) -> str:
    """``fpr,tpr,threshold`` rows, thinned to the corners of the curve; the first threshold is inf."""
    return roc_csv_rows(result.roc_fpr, result.roc_tpr, result.roc_thresholds)


def roc_csv_rows(roc_fpr: np.ndarray, roc_tpr: np.ndarray, roc_thresholds: np.ndarray) -> str:
    """:func:`roc_csv` of an exact ROC from :func:`~facepipe.evaluation.verification.roc_curve`."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["fpr", "tpr", "threshold"])
    for fpr, tpr, threshold in zip(*thin_roc(roc_fpr, roc_tpr, roc_thresholds)):
        writer.writerow([f"{fpr:.6f}", f"{tpr:.6f}", "inf" if np.isinf(threshold) else f"{threshold:.6f}"])
    return buffer.getvalue()


def run(
    params: EvaluateParams,
    model_dir: str | Path,
    prepared: str | Path,
    out: str | Path,
    *,
    pairs: str | Path | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Evaluate the backbone in ``model_dir`` on verification pairs of ``prepared``; returns metrics.json.

    ``pairs`` overrides ``params.pairs``.
    """
    pairs_path = Path(pairs if pairs is not None else params.pairs)
    sources = {"model folder": model_dir, "shard set": prepared, "pairs file": pairs_path}
    check_output(out, kind=EVALUATE_OUTPUT, sources=sources)
    device = resolve_device(params.device, what="evaluate.device")
    shard_set = check_shard_set(prepared)  # counts, sizes, small files' hashes: seconds, before any work
    kind, indexes, same = load_pairs(pairs_path, shard_set)
    num_same, num_different = int(same.sum()), int((~same).sum())
    if min(num_same, num_different) < params.folds:
        raise FacepipeError(
            f"{pairs_path}: {params.folds} folds need at least {params.folds} same and {params.folds} different "
            f"pairs, have {num_same} and {num_different}"
        )
    model, spec = load_backbone(model_dir, device=device)
    _check_faces_match(spec, shard_set.manifest, prepared=prepared)
    images, inverse = np.unique(indexes, return_inverse=True)
    inverse = inverse.reshape(indexes.shape)
    log.info("evaluate: %d pairs, %d distinct images, flip=%s on %s", len(indexes), len(images), params.flip, device)
    embeddings = embed_images(
        model,
        (shard_set.record(int(i)).image() for i in images),
        count=len(images),
        batch_size=params.batch_size,
        flip=params.flip,
        device=device,
        progress=progress,
        normalization=(spec.normalization.mean, spec.normalization.std),
    )
    scores = cosine_scores(embeddings[inverse[:, 0]], embeddings[inverse[:, 1]])
    result = verification_metrics(scores, same, folds=params.folds, far_targets=params.far_targets)
    metrics = metrics_dict(
        result,
        num_pairs=len(indexes),
        num_images=len(images),
        folds=params.folds,
        flip=params.flip,
        pairs_format=kind,
    )
    with atomic_output_dir(out, kind=EVALUATE_OUTPUT) as tmp:
        (tmp / METRICS_FILE).write_text(dumps(metrics), encoding="utf-8")
        _write_curves(tmp, result, metrics)
    for note in metrics["notes"]:
        log.info("evaluate: %s", note)
    return metrics


def _check_faces_match(spec: ModelSpec, manifest: dict[str, Any], *, prepared: str | Path) -> None:
    """The set's faces are the size and crop the model was trained on. Raises FacepipeError."""
    image_size = manifest.get("image", {}).get("size")
    if image_size != spec.image_size:
        raise FacepipeError(f"model expects {spec.image_size}px faces, shard set {prepared} holds {image_size}px")
    crop = shard_set_crop(manifest)
    if crop != spec.crop:
        raise FacepipeError(
            f"model was trained on {spec.crop} crops, shard set {prepared} holds {crop} crops "
            f"(prepare.crop): evaluate it on a set prepared with crop: {spec.crop}"
        )


def _write_curves(folder: Path, result: VerificationResult, metrics: dict[str, Any]) -> None:
    """roc.csv, roc.png and thresholds.json of one evaluation into ``folder``."""
    folder.mkdir(exist_ok=True)
    (folder / ROC_FILE).write_text(roc_csv(result), encoding="utf-8")
    (folder / THRESHOLDS_FILE).write_text(dumps(thresholds_dict(result)), encoding="utf-8")
    fpr, tpr, _ = thin_roc(result.roc_fpr, result.roc_tpr, result.roc_thresholds)
    roc_png(fpr, tpr, folder / ROC_PLOT, title=_roc_title(metrics))


def check_arcface_crop(spec: Any, *, what: str) -> None:
    """insightface's sets hold faces aligned on the ArcFace template: a model of another crop is refused."""
    if spec.crop != "arcface":
        raise FacepipeError(
            f"{what} hold ArcFace-aligned faces; this model was trained on {spec.crop} crops (prepare.crop)"
        )


def bin_set_metrics(
    params: EvaluateParams,
    model: Any,
    bin_set: BinSet,
    *,
    image_size: int,
    normalization: tuple[float, float],
    device: Any,
    progress: bool = True,
) -> tuple[dict[str, Any], VerificationResult]:
    """facepipe's metrics of one .bin set (cosine, stratified folds) and insightface's (``insightface_*``)."""
    if min(int(bin_set.same.sum()), int((~bin_set.same).sum())) < params.folds:
        raise FacepipeError(f"{bin_set.name}.bin: {params.folds} folds need at least {params.folds} pairs of each kind")
    faces = decode_bin_faces(bin_set, image_size=image_size)

    def embed(flip: bool) -> np.ndarray:
        return embed_images(
            model, iter(faces), count=len(faces), batch_size=params.batch_size, flip=flip, device=device,
            progress=progress, normalization=normalization,
        )

    fused = embed(True)  # insightface's convention always adds the mirror
    own = fused if params.flip else embed(False)
    result = verification_metrics(
        cosine_scores(own[0::2], own[1::2]), bin_set.same, folds=params.folds, far_targets=params.far_targets
    )
    theirs = insightface_verification(fused[0::2], fused[1::2], bin_set.same, folds=params.folds)
    metrics = metrics_dict(
        result,
        num_pairs=bin_set.num_pairs,
        num_images=len(faces),
        folds=params.folds,
        flip=params.flip,
        pairs_format="insightface_bin",
        insightface_accuracy_mean=_round(theirs.accuracy_mean),
        insightface_accuracy_std=_round(theirs.accuracy_std),
        insightface_fold_accuracies=[_round(a) for a in theirs.fold_accuracies],
        **{
            f"insightface_val_at_far_{far_key(theirs.far_target)}": _round(theirs.val),
            f"insightface_val_std_at_far_{far_key(theirs.far_target)}": _round(theirs.val_std),
            f"insightface_far_at_far_{far_key(theirs.far_target)}": _round(theirs.far),
        },
    )
    return metrics, result


def run_bin_sets(
    params: EvaluateParams,
    model_dir: str | Path,
    sets: list[str | Path] | tuple[str | Path, ...],
    out: str | Path,
    *,
    progress: bool = True,
) -> dict[str, Any]:
    """Evaluate the backbone in ``model_dir`` on insightface ``.bin`` validation sets; returns metrics.json.

    Every set is read and checked before any is embedded; names (the files' stems) must differ.
    """
    paths = [Path(p) for p in sets]
    names = [p.stem for p in paths]
    if len(set(names)) != len(names):
        raise FacepipeError(f"validation sets need distinct file names, got {', '.join(map(str, paths))}")
    check_output(out, kind=BIN_SETS_OUTPUT, sources={f"validation set {p}": p for p in paths} | {"model folder": model_dir})
    device = resolve_device(params.device, what="evaluate.device")
    bin_sets = [read_bin_set(p) for p in paths]
    model, spec = load_backbone(model_dir, device=device)
    check_arcface_crop(spec, what="insightface .bin sets")
    per_set, results = {}, {}
    for bin_set in bin_sets:
        log.info("evaluate: %s, %d pairs on %s", bin_set.name, bin_set.num_pairs, device)
        per_set[bin_set.name], results[bin_set.name] = bin_set_metrics(
            params, model, bin_set, image_size=spec.image_size, device=device, progress=progress,
            normalization=(spec.normalization.mean, spec.normalization.std),
        )
    metrics = {"sets": per_set}
    with atomic_output_dir(out, kind=BIN_SETS_OUTPUT) as tmp:
        (tmp / METRICS_FILE).write_text(dumps(metrics), encoding="utf-8")
        for name, result in results.items():
            _write_curves(tmp / name, result, per_set[name])
    return metrics


def bin_sets_summary(metrics: dict[str, Any]) -> str:
    return "evaluate: " + "; ".join(
        f"{name} accuracy {m['accuracy_mean']:.4f} ± {m['accuracy_std']:.4f} (facepipe), "
        f"{m['insightface_accuracy_mean']:.4f} ± {m['insightface_accuracy_std']:.4f} (insightface)"
        for name, m in metrics["sets"].items()
    )


def _roc_title(metrics: dict[str, Any]) -> str:
    return (
        f"ROC of {metrics['num_pairs']} pairs: AUC {metrics['auc']:.3f}, "
        f"accuracy {metrics['accuracy_mean']:.3f} ± {metrics['accuracy_std']:.3f} ({metrics['folds']}-fold)"
    )


def summary_line(metrics: dict[str, Any]) -> str:
    tars = ", ".join(
        f"TAR@FAR={key.removeprefix('tar_at_far_')} {'n/a' if value is None else f'{value:.4f}'}"
        for key, value in metrics.items()
        if key.startswith("tar_at_far_")
    )
    return (
        f"evaluate: accuracy {metrics['accuracy_mean']:.4f} ± {metrics['accuracy_std']:.4f} "
        f"({metrics['folds']}-fold), AUC {metrics['auc']:.4f}, {tars} on {metrics['num_pairs']} pairs"
    )
