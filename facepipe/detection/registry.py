"""Detectors by name (``prepare.detector``): one constructor call for the prepare workers and the tools."""

from __future__ import annotations

import os

from facepipe.detection.base import Detector

#: Names that ``prepare.detector`` accepts.
DETECTORS = ("mtcnn", "retinaface", "none", "facenet_pytorch")


def create_detector(
    name: str,
    *,
    weights: str | os.PathLike[str] | None = None,
    min_face_size: int = 40,
    detect_size: int = 640,
    device: str = "auto",
) -> Detector:
    """The detector ``name`` with its weights (MTCNN, facepipe's cascade or facenet-pytorch's own: its weights, shipped; RetinaFace: ``weights``
    or the cached MobileNet-0.25 of ``facepipe weights fetch retinaface``; ``none``: pre-aligned crops,
    no network)."""
    if name == "mtcnn":
        if weights is not None:
            raise ValueError("mtcnn uses the weights shipped with facenet-pytorch; weights are for retinaface")
        from facepipe.detection.mtcnn import MTCNNDetector

        return MTCNNDetector(min_face_size=min_face_size, detect_size=detect_size, device=device)
    if name == "facenet_pytorch":
        if weights is not None:
            raise ValueError("facenet_pytorch uses the weights shipped with facenet-pytorch; weights are for retinaface")
        from facepipe.detection.facenet_mtcnn import FacenetPytorchDetector

        return FacenetPytorchDetector(min_face_size=min_face_size, detect_size=detect_size, device=device)
    if name == "retinaface":
        from facepipe.detection.retinaface import RetinaFaceDetector

        # Faces below min_face_size are gated by the caller, so the network need not see them larger
        # than MIN_FACE_INPUT px: a smaller input, same landmark accuracy (retinaface.MIN_FACE_INPUT).
        return RetinaFaceDetector(weights=weights, detect_size=detect_size, min_face_size=min_face_size, device=device)
    if name == "none":
        if weights is not None:
            raise ValueError("detector none runs no network; weights are for retinaface")
        from facepipe.detection.prealigned import PrealignedDetector

        return PrealignedDetector()  # the images are aligned crops already
    raise ValueError(f"unknown detector {name!r}; known: {', '.join(DETECTORS)}")
