"""facenet-pytorch's own MTCNN (``prepare.detector: facenet_pytorch``): its cascade, one photo at a time.

facepipe's ``mtcnn`` runs the same three networks in its own batched cascade (other resampling: boxes
a few pixels apart from facenet-pytorch's). Where a dataset must be cut exactly as facenet-pytorch
cuts it (``prepare.crop: facenet``, to fine-tune its published weights on the faces they were trained
on), this detector gives facenet-pytorch's boxes as they are, at several times the cost.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from facepipe.detection.base import Face, downscale
from facepipe.devices import resolve_device


class FacenetPytorchDetector:
    """``facenet_pytorch.MTCNN(keep_all=True).detect`` per image, downscaled to ``detect_size`` first."""

    def __init__(self, *, min_face_size: int = 40, detect_size: int = 640, device: str = "auto") -> None:
        from facenet_pytorch import MTCNN

        self.min_face_size = min_face_size
        self.detect_size = detect_size
        self.device = resolve_device(device, what="prepare device")
        self.mtcnn = MTCNN(keep_all=True, min_face_size=min_face_size, device=self.device)

    def detect(self, images: list[np.ndarray], *, reductions: Sequence[int] | None = None) -> list[list[Face]]:
        """[H, W, 3] uint8 RGB images -> their faces in each image's coordinates, highest score first."""
        found = []
        for image, reduction in zip(images, reductions or [1] * len(images)):
            small, scale = downscale(image, self.detect_size)
            # the pyramid searches faces down to min_face_size original pixels, fewer in a reduced decode
            self.mtcnn.min_face_size = max(12, round(self.min_face_size * scale / reduction))
            boxes, scores, landmarks = self.mtcnn.detect(small, landmarks=True)
            faces = [] if boxes is None else [
                Face(
                    box=np.asarray(box, dtype=np.float64) / scale,
                    score=float(score),
                    landmarks=np.asarray(points, dtype=np.float64) / scale,
                )
                for box, score, points in zip(boxes, scores, landmarks)
            ]
            found.append(sorted(faces, key=lambda face: -face.score))
        return found
