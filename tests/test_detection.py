"""facepipe's MTCNN cascade on real faces, against facenet-pytorch's own ``MTCNN.detect``."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from facepipe.detection import MTCNNDetector
from rawdata import astronaut, hopper


@pytest.fixture(scope="module")
def detector():
    return MTCNNDetector(min_face_size=40, device="cpu")


@pytest.fixture(scope="module")
def reference():
    from facenet_pytorch import MTCNN

    return MTCNN(keep_all=True, min_face_size=40, device="cpu")


def photos() -> dict[str, np.ndarray]:
    h, a = hopper(), astronaut()
    small = cv2.resize(h, (h.shape[1] * 2 // 5, h.shape[0] * 2 // 5), interpolation=cv2.INTER_AREA)
    tilted = cv2.warpAffine(a, cv2.getRotationMatrix2D((256, 200), 15, 0.8), (512, 512), borderValue=(40, 90, 30))
    return {"hopper": h, "astronaut": a, "hopper_small": small, "astronaut_tilted": tilted}


def iou(a: np.ndarray, b: np.ndarray) -> float:
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def test_same_faces_and_landmarks_as_facenet_pytorch(detector, reference):
    """The cascade around the shared networks is ours (resampling, pyramid, batching differ), so the
    two agree as two runs of MTCNN at different resampling do: same face, landmarks within a few
    percent of the face size (the mouth corners move most), same confidence."""
    errors = []
    for name, image in photos().items():
        faces = detector.detect([image])[0]
        boxes, scores, landmarks = reference.detect(image, landmarks=True)
        boxes = np.asarray(boxes, dtype=np.float32)  # numpy 2: object arrays
        landmarks = np.asarray(landmarks, dtype=np.float32) - 1  # facenet-pytorch's points are 1-based (test_landmark_geometry.py)
        ours = max((f for f in faces if f.score >= 0.95), key=lambda f: f.area)
        theirs = int(np.argmax((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])))
        assert iou(ours.box, boxes[theirs]) > 0.85, name
        assert abs(ours.score - float(np.asarray(scores, dtype=np.float32)[theirs])) < 0.01, name
        errors.append(np.abs(ours.landmarks - landmarks[theirs]).max(axis=1) / ours.size)  # [5] per landmark
    errors = np.stack(errors)
    assert errors[:, :2].max() < 0.03, errors  # eyes
    assert np.median(errors) < 0.02 and errors.max() < 0.05, errors


def test_a_batch_gives_what_single_images_give(detector):
    """Equal-size photos share one padded P-Net batch and R/O-Net see the whole chunk: same faces."""
    pics = photos()
    a = pics["astronaut"]
    b = pics["astronaut_tilted"]  # same size as a: one bucket
    c = pics["hopper"]  # another bucket
    together = detector.detect([a, c, b, a])
    alone = [detector.detect([image])[0] for image in (a, c, b, a)]
    for batch_faces, single_faces in zip(together, alone):
        assert len(batch_faces) == len(single_faces)
        for x, y in zip(batch_faces, single_faces):
            # Batched convolutions round differently in float32: measured 1.5e-5 px (one float32 step at
            # 128-256 px; 3e-5 at 256-512), so 1e-4 px leaves ~6x headroom and catches any real offset.
            np.testing.assert_allclose(x.box, y.box, rtol=0, atol=1e-4)
            np.testing.assert_allclose(x.landmarks, y.landmarks, rtol=0, atol=1e-4)
            assert x.score == pytest.approx(y.score, abs=1e-6)  # measured 1.2e-7 (one float32 step below 1)
    assert together[0][0].score == together[3][0].score


def test_no_face_and_tiny_images(detector):
    flat = np.full((300, 400, 3), 128, np.uint8)
    tiny = np.full((20, 20, 3), 200, np.uint8)
    assert detector.detect([flat, tiny]) == [[], []]
    assert detector.detect([]) == []


def test_large_photos_are_downscaled_and_mapped_back(detector, monkeypatch):
    """A photo larger than ``detect_size`` is detected at reduced size; boxes come back in its own pixels."""
    a = photos()["astronaut"]
    big = cv2.resize(a, (a.shape[1] * 3, a.shape[0] * 3), interpolation=cv2.INTER_CUBIC)
    small_face = max(detector.detect([a])[0], key=lambda f: f.area)
    seen = []
    resize = detector._resize
    monkeypatch.setattr(detector, "_resize", lambda image: seen.append(resize(image)[0].shape) or resize(image))
    big_face = max(detector.detect([big])[0], key=lambda f: f.area)
    assert [max(shape[:2]) for shape in seen] == [detector.detect_size]  # the network saw the reduced photo
    np.testing.assert_allclose(big_face.landmarks / 3, small_face.landmarks, atol=2.0)
