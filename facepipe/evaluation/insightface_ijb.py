"""TAR at FAR as insightface's IJB-B/C evaluation reads it off its ROC, for numbers that can sit next
to published IJB tables. Pure: no I/O, no globals.

insightface computes the ROC with scikit-learn's ``roc_curve`` (default ``drop_intermediate=True``)
on the template-pair similarities, reverses it, and for each FAR takes the TPR of the ROC point
whose FPR is *nearest* the rate, above or below it (the lowest index of the reversed curve on a tie,
which is the point with the larger TPR). facepipe's own convention (:func:`facepipe.evaluation.
verification.tar_at_far`) takes the most permissive threshold whose FPR does not exceed the rate,
so it never reports a point above the target; the two agree when a ROC point lies exactly at the
rate and otherwise differ by the ROC's step there. metrics.json names these ``insightface_*``.
"""

from __future__ import annotations

import numpy as np

from facepipe.evaluation.verification import roc_curve


def sklearn_roc(scores: np.ndarray, same: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([R] fpr, [R] tpr) as scikit-learn's ``roc_curve(same, scores)`` returns them (thresholds at
    the distinct scores, decreasing; collinear points dropped; (0, 0) first). Higher score = more
    alike. Needs pairs of both kinds."""
    fpr, tpr, _ = roc_curve(scores, same)  # (0, 0), then one point per distinct score, decreasing
    same = np.asarray(same, dtype=bool)
    fps = np.rint(fpr[1:] * (~same).sum()).astype(np.int64)  # back to counts: the thinning is exact on them
    tps = np.rint(tpr[1:] * same.sum()).astype(np.int64)
    if len(fps) > 2:  # drop_intermediate: keep a point only where the curve turns
        turns = np.logical_or(np.diff(fps, 2) != 0, np.diff(tps, 2) != 0)
        keep = np.flatnonzero(np.concatenate([[True], turns, [True]]))
        fps, tps = fps[keep], tps[keep]
    fps = np.concatenate([[0], fps])
    tps = np.concatenate([[0], tps])
    return fps / fps[-1], tps / tps[-1]


def insightface_tar_at_far(scores: np.ndarray, same: np.ndarray, *, fars: tuple[float, ...]) -> dict[float, float]:
    """{far: TPR of the ROC point nearest ``far``} by insightface's rule (module docstring)."""
    fpr, tpr = sklearn_roc(scores, same)
    fpr, tpr = fpr[::-1], tpr[::-1]
    # np.argmin returns the first of equal minima: Python's min over (distance, index) pairs does too
    return {far: float(tpr[int(np.argmin(np.abs(fpr - far)))]) for far in fars}
