"""One chunk of raw files -> encoded aligned faces or rejects: the unit of parallel work in prepare.

Runs inside Dask worker processes. It returns encoded records (JPEG bytes plus a JSON-able header),
never decoded arrays, so results are small to ship back to the single writer.

Memory: a worker holds at most :data:`DECODE_BUDGET_PIXELS` decoded pixels of a chunk at once (or
one image, when that alone is more): once the next image would exceed it, the images held so far
are detected, aligned and encoded, and dropped. Each pixel held costs 3 bytes; decoding one image
costs about 7 bytes a pixel more while it lasts (Pillow's 4-byte buffer and the array taken from it).
Chunks of ordinary photos (16 x 2 MP) stay one detector batch, as before.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from facepipe.alignment import align_face, facenet_crop, template, umeyama
from facepipe.config import PrepareParams
from facepipe.data.decode import Decoded, Reject, decode_opened, load_image_reduced, max_file_bytes, open_image
from facepipe.data.scan import FileTooLarge, ScanItem, read_raw_file
from facepipe.detection.base import Detector, Face, select_face
from facepipe.detection.registry import create_detector
from facepipe.io.records import encode_image

if TYPE_CHECKING:
    from PIL import Image

#: Decoded pixels a worker holds at once (2 x 16 MP photos; 96 MB as uint8 RGB). Read at call time.
DECODE_BUDGET_PIXELS = 32_000_000


@dataclass(frozen=True)
class Outcome:
    """What became of one scanned file: ``header`` and ``payload`` when accepted, else ``reason``."""

    path: str
    sha256: str | None
    header: dict[str, Any] | None = None
    payload: bytes | None = None
    reason: str | None = None
    detail: str = ""
    #: with ``all_faces``: the photo's other faces that pass the gates, each accepted like this one
    others: tuple[Outcome, ...] = ()

    @property
    def accepted(self) -> bool:
        return self.reason is None


@functools.lru_cache(maxsize=4)
def get_detector(name: str, weights: str | None, min_face_size: int, detect_size: int, device: str) -> Detector:
    """One detector per process and setting: loading the weights costs more than a small chunk."""
    import cv2

    # Parallelism comes from worker processes; one intra-op thread each also makes the numerics
    # independent of the machine's core count, so any worker gives byte-identical output. Only the
    # detectors that run in torch import it (3 s of start-up).
    cv2.setNumThreads(1)
    return create_detector(name, weights=weights, min_face_size=min_face_size, detect_size=detect_size, device=device, threads=1)


def warm_up(params: PrepareParams, device: str = "auto") -> None:
    """Import torch and load the detector in this process, so the first chunk does not pay for it."""
    get_detector(params.detector, params.detector_weights, params.min_face_size, params.detect_size, device)


def _gate(faces: list[Face], params: PrepareParams, shape: tuple[int, ...]) -> Face:
    """The face a photo stands for: the selected one of those that pass the gates (a Reject if none)."""
    return _passing(faces, params, shape)[0]


def _passing(faces: list[Face], params: PrepareParams, shape: tuple[int, ...]) -> list[Face]:
    """The faces that pass the score and size gates, the selected one (``face_selection``) first,
    then the others by score, highest first; a Reject when none passes."""
    if not faces:
        raise Reject("no_face", "detector found no face")
    confident = [face for face in faces if face.score >= params.score_threshold]
    if not confident:
        best = max(face.score for face in faces)
        raise Reject("low_score", f"best score {best:.4f} < {params.score_threshold}")
    big = [face for face in confident if face.size >= params.min_face_size]
    if not big:
        largest = max(face.size for face in confident)
        raise Reject("face_too_small", f"largest face {largest:.0f}px < min_face_size={params.min_face_size}")
    selected = select_face(big, params.face_selection, shape)
    return [selected, *sorted((face for face in big if face is not selected), key=lambda face: -face.score)]


def _alignment_source(decoded: Decoded, data: bytes | None, face: Face, params: PrepareParams) -> tuple[np.ndarray, np.ndarray]:
    """The image to align from and ``face``'s [5, 2] landmarks in its pixels: the least-reduced decode
    (1/1 .. 1/8) in which the face is at least as large as in the aligned crop, so the warp only
    shrinks it, as it would the full-resolution face: the detector's decode when that is enough, else
    one decoded again from ``data`` at the reduction needed (full resolution for small faces)."""
    if decoded.reduction == 1:
        return decoded.image, face.landmarks
    matrix = umeyama(face.landmarks, template(params.image_size))
    crop_per_pixel = float(np.sqrt(abs(np.linalg.det(matrix[:, :2]))))  # crop px per full-resolution px
    needed = max((r for r in (8, 4, 2, 1) if r * crop_per_pixel <= 1.0), default=1)
    if needed >= decoded.reduction:
        return decoded.image, decoded.from_full(face.landmarks)
    assert data is not None  # process_chunk keeps the bytes of every reduced decode
    longest = -(-max(decoded.size) // needed)  # load_image_reduced then picks exactly 1/needed
    again = load_image_reduced(data, max_pixels=params.max_pixels, longest=longest if needed > 1 else None)
    return again.image, again.from_full(face.landmarks)


def _full_resolution(decoded: Decoded, data: bytes | None, params: PrepareParams) -> np.ndarray:
    """The photo at full resolution (``crop: facenet`` cuts the box from it, as facenet-pytorch does)."""
    if decoded.reduction == 1:
        return decoded.image
    assert data is not None  # process_chunk keeps the bytes of every reduced decode
    return load_image_reduced(data, max_pixels=params.max_pixels, longest=None).image


def _accept(path: str, sha: str, decoded: Decoded, data: bytes | None, face: Face, params: PrepareParams) -> Outcome:
    try:
        if params.crop == "facenet":
            image = _full_resolution(decoded, data, params)
            aligned = facenet_crop(image, face.box, image_size=params.image_size, margin=params.margin)
        else:
            image, landmarks = _alignment_source(decoded, data, face, params)
            aligned = align_face(image, landmarks, params.image_size)
    except ValueError as error:
        return Outcome(path, sha, reason="bad_landmarks", detail=str(error))
    except Reject as reject:  # the full-resolution decode can fail where the reduced one did not
        return Outcome(path, sha, reason=reject.reason, detail=reject.detail)
    payload = encode_image(aligned, encoding=params.encoding, quality=params.quality)
    header = {
        "path": path,
        "sha256": sha,
        "box": [round(float(v), 2) for v in face.box],
        "landmarks": [[round(float(x), 3), round(float(y), 3)] for x, y in face.landmarks],
        "score": round(face.score, 6),
        "source_size": [int(decoded.size[0]), int(decoded.size[1])],
        "encoding": params.encoding,
        "size": [params.image_size, params.image_size],
    }
    return Outcome(path, sha, header=header, payload=payload)


def process_chunk(
    paths: list[str],
    raw_root: str,
    params: PrepareParams,
    device: str = "auto",
    *,
    all_faces: bool = False,
    identity_folders: bool = True,
) -> list[Outcome]:
    """Read, hash, decode, detect, gate, align and encode every file of ``paths`` (scan paths, relative
    to ``raw_root``). Returns one :class:`Outcome` per path, in the order given. Every per-image
    problem is a reject. Decoded images are batched under :data:`DECODE_BUDGET_PIXELS`.
    ``all_faces``: an accepted outcome carries the photo's other faces in ``others``; with
    ``identity_folders`` off, files directly in ``raw_root`` are read too (``facepipe embed``).
    """
    outcomes: dict[int, Outcome] = {}
    batch: list[tuple[int, str, Decoded, bytes | None]] = []
    held = 0
    for index, path in enumerate(paths):
        read = _read(path, raw_root, params, identity_folders=identity_folders)
        if isinstance(read, Outcome):
            outcomes[index] = read
            continue
        sha, data = read
        try:
            pil = open_image(data)  # the header only: the size, for the budget
        except Reject as reject:
            outcomes[index] = Outcome(path, sha, reason=reject.reason, detail=reject.detail)
            continue
        # flush before decoding: the image being decoded counts against the budget too
        pixels = pil.width * pil.height
        if batch and held + pixels > DECODE_BUDGET_PIXELS:
            outcomes.update(_detect_and_align(batch, paths, params, device, all_faces=all_faces))
            batch, held = [], 0
        decoded = _decode(path, sha, data, pil, params)
        # the file's bytes are not kept while the next one is read, except a reduced decode's (a small
        # face may need the full resolution for alignment; they are a fraction of its decoded pixels)
        kept = data if isinstance(decoded, Decoded) and decoded.reduction > 1 else None
        del read, data, pil
        if isinstance(decoded, Outcome):
            outcomes[index] = decoded
            continue
        batch.append((index, sha, decoded, kept))
        held += pixels
    if batch:
        outcomes.update(_detect_and_align(batch, paths, params, device, all_faces=all_faces))
    return [outcomes[index] for index in range(len(paths))]


def with_scan_rejects(chunk: Sequence[ScanItem], processed: Sequence[Outcome]) -> list[Outcome]:
    """Outcomes of a chunk of scan items, in scan order: the scan's own rejects (never sent to a
    worker), and ``processed``, what :func:`process_chunk` made of the others, in order."""
    done = iter(processed)
    outcomes = [Outcome(i.path, None, reason=i.reason, detail=i.detail) if i.reason else next(done) for i in chunk]
    if next(done, None) is not None:
        raise RuntimeError("a worker returned more outcomes than it was given paths")
    return outcomes


def _read(path: str, raw_root: str, params: PrepareParams, *, identity_folders: bool = True) -> Outcome | tuple[str, bytes]:
    """``(sha256, bytes)`` of one file, or its reject."""
    if identity_folders and "/" not in path:
        return Outcome(path, None, reason="outside_identity_folder", detail="file is not inside an identity folder")
    limit = max_file_bytes(params.max_pixels)
    try:
        data = read_raw_file(raw_root, path, max_bytes=limit)
    except FileTooLarge as error:
        detail = f"{error.size} bytes; an image of max_pixels={params.max_pixels} takes at most {limit}"
        return Outcome(path, None, reason="file_too_large", detail=detail)
    except OSError as error:
        return Outcome(path, None, reason="io_error", detail=f"{type(error).__name__}: {error.strerror}")
    return hashlib.sha256(data).hexdigest(), data


def _decode(path: str, sha: str, data: bytes, pil: Image.Image, params: PrepareParams) -> Outcome | Decoded:
    """One file's bytes (its header parsed into ``pil``) decoded for detection, or its reject. The
    detector sees at most ``detect_size`` px on the longest side, so JPEGs at least twice that size are
    decoded at 1/2, 1/4 or 1/8 scale, no smaller than ``detect_size`` (3-10x less decoding;
    :func:`_alignment_source`)."""
    longest = params.detect_size if params.needs_alignment else None
    try:
        decoded = decode_opened(data, pil, max_pixels=params.max_pixels, longest=longest)
        width, height = decoded.size
        if min(width, height) < params.min_face_size:
            raise Reject("image_too_small", f"{width}x{height} cannot hold a {params.min_face_size}px face")
    except Reject as reject:
        return Outcome(path, sha, reason=reject.reason, detail=reject.detail)
    return decoded


def _detect_and_align(
    batch: list[tuple[int, str, Decoded, bytes | None]],
    paths: list[str],
    params: PrepareParams,
    device: str,
    *,
    all_faces: bool = False,
) -> dict[int, Outcome]:
    """Outcomes of decoded images (one detector batch), by their index in ``paths``."""
    detector = get_detector(params.detector, params.detector_weights, params.min_face_size, params.detect_size, device)
    images = [decoded.image for _, _, decoded, _ in batch]
    reductions = [decoded.reduction for _, _, decoded, _ in batch]

    def detect(indices: list[int]) -> list[list[Face]]:
        # reductions only when there are any: a full-resolution batch is a plain Detector call
        if any(reductions[i] > 1 for i in indices):
            return detector.detect([images[i] for i in indices], reductions=[reductions[i] for i in indices])
        return detector.detect([images[i] for i in indices])

    try:
        detections = detect(list(range(len(images))))
    except Exception:  # noqa: BLE001 - isolate the image that breaks the batch
        detections = []
        for i in range(len(images)):
            try:
                detections.append(detect([i])[0])
            except Exception as error:  # noqa: BLE001
                detections.append(error)
    outcomes = {}
    for (index, sha, decoded, data), faces in zip(batch, detections):
        path = paths[index]
        if isinstance(faces, Exception):
            outcomes[index] = Outcome(path, sha, reason="detector_error", detail=f"{type(faces).__name__}: {faces}")
            continue
        r = decoded.reduction  # gates, selection and the header work in full-resolution pixels
        faces = [Face(box=f.box * r, score=f.score, landmarks=decoded.to_full(f.landmarks)) for f in faces] if r > 1 else faces
        try:
            kept = _passing(faces, params, (decoded.size[1], decoded.size[0]))
        except Reject as reject:
            outcomes[index] = Outcome(path, sha, reason=reject.reason, detail=reject.detail)
            continue
        outcomes[index] = _accept(path, sha, decoded, data, kept[0], params)
        if all_faces and outcomes[index].accepted and len(kept) > 1:
            others = tuple(_accept(path, sha, decoded, data, face, params) for face in kept[1:])
            outcomes[index] = replace(outcomes[index], others=tuple(o for o in others if o.accepted))
    return outcomes
