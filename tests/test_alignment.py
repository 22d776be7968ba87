import math

import numpy as np
import pytest

from facepipe.alignment import ARCFACE_TEMPLATE_112, align_face, apply_transform, template, umeyama


def similarity(scale: float, angle: float, tx: float, ty: float) -> np.ndarray:
    c, s = math.cos(angle), math.sin(angle)
    return np.array([[scale * c, -scale * s, tx], [scale * s, scale * c, ty]])


@pytest.mark.parametrize("scale,angle,tx,ty", [(1.0, 0.0, 0.0, 0.0), (2.5, 0.3, -10.0, 4.0), (0.37, -2.0, 100.0, 55.5)])
def test_umeyama_recovers_a_known_similarity(scale, angle, tx, ty):
    src = np.random.default_rng(0).uniform(0, 200, size=(5, 2))
    truth = similarity(scale, angle, tx, ty)
    dst = apply_transform(truth, src)
    np.testing.assert_allclose(umeyama(src, dst), truth, atol=1e-9)


def test_template_points_map_exactly_onto_themselves():
    np.testing.assert_allclose(umeyama(ARCFACE_TEMPLATE_112, ARCFACE_TEMPLATE_112), similarity(1, 0, 0, 0), atol=1e-12)


def test_template_scales_with_output_size():
    np.testing.assert_allclose(template(224), ARCFACE_TEMPLATE_112 * 2)
    # landmarks that are the 112 template map to the 224 template by a pure x2 scale
    np.testing.assert_allclose(umeyama(ARCFACE_TEMPLATE_112, template(224)), similarity(2, 0, 0, 0), atol=1e-12)


def test_umeyama_never_reflects():
    src = ARCFACE_TEMPLATE_112.copy()
    mirrored = src * np.array([-1.0, 1.0])  # best orthogonal fit is a reflection
    matrix = umeyama(src, mirrored)
    assert np.linalg.det(matrix[:, :2]) > 0


def test_umeyama_least_squares_with_noise_beats_perturbations():
    rng = np.random.default_rng(1)
    src = rng.uniform(0, 100, (5, 2))
    dst = apply_transform(similarity(1.3, 0.2, 5, 7), src) + rng.normal(0, 0.5, (5, 2))
    best = umeyama(src, dst)
    err = ((apply_transform(best, src) - dst) ** 2).sum()
    scale = math.hypot(best[0, 0], best[1, 0])
    angle = math.atan2(best[1, 0], best[0, 0])
    for delta in (1e-3, -1e-3):
        for params in ((scale + delta, angle, *best[:, 2]), (scale, angle + delta, *best[:, 2])):
            other = similarity(*params)
            assert ((apply_transform(other, src) - dst) ** 2).sum() >= err - 1e-9


def test_degenerate_landmarks_raise():
    with pytest.raises(ValueError, match="degenerate"):
        umeyama(np.ones((5, 2)), ARCFACE_TEMPLATE_112)


def test_align_face_puts_landmarks_on_the_template():
    # a synthetic image with bright dots at known landmark positions under a known similarity
    truth = similarity(2.0, 0.25, 40.0, 10.0)
    landmarks = apply_transform(truth, ARCFACE_TEMPLATE_112)
    image = np.zeros((400, 400, 3), np.uint8)
    for x, y in landmarks.round().astype(int):
        image[y - 2 : y + 3, x - 2 : x + 3] = 255
    aligned = align_face(image, landmarks, 112)
    assert aligned.shape == (112, 112, 3) and aligned.dtype == np.uint8
    for x, y in ARCFACE_TEMPLATE_112.round().astype(int):
        assert aligned[y, x].max() > 200
