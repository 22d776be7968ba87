"""The detector's reject reasons on real photos: low_score and face_too_small from images made bad on
purpose, bad_landmarks and detector_error (with the per-image retry) by injecting a detector fault."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageEnhance, ImageFilter

from facepipe.config import PrepareParams
from facepipe.data.extract import process_chunk
from facepipe.detection.mtcnn import MTCNNDetector
from rawdata import hopper, save

# MTCNN (the default detector before issue 21): the bad photos below are made to MTCNN's scores, and
# the faults are injected into its class; RetinaFace's own rejects: tests/test_retinaface.py
PARAMS = PrepareParams(detector="mtcnn", min_face_size=40, score_threshold=0.95)


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """hopper/good.png, a blurred low-contrast copy, a tiny copy on a big canvas, and a padded copy."""
    root = tmp_path_factory.mktemp("rejects_raw")
    photo = Image.fromarray(hopper())  # 512 x 600, face ~200 px
    save(np.asarray(photo), root / "hopper" / "good.png")
    # Blur 8 px and 15 % contrast: MTCNN still sees a face, at a score (0.78) well under 0.95.
    faint = ImageEnhance.Contrast(photo.filter(ImageFilter.GaussianBlur(8))).enhance(0.15)
    save(np.asarray(faint), root / "hopper" / "faint.png")
    # Shrunk to 36/200 and pasted on a 400 px canvas: a face box of ~32 px, under min_face_size 40.
    small = photo.resize((photo.width * 36 // 200, photo.height * 36 // 200), Image.BICUBIC)
    canvas = Image.new("RGB", (400, 400), (120, 120, 120))
    canvas.paste(small, (150, 150))
    save(np.asarray(canvas), root / "hopper" / "small.png")
    padded = Image.new("RGB", (photo.width + 80, photo.height + 80), (90, 120, 150))
    padded.paste(photo, (40, 40))
    save(np.asarray(padded), root / "hopper" / "padded.png")
    return root


def outcomes_by_name(raw: Path, names: list[str]) -> dict[str, object]:
    paths = [f"hopper/{name}" for name in names]
    return {o.path.split("/")[1]: o for o in process_chunk(paths, str(raw), PARAMS, "cpu")}


def test_low_score_and_face_too_small_on_real_photos(raw: Path) -> None:
    found = outcomes_by_name(raw, ["good.png", "faint.png", "small.png"])
    assert found["good.png"].accepted and found["good.png"].header["score"] >= 0.95
    faint, small = found["faint.png"], found["small.png"]
    assert (faint.reason, small.reason) == ("low_score", "face_too_small")
    score = float(faint.detail.split()[2])  # "best score 0.7832 < 0.95"
    assert 0.5 < score < 0.95, faint.detail
    size = float(small.detail.split()[2].removesuffix("px"))  # "largest face 32px < min_face_size=40"
    assert size < 40 and small.detail.endswith("min_face_size=40"), small.detail
    assert faint.sha256 and small.sha256  # rejects keep the content hash of the source


def test_degenerate_landmarks_are_bad_landmarks(raw: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = MTCNNDetector.detect

    def collapsed(self, images):  # every landmark on the nose: no similarity transform exists
        return [[replace(f, landmarks=np.repeat(f.landmarks[2:3], 5, axis=0)) for f in faces] for faces in real(self, images)]

    monkeypatch.setattr(MTCNNDetector, "detect", collapsed)
    found = outcomes_by_name(raw, ["good.png"])
    assert found["good.png"].reason == "bad_landmarks"
    assert "degenerate landmarks" in found["good.png"].detail


def test_a_detector_error_rejects_only_the_image_that_causes_it(raw: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunk-wide call fails; each image is retried alone; only the poisoned one is rejected."""
    real = MTCNNDetector.detect
    calls: list[int] = []
    poison_height = 600 + 80  # padded.png

    def failing(self, images):
        calls.append(len(images))
        if any(image.shape[0] == poison_height for image in images):
            raise RuntimeError("injected detector fault")
        return real(self, images)

    monkeypatch.setattr(MTCNNDetector, "detect", failing)
    found = outcomes_by_name(raw, ["good.png", "padded.png", "faint.png"])
    assert calls == [3, 1, 1, 1]  # the chunk, then each image alone
    assert found["padded.png"].reason == "detector_error"
    assert found["padded.png"].detail == "RuntimeError: injected detector fault"
    assert found["good.png"].accepted and found["faint.png"].reason == "low_score"
