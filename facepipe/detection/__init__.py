"""Face detectors: images in, faces (box, score, 5 landmarks) out."""

from facepipe.detection.base import Face, select_face
from facepipe.detection.mtcnn import MTCNNDetector

__all__ = ["Face", "MTCNNDetector", "select_face"]
