"""``prepare.detector: none``: images that are already aligned face crops (insightface's 112x112).

No network runs. Each image gets one face, score 1, whose landmarks are where an aligned crop holds
them: the ArcFace template scaled so the face fills the image's height, centred horizontally. For a
112x112 crop that is the template itself, so alignment copies the pixels; an S x S crop is resized
to the output size; a 96-wide, 112-high crop (SphereFace/CASIA style) is the 112 template moved 8 px
left, so alignment pads its sides as insightface does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from facepipe.alignment import ARCFACE_TEMPLATE_112
from facepipe.detection.base import Face


def aligned_landmarks(width: int, height: int) -> np.ndarray:
    """[5, 2] float64 landmarks of an aligned ``width`` x ``height`` crop (see the module doc)."""
    scale = height / 112.0
    points = ARCFACE_TEMPLATE_112 * scale
    points[:, 0] += width / 2.0 - 56.0 * scale
    return points


class PrealignedDetector:
    """The "detector" of pre-aligned crops: one whole-image face per image, score 1."""

    def detect(self, images: list[np.ndarray], *, reductions: Sequence[int] | None = None) -> list[list[Face]]:
        """One face covering each image; ``reductions`` (unused) as :class:`Detector` takes them."""
        faces = []
        for image in images:
            height, width = image.shape[:2]
            box = np.array([0.0, 0.0, float(width), float(height)])
            faces.append([Face(box=box, score=1.0, landmarks=aligned_landmarks(width, height))])
        return faces
