"""Verification metrics against hand-computed cases and brute-force definitions; pair sampling and pair
files (evaluation/pairs.py) against hand-worked cases.

Error messages and notes are matched whole: they are what a user reads when split or evaluate refuses an
input, so a garbled one is a bug (the policy in tests/README.md).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from facepipe.evaluation.pairs import (
    NamedPair,
    Pair,
    format_pairs_jsonl,
    holdout_count,
    parse_lfw_pairs,
    parse_pairs_jsonl,
    sample_pairs,
    triangle_pairs,
)
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
    # norms 1, 5, sqrt(2): float64 gives these within an ulp or two
    np.testing.assert_allclose(cosine_scores(a, b), [1.0, -1.0, 0.0], rtol=0, atol=1e-15)


def test_threshold_accuracies_by_hand() -> None:
    # sorted: 0.1 diff, 0.35 same, 0.4 diff, 0.8 same
    scores = np.array([0.1, 0.4, 0.35, 0.8])
    same = np.array([False, False, True, True])
    thresholds, accuracies = threshold_accuracies(scores, same)
    # midpoints of float64 scores (one rounding each); accuracies are counts / 4, exact
    np.testing.assert_allclose(thresholds, [-0.9, 0.225, 0.375, 0.6, 1.8], rtol=1e-15, atol=0)
    np.testing.assert_array_equal(accuracies, [0.5, 0.75, 0.5, 0.75, 0.5])
    # two thresholds reach 0.75: the lower one wins
    assert best_threshold(scores, same) == pytest.approx((0.225, 0.75), rel=1e-15)


def test_threshold_accuracies_with_tied_scores() -> None:
    scores = np.array([0.5, 0.5, 0.5, 0.9])
    same = np.array([True, False, False, True])
    thresholds, accuracies = threshold_accuracies(scores, same)
    np.testing.assert_allclose(thresholds, [-0.5, 0.7, 1.9], rtol=1e-15, atol=0)  # midpoints: one rounding
    np.testing.assert_array_equal(accuracies, [0.5, 0.75, 0.5])  # counts / 4


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
    np.testing.assert_allclose(thresholds, [0.25, 0.5], rtol=1e-15, atol=0)  # midpoints: one rounding
    np.testing.assert_array_equal(accuracies, [1.0, 0.5])  # counts / 4


def test_roc_curve_and_auc_by_hand() -> None:
    scores = np.array([0.9, 0.8, 0.7, 0.6])
    same = np.array([True, False, True, False])
    fpr, tpr, thresholds = roc_curve(scores, same)
    # counts / 2 and the scores themselves: exact; so is the trapezoid sum of halves
    np.testing.assert_array_equal(fpr, [0, 0, 0.5, 0.5, 1])
    np.testing.assert_array_equal(tpr, [0, 0.5, 0.5, 1, 1])
    np.testing.assert_array_equal(thresholds, [np.inf, 0.9, 0.8, 0.7, 0.6])
    assert roc_auc(fpr, tpr) == 0.75


def test_auc_equals_the_pairwise_definition_with_ties() -> None:
    rng = np.random.default_rng(1)
    scores = rng.integers(0, 6, size=200) / 5  # many ties
    same = rng.random(200) < scores * 0.8
    positives, negatives = scores[same], scores[~same]
    greater = (positives[:, None] > negatives[None, :]).mean()
    ties = (positives[:, None] == negatives[None, :]).mean()
    fpr, tpr, _ = roc_curve(scores, same)
    assert roc_auc(fpr, tpr) == pytest.approx(greater + 0.5 * ties, rel=1e-12)  # sums of ~200 float64 terms


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
    assert result.tar == pytest.approx(2 / 3, rel=1e-15) and result.threshold == 0.9985  # a score itself
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
    assert result.auc == 1.0  # the ROC is the corner (0, 1): a trapezoid of 0s and 1s
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
    assert (result.best_threshold, result.best_accuracy) == pytest.approx((0.25, 35 / 40), rel=1e-15)
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


# --- evaluation/pairs.py: hold-out, pair sampling, pair files ----------------------------------------


def _pair_labels(sizes: list[int]) -> np.ndarray:
    return np.repeat(np.arange(len(sizes)), sizes).astype(np.int64)


# --- hold-out ---------------------------------------------------------------------------------------


def test_holdout_count_limits_and_messages() -> None:
    assert holdout_count(3, 2) == 2  # the smallest hold-out, leaving one identity to train on
    assert holdout_count(10, 0.3) == 3 and holdout_count(10, 0.35) == 4  # round(3.5) = 4
    with pytest.raises(ValueError, match=r"^hold-out of 0\.01 gives 0 identities; verification needs at least 2$"):
        holdout_count(40, 0.01)
    with pytest.raises(ValueError, match=r"^hold-out of 1 gives 1 identities; verification needs at least 2$"):
        holdout_count(40, 1)
    with pytest.raises(ValueError, match=r"^hold-out of 3 gives 3 of 3 identities; training needs at least 1$"):
        holdout_count(3, 3)


# --- pair sampling ----------------------------------------------------------------------------------


def test_few_negatives_are_all_enumerated_exactly() -> None:
    # identities {0,1,2} {3} {4}: 3 same pairs, and 7 different pairs, fewer than 4 x the 3 asked for, so
    # the different pairs are enumerated and 3 of them drawn
    labels = _pair_labels([3, 1, 1])
    different = {(0, 3), (1, 3), (2, 3), (0, 4), (1, 4), (2, 4), (3, 4)}
    every = set()
    for seed in range(40):
        result = sample_pairs(labels, np.arange(3), num_pairs=6, seed=seed)
        assert result.indexes.dtype == np.int64 and result.indexes.shape == (6, 2)
        assert {tuple(p) for p in result.indexes[result.same].tolist()} == {(0, 1), (0, 2), (1, 2)}
        pairs = {tuple(p) for p in result.indexes[~result.same].tolist()}
        assert len(pairs) == 3 and pairs <= different
        every |= pairs
    assert every == different  # each is drawn by some seed, nothing else


def test_drawn_negatives_are_distinct_ordered_pairs_of_different_identities() -> None:
    labels = np.array([2, 0, 1, 0, 2, 1], dtype=np.int64)  # identities hold samples {1,3} {2,5} {0,4}
    result = sample_pairs(labels, np.arange(3), num_pairs=6, seed=0)
    negatives = {tuple(p) for p in result.indexes[~result.same].tolist()}
    assert {tuple(p) for p in result.indexes[result.same].tolist()} == {(1, 3), (2, 5), (0, 4)}
    # 3 asked for, 12 exist: drawn, not enumerated; distinct, smaller index first, different identities
    assert len(negatives) == 3 and all(a < b and labels[a] != labels[b] for a, b in negatives)
    # identities {0,1,2} {3} {4}: 3 same pairs asked, 7 different ones exist (< 4 x 3): all enumerated, 3 drawn
    short = sample_pairs(_pair_labels([3, 1, 1]), np.arange(3), num_pairs=6, seed=0)
    different = {(a, 3) for a in range(3)} | {(a, 4) for a in range(4)}
    assert len({tuple(p) for p in short.indexes[~short.same].tolist()} & different) == 3


def test_sample_pairs_notes_and_errors_in_full() -> None:
    result = sample_pairs(_pair_labels([3, 1, 2, 4]), np.arange(4), num_pairs=50, seed=0)
    assert result.notes == [
        "1 held-out identities have fewer than 2 samples: no same-identity pairs from them",
        "only 10 same-identity pairs exist among the held-out samples (25 asked): "
        "all are used, with as many different-identity pairs",
    ]
    few = sample_pairs(_pair_labels([5, 1]), np.arange(2), num_pairs=20, seed=0)
    assert few.notes == [
        "1 held-out identities have fewer than 2 samples: no same-identity pairs from them",
        "only 5 different-identity pairs exist (10 asked): all are used",
    ]
    exact = sample_pairs(_pair_labels([5, 2]), np.arange(2), num_pairs=22, seed=0)  # 11 same, 10 different exist
    assert exact.notes == ["only 10 different-identity pairs exist (11 asked): all are used"]
    with pytest.raises(ValueError, match="^fewer than 2 held-out identities have samples: no different-identity pairs possible$"):
        sample_pairs(_pair_labels([5, 0, 0]), np.arange(3), num_pairs=10, seed=0)
    with pytest.raises(ValueError, match="^no held-out identity has 2 or more samples: no same-identity pairs possible$"):
        sample_pairs(_pair_labels([1, 1, 1]), np.arange(3), num_pairs=10, seed=0)


# --- pairs.jsonl ------------------------------------------------------------------------------------


def test_pairs_jsonl_text_and_round_trip() -> None:
    pairs = [Pair(0, "a/1.jpg", 5, "b/é.jpg", False), Pair(2, "a/2.jpg", 3, "a/3.jpg", True)]
    text = format_pairs_jsonl(pairs)
    assert text == (
        '{"index1": 0, "index2": 5, "path1": "a/1.jpg", "path2": "b/é.jpg", "same": false}\n'
        '{"index1": 2, "index2": 3, "path1": "a/2.jpg", "path2": "a/3.jpg", "same": true}\n'
    )
    assert parse_pairs_jsonl(text) == pairs
    assert parse_pairs_jsonl("\n" + text + "  \n") == pairs  # blank lines are skipped


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("not json", "JSONDecodeError: Expecting value: line 1 column 1 (char 0)"),
        ('{"index1": 0}', "KeyError: 'path1'"),
        ('{"index1": true, "path1": "a", "index2": 1, "path2": "b", "same": true}', "TypeError: wrong value types"),
        ('{"index1": 0, "path1": "a", "index2": 1.0, "path2": "b", "same": true}', "TypeError: wrong value types"),
        ('{"index1": 0, "path1": 1, "index2": 1, "path2": "b", "same": true}', "TypeError: wrong value types"),
        ('{"index1": 0, "path1": "a", "index2": 1, "path2": null, "same": true}', "TypeError: wrong value types"),
        ('{"index1": 0, "path1": "a", "index2": 1, "path2": "b", "same": 1}', "TypeError: wrong value types"),
        ("[1, 2]", "TypeError: list indices must be integers or slices, not str"),
    ],
)
def test_pairs_jsonl_errors_name_the_line(row: str, message: str) -> None:
    good = format_pairs_jsonl([Pair(0, "a", 1, "b", True)])
    with pytest.raises(ValueError) as caught:
        parse_pairs_jsonl(good + "\n" + row + "\n")
    assert str(caught.value) == f"line 3: not a pair ({message})"


# --- LFW pairs.txt ----------------------------------------------------------------------------------


def test_lfw_pairs_with_one_count_and_trailing_blank_lines() -> None:
    assert parse_lfw_pairs("2\nA 1 2\nB 3 4\nA 1 B 2\nB 1 C 1\n\n\n") == [
        NamedPair("A", 1, "A", 2),
        NamedPair("B", 3, "B", 4),
        NamedPair("A", 1, "B", 2),
        NamedPair("B", 1, "C", 1),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "line 1: expected a header of one or two counts, such as '10 300'"),
        ("\n\n", "line 1: expected a header of one or two counts, such as '10 300'"),
        ("10 300 2\n", "line 1: expected a header of one or two counts, such as '10 300'"),
        ("1 x\nA 1 2\n", "line 1: expected a header of one or two counts, such as '10 300'"),
        ("1 1\nA 1 2\n", "header '1 1' promises 2 pairs, found 1"),
        ("1\nA 1 2\nA 1 B 2\nA 1 B 3\n", "header '1' promises 2 pairs, found 3"),
        ("1 1\nA 1 2\nA x B 2\n", "line 3: expected 'name i j' or 'name1 i name2 j' (invalid literal for int() with base 10: 'x')"),
        ("1 1\nA 1 y\nA 1 B 2\n", "line 2: expected 'name i j' or 'name1 i name2 j' (invalid literal for int() with base 10: 'y')"),
        ("1 1\nA 1 2\nA 1 B z\n", "line 3: expected 'name i j' or 'name1 i name2 j' (invalid literal for int() with base 10: 'z')"),
        ("1 1\nA 1\nA 1 B 2\n", "line 2: expected 'name i j' or 'name1 i name2 j' (2 fields)"),
        ("1 1\nA 1 2\n\nA 1 B 2\n", "line 3: expected 'name i j' or 'name1 i name2 j' (0 fields)"),
        ("1 1\nA 1 2 3 4\nA 1 B 2\n", "line 2: expected 'name i j' or 'name1 i name2 j' (5 fields)"),
        ("1 1\nA 0 2\nA 1 B 2\n", "line 2: image numbers start at 1"),
        ("1 1\nA 1 2\nA 1 B 0\n", "line 3: image numbers start at 1"),
    ],
)
def test_lfw_pairs_errors_in_full(text: str, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_lfw_pairs(text)
    assert str(caught.value) == message


def test_lfw_pairs_numbers_are_read_from_the_right_fields() -> None:
    assert parse_lfw_pairs("1\nA 3 7\nA 2 B 9\n") == [NamedPair("A", 3, "A", 7), NamedPair("A", 2, "B", 9)]
    assert json.dumps(parse_lfw_pairs("1\nA 3 7\nA 2 B 9\n")[1].same) == "false"


def test_drawn_negatives_spread_evenly_over_identities() -> None:
    # 4 identities of 50 samples: 1000 different pairs asked, 15,000 exist (>= 4 x 1000): drawn, not
    # enumerated. Two distinct identities uniformly per pair: each identity is in half of all pairs,
    # 500 of 1000 (binomial std 16; 440..560 is beyond 3.5 std).
    labels = _pair_labels([50] * 4)
    result = sample_pairs(labels, np.arange(4), num_pairs=2000, seed=0)
    negatives = result.indexes[~result.same]
    assert len(negatives) == 1000 and len({tuple(p) for p in negatives.tolist()}) == 1000
    assert np.all(labels[negatives[:, 0]] != labels[negatives[:, 1]])
    appearances = np.bincount(labels[negatives].ravel(), minlength=4)
    assert np.all((440 <= appearances) & (appearances <= 560)), appearances
    # two identities only: every different pair joins them
    two = sample_pairs(_pair_labels([10, 10]), np.arange(2), num_pairs=20, seed=0)
    pairs = two.indexes[~two.same]
    assert len(pairs) == 10 and np.all((pairs[:, 0] < 10) & (pairs[:, 1] >= 10))


def test_triangle_pairs_where_the_float_estimate_of_j_is_one_too_big() -> None:
    # Found by search: for these t, floor((1 + sqrt(1 + 8t)) / 2) in float64 is one above the true j, so
    # the correction step must bring it back. Exact answer from integer square roots.
    t = [3294257438736367130, 3294257441303177384, 1895772289590499385]
    i, j = triangle_pairs(np.array(t, dtype=np.int64))
    for k, value in enumerate(t):
        exact_j = (1 + math.isqrt(1 + 8 * value)) // 2  # the largest j with j(j-1)/2 <= t
        assert (int(i[k]), int(j[k])) == (value - exact_j * (exact_j - 1) // 2, exact_j)
        assert 0 <= i[k] < j[k]


def test_tar_at_far_reports_its_target_and_metrics_honour_the_fold_count() -> None:
    scores = np.tile([0.9, 0.8, 0.1, 0.2, 0.9, 0.3, 0.2, 0.7], 5)
    same = np.tile([True, True, False, False, True, True, False, False], 5)
    result = tar_at_far(*roc_curve(scores, same), far=0.25, num_negative=20)
    assert result is not None and result.far == 0.25
    assert len(verification_metrics(scores, same, folds=4).fold_accuracies) == 4


def test_embed_images_feeds_the_model_batches_of_the_given_size() -> None:
    import torch

    from facepipe.evaluation.embed import embed_images

    sizes: list[int] = []

    class Recorder(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            sizes.append(x.shape[0])
            return x.mean(dim=(2, 3))  # [B, 3]

    images = [np.full((4, 4, 3), k, np.uint8) for k in range(7)]
    out = embed_images(Recorder(), images, count=7, batch_size=3, flip=False, progress=False)
    assert sizes == [3, 3, 1] and out.shape == (7, 3)


def test_fold_ids_are_int64_and_a_score_on_the_threshold_counts_as_same() -> None:
    assert fold_ids(np.array([True, False] * 3), 3).dtype == np.int64
    # dyadic scores, so the learnt midpoints are exact. Fold 0 learns on fold 1 (same 0.75, different
    # 0.25): threshold 0.5, and fold 0's same pair scores exactly 0.5, which counts as "same" (>=).
    scores = np.array([0.5, 0.75, 0.125, 0.25])
    same = np.array([True, True, False, False])
    accuracies, thresholds = kfold_accuracy(scores, same, folds=2)
    np.testing.assert_array_equal(thresholds, [0.5, 0.3125])
    np.testing.assert_array_equal(accuracies, [1.0, 1.0])
