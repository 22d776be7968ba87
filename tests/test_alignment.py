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


# --- found by mutation testing (tests/README.md) ----------------------------------------------------


def best_similarity_by_search(src: np.ndarray, dst: np.ndarray) -> float:
    """Smallest squared residual of any similarity (no reflection) taking src to dst, by a grid search
    over the rotation angle; for a fixed rotation the best scale and translation are closed-form."""
    src_c, dst_c = src - src.mean(0), dst - dst.mean(0)
    best = math.inf
    for angle in np.linspace(-math.pi, math.pi, 20001):
        rotated = src_c @ similarity(1.0, angle, 0.0, 0.0)[:, :2].T
        scale = max((rotated * dst_c).sum() / (src_c**2).sum(), 0.0)
        best = min(best, ((scale * rotated - dst_c) ** 2).sum())
    return best


@pytest.mark.parametrize("mirror", [False, True])
def test_umeyama_is_the_least_squares_similarity_even_when_a_reflection_fits_better(mirror):
    # mirrored landmarks: the best orthogonal map is a reflection, the best rotation must still be found
    rng = np.random.default_rng(3)
    src = rng.uniform(0, 100, (5, 2))
    dst = apply_transform(similarity(1.7, 0.4, 3, -2), src) + rng.normal(0, 2.0, (5, 2))
    if mirror:
        dst = dst * np.array([-1.0, 1.0])
    matrix = umeyama(src, dst)
    assert np.linalg.det(matrix[:, :2]) > 0
    residual = ((apply_transform(matrix, src) - dst) ** 2).sum()
    # the grid step (3e-4 rad) bounds how far the search can be above the true optimum
    assert residual <= best_similarity_by_search(src, dst) + 1e-6
    assert residual >= best_similarity_by_search(src, dst) - 1.0


def test_umeyama_computes_in_float64_whatever_the_input_dtype():
    # far from the origin float32 arithmetic would lose about 1e-3 px; inputs are exact float32 values
    src = (np.random.default_rng(2).uniform(0, 50, (5, 2)) + 20000.0).astype(np.float32)
    dst = apply_transform(similarity(0.8, 0.1, -5000.0, 300.0), src).astype(np.float32)
    expected = umeyama(src.astype(np.float64), dst.astype(np.float64))
    np.testing.assert_allclose(umeyama(src, dst), expected, rtol=0, atol=1e-9)
    np.testing.assert_allclose(umeyama(src.tolist(), dst.astype(np.float64)), expected, rtol=0, atol=1e-9)


def test_two_points_determine_a_similarity():
    src = np.array([[10.0, 20.0], [30.0, 25.0]])
    truth = similarity(1.5, -0.7, 4.0, 9.0)
    np.testing.assert_allclose(umeyama(src, apply_transform(truth, src)), truth, atol=1e-12)


@pytest.mark.parametrize(
    "src_shape,dst_shape",
    [((5, 2), (4, 2)), ((1, 2), (1, 2)), ((5, 3), (5, 3)), ((5, 2, 1), (5, 2, 1)), ((10,), (10,))],
)
def test_umeyama_rejects_point_sets_of_the_wrong_shape(src_shape, dst_shape):
    src = np.arange(math.prod(src_shape), dtype=float).reshape(src_shape) ** 1.5
    dst = np.arange(math.prod(dst_shape), dtype=float).reshape(dst_shape)
    with pytest.raises(ValueError, match=r"^expected two \[N, 2\] point sets with N >= 2, got"):
        umeyama(src, dst)


def test_a_tiny_face_is_not_degenerate():
    # a face a fraction of a pixel across is unusual but well defined: scale 100 onto the template
    np.testing.assert_allclose(
        umeyama(ARCFACE_TEMPLATE_112 * 0.01, ARCFACE_TEMPLATE_112), similarity(100, 0, 0, 0), atol=1e-9
    )
    with pytest.raises(ValueError, match="^degenerate landmarks: all points coincide$"):
        umeyama(np.full((5, 2), 7.5), ARCFACE_TEMPLATE_112)


def test_template_default_size_and_bad_sizes():
    np.testing.assert_array_equal(template(), ARCFACE_TEMPLATE_112)
    np.testing.assert_allclose(template(1), ARCFACE_TEMPLATE_112 / 112)
    for size in (0, -1):
        with pytest.raises(ValueError, match=f"^template size must be positive, got {size}$"):
            template(size)


def test_align_face_default_size_and_black_border():
    # an all-white photo whose face sits at its corner: the part of the output outside the photo is black
    image = np.full((60, 60, 3), 255, np.uint8)
    landmarks = apply_transform(similarity(0.5, 0.0, -10.0, -10.0), ARCFACE_TEMPLATE_112)
    aligned = align_face(image, landmarks)
    assert aligned.shape == (112, 112, 3)
    assert (aligned[:15, :15] == 0).all() and (aligned[60:, 60:] == 255).all()


def test_umeyama_without_reflection_when_the_singular_values_differ():
    # dst: the template mirrored and stretched unevenly, so a reflection fits it best and the two
    # singular values of the covariance differ. The answer must be the best *proper* similarity:
    # compared with a brute-force search over the angle, where
    # scale and translation have a closed form for each angle (linear least squares).
    src = np.array(ARCFACE_TEMPLATE_112)
    dst = src * np.array([-1.3, 0.8]) + np.array([5.0, -2.0])

    def residual(matrix):
        return float(((apply_transform(matrix, src) - dst) ** 2).sum())

    best = math.inf
    for theta in np.linspace(-math.pi, math.pi, 20001):
        c, s = math.cos(theta), math.sin(theta)
        rotated = src @ np.array([[c, -s], [s, c]]).T
        rc, dc = rotated - rotated.mean(0), dst - dst.mean(0)
        scale = (rc * dc).sum() / (rc * rc).sum()
        shift = dst.mean(0) - scale * rotated.mean(0)
        matrix = np.array([[scale * c, -scale * s, shift[0]], [scale * s, scale * c, shift[1]]])
        best = min(best, residual(matrix))
    matrix = umeyama(src, dst)
    assert np.linalg.det(matrix[:, :2]) > 0  # a rotation times a positive scale, not a reflection
    assert residual(matrix) <= best + 1e-6 * best  # at least as good as the finest angle on the grid
