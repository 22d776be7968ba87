"""Template features for IJB-style set-to-set verification. Pure: no I/O, no globals.

insightface's ``image2template_feature``: a template's faces are averaged within each media (a
video's frames, or one photo), the media features summed, and the result L2-normalised; a template
pair's score is the cosine of its two features.
"""

from __future__ import annotations

import numpy as np


def template_features(
    features: np.ndarray, templates: np.ndarray, medias: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """([F, E] float face features, [F] template ids, [F] media ids) -> ([T] ids, [T, E] float64 unit rows).

    Media are grouped within a template (the same media id in two templates is two media).
    """
    features = np.asarray(features, dtype=np.float64)
    ids, template_index = np.unique(templates, return_inverse=True)
    groups, group_index = np.unique(np.stack([template_index, np.asarray(medias)]), axis=1, return_inverse=True)
    group_index = group_index.reshape(-1)
    sums = np.zeros((groups.shape[1], features.shape[1]))
    np.add.at(sums, group_index, features)
    media_means = sums / np.bincount(group_index, minlength=groups.shape[1])[:, None]
    pooled = np.zeros((len(ids), features.shape[1]))
    np.add.at(pooled, groups[0], media_means)
    return ids, pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)


def pair_scores(ids: np.ndarray, features: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """[P, 2] template ids -> [P] float64 cosine scores of their (unit) features."""
    rows = np.searchsorted(ids, pairs)
    return np.einsum("pe,pe->p", features[rows[:, 0]], features[rows[:, 1]])
