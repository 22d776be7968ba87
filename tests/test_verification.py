"""Verification metrics against hand-computed cases and brute-force definitions."""

from __future__ import annotations

import numpy as np
import pytest

from facepipe.evaluation.verification import (
    best_threshold,
    cosine_scores,
    fold_ids,
    kfold_accuracy,
    roc_auc,
    roc_curve,
    tar_at_far,
    thin_roc,
    threshold_accuracies,
    verification_metrics,
)


def test_cosine_scores_of_hand_picked_vectors() -> None:
    a = np.array([[1.0, 0.0], [3.0, 4.0], [1.0, 1.0]])
    b = np.array([[2.0, 0.0], [-3.0, -4.0], [1.0, -1.0]])
    np.testing.assert_allclose(cosine_scores(a, b), [1.0, -1.0, 0.0], atol=1e-12)


def test_threshold_accuracies_by_hand() -> None:
    # sorted: 0.1 diff, 0.35 same, 0.4 diff, 0.8 same
    scores = np.array([0.1, 0.4, 0.35, 0.8])
    same = np.array([False, False, True, True])
    thresholds, accuracies = threshold_accuracies(scores, same)
    np.testing.assert_allclose(thresholds, [-0.9, 0.225, 0.375, 0.6, 1.8])
    np.testing.assert_allclose(accuracies, [0.5, 0.75, 0.5, 0.75, 0.5])
    # two thresholds reach 0.75: the lower one wins
    assert best_threshold(scores, same) == pytest.approx((0.225, 0.75))


def test_threshold_accuracies_with_tied_scores() -> None:
    scores = np.array([0.5, 0.5, 0.5, 0.9])
    same = np.array([True, False, False, True])
    thresholds, accuracies = threshold_accuracies(scores, same)
    np.testing.assert_allclose(thresholds, [-0.5, 0.7, 1.9])
    np.testing.assert_allclose(accuracies, [0.5, 0.75, 0.5])


def test_fold_ids_reproduce_the_lfw_sets() -> None:
    # LFW pairs.txt order: 10 sets of (3 same, then 3 different)
    same = np.tile(np.repeat([True, False], 3), 10)
    np.testing.assert_array_equal(fold_ids(same, 10), np.repeat(np.arange(10), 6))


def test_fold_ids_are_stratified_whatever_the_order() -> None:
    same = np.random.default_rng(0).permutation(np.arange(100) < 30)
    ids = fold_ids(same, 10)
    for fold in range(10):
        assert same[ids == fold].sum() == 3 and (~same[ids == fold]).sum() == 7


def test_fold_ids_need_enough_pairs_of_each_kind() -> None:
    with pytest.raises(ValueError, match="at least 10 pairs of each kind"):
        fold_ids(np.array([True] * 20 + [False] * 9), 10)


def test_kfold_accuracy_by_hand() -> None:
    # Two folds of two same (0.9, 0.8) / (0.9, 0.3) and two different (0.1, 0.2) / (0.2, 0.7) pairs.
    scores = np.array([0.9, 0.8, 0.1, 0.2, 0.9, 0.3, 0.2, 0.7])
    same = np.array([True, True, False, False, True, True, False, False])
    accuracies, thresholds = kfold_accuracy(scores, same, folds=2)
    # Fold 0 is tested with the threshold learnt on fold 1 (scores 0.9 s, 0.3 s, 0.2 d, 0.7 d):
    # best is 0.25 (3/4 right, the lowest of the ties); on fold 0 it gets all 4 right.
    # Fold 1 with the threshold of fold 0 (0.9 s, 0.8 s, 0.1 d, 0.2 d): 0.5; on fold 1: 2/4.
    np.testing.assert_allclose(thresholds, [0.25, 0.5])
    np.testing.assert_allclose(accuracies, [1.0, 0.5])


def test_roc_curve_and_auc_by_hand() -> None:
    scores = np.array([0.9, 0.8, 0.7, 0.6])
    same = np.array([True, False, True, False])
    fpr, tpr, thresholds = roc_curve(scores, same)
    np.testing.assert_allclose(fpr, [0, 0, 0.5, 0.5, 1])
    np.testing.assert_allclose(tpr, [0, 0.5, 0.5, 1, 1])
    np.testing.assert_allclose(thresholds, [np.inf, 0.9, 0.8, 0.7, 0.6])
    assert roc_auc(fpr, tpr) == pytest.approx(0.75)


def test_auc_equals_the_pairwise_definition_with_ties() -> None:
    rng = np.random.default_rng(1)
    scores = rng.integers(0, 6, size=200) / 5  # many ties
    same = rng.random(200) < scores * 0.8
    positives, negatives = scores[same], scores[~same]
    greater = (positives[:, None] > negatives[None, :]).mean()
    ties = (positives[:, None] == negatives[None, :]).mean()
    fpr, tpr, _ = roc_curve(scores, same)
    assert roc_auc(fpr, tpr) == pytest.approx(greater + 0.5 * ties)


def test_thin_roc_keeps_corners_only() -> None:
    fpr = np.array([0, 0, 0, 0.5, 1.0])
    tpr = np.array([0, 0.5, 1.0, 1.0, 1.0])
    thin = thin_roc(fpr, tpr, np.arange(5.0))
    np.testing.assert_array_equal(thin[0], [0, 0, 1.0])
    np.testing.assert_array_equal(thin[1], [0, 1.0, 1.0])
    np.testing.assert_array_equal(thin[2], [0, 2, 4])
    assert roc_auc(thin[0], thin[1]) == roc_auc(fpr, tpr)


