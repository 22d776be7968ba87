"""Face detectors: images in, faces (box, score, 5 landmarks) out."""

from facepipe.detection.base import Detector, Face, select_face
from facepipe.detection.mtcnn import MTCNNDetector
from facepipe.detection.registry import DETECTORS, create_detector

__all__ = ["DETECTORS", "Detector", "Face", "MTCNNDetector", "create_detector", "select_face"]
