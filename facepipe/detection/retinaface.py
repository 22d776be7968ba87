"""Batched RetinaFace (biubug6's MobileNet-0.25 or ResNet-50) behind the detector interface.

- Weights: by default the MobileNet-0.25 ONNX model that ``facepipe weights fetch retinaface`` put in
  the cache, mapped onto facepipe's PyTorch network (:mod:`facepipe.detection.retinaface_net`); or a
  path: biubug6's ``.pth`` checkpoints (either variant) or an ``.onnx`` file of the same model.
- Runtime: on the CPU the network runs in onnxruntime (2-3x faster than PyTorch's CPU kernels for this
  depthwise network; a ``.pth`` is exported to ONNX in memory first), on CUDA in PyTorch. Both give the
  same outputs within 1e-4 (tests); ``runtime="torch"`` forces the PyTorch reference on the CPU.
- Images are downscaled so the longest side is at most ``detect_size`` and, when ``min_face_size`` is
  given, so that a face of ``min_face_size`` original pixels is seen at :data:`MIN_FACE_INPUT` px (the
  network is trained on faces from 16 px up; smaller faces are rejected by prepare anyway), then padded on the right and
  bottom to a multiple of 32 px (the network's largest stride) with the mean colour, which is 0 after
  normalisation. Images of the same padded size run as one batch. An image alone is padded the same
  way, so a batch gives what one image at a time gives.
- Decoding follows biubug6's ``detect.py``: anchors of 16/32, 64/128, 256/512 px at strides 8, 16, 32,
  variances (0.1, 0.2), a score floor, the ``top_k`` best before NMS (IoU 0.4, torchvision's, per
  image), the ``keep_top_k`` best after.

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

import numpy as np
import torch
from torchvision.ops import batched_nms

from facepipe.detection.base import Face, downscale
from facepipe.detection.retinaface_net import BGR_MEAN, RetinaFace, load_checkpoint, load_onnx
from facepipe.detection.weights import KNOWN, check_model, load_onnx_bytes
from facepipe.devices import resolve_device
from facepipe.errors import FacepipeError

_BUCKET = 32
_STRIDES = (8, 16, 32)
_ANCHORS = ((16, 32), (64, 128), (256, 512))
_VARIANCE = (0.1, 0.2)
#: Pixels at which a face of ``min_face_size`` is seen by the network, when a detector is given one
#: (prepare gives it). The network finds faces from 16 px; at 32 px the eyes are as close to the
#: sample photos' true landmarks as at full size (median 8.8% of the eye distance either way, MTCNN
#: 8.5%) while a 40-px minimum shrinks 250-700 px photos 1.56x in pixels (forward ~1.6x faster).
#: At 24 px they drift to 10.5% (tests/test_retinaface.py, benchmarks/README.md).
MIN_FACE_INPUT = 32


def load_model(weights: str | os.PathLike[str] | None = None, *, cache: str | os.PathLike[str] | None = None) -> RetinaFace:
    """The fused network, in eval mode on the CPU: the cached MobileNet-0.25 weights (``weights=None``),
    an ``.onnx`` file of that model, or a biubug6 ``.pth`` checkpoint."""
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
    """The network as checked ONNX bytes: the cached or given ``.onnx`` model as it is, a ``.pth``
    checkpoint loaded (:func:`load_model`) and exported with dynamic batch and image size."""
    if weights is None:
        return load_onnx_bytes("retinaface", cache=cache)
    path = Path(weights)
    if path.suffix == ".onnx" and path.is_file():
        data = path.read_bytes()
        check_model(data, KNOWN["retinaface"], source=path)
        return data
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
    """The network in an onnxruntime CPU session: [N, 3, H, W] float32 in, ``(loc, conf, landmarks)``
    as :class:`RetinaFace` returns them out. Thread-safe (onnxruntime's ``run`` is)."""

    def __init__(self, data: bytes, *, threads: int) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        # Parallelism comes from the prepare workers; a fixed thread count also keeps the numerics
        # the same on every machine (the PyTorch path's torch.set_num_threads does the same).
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self.session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        loc, conf, landmarks = self.session.run(None, {"input": x.contiguous().numpy()})
        return torch.from_numpy(loc), torch.from_numpy(conf), torch.from_numpy(landmarks)


def resolve_runtime(runtime: str, device: torch.device) -> str:
    """``auto``: onnxruntime on the CPU, PyTorch on CUDA; ``torch`` or ``onnxruntime`` as asked (CPU only)."""
    if runtime == "auto":
        return "onnxruntime" if device.type == "cpu" else "torch"
    if runtime not in ("torch", "onnxruntime"):
        raise ValueError(f"unknown RetinaFace runtime {runtime!r}; known: auto, torch, onnxruntime")
    if runtime == "onnxruntime" and device.type != "cpu":
        raise ValueError(f"the onnxruntime path runs on the CPU, not {device}")
    return runtime


@functools.lru_cache(maxsize=16)
def priors(height: int, width: int) -> torch.Tensor:
    """Anchors [A, 4] (cx, cy, w, h) in pixels of a height x width input, in the network's output order."""
    rows = []
    for stride, sizes in zip(_STRIDES, _ANCHORS):
        fh, fw = math.ceil(height / stride), math.ceil(width / stride)
        ys, xs = torch.meshgrid(torch.arange(fh), torch.arange(fw), indexing="ij")
        centres = (torch.stack([xs, ys], dim=-1).reshape(-1, 1, 2).float() + 0.5) * stride  # [fh*fw, 1, 2]
        wh = torch.tensor(sizes, dtype=torch.float32).reshape(1, -1, 1).expand(fh * fw, len(sizes), 2)
        rows.append(torch.cat([centres.expand(-1, len(sizes), -1), wh], dim=-1).reshape(-1, 4))
    return torch.cat(rows)


def decode(loc: torch.Tensor, landmarks: torch.Tensor, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Boxes [..., 4] (x1, y1, x2, y2) and landmarks [..., 5, 2] (x, y) in pixels, from the network's
    ``loc`` [..., 4] and ``landmarks`` [..., 10] regressions against ``anchors`` [..., 4]."""
    centre, size = anchors[..., :2], anchors[..., 2:]
    box_centre = centre + loc[..., :2] * _VARIANCE[0] * size
    box_size = size * torch.exp(loc[..., 2:] * _VARIANCE[1])
    boxes = torch.cat([box_centre - box_size / 2, box_centre + box_size / 2], dim=-1)
    points = centre.unsqueeze(-2) + landmarks.unflatten(-1, (5, 2)) * _VARIANCE[0] * size.unsqueeze(-2)
    return boxes, points


class RetinaFaceDetector:
    """Detect faces with RetinaFace, a batch of images at a time (see the module docstring)."""

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
    ) -> None:
        self.detect_size = detect_size
        self.min_face_size = min_face_size
        self.score_floor = score_floor
        self.nms_threshold = nms_threshold
        self.top_k = top_k
        self.keep_top_k = keep_top_k
        self.device = resolve_device(device)
        self.runtime = resolve_runtime(runtime, self.device)
        self.net: RetinaFace | OnnxRetinaFace
        if self.runtime == "onnxruntime":
            self.net = OnnxRetinaFace(onnx_model(weights, cache=cache), threads=torch.get_num_threads())
        else:
            self.net = load_model(weights, cache=cache).to(self.device).to(memory_format=torch.channels_last)
        self.mean = torch.tensor(BGR_MEAN, device=self.device).reshape(1, 3, 1, 1)
        self.mean_bgr = np.asarray(BGR_MEAN, np.float32).reshape(3, 1, 1)

    def detect(self, images: list[np.ndarray], *, reductions: Sequence[int] | None = None) -> list[list[Face]]:
        """Faces of each [H, W, 3] uint8 RGB image, in its coordinates, highest score first.
        ``reductions[i]``: original pixels per pixel of image i (a reduced decode), for min_face_size."""
        results: list[list[Face]] = [[] for _ in images]
        reductions = reductions or [1] * len(images)
        prepared = [downscale(image, self.input_side(image.shape, reduction=r)) for image, r in zip(images, reductions)]
        buckets: dict[tuple[int, int], list[int]] = defaultdict(list)
        for index, (small, _) in enumerate(prepared):
            h, w = small.shape[:2]
            buckets[(_BUCKET * math.ceil(h / _BUCKET), _BUCKET * math.ceil(w / _BUCKET))].append(index)
        with torch.inference_mode():
            for size in sorted(buckets):
                members = buckets[size]
                found = self._detect_bucket([prepared[i][0] for i in members], size)
                for index, faces in zip(members, found):
                    scale = prepared[index][1]
                    results[index] = [
                        Face(box=box / scale, score=score, landmarks=points / scale) for box, score, points in faces
                    ]
        return results

    def input_side(self, shape: tuple[int, ...], *, reduction: int = 1) -> int:
        """Longest side, px, at which an image of ``shape`` (H, W, ...) is seen by the network; the
        image is a 1/``reduction`` scale decode of the original (min_face_size is in original px)."""
        longest = max(shape[:2])
        if self.min_face_size is not None and self.min_face_size > MIN_FACE_INPUT * reduction:
            longest = math.ceil(longest * MIN_FACE_INPUT * reduction / self.min_face_size)
        return min(self.detect_size, longest)

    def _input(self, images: list[np.ndarray], size: tuple[int, int]) -> torch.Tensor:
        """[N, 3, H, W] float BGR minus the mean, zero (the mean colour) right of and below each image."""
        if self.runtime == "onnxruntime":
            # One numpy pass per image (uint8 HWC RGB -> float CHW BGR minus the mean) is 3x faster on
            # the CPU than torch's permute + flip + float + subtract; the values are the same.
            batch = np.zeros((len(images), 3, *size), np.float32)
            for row, image in enumerate(images):
                h, w = image.shape[:2]
                np.subtract(image.transpose(2, 0, 1)[::-1], self.mean_bgr, out=batch[row, :, :h, :w])
            return torch.from_numpy(batch)
        batch = torch.zeros((len(images), 3, *size), device=self.device).contiguous(memory_format=torch.channels_last)
        for row, image in enumerate(images):
            h, w = image.shape[:2]
            pixels = torch.from_numpy(np.require(image, np.uint8, ['C', 'W'])).to(self.device).permute(2, 0, 1).flip(0)
            batch[row, :, :h, :w] = pixels.float() - self.mean[0]
        return batch

    def _detect_bucket(self, images: list[np.ndarray], size: tuple[int, int]) -> list[list[tuple[np.ndarray, float, np.ndarray]]]:
        loc, conf, landmarks = self.net(self._input(images, size))
        anchors = priors(*size).to(self.device)
        scores = conf[..., 1]
        owners, rows = (scores > self.score_floor).nonzero(as_tuple=True)
        picked = []
        for image in range(len(images)):  # the top_k best of each image
            mine = rows[owners == image]
            mine = mine[scores[image, mine].argsort(descending=True, stable=True)[: self.top_k]]
            picked.append(torch.stack([torch.full_like(mine, image), mine], dim=1))
        picked = torch.cat(picked) if picked else torch.zeros((0, 2), dtype=torch.long, device=self.device)
        owners, rows = picked[:, 0], picked[:, 1]
        boxes, points = decode(loc[owners, rows], landmarks[owners, rows], anchors[rows])
        kept_scores = scores[owners, rows]
        keep = batched_nms(boxes, kept_scores, owners, self.nms_threshold)  # sorted by score, descending
        boxes, points = boxes[keep].double().cpu().numpy(), points[keep].double().cpu().numpy()
        kept_scores, owners = kept_scores[keep].tolist(), owners[keep].tolist()
        out: list[list[tuple[np.ndarray, float, np.ndarray]]] = [[] for _ in images]
        for box, score, pts, owner in zip(boxes, kept_scores, points, owners):
            if len(out[owner]) < self.keep_top_k:
                out[owner].append((box, score, pts))
        return out