def test_tar_at_far_by_hand() -> None:
    negatives = np.arange(1000) / 1000  # 0.000 ... 0.999
    positives = np.array([0.9995, 0.9985, 0.5])
    scores = np.concatenate([negatives, positives])
    same = np.concatenate([np.zeros(1000, bool), np.ones(3, bool)])
    curve = roc_curve(scores, same)
    # FAR 1e-3 of 1000 negatives allows one false accept (0.999): the threshold can go down to 0.9985.
    result = tar_at_far(*curve, far=1e-3, num_negative=1000)
    assert result is not None
    assert result.tar == pytest.approx(2 / 3) and result.threshold == pytest.approx(0.9985)
    # 1000 negatives cannot measure FAR 1e-4
    assert tar_at_far(*curve, far=1e-4, num_negative=1000) is None


def test_tar_at_far_with_no_threshold_short_of_accepting_nothing() -> None:
    scores = np.array([0.9, 0.9, 0.1])  # the top score is shared by a negative
    same = np.array([True, False, True])
    result = tar_at_far(*roc_curve(scores, same), far=0.5, num_negative=2)
    assert result is not None and result.tar == 0.0 and result.threshold is None


def test_verification_metrics_on_separable_scores() -> None:
    rng = np.random.default_rng(0)
    same = rng.permutation(np.arange(2000) < 1000)
    scores = np.where(same, rng.uniform(0.5, 1.0, 2000), rng.uniform(-1.0, 0.4, 2000))
    result = verification_metrics(scores, same, folds=10, far_targets=(1e-3, 1e-4))
    assert result.accuracy_mean == 1.0 and result.accuracy_std == 0.0
    assert result.best_accuracy == 1.0 and 0.4 <= result.best_threshold <= 0.5
    assert result.auc == pytest.approx(1.0)
    assert result.tar_at_far[1e-3] is not None and result.tar_at_far[1e-3].tar == 1.0
    assert result.tar_at_far[1e-4] is None  # 1000 negatives
    assert (result.num_positive, result.num_negative) == (1000, 1000)
    assert len(result.fold_accuracies) == 10


# --- found by mutation testing (tests/README.md) ----------------------------------------------------


def test_cosine_score_of_a_zero_embedding_is_zero_not_nan() -> None:
    scores = cosine_scores(np.array([[0.0, 0.0], [1e-8, 0.0]]), np.array([[1.0, 0.0], [2e-8, 0.0]]))
    np.testing.assert_allclose(scores, [0.0, 2e-4], rtol=1e-12)  # tiny norms: 2e-16 / max(2e-16, 1e-12)


def test_fold_ids_with_exactly_one_pair_of_each_kind_per_fold() -> None:
    same = np.array([True, False] * 3)
    np.testing.assert_array_equal(fold_ids(same, 3), [0, 0, 1, 1, 2, 2])
    with pytest.raises(ValueError, match=r"^4 folds need at least 4 pairs of each kind, have 3$"):
        fold_ids(same, 4)


def test_roc_needs_both_kinds() -> None:
    for same in (np.ones(3, bool), np.zeros(3, bool)):
        with pytest.raises(ValueError, match="^a ROC curve needs both same and different pairs$"):
            roc_curve(np.array([0.1, 0.2, 0.3]), same)


def test_thin_roc_of_three_points() -> None:
    collinear = thin_roc(np.array([0.0, 0.5, 1.0]), np.array([0.0, 0.5, 1.0]), np.array([3.0, 2.0, 1.0]))
    np.testing.assert_array_equal(collinear[2], [3.0, 1.0])
    corner = thin_roc(np.array([0.0, 0.0, 1.0]), np.array([0.0, 1.0, 1.0]), np.array([3.0, 2.0, 1.0]))
    np.testing.assert_array_equal(corner[2], [3.0, 2.0, 1.0])
    two = thin_roc(np.array([0.0, 1.0]), np.array([0.0, 1.0]), np.array([2.0, 1.0]))
    np.testing.assert_array_equal(two[2], [2.0, 1.0])


def test_verification_metrics_by_hand_with_defaults() -> None:
    # the two-fold case of test_kfold_accuracy_by_hand, repeated 5 times over -> 10 folds by default
    scores = np.tile([0.9, 0.8, 0.1, 0.2, 0.9, 0.3, 0.2, 0.7], 5)
    same = np.tile([True, True, False, False, True, True, False, False], 5)
    result = verification_metrics(scores, same)
    assert len(result.fold_accuracies) == 10
    assert result.accuracy_mean == pytest.approx(np.mean(result.fold_accuracies), abs=1e-15)
    assert result.accuracy_std == pytest.approx(np.std(result.fold_accuracies), abs=1e-15)  # population std
    assert sorted(result.tar_at_far) == [1e-4, 1e-3] and all(v is None for v in result.tar_at_far.values())
    # over all 40 pairs: scores 0.1 d, 0.2 dd, 0.3 s, 0.7 d, 0.8 s, 0.9 ss (x5); best split at 0.25: 35/40
    assert (result.best_threshold, result.best_accuracy) == pytest.approx((0.25, 35 / 40))
    assert (result.num_positive, result.num_negative) == (20, 20)
    # AUC by the pairwise definition: P(score of a same pair > a different one), ties count one half
    positives, negatives = scores[same], scores[~same]
    expected_auc = (positives[:, None] > negatives).mean() + 0.5 * (positives[:, None] == negatives).mean()
    assert result.auc == pytest.approx(expected_auc, abs=1e-12)
    np.testing.assert_array_equal(result.roc_thresholds, [np.inf, 0.9, 0.8, 0.7, 0.3, 0.2, 0.1])


def test_kfold_accuracy_uses_ten_folds_by_default() -> None:
    same = np.tile([True, False], 10)
    scores = np.linspace(0, 1, 20)
    accuracies, thresholds = kfold_accuracy(scores, same)
    assert len(accuracies) == len(thresholds) == 10
