"""Face verification metrics. Pure: no I/O, no globals.

Conventions throughout: ``scores`` is [P] float, higher meaning "more alike" (cosine similarity of
embeddings); ``same`` is [P] bool, the ground truth. A pair is predicted "same" when
``score >= threshold``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TarAtFar:
    """True accept rate at the most permissive threshold whose false accept rate is <= ``far``.

    ``threshold`` is None when no threshold reaches it other than accepting nothing.
    """

    far: float
    tar: float
    threshold: float | None


@dataclass(frozen=True)
class VerificationResult:
    """Everything :func:`verification_metrics` computes. ``roc_*`` are [R] float arrays."""

    num_positive: int
    num_negative: int
    fold_accuracies: tuple[float, ...]
    fold_thresholds: tuple[float, ...]
    accuracy_mean: float
    accuracy_std: float
    best_threshold: float
    best_accuracy: float
    auc: float
    tar_at_far: dict[float, TarAtFar | None]
    roc_fpr: np.ndarray
    roc_tpr: np.ndarray
    roc_thresholds: np.ndarray


def cosine_scores(embeddings1: np.ndarray, embeddings2: np.ndarray) -> np.ndarray:
    """[P, E] and [P, E] float -> [P] float64 cosine similarity in [-1, 1]."""
    a = np.asarray(embeddings1, dtype=np.float64)
    b = np.asarray(embeddings2, dtype=np.float64)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return np.einsum("pe,pe->p", a, b) / np.maximum(norms, 1e-12)


def fold_ids(same: np.ndarray, folds: int) -> np.ndarray:
    """[P] int64 fold of each pair, stratified: positives and negatives each cut into ``folds`` runs.

    Runs are contiguous in the given order, so LFW's ``pairs.txt`` (sets of 300 same then 300
    different pairs) gets exactly its ten official folds.
    """
    same = np.asarray(same, dtype=bool)
    ids = np.empty(len(same), dtype=np.int64)
    for members in (np.flatnonzero(same), np.flatnonzero(~same)):
        if len(members) < folds:
            raise ValueError(f"{folds} folds need at least {folds} pairs of each kind, have {len(members)}")
        ids[members] = np.arange(len(members)) * folds // len(members)
    return ids


def threshold_accuracies(scores: np.ndarray, same: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Accuracy at every threshold that splits the scores differently.

    Candidates are the midpoints between consecutive distinct scores, plus one below the lowest
    (everything "same") and one above the highest (nothing "same"), in increasing order. Returns
    ([T] thresholds, [T] accuracies) with T = distinct scores + 1.
    """
    scores = np.asarray(scores, dtype=np.float64)
    same = np.asarray(same, dtype=bool)
    values, inverse = np.unique(scores, return_inverse=True)
    positives = np.bincount(inverse, weights=same, minlength=len(values))
    negatives = np.bincount(inverse, weights=~same, minlength=len(values))
    # Threshold k sits just below values[k]: pairs with smaller scores are rejected.
    positives_below = np.concatenate([[0.0], np.cumsum(positives)])
    negatives_below = np.concatenate([[0.0], np.cumsum(negatives)])
    correct = negatives_below + (positives_below[-1] - positives_below)
    thresholds = np.concatenate([[values[0] - 1.0], (values[:-1] + values[1:]) / 2, [values[-1] + 1.0]])
    return thresholds, correct / len(scores)


def best_threshold(scores: np.ndarray, same: np.ndarray) -> tuple[float, float]:
    """(threshold, accuracy) of the most accurate threshold; ties go to the lowest threshold."""
    thresholds, accuracies = threshold_accuracies(scores, same)
    best = int(np.argmax(accuracies))
    return float(thresholds[best]), float(accuracies[best])


