"""The one-photo loop that facepipe prepare replaces: what a facenet-pytorch user writes.

    python benchmarks/facenet_loop.py RAW [--min-face-size 40] [--threads 1]

Every image file of RAW (``facepipe prepare``'s scan, same order) is decoded in full, scaled to 640 px
on its longest side (Pillow, bilinear), given to ``facenet_pytorch.MTCNN(keep_all=True)``, and the face
facepipe would choose (score >= 0.95, size >= ``--min-face-size`` original pixels, the largest) is
aligned with the same 5-point template and encoded as a JPEG at quality 95, in one process with torch
at ``--threads`` intra-op threads (1: on a shared machine 2 threads only spin against other work).
Prints one JSON line: ``startup_s`` (imports and loading MTCNN), ``process_s``, ``images``,
``accepted``. ``benchmarks/prepare_bench.py`` runs it as a whole command, beside facepipe's.
"""

from __future__ import annotations

import argparse
import json
import time

STARTED = time.perf_counter()

from pathlib import Path  # noqa: E402 - the imports are part of the loop's start-up

import numpy as np  # noqa: E402
import torch  # noqa: E402
from facenet_pytorch import MTCNN  # noqa: E402
from PIL import Image  # noqa: E402

from facepipe.alignment import align_face  # noqa: E402
from facepipe.data.decode import Reject, load_image  # noqa: E402
from facepipe.data.scan import scan_raw  # noqa: E402
from facepipe.detection import Face, select_face  # noqa: E402
from facepipe.io.records import encode_image  # noqa: E402

DETECT_SIZE = 640


def detect_faces(mtcnn: MTCNN, image: np.ndarray, min_face_size: int) -> list[Face]:
    """The faces of ``image`` ([H, W, 3] uint8 RGB) that pass facepipe's gates (score >= 0.95, size >=
    ``min_face_size`` original pixels), MTCNN run on the photo scaled to ``DETECT_SIZE``; boxes and
    landmarks in original pixels."""
    scale = min(1.0, DETECT_SIZE / max(image.shape[:2]))
    small = image
    if scale < 1.0:
        size = (round(image.shape[1] * scale), round(image.shape[0] * scale))
        small = np.asarray(Image.fromarray(image).resize(size, Image.BILINEAR))
    try:
        boxes, probs, points = mtcnn.detect(small, landmarks=True)
    except (RuntimeError, ValueError):  # MTCNN raises on images smaller than its smallest face
        return []
    if boxes is None:
        return []
    boxes = np.asarray(boxes, dtype=np.float32) / scale  # numpy 2: object arrays otherwise
    probs = np.asarray(probs, dtype=np.float32)
    points = np.asarray(points, dtype=np.float32) / scale
    faces = [Face(b, float(p), l) for b, p, l in zip(boxes, probs, points) if p >= 0.95]
    return [face for face in faces if face.size >= min_face_size]


def one_photo(mtcnn: MTCNN, data: bytes, min_face_size: int) -> bool:
    """Detect, choose, align and encode one photo's face; False when it has none facepipe would keep."""
    try:
        image = load_image(data, max_pixels=100_000_000)
    except Reject:
        return False
    faces = detect_faces(mtcnn, image, min_face_size)
    if not faces:
        return False
    face = select_face(faces, "largest", image.shape)
    encode_image(align_face(image, face.landmarks, 112), quality=95)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", type=Path)
    parser.add_argument("--min-face-size", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    mtcnn = MTCNN(keep_all=True, min_face_size=args.min_face_size, device="cpu")
    items = [item for item in scan_raw(args.raw) if item.reason is None]
    started = time.perf_counter()
    accepted = sum(one_photo(mtcnn, (args.raw / item.path).read_bytes(), args.min_face_size) for item in items)
    done = time.perf_counter()
    print(json.dumps({"startup_s": round(started - STARTED, 3), "process_s": round(done - started, 3), "images": len(items), "accepted": accepted}))


if __name__ == "__main__":
    main()
