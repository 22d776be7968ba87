"""Face detectors: images in, faces (box, score, 5 landmarks) out.

The registry (names and traits: :mod:`facepipe.detection.registry`) loads without torch or OpenCV;
the detectors and the face types load when first named here, so that ``facepipe.config`` can ask a
detector's traits cheaply."""

from importlib import import_module
from typing import Any

from facepipe.detection.registry import DETECTORS, DetectorKind, create_detector, detector_kind, list_detectors

#: Names this package gives on first use, and the module each comes from.
_LAZY = {"Detector": "base", "Face": "base", "select_face": "base", "MTCNNDetector": "mtcnn"}

__all__ = [
    "DETECTORS",
    "Detector",
    "DetectorKind",
    "Face",
    "MTCNNDetector",
    "create_detector",
    "detector_kind",
    "list_detectors",
    "select_face",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"facepipe.detection.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'facepipe.detection' has no attribute {name!r}")