def kfold_accuracy(scores: np.ndarray, same: np.ndarray, *, folds: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """The verification protocol: per fold, the threshold is chosen on the other folds and tested on it.

    Returns ([folds] accuracies, [folds] thresholds), folds as in :func:`fold_ids`.
    """
    scores = np.asarray(scores, dtype=np.float64)
    same = np.asarray(same, dtype=bool)
    ids = fold_ids(same, folds)
    accuracies = np.empty(folds)
    thresholds = np.empty(folds)
    for fold in range(folds):
        test = ids == fold
        thresholds[fold], _ = best_threshold(scores[~test], same[~test])
        accuracies[fold] = np.mean((scores[test] >= thresholds[fold]) == same[test])
    return accuracies, thresholds


def roc_curve(scores: np.ndarray, same: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exact ROC: one point per distinct score used as threshold, from (0, 0) to (1, 1).

    Returns ([R] fpr, [R] tpr, [R] thresholds) with thresholds decreasing; the first is +inf
    (accept nothing). Needs pairs of both kinds.
    """
    scores = np.asarray(scores, dtype=np.float64)
    same = np.asarray(same, dtype=bool)
    num_positive, num_negative = int(same.sum()), int((~same).sum())
    if not num_positive or not num_negative:
        raise ValueError("a ROC curve needs both same and different pairs")
    values, inverse = np.unique(-scores, return_inverse=True)  # distinct scores, decreasing
    tps = np.cumsum(np.bincount(inverse, weights=same, minlength=len(values)))
    fps = np.cumsum(np.bincount(inverse, weights=~same, minlength=len(values)))
    fpr = np.concatenate([[0.0], fps / num_negative])
    tpr = np.concatenate([[0.0], tps / num_positive])
    return fpr, tpr, np.concatenate([[np.inf], -values])


def thin_roc(fpr: np.ndarray, tpr: np.ndarray, thresholds: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Drop ROC points that lie on a straight run between their neighbours (the plot is unchanged)."""
    if len(fpr) <= 2:
        return fpr, tpr, thresholds
    corner = np.logical_or(np.diff(fpr, 2) != 0, np.diff(tpr, 2) != 0)
    keep = np.concatenate([[True], corner, [True]])
    return fpr[keep], tpr[keep], thresholds[keep]


def roc_auc(fpr: np.ndarray, tpr: np.ndarray) -> float:
    """Area under a ROC curve from :func:`roc_curve` (trapezoids: a tie between kinds counts one half)."""
    return float(np.trapezoid(tpr, fpr))


def tar_at_far(
    fpr: np.ndarray, tpr: np.ndarray, thresholds: np.ndarray, *, far: float, num_negative: int
) -> TarAtFar | None:
    """TAR at FAR <= ``far`` on a curve from :func:`roc_curve`.

    None when there are too few negatives to measure it: below ``1 / far`` negatives, a single
    false accept already exceeds ``far``, so the figure would only say "no false accept at all".
    """
    if num_negative * far < 1:
        return None
    last = int(np.searchsorted(fpr, far, side="right")) - 1  # fpr rises with the index
    threshold = float(thresholds[last]) if np.isfinite(thresholds[last]) else None
    return TarAtFar(far=far, tar=float(tpr[last]), threshold=threshold)


def verification_metrics(
    scores: np.ndarray, same: np.ndarray, *, folds: int = 10, far_targets: tuple[float, ...] = (1e-3, 1e-4)
) -> VerificationResult:
    """The standard verification report of ``scores`` against ``same``.

    Accuracy is the mean (and population std) over ``folds`` folds of :func:`kfold_accuracy`; the
    best threshold and its accuracy are over all pairs. The ROC is exact; :func:`thin_roc` makes it
    smaller for plotting.
    """
    same = np.asarray(same, dtype=bool)
    accuracies, thresholds = kfold_accuracy(scores, same, folds=folds)
    threshold, accuracy = best_threshold(scores, same)
    fpr, tpr, roc_thresholds = roc_curve(scores, same)
    num_negative = int((~same).sum())
    return VerificationResult(
        num_positive=int(same.sum()),
        num_negative=num_negative,
        fold_accuracies=tuple(accuracies.tolist()),
        fold_thresholds=tuple(thresholds.tolist()),
        accuracy_mean=float(accuracies.mean()),
        accuracy_std=float(accuracies.std()),
        best_threshold=threshold,
        best_accuracy=accuracy,
        auc=roc_auc(fpr, tpr),
        tar_at_far={
            far: tar_at_far(fpr, tpr, roc_thresholds, far=far, num_negative=num_negative) for far in far_targets
        },
        roc_fpr=fpr,
        roc_tpr=tpr,
        roc_thresholds=roc_thresholds,
    )
