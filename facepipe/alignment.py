"""Face crops: 5-point similarity alignment to the ArcFace template (``prepare.crop: arcface``) and
facenet-pytorch's box crop (``crop: facenet``). Pure math: no I/O, no globals mutated."""

from __future__ import annotations

import cv2
import numpy as np

#: ArcFace template for 112x112 faces: left eye, right eye, nose, left and right mouth corners (x, y).
ARCFACE_TEMPLATE_112 = np.array(
    [
        [38.2946, 51.6963],
        [73.5318, 51.5014],
        [56.0252, 71.7366],
        [41.5493, 92.3655],
        [70.7299, 92.2041],
    ],
    dtype=np.float64,
)


def template(size: int = 112) -> np.ndarray:
    """The ArcFace template scaled to a ``size`` x ``size`` output; [5, 2] float64 pixel coordinates."""
    if size <= 0:
        raise ValueError(f"template size must be positive, got {size}")
    return ARCFACE_TEMPLATE_112 * (size / 112.0)


def umeyama(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Least-squares similarity transform (rotation, uniform scale, translation) taking ``src`` to ``dst``.

    Umeyama (1991), without reflection. ``src`` and ``dst`` are [N, 2] point sets, N >= 2.
    Returns the [2, 3] float64 matrix ``M`` with ``dst ~= src @ M[:, :2].T + M[:, 2]``.
    Raises ValueError when ``src`` is degenerate (all points coincide).
    """
    src = np.asarray(src, dtype=np.float64)
    dst = np.asarray(dst, dtype=np.float64)
    if src.shape != dst.shape or src.ndim != 2 or src.shape[1] != 2 or src.shape[0] < 2:
        raise ValueError(f"expected two [N, 2] point sets with N >= 2, got {src.shape} and {dst.shape}")
    n = src.shape[0]
    src_mean, dst_mean = src.mean(axis=0), dst.mean(axis=0)
    src_c, dst_c = src - src_mean, dst - dst_mean
    src_var = (src_c**2).sum() / n
    if not np.isfinite(src_var) or src_var < 1e-12:
        raise ValueError("degenerate landmarks: all points coincide")
    cov = dst_c.T @ src_c / n
    u, s, vt = np.linalg.svd(cov)
    d = np.ones(2)
    if np.linalg.det(u) * np.linalg.det(vt) < 0:
        d[-1] = -1.0  # the best orthogonal map is a reflection; take the best rotation instead
    rotation = u @ np.diag(d) @ vt
    scale = (s * d).sum() / src_var
    matrix = np.empty((2, 3), dtype=np.float64)
    matrix[:, :2] = scale * rotation
    matrix[:, 2] = dst_mean - scale * rotation @ src_mean
    return matrix


def apply_transform(matrix: np.ndarray, points: np.ndarray) -> np.ndarray:
    """Map [N, 2] points through a [2, 3] affine matrix."""
    points = np.asarray(points, dtype=np.float64)
    return points @ matrix[:, :2].T + matrix[:, 2]


def align_face(image: np.ndarray, landmarks: np.ndarray, size: int = 112) -> np.ndarray:
    """Warp the face with 5 ``landmarks`` ([5, 2], original pixel coordinates) onto the template.

    ``image`` is [H, W, 3] uint8 RGB; returns [size, size, 3] uint8 RGB (bilinear, black border).
    """
    matrix = umeyama(landmarks, template(size))
    return cv2.warpAffine(
        image, matrix, (size, size), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_CONSTANT, borderValue=0
    )


def facenet_box(box: np.ndarray, *, image_size: int, margin: int, width: int, height: int) -> tuple[int, int, int, int]:
    """facenet-pytorch's ``extract_face`` box: ``box`` (x1, y1, x2, y2) grown by ``margin`` pixels *of
    the output* (``margin * side / (image_size - margin)`` of the photo), clipped to the image and
    truncated to integers as that function does."""
    grow_x = margin * (box[2] - box[0]) / (image_size - margin)
    grow_y = margin * (box[3] - box[1]) / (image_size - margin)
    return (
        int(max(box[0] - grow_x / 2, 0)),
        int(max(box[1] - grow_y / 2, 0)),
        int(min(box[2] + grow_x / 2, width)),
        int(min(box[3] + grow_y / 2, height)),
    )


def facenet_crop(image: np.ndarray, box: np.ndarray, *, image_size: int = 160, margin: int = 0) -> np.ndarray:
    """facenet-pytorch's ``extract_face`` on a PIL image: the grown box (:func:`facenet_box`) resized to
    ``image_size`` square by Pillow's bilinear filter, no rotation. ``image`` [H, W, 3] uint8 RGB ->
    [image_size, image_size, 3] uint8 RGB (what ``MTCNN(post_process=False)`` returns, as bytes)."""
    from PIL import Image

    height, width = image.shape[:2]
    crop = facenet_box(box, image_size=image_size, margin=margin, width=width, height=height)
    resized = Image.fromarray(image).crop(crop).resize((image_size, image_size), Image.BILINEAR)
    return np.asarray(resized, dtype=np.uint8)
