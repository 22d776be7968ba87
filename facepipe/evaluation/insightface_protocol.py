"""Verification accuracy as insightface's ``verification.py`` computes it, for numbers that can sit
next to published ones. Pure: no I/O, no globals.

This convention differs from facepipe's own (:mod:`facepipe.evaluation.verification`) on purpose,
in every place a paper's number depends on:

- the score is the squared L2 distance of L2-normalised embeddings (in [0, 4]; lower = more alike;
  a pair is "same" when ``distance < threshold``), not cosine similarity (equivalent: d = 2 − 2·cos);
- thresholds are a fixed grid, ``0, 0.01, …, 3.99``, not the midpoints between scores;
- the 10 folds are consecutive runs of pairs in file order (sklearn's ``KFold(shuffle=False)``),
  not stratified by kind;
- per fold, the threshold most accurate on the other folds (lowest on ties) is applied to it;
  accuracy is the mean ± population std over folds;
- VAL@FAR=1e-3: per fold, the threshold at which the other folds' FAR reaches 1e-3, linearly
  interpolated on a 0.001 grid (0 when they never reach it), then the test fold's VAL and FAR;
  mean ± std over folds.

metrics.json names these ``insightface_*`` so they are never compared with facepipe's by accident.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: insightface's threshold grids: accuracy, and VAL@FAR.
ACCURACY_THRESHOLDS = np.arange(0, 4, 0.01)
VAL_THRESHOLDS = np.arange(0, 4, 0.001)
VAL_FAR = 1e-3


@dataclass(frozen=True)
class InsightfaceResult:
    """``fold_accuracies`` [folds]; ``val``/``val_std``: VAL at ``far_target`` over folds; ``far``: the
    FAR those thresholds gave on the test folds (mean)."""

    fold_accuracies: tuple[float, ...]
    accuracy_mean: float
    accuracy_std: float
    val: float
    val_std: float
    far: float
    far_target: float


def squared_distances(embeddings1: np.ndarray, embeddings2: np.ndarray) -> np.ndarray:
    """[P, E], [P, E] float (L2-normalised rows) -> [P] float64 squared L2 distance in [0, 4]."""
    diff = np.asarray(embeddings1, dtype=np.float64) - np.asarray(embeddings2, dtype=np.float64)
    return np.einsum("pe,pe->p", diff, diff)


def consecutive_folds(count: int, folds: int) -> list[np.ndarray]:
    """Test indexes of each fold: consecutive runs, the first ``count % folds`` one longer (KFold)."""
    if count < folds:
        raise ValueError(f"{folds} folds need at least {folds} pairs, have {count}")
    sizes = np.full(folds, count // folds)
    sizes[: count % folds] += 1
    stops = np.cumsum(sizes)
    return [np.arange(stop - size, stop) for size, stop in zip(sizes, stops)]


def _accuracies(distances: np.ndarray, same: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """[T] accuracy of "same when distance < threshold" at each threshold."""
    accept = distances[None, :] < thresholds[:, None]
    return (accept == same[None, :]).mean(axis=1)


def _val_far(distances: np.ndarray, same: np.ndarray, thresholds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([T] VAL, [T] FAR) of "same when distance < threshold"."""
    accept = distances[None, :] < thresholds[:, None]
    val = (accept & same).sum(axis=1) / max(int(same.sum()), 1)
    far = (accept & ~same).sum(axis=1) / max(int((~same).sum()), 1)
    return val, far


def _threshold_at_far(far: np.ndarray, thresholds: np.ndarray, target: float) -> float:
    """Where the piecewise-linear (FAR -> threshold) curve crosses ``target`` (scipy's
    ``interp1d(kind="slinear")`` on FAR, which rises with the threshold); 0 when FAR never reaches it."""
    if far.max() < target:
        return 0.0
    i = int(np.searchsorted(far, target, side="right")) - 1
    if i < 0:  # target below the lowest FAR: extrapolating, as interp1d refuses; insightface's grid starts at FAR 0
        return float(thresholds[0])
    if i == len(far) - 1:
        return float(thresholds[-1])
    weight = (target - far[i]) / (far[i + 1] - far[i])
    return float(thresholds[i] + weight * (thresholds[i + 1] - thresholds[i]))


def insightface_verification(
    embeddings1: np.ndarray, embeddings2: np.ndarray, same: np.ndarray, *, folds: int = 10, far_target: float = VAL_FAR
) -> InsightfaceResult:
    """insightface's ``evaluate(embeddings, issame)`` on pairs ([P, E] each, L2-normalised, [P] bool)."""
    distances = squared_distances(embeddings1, embeddings2)
    same = np.asarray(same, dtype=bool)
    accuracies, vals, fars = [], [], []
    for test in consecutive_folds(len(same), folds):
        train = np.ones(len(same), dtype=bool)
        train[test] = False
        best = ACCURACY_THRESHOLDS[int(np.argmax(_accuracies(distances[train], same[train], ACCURACY_THRESHOLDS)))]
        accuracies.append(float(_accuracies(distances[test], same[test], np.array([best]))[0]))
        _, far_train = _val_far(distances[train], same[train], VAL_THRESHOLDS)
        threshold = _threshold_at_far(far_train, VAL_THRESHOLDS, far_target)
        val, far = _val_far(distances[test], same[test], np.array([threshold]))
        vals.append(float(val[0]))
        fars.append(float(far[0]))
    return InsightfaceResult(
        fold_accuracies=tuple(accuracies),
        accuracy_mean=float(np.mean(accuracies)),
        accuracy_std=float(np.std(accuracies)),
        val=float(np.mean(vals)),
        val_std=float(np.std(vals)),
        far=float(np.mean(fars)),
        far_target=far_target,
    )
