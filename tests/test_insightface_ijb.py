"""insightface's IJB TAR@FAR (the ROC point nearest the rate, on scikit-learn's thinned ROC) against a
loop implementation written here from insightface's ``eval_ijbc.py`` and scikit-learn's documented
``roc_curve``, and against facepipe's convention where the two must differ."""

from __future__ import annotations

import numpy as np
import pytest

from facepipe.evaluation.insightface_ijb import insightface_tar_at_far, sklearn_roc
from facepipe.evaluation.verification import roc_curve, tar_at_far


def roc_by_loop(scores: list[float], labels: list[bool]) -> tuple[list[float], list[float]]:
    """scikit-learn's roc_curve(drop_intermediate=True), one threshold at a time."""
    points = []
    for threshold in sorted(set(scores), reverse=True):
        tp = sum(1 for s, same in zip(scores, labels) if s >= threshold and same)
        fp = sum(1 for s, same in zip(scores, labels) if s >= threshold and not same)
        points.append((fp, tp))
    if len(points) > 2:
        kept = [points[0]]
        for before, here, after in zip(points, points[1:], points[2:]):
            if after[0] - 2 * here[0] + before[0] != 0 or after[1] - 2 * here[1] + before[1] != 0:
                kept.append(here)
        points = kept + [points[-1]]
    points = [(0, 0)] + points
    positives, negatives = sum(labels), len(labels) - sum(labels)
    return [fp / negatives for fp, _ in points], [tp / positives for _, tp in points]


def nearest_by_loop(fpr: list[float], tpr: list[float], far: float) -> float:
    """eval_ijbc.py: flipud both, then min over (|fpr - far|, index)."""
    fpr, tpr = fpr[::-1], tpr[::-1]
    _, index = min(zip([abs(value - far) for value in fpr], range(len(fpr))))
    return tpr[index]


@pytest.mark.parametrize("seed", range(12))
def test_equals_the_loop_on_random_scores_with_ties(seed: int) -> None:
    rng = np.random.default_rng(seed)
    count = int(rng.integers(3, 60))
    labels = rng.random(count) < rng.uniform(0.2, 0.8)
    labels[0], labels[-1] = True, False
    scores = np.round(rng.normal(labels * rng.uniform(0, 2), 1.0), int(rng.integers(0, 3)))  # ties at low precision
    fpr, tpr = roc_by_loop(scores.tolist(), labels.tolist())
    got_fpr, got_tpr = sklearn_roc(scores, labels)
    assert got_fpr.tolist() == pytest.approx(fpr, abs=0) and got_tpr.tolist() == pytest.approx(tpr, abs=0)
    fars = (1e-3, 0.05, 0.1, 0.18, 0.3, 0.5, 1.0)
    expected = {far: nearest_by_loop(fpr, tpr, far) for far in fars}
    assert insightface_tar_at_far(scores, labels, fars=fars) == expected


def test_the_nearest_point_may_lie_above_the_rate_where_facepipe_stays_below() -> None:
    # 10 different pairs, 5 same; descending: s s d s d d s d d d d s d d d
    labels = np.array([1, 1, 0, 1, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0], dtype=bool)
    scores = np.linspace(1.0, 0.0, len(labels))
    nearest = insightface_tar_at_far(scores, labels, fars=(0.18,))[0.18]
    fpr, tpr, thresholds = roc_curve(scores, labels)
    below = tar_at_far(fpr, tpr, thresholds, far=0.18, num_negative=10)
    assert below is not None and below.tar == pytest.approx(3 / 5)  # FPR 0.1: three same pairs accepted
    assert nearest == pytest.approx(3 / 5)  # the point at FPR 0.2 is nearest (|0.2-0.18| < |0.1-0.18|), TPR 3/5 there too
    assert insightface_tar_at_far(scores, labels, fars=(0.28,))[0.28] == pytest.approx(4 / 5)  # FPR 0.3, above the rate
    assert tar_at_far(fpr, tpr, thresholds, far=0.28, num_negative=10).tar == pytest.approx(3 / 5)


def test_collinear_points_are_dropped_as_scikit_learn_drops_them() -> None:
    labels = np.array([1, 1, 1, 0, 0, 0], dtype=bool)
    fpr, tpr = sklearn_roc(np.array([6.0, 5, 4, 3, 2, 1]), labels)
    # thresholds 6..1 give (fp, tp) = (0,1) (0,2) (0,3) (1,3) (2,3) (3,3): the first and last stay, and
    # the one corner (0,3); (0,0) goes in front
    assert fpr.tolist() == [0, 0, 0, 1] and tpr.tolist() == pytest.approx([0, 1 / 3, 1, 1])
    # three thresholds on one line, (0,1) (1,2) (2,3): the middle one goes too
    fpr, tpr = sklearn_roc(np.array([3.0, 2, 2, 1, 1]), np.array([1, 1, 0, 1, 0], dtype=bool))
    assert fpr.tolist() == [0, 0, 1] and tpr.tolist() == pytest.approx([0, 1 / 3, 1])


def test_one_kind_only_is_refused() -> None:
    with pytest.raises(ValueError, match="^a ROC curve needs both same and different pairs$"):
        sklearn_roc(np.array([0.1, 0.2]), np.array([True, True]))


def test_labels_given_as_0_and_1_are_read_as_bools() -> None:
    """insightface's pair files hold 0/1 labels."""
    scores = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    labels = [1, 0, 1, 1, 0, 0]
    expected = sklearn_roc(scores, np.array(labels, dtype=bool))
    got = sklearn_roc(scores, labels)
    assert got[0].tolist() == expected[0].tolist() and got[1].tolist() == expected[1].tolist()
