"""Batched MTCNN (weights shipped inside facenet-pytorch; nothing is downloaded).

The three networks are facenet-pytorch's ``PNet``/``RNet``/``ONet`` with their shipped weights; the
cascade around them is ours, written for throughput on CPU and GPU:

- Images are downscaled so the longest side is at most ``detect_size``, then grouped into size
  buckets (multiples of 32 px): the P-Net pyramid of a bucket runs as one padded batch per scale.
  Datasets of equal-size photos (LFW, CASIA-WebFace) form full batches.
- R-Net and O-Net see every candidate of the whole chunk in one batch.
- Pyramid levels and candidate crops are resampled with OpenCV's area interpolation, and the
  networks run in ``channels_last`` layout: on CPU, PyTorch's NCHW max-pooling and area
  interpolation are several times slower than the convolutions around them. Each pyramid level is
  made from the one before, and R-Net's crops of large boxes come from the first level.

The numerics follow facenet-pytorch's ``detect_face`` (same scales, thresholds, box regression and
NMS); resampling differs (tests/test_detection.py holds the two implementations' faces and
landmarks together).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import cv2
import numpy as np
import torch
from facenet_pytorch.models.utils.detect_face import batched_nms_numpy, bbreg, rerec
from torchvision.ops import batched_nms

from facepipe.detection.base import Face, to_source
from facepipe.devices import resolve_device

_BUCKET = 32
_PNET_MIN = 12.0  # the smallest face P-Net sees, pixels
_PNET_STRIDE = 2
_PNET_CELL = 12
_COARSE_MIN = 48  # R-Net crops come from the first pyramid level when the box is this wide there

#: A photo's first pyramid level, and its x and y scale relative to the photo.
Level = tuple[np.ndarray, float, float]


def _to_input(batch: np.ndarray, device: torch.device) -> torch.Tensor:
    """[N, H, W, 3] float32 pixels -> [N, 3, H, W] channels_last tensor scaled to about [-1, 1]."""
    tensor = torch.from_numpy(batch).to(device).permute(0, 3, 1, 2)
    return (tensor - 127.5) * 0.0078125


class MTCNNDetector:
    """Detect faces with the MTCNN cascade, a batch of images at a time.

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
        self.thresholds = tuple(thresholds)
        self.factor = factor
        self.device = resolve_device(device)
        nets = [net(pretrained=True).to(self.device).eval() for net in (PNet, RNet, ONet)]
        self.pnet, self.rnet, self.onet = (net.to(memory_format=torch.channels_last) for net in nets)

    def detect(self, images: list[np.ndarray], *, reductions: Sequence[int] | None = None) -> list[list[Face]]:
        """Faces of each [H, W, 3] uint8 RGB image, in its coordinates, highest score first.
        ``reductions[i]``: original pixels per pixel of image i (a reduced decode), for min_face_size."""
        if not images:
            return []
        prepared = [self._resize(image) for image in images]
        smalls = [small for small, _ in prepared]
        scales = [scale for _, scale in prepared]
        from_original = [scale / r for scale, r in zip(scales, reductions or [1] * len(images))]
        with torch.inference_mode():
            boxes, owners, first_levels = self._propose(smalls, from_original)
            boxes, owners = self._refine(smalls, boxes, owners, first_levels)
            boxes, points, owners = self._output(smalls, boxes, owners)
        results: list[list[Face]] = [[] for _ in images]
        for box, landmarks, owner in zip(boxes, points, owners):
            # The networks place points 1-based (the reference MATLAB code's convention): one detector
            # pixel right of and below a pixel-centre position (tests/test_landmark_geometry.py).
            points_here = to_source(landmarks.astype(np.float64) - 1.0, images[owner].shape, smalls[owner].shape)
            results[owner].append(Face(box=(box[:4] / scales[owner]).astype(np.float64), score=float(box[4]), landmarks=points_here))
        for faces in results:
            faces.sort(key=lambda face: -face.score)
        return results

    def _resize(self, image: np.ndarray) -> tuple[np.ndarray, float]:
        h, w = image.shape[:2]
        scale = min(1.0, self.detect_size / max(h, w))
        if scale < 1.0:
            size = (max(1, round(w * scale)), max(1, round(h * scale)))
            image = cv2.resize(image, size, interpolation=cv2.INTER_AREA)
        return np.ascontiguousarray(image, dtype=np.float32), scale

    # -- stage 1: P-Net over an image pyramid, one padded batch per size bucket and scale ----------

    def _propose(
        self, images: list[np.ndarray], scales: list[float]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[int, Level]]:
        """Candidate boxes [K, 5] (squared, in detect-size pixels), their image index [K], and each
        image's first pyramid level. ``scales``: detect-size pixels per original pixel, per image."""
        first_levels: dict[int, Level] = {}
        buckets: dict[tuple[int, int], list[int]] = defaultdict(list)
        for index, image in enumerate(images):
            h, w = image.shape[:2]
            buckets[(math.ceil(h / _BUCKET), math.ceil(w / _BUCKET))].append(index)
        all_boxes, all_owners = [], []
        for members in (buckets[key] for key in sorted(buckets)):
            minsize = max(_PNET_MIN, self.min_face_size * min(scales[i] for i in members))
            boxes, owners = self._pnet_bucket(images, members, minsize, first_levels)
            all_boxes.append(boxes)
            all_owners.append(torch.as_tensor(members, device=self.device)[owners])
        boxes, owners = torch.cat(all_boxes), torch.cat(all_owners)
        if len(boxes) == 0:
            return boxes[:, :5], owners, first_levels
        keep = batched_nms(boxes[:, :4], boxes[:, 4], owners, 0.7)
        boxes, owners = boxes[keep], owners[keep]
        w = boxes[:, 2] - boxes[:, 0]
        h = boxes[:, 3] - boxes[:, 1]
        regressed = torch.stack(
            [
                boxes[:, 0] + boxes[:, 5] * w,
                boxes[:, 1] + boxes[:, 6] * h,
                boxes[:, 2] + boxes[:, 7] * w,
                boxes[:, 3] + boxes[:, 8] * h,
                boxes[:, 4],
            ],
            dim=1,
        )
        return rerec(regressed), owners, first_levels

    def _pnet_bucket(
        self, all_images: list[np.ndarray], members: list[int], minsize: float, first_levels: dict[int, Level]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """P-Net over the pyramid of ``all_images[members]``: boxes [K, 9] and their row in ``members``."""
        images = [all_images[index] for index in members]
        heights = [image.shape[0] for image in images]
        widths = [image.shape[1] for image in images]
        m = _PNET_MIN / minsize
        level_scales = []
        scale, shortest = m, min(min(heights), min(widths)) * m
        while shortest >= _PNET_MIN:
            level_scales.append(scale)
            scale *= self.factor
            shortest *= self.factor
        found, found_owners = [torch.zeros(0, 9, device=self.device)], [torch.zeros(0, dtype=torch.long, device=self.device)]
        previous = list(images)
        for level, scale in enumerate(level_scales):
            sizes = [(int(h * scale + 1), int(w * scale + 1)) for h, w in zip(heights, widths)]
            canvas = np.zeros((len(images), max(s[0] for s in sizes), max(s[1] for s in sizes), 3), np.float32)
            for row, (lh, lw) in enumerate(sizes):
                # Each level from the one before: reading the whole photo once per level cost more
                # than P-Net itself. Area resampling of area resampling stays an area average.
                previous[row] = cv2.resize(previous[row], (lw, lh), interpolation=cv2.INTER_AREA)
                canvas[row, :lh, :lw] = previous[row]
                if level == 0:
                    first_levels[members[row]] = (previous[row], lw / widths[row], lh / heights[row])
            reg, probs = self.pnet(_to_input(canvas, self.device))
            prob = probs[:, 1]
            mask = prob >= self.thresholds[0]
            where = mask.nonzero()
            if len(where) == 0:
                continue
            owners = where[:, 0]
            cells = where[:, 1:].flip(1).to(prob.dtype)  # (x, y) of each window
            x1y1 = ((_PNET_STRIDE * cells + 1) / scale).floor()
            x2y2 = ((_PNET_STRIDE * cells + _PNET_CELL) / scale).floor()
            offsets = reg.permute(0, 2, 3, 1)[mask]
            boxes = torch.cat([x1y1, x2y2, prob[mask].unsqueeze(1), offsets], dim=1)
            # Windows that start on a member's padding are not part of that photo.
            limit_w = torch.as_tensor(widths, device=self.device, dtype=boxes.dtype)[owners]
            limit_h = torch.as_tensor(heights, device=self.device, dtype=boxes.dtype)[owners]
            inside = (boxes[:, 0] < limit_w) & (boxes[:, 1] < limit_h)
            boxes, owners = boxes[inside], owners[inside]
            keep = batched_nms(boxes[:, :4], boxes[:, 4], owners, 0.5)
            found.append(boxes[keep])
            found_owners.append(owners[keep])
        return torch.cat(found), torch.cat(found_owners)

    # -- stages 2 and 3: every candidate of the chunk in one batch ----------------------------------

    def _crops(
        self,
        images: list[np.ndarray],
        boxes: torch.Tensor,
        owners: torch.Tensor,
        size: int,
        first_levels: dict[int, Level] | None = None,
    ) -> np.ndarray:
        """Resample each box (clipped to its image, 1-based inclusive like facenet's ``pad``) to size x size.

        With ``first_levels`` (R-Net): a box at least ``_COARSE_MIN`` px wide in its image's first
        pyramid level is cut from that level, not from the photo (far fewer pixels to average). R-Net
        only filters and nudges candidates; O-Net's crops, which place the landmarks, always come from
        the photo.
        """
        coords = boxes[:, :4].trunc().int().cpu().numpy()
        owner_list = owners.cpu().tolist()
        out = np.empty((len(coords), size, size, 3), np.float32)
        for row, ((x, y, ex, ey), owner) in enumerate(zip(coords, owner_list)):
            image = images[owner]
            x, y = max(int(x), 1), max(int(y), 1)
            ex, ey = min(int(ex), image.shape[1]), min(int(ey), image.shape[0])
            if ex < x or ey < y:  # the box lies outside its image
                out[row] = 0.0
                continue
            fine = first_levels.get(owner) if first_levels else None
            if fine is not None and min(ex - x + 1, ey - y + 1) * min(fine[1], fine[2]) >= _COARSE_MIN:
                level, sx, sy = fine
                crop = level[round((y - 1) * sy) : round(ey * sy), round((x - 1) * sx) : round(ex * sx)]
            else:
                crop = image[y - 1 : ey, x - 1 : ex]
            out[row] = cv2.resize(crop, (size, size), interpolation=cv2.INTER_AREA)
        return out

    def _refine(self, images, boxes, owners, first_levels):
        if len(boxes) == 0:
            return boxes, owners
        offsets, probs = self.rnet(_to_input(self._crops(images, boxes, owners, 24, first_levels), self.device))
        score = probs[:, 1]
        passed = score > self.thresholds[1]
        boxes = torch.cat([boxes[passed, :4], score[passed].unsqueeze(1)], dim=1)
        owners, offsets = owners[passed], offsets[passed]
        keep = batched_nms(boxes[:, :4], boxes[:, 4], owners, 0.7)
        boxes, owners, offsets = boxes[keep], owners[keep], offsets[keep]
        return rerec(bbreg(boxes, offsets)), owners

    def _output(self, images, boxes, owners) -> tuple[np.ndarray, np.ndarray, list[int]]:
        if len(boxes) == 0:
            return np.zeros((0, 5), np.float32), np.zeros((0, 5, 2), np.float32), []
        offsets, landmarks, probs = self.onet(_to_input(self._crops(images, boxes, owners, 48), self.device))
        score = probs[:, 1]
        passed = score > self.thresholds[2]
        boxes = torch.cat([boxes[passed, :4], score[passed].unsqueeze(1)], dim=1)
        owners, offsets, landmarks = owners[passed], offsets[passed], landmarks[passed]
        w = (boxes[:, 2] - boxes[:, 0] + 1).unsqueeze(1)
        h = (boxes[:, 3] - boxes[:, 1] + 1).unsqueeze(1)
        points = torch.stack(
            [w * landmarks[:, :5] + boxes[:, :1] - 1, h * landmarks[:, 5:] + boxes[:, 1:2] - 1], dim=2
        )
        boxes = bbreg(boxes, offsets)
        # MTCNN's last NMS: overlap measured against the smaller box, per image
        keep = batched_nms_numpy(boxes[:, :4], boxes[:, 4], owners, 0.7, "Min").sort().values
        return boxes[keep].float().cpu().numpy(), points[keep].float().cpu().numpy(), owners[keep].tolist()
