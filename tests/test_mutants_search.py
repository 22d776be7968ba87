"""Fast tests that kill mutants of facepipe/gallery/thumbs.py and facepipe/stages/search.py: thumbnails
of small generated photos, and the search stage on hand-made embedding folders (no model)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from facepipe.config import EmbedParams
from facepipe.errors import FacepipeError
from facepipe.gallery import store, thumbs
from facepipe.stages import search

# ----------------------------------------------------------------------------- thumbnails


def _photo(path: Path, width: int = 80, height: int = 60) -> np.ndarray:
    """A JPEG of smooth colour ramps at ``path``; returns the pixels as decoded back."""
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // width, y * 255 // height, (x + y) * 255 // (width + height)], axis=-1).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, format="JPEG", quality=95)
    return np.asarray(Image.open(path).convert("RGB"))


def _jpeg(pixels: np.ndarray, size: int) -> bytes:
    pil = Image.fromarray(np.ascontiguousarray(pixels))
    pil.thumbnail((size, size))
    buffer = io.BytesIO()
    pil.save(buffer, format="JPEG", quality=85)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("box", "context", "expected"),
    [
        ((20, 10, 40, 30), 0.25, (slice(5, 35), slice(15, 45))),  # grown by 5 on each side
        ((20.5, 10.5, 40.2, 30.2), 0.0, (slice(10, 31), slice(20, 41))),  # floor the start, ceil the end
        ((2, 3, 30, 50), 0.25, (slice(0, 60), slice(0, 37))),  # clipped at the top, left and bottom
        ((50, 40, 79, 59), 0.5, (slice(30, 60), slice(35, 80))),  # clipped at the right and bottom
        ((10, 10, 30, 20), 0.5, (slice(5, 25), slice(0, 40))),  # x and y grow by their own sizes
    ],
)
def test_crop_geometry_is_exact(box, context, expected):
    image = np.arange(60 * 80 * 3, dtype=np.int64).reshape(60, 80, 3)
    crop = thumbs._crop(image, box, context)
    assert np.array_equal(crop, image[expected])
    assert crop.flags.c_contiguous


@pytest.mark.parametrize("box", [(90, 10, 120, 30), (10, 70, 30, 90), (30, 10, 30, 20), (30, 20, 40, 20)])
def test_a_box_outside_or_empty_gives_the_whole_photo(box):
    image = np.arange(60 * 80 * 3, dtype=np.int64).reshape(60, 80, 3)
    assert thumbs._crop(image, box, 0.0) is image


def test_thumbnail_of_a_face_in_a_scanned_photo(tmp_path):
    pixels = _photo(tmp_path / "raw" / "alice" / "a b.jpg")
    got = thumbs.face_thumbnail(tmp_path / "raw", "alice/a b.jpg", [20, 10, 40, 30])
    assert got == _jpeg(pixels[5:35, 15:45], 96)
    assert thumbs.face_thumbnail(str(tmp_path / "raw"), "alice/a b.jpg", [20, 10, 40, 30], size=16, context=0.5) == _jpeg(pixels[0:40, 10:50], 16)
    assert Image.open(io.BytesIO(thumbs.face_thumbnail(tmp_path / "raw", "alice/a b.jpg", [20, 10, 40, 30], size=16))).size == (16, 16)
    # no box: the whole photo, longest side 96 at most (80 x 60 is not enlarged), or `size`
    assert thumbs.face_thumbnail(tmp_path / "raw", "alice/a b.jpg", None) == _jpeg(pixels, 96)
    assert Image.open(io.BytesIO(thumbs.face_thumbnail(tmp_path / "raw", "alice/a b.jpg", None, size=40))).size == (40, 30)
    # an absolute path without a photo folder
    assert thumbs.face_thumbnail(None, str(tmp_path / "raw" / "alice" / "a b.jpg"), [20, 10, 40, 30]) == _jpeg(pixels[5:35, 15:45], 96)


def test_thumbnail_refusals(tmp_path):
    _photo(tmp_path / "raw" / "alice" / "1.jpg")
    _photo(tmp_path / "elsewhere.jpg")
    (tmp_path / "raw" / "broken.jpg").write_bytes(b"not an image")
    (tmp_path / "raw" / "link.jpg").symlink_to(tmp_path / "elsewhere.jpg")
    assert thumbs.face_thumbnail(tmp_path / "raw", "../elsewhere.jpg", None) is None  # outside the folder
    assert thumbs.face_thumbnail(tmp_path / "raw", "link.jpg", None) is None  # a link out of it
    assert thumbs.face_thumbnail(tmp_path / "raw", "alice/gone.jpg", None) is None
    assert thumbs.face_thumbnail(None, str(tmp_path / "gone.jpg"), None) is None
    assert thumbs.face_thumbnail(tmp_path / "raw", "broken.jpg", None) is None
    assert thumbs.face_thumbnail(None, str(tmp_path / "raw" / "broken.jpg"), None) is None
    assert thumbs._read(tmp_path / "raw", "alice/1.jpg") == (tmp_path / "raw" / "alice" / "1.jpg").read_bytes()
    with pytest.raises(ValueError, match="^outside the photo folder$"):
        thumbs._read(tmp_path / "raw", "../elsewhere.jpg")


@pytest.mark.parametrize("in_folder", [True, False])
def test_a_photo_over_max_bytes_gives_no_thumbnail(tmp_path, monkeypatch, in_folder):
    _photo(tmp_path / "raw" / "a.jpg")
    size = (tmp_path / "raw" / "a.jpg").stat().st_size
    (tmp_path / "raw" / "b.jpg").write_bytes((tmp_path / "raw" / "a.jpg").read_bytes() + b"\0")  # one byte more
    monkeypatch.setattr(thumbs, "MAX_BYTES", size)
    call = (lambda name: thumbs.face_thumbnail(tmp_path / "raw", name, None)) if in_folder else (
        lambda name: thumbs.face_thumbnail(None, str(tmp_path / "raw" / name), None)
    )
    assert call("a.jpg") is not None
    assert call("b.jpg") is None
    if not in_folder:
        with pytest.raises(ValueError, match="^too large for a thumbnail$"):
            thumbs._read(None, str(tmp_path / "raw" / "b.jpg"))
