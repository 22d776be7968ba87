"""Detectors by name (``prepare.detector``), through the one :class:`~facepipe.registry.Registry`
mechanism: one constructor call for the prepare workers and the tools, and what each detector is
(:class:`DetectorKind`) known without building it, so callers ask ``needs_alignment`` instead of
comparing names. The names a params file may use are ``facepipe.config.DetectorName``;
tests/test_structure.py checks that they are the registered names."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from typing import Any, Protocol

from facepipe.registry import Registry

#: A built detector (:class:`facepipe.detection.base.Detector`), not imported here: the registry
#: and config, which asks it for traits, carry no detector code.
Detector = Any


class DetectorBuilder(Protocol):
    """What ``@register_detector`` decorates: builds a detector (all arguments keyword-only)."""

    def __call__(
        self, *, weights: str | os.PathLike[str] | None, min_face_size: int, detect_size: int, device: str, threads: int
    ) -> Detector: ...


@dataclass(frozen=True)
class DetectorKind:
    """A registered detector: its builder and its traits. ``needs_alignment``: False for inputs that
    are aligned crops already (``none``: no network, decoded at full size, crops that are not
    ``image_size`` squares resized, no box to crop by); ``takes_weights``: ``prepare.detector_weights``
    (a checkpoint by path) is for it."""

    name: str
    build: DetectorBuilder
    needs_alignment: bool = True
    takes_weights: bool = False


DETECTORS: Registry[DetectorKind] = Registry("detector")


def register_detector(
    name: str, *, needs_alignment: bool = True, takes_weights: bool = False
) -> Callable[[DetectorBuilder], DetectorBuilder]:
    """Decorator: make ``create_detector(name, ...)`` call the decorated builder, with these traits."""

    def add(build: DetectorBuilder) -> DetectorBuilder:
        DETECTORS.register(name)(DetectorKind(name, build, needs_alignment=needs_alignment, takes_weights=takes_weights))
        return build

    return add


def list_detectors() -> list[str]:
    """Names accepted by ``create_detector``, sorted."""
    return DETECTORS.names()


def detector_kind(name: str) -> DetectorKind:
    """The registered detector ``name``; an unknown name raises ``ValueError`` naming the known ones."""
    return DETECTORS.get(name)


def aligned_detector() -> str:
    """The name of the detector for inputs that are aligned crops already (what the imports use)."""
    (name,) = [name for name in list_detectors() if not detector_kind(name).needs_alignment]
    return name


def create_detector(
    name: str,
    *,
    weights: str | os.PathLike[str] | None = None,
    min_face_size: int = 40,
    detect_size: int = 640,
    device: str = "auto",
    threads: int = 0,
) -> Detector:
    """The detector ``name`` with its weights (MTCNN, facepipe's cascade or facenet-pytorch's own: its weights, shipped; RetinaFace: ``weights``
    or the packaged MobileNet-0.25 (:func:`facepipe.detection.weights.load_onnx_bytes`); ``none``:
    pre-aligned crops, no network). ``threads``: CPU threads its network may use (0: the runtime's
    default); prepare's workers run one each."""
    kind = detector_kind(name)
    return kind.build(weights=weights, min_face_size=min_face_size, detect_size=detect_size, device=device, threads=threads)


def _load(module: str, name: str) -> Any:
    """A detector class of this package, imported when a detector is built (by name, so that the
    registry, and ``facepipe.config`` that asks it for traits, carry no detector code nor torch: only
    the stages that detect have the detectors among their DVC deps)."""
    return getattr(import_module(f"facepipe.detection.{module}"), name)


def _torch_threads(threads: int) -> None:
    """torch's intra-op threads, for the detectors that run in torch (process-wide, as torch has it)."""
    if threads:
        import torch

        torch.set_num_threads(threads)


@register_detector("mtcnn")
def _mtcnn(*, weights: str | os.PathLike[str] | None, min_face_size: int, detect_size: int, device: str, threads: int) -> Detector:
    if weights is not None:
        raise ValueError("mtcnn uses the weights shipped with facenet-pytorch; weights are for retinaface")
    _torch_threads(threads)
    return _load("mtcnn", "MTCNNDetector")(min_face_size=min_face_size, detect_size=detect_size, device=device)


@register_detector("facenet_pytorch")
def _facenet_pytorch(*, weights: str | os.PathLike[str] | None, min_face_size: int, detect_size: int, device: str, threads: int) -> Detector:
    if weights is not None:
        raise ValueError("facenet_pytorch uses the weights shipped with facenet-pytorch; weights are for retinaface")
    _torch_threads(threads)
    return _load("facenet_mtcnn", "FacenetPytorchDetector")(min_face_size=min_face_size, detect_size=detect_size, device=device)


@register_detector("retinaface", takes_weights=True)
def _retinaface(*, weights: str | os.PathLike[str] | None, min_face_size: int, detect_size: int, device: str, threads: int) -> Detector:
    # Faces below min_face_size are gated by the caller, so the network need not see them larger
    # than MIN_FACE_INPUT px: a smaller input, same landmark accuracy (retinaface.MIN_FACE_INPUT).
    build = _load("retinaface", "RetinaFaceDetector")
    return build(weights=weights, detect_size=detect_size, min_face_size=min_face_size, device=device, threads=threads)


@register_detector("none", needs_alignment=False)
def _none(*, weights: str | os.PathLike[str] | None, min_face_size: int, detect_size: int, device: str, threads: int) -> Detector:
    if weights is not None:
        raise ValueError("detector none runs no network; weights are for retinaface")
    return _load("prealigned", "PrealignedDetector")()  # the images are aligned crops already
