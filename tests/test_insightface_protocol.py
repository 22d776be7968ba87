"""insightface-convention accuracy and VAL@FAR against an independent implementation written here
from insightface's published ``verification.py`` (calculate_roc / calculate_val): per-threshold
loops, sklearn-style KFold(shuffle=False) folds, scipy's interp1d(kind="slinear")."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import interpolate

from facepipe.evaluation.insightface_protocol import consecutive_folds, insightface_verification


def _kfold(count: int, folds: int) -> list[tuple[np.ndarray, np.ndarray]]:
    # sklearn.model_selection.KFold(n_splits=folds, shuffle=False).split(range(count))
    sizes = [count // folds + (1 if i < count % folds else 0) for i in range(folds)]
    out, start = [], 0
    for size in sizes:
        test = np.arange(start, start + size)
        out.append((np.setdiff1d(np.arange(count), test), test))
        start += size
    return out


def _accuracy(threshold: float, dist: np.ndarray, issame: np.ndarray) -> float:
    predict = np.less(dist, threshold)
    tp = np.sum(np.logical_and(predict, issame))
    tn = np.sum(np.logical_and(np.logical_not(predict), np.logical_not(issame)))
    return float(tp + tn) / dist.size


def _val_far(threshold: float, dist: np.ndarray, issame: np.ndarray) -> tuple[float, float]:
    predict = np.less(dist, threshold)
    ta = np.sum(np.logical_and(predict, issame))
    fa = np.sum(np.logical_and(predict, np.logical_not(issame)))
    return float(ta) / float(np.sum(issame)), float(fa) / float(np.sum(np.logical_not(issame)))


def _slinear(x: np.ndarray, y: np.ndarray) -> interpolate.BSpline:
    """``interp1d(x, y, kind="slinear")`` as scipy built it when insightface wrote verification.py:
    x sorted (stable), then a degree-1 B-spline on knots ``[x0, x..., x_last]`` (scipy 1.17 refuses
    the repeated FARs of a real run with "Expect x to not have duplicates")."""
    order = np.argsort(x, kind="mergesort")
    x, y = x[order], y[order]
    return interpolate.BSpline(np.r_[x[0], x, x[-1]], y, 1)


def reference(embeddings: np.ndarray, issame: np.ndarray, folds: int = 10) -> tuple[float, float, float, float, float]:
    """insightface evaluate(): embeddings [2P, E] interleaved (pair p = rows 2p, 2p+1)."""
    e1, e2 = embeddings[0::2], embeddings[1::2]
    dist = np.sum(np.square(np.subtract(e1, e2)), 1)
    thresholds = np.arange(0, 4, 0.01)
    accuracy = np.zeros(folds)
    for fold, (train, test) in enumerate(_kfold(len(issame), folds)):
        acc_train = np.array([_accuracy(t, dist[train], issame[train]) for t in thresholds])
        accuracy[fold] = _accuracy(thresholds[np.argmax(acc_train)], dist[test], issame[test])
    thresholds = np.arange(0, 4, 0.001)
    val, far = np.zeros(folds), np.zeros(folds)
    for fold, (train, test) in enumerate(_kfold(len(issame), folds)):
        far_train = np.array([_val_far(t, dist[train], issame[train])[1] for t in thresholds])
        if np.max(far_train) >= 1e-3:
            threshold = _slinear(far_train, thresholds)(1e-3)
        else:
            threshold = 0.0
        val[fold], far[fold] = _val_far(threshold, dist[test], issame[test])
    return accuracy.mean(), accuracy.std(), val.mean(), val.std(), far.mean()


def _structured(pairs: int, *, seed: int, noise: float, dim: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Interleaved unit embeddings: same pairs are a centre plus noise each, different pairs two
    centres; labels in blocks (as LFW's files) with a few flipped, so folds are not all alike."""
    rng = np.random.default_rng(seed)
    issame = np.resize(np.repeat([True, False], pairs // 20), pairs)
    issame[rng.choice(pairs, pairs // 50, replace=False)] ^= True
    centres = rng.normal(size=(pairs, 2, dim))
    centres[issame, 1] = centres[issame, 0]
    embeddings = (centres + noise * rng.normal(size=centres.shape)).reshape(2 * pairs, dim)
    return embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True), issame


@pytest.mark.parametrize(("pairs", "noise", "seed"), [(6000, 0.6, 0), (3000, 0.9, 1), (1203, 0.5, 2)])
def test_insightface_accuracy_and_val_equal_the_reference(pairs: int, noise: float, seed: int) -> None:
    embeddings, issame = _structured(pairs, seed=seed, noise=noise)
    result = insightface_verification(embeddings[0::2], embeddings[1::2], issame)
    expected = reference(embeddings, issame)
    got = (result.accuracy_mean, result.accuracy_std, result.val, result.val_std, result.far)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)
    assert 0.5 < result.accuracy_mean < 1  # neither trivial nor perfect: the thresholds matter


def test_folds_are_consecutive_and_unshuffled() -> None:
    assert [f.tolist() for f in consecutive_folds(7, 3)] == [[0, 1, 2], [3, 4], [5, 6]]


def test_a_pair_order_change_changes_the_folds() -> None:
    """Consecutive folds, not stratified: sorting same pairs first moves the per-fold accuracies."""
    embeddings, issame = _structured(600, seed=3, noise=0.9)
    e1, e2 = embeddings[0::2], embeddings[1::2]
    order = np.argsort(~issame, kind="stable")
    a = insightface_verification(e1, e2, issame)
    b = insightface_verification(e1[order], e2[order], issame[order])
    assert a.fold_accuracies != b.fold_accuracies


def test_distances_on_the_threshold_grid_are_rejected_as_insightface_does() -> None:
    """Embeddings of ±0.5 in 4-D give squared distances of exactly 0, 1, 2, 3 or 4, points of the grid:
    "same" is ``distance < threshold``, so a pair at a grid value is rejected by that threshold."""
    rng = np.random.default_rng(4)
    pairs = 2000
    issame = np.resize(np.repeat([True, False], 100), pairs)
    first = rng.choice([-0.5, 0.5], size=(pairs, 4))
    flips = np.where(issame, rng.choice([0, 1, 2], size=pairs, p=[0.3, 0.5, 0.2]), rng.choice([1, 2, 3, 4], size=pairs))
    second = first.copy()
    for p, count in enumerate(flips):
        second[p, rng.choice(4, count, replace=False)] *= -1
    embeddings = np.stack([first, second], axis=1).reshape(2 * pairs, 4)
    result = insightface_verification(first, second, issame)
    expected = reference(embeddings, issame)
    np.testing.assert_allclose(
        (result.accuracy_mean, result.accuracy_std, result.val, result.val_std, result.far), expected, rtol=0, atol=1e-12
    )
