"""thresholds.json: the cosine threshold at each far_targets rate is the most permissive one whose
false accept rate stays within the target."""

from __future__ import annotations

import json

import numpy as np
import pytest

from facepipe.evaluation.verification import verification_metrics
from facepipe.stages import evaluate


@pytest.mark.parametrize("seed", [0, 1])
def test_each_threshold_keeps_the_false_accept_rate_and_is_the_most_permissive(seed: int) -> None:
    rng = np.random.default_rng(seed)
    same = rng.permutation(np.arange(5000) < 2000)  # 3000 different pairs: 1e-3 and 1e-2 measurable, 1e-4 not
    scores = np.round(np.where(same, rng.normal(0.6, 0.15, 5000), rng.normal(0.1, 0.15, 5000)), 3)  # ties too
    result = verification_metrics(scores, same, far_targets=(1e-2, 1e-3, 1e-4))
    written = evaluate.thresholds_dict(result)
    json.dumps(written, allow_nan=False)
    assert written["accept"] == "same person when score >= threshold"
    assert written["thresholds"]["1e-4"] is None
    negatives = np.sort(scores[~same])
    for key, far in (("1e-2", 1e-2), ("1e-3", 1e-3)):
        threshold = written["thresholds"][key]
        assert np.mean(negatives >= threshold) <= far
        looser = negatives[negatives < threshold].max()  # the next score it could accept
        assert np.mean(negatives >= looser) > far
    assert written["measured_on"] == {"num_same": 2000, "num_different": 3000}
