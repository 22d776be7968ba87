"""Face thumbnails for the search page: the face's box (with some context) cut from its photo."""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from facepipe.data.decode import Reject, load_image_reduced
from facepipe.data.scan import FileTooLarge, read_raw_file, unescape_path

#: Photos above these are not opened for a thumbnail (a page should not stall on one file).
MAX_BYTES = 64 * 2**20
MAX_PIXELS = 60_000_000


def face_thumbnail(raw: str | Path | None, path: str, box: Sequence[float] | None, *, size: int = 96, context: float = 0.25) -> bytes | None:
    """A JPEG (longest side ``size``) of the face ``box`` (full-resolution pixels, x1 y1 x2 y2) grown
    by ``context`` of its size on each side, from the photo ``path`` (a scan path under ``raw``, or
    an absolute path when ``raw`` is None); the whole photo when ``box`` is None. None when the file
    is not under ``raw``, is gone, is over ``MAX_BYTES``, or does not decode: a page shows a
    placeholder then."""
    try:
        data = _read(raw, path)
        decoded = load_image_reduced(data, max_pixels=MAX_PIXELS, longest=None)
    except (OSError, ValueError, FileTooLarge, Reject):
        return None
    image = decoded.image
    if box is not None:
        image = _crop(image, box, context)
    pil = Image.fromarray(image)
    pil.thumbnail((size, size))
    buffer = io.BytesIO()
    pil.save(buffer, format="JPEG", quality=85)
    return buffer.getvalue()


def _read(raw: str | Path | None, path: str) -> bytes:
    if raw is None:
        with open(path, "rb") as handle:
            data = handle.read(MAX_BYTES + 1)
        if len(data) > MAX_BYTES:
            raise ValueError("too large for a thumbnail")
        return data
    base = os.path.realpath(os.fsencode(raw))
    target = os.path.realpath(os.path.join(base, unescape_path(path)))
    if os.path.commonpath([base, target]) != base:
        raise ValueError("outside the photo folder")
    return read_raw_file(raw, path, max_bytes=MAX_BYTES)


def _crop(image: np.ndarray, box: Sequence[float], context: float) -> np.ndarray:
    x1, y1, x2, y2 = (float(v) for v in box)
    grow_x, grow_y = (x2 - x1) * context, (y2 - y1) * context
    height, width = image.shape[:2]
    left, top = max(0, int(x1 - grow_x)), max(0, int(y1 - grow_y))
    right, bottom = min(width, int(np.ceil(x2 + grow_x))), min(height, int(np.ceil(y2 + grow_y)))
    if right <= left or bottom <= top:
        return image
    return np.ascontiguousarray(image[top:bottom, left:right])
