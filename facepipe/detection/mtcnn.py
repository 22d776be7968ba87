"""Batched MTCNN (weights shipped inside facenet-pytorch; nothing is downloaded).

Images are downscaled so the longest side is at most ``detect_size`` and padded to a size bucket
(multiples of 32), so that images of similar shape run through the cascade as one real batch.
"""

from __future__ import annotations

import math
from collections import defaultdict

import cv2
import numpy as np
import torch

from facepipe.detection.base import Face

_BUCKET = 32
_PNET_MIN = 12.0  # the smallest face P-Net sees, pixels


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class MTCNNDetector:
    """Detect faces with facenet-pytorch's MTCNN cascade, a batch of images at a time.

    ``min_face_size`` is in original-image pixels; faces smaller than it may still be returned (the
    caller gates on size) but the image pyramid does not search below it.
    """

    def __init__(
        self,
        *,
        min_face_size: int = 40,
        detect_size: int = 640,
        thresholds: tuple[float, float, float] = (0.6, 0.7, 0.7),
        factor: float = 0.709,
        device: str = "auto",
    ) -> None:
        from facenet_pytorch.models.mtcnn import ONet, PNet, RNet

        self.min_face_size = min_face_size
        self.detect_size = detect_size
        self.thresholds = list(thresholds)
        self.factor = factor
        self.device = resolve_device(device)
        self.pnet = PNet(pretrained=True).to(self.device).eval()
        self.rnet = RNet(pretrained=True).to(self.device).eval()
        self.onet = ONet(pretrained=True).to(self.device).eval()

    def detect(self, images: list[np.ndarray]) -> list[list[Face]]:
        """Faces of each [H, W, 3] uint8 RGB image, in original coordinates, highest score first."""
        prepared = [self._resize(image) for image in images]
        buckets: dict[tuple[int, int], list[int]] = defaultdict(list)
        for index, (small, _) in enumerate(prepared):
            h, w = small.shape[:2]
            buckets[(math.ceil(h / _BUCKET) * _BUCKET, math.ceil(w / _BUCKET) * _BUCKET)].append(index)
        results: list[list[Face]] = [[] for _ in images]
        for (bh, bw), indexes in sorted(buckets.items()):
            batch = np.zeros((len(indexes), bh, bw, 3), dtype=np.uint8)
            for row, index in enumerate(indexes):
                small = prepared[index][0]
                batch[row, : small.shape[0], : small.shape[1]] = small
            scales = [prepared[index][1] for index in indexes]
            minsize = max(_PNET_MIN, self.min_face_size * min(scales))
            for index, faces in zip(indexes, self._run(batch, minsize, scales)):
                results[index] = faces
        return results

    def _resize(self, image: np.ndarray) -> tuple[np.ndarray, float]:
        h, w = image.shape[:2]
        scale = min(1.0, self.detect_size / max(h, w))
        if scale == 1.0:
            return image, 1.0
        size = (max(1, round(w * scale)), max(1, round(h * scale)))
        return cv2.resize(image, size, interpolation=cv2.INTER_AREA), scale

    def _run(self, batch: np.ndarray, minsize: float, scales: list[float]) -> list[list[Face]]:
        from facenet_pytorch.models.utils.detect_face import detect_face

        with torch.inference_mode():
            boxes, points = detect_face(
                batch, minsize, self.pnet, self.rnet, self.onet, self.thresholds, self.factor, self.device
            )
        out = []
        for image_boxes, image_points, scale in zip(boxes, points, scales):
            # numpy 2: facenet-pytorch hands back object arrays; make them plain float arrays.
            image_boxes = np.asarray(image_boxes, dtype=np.float32).reshape(-1, 5)
            image_points = np.asarray(image_points, dtype=np.float32).reshape(-1, 5, 2)
            faces = [
                Face(box=(b[:4] / scale).astype(np.float64), score=float(b[4]), landmarks=(p / scale).astype(np.float64))
                for b, p in zip(image_boxes, image_points)
            ]
            faces.sort(key=lambda face: -face.score)
            out.append(faces)
        return out
