"""Raw file bytes -> upright [H, W, 3] uint8 RGB, or a reject with a reason. Never raises anything else."""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

# Pillow's own bomb guard would raise before we can say why; the pixel limit is enforced below.
Image.MAX_IMAGE_PIXELS = None

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".gif", ".ppm", ".pgm"})


class Reject(Exception):
    """A per-image problem: ``reason`` is a stable machine-readable code, ``detail`` a short human text."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def _to_rgb(pil: Image.Image) -> np.ndarray:
    if pil.mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16/32-bit grey: scale the full range into 8 bits instead of clipping everything above 255.
        array = np.asarray(pil, dtype=np.float64)
        top = 65535.0 if pil.mode.startswith("I;16") or array.max() > 255 else 255.0
        grey = np.clip(array * (255.0 / top) + 0.5, 0, 255).astype(np.uint8)
        return np.repeat(grey[:, :, None], 3, axis=2)
    if pil.mode == "F":
        grey = np.clip(np.asarray(pil, dtype=np.float64) * 255.0 + 0.5, 0, 255).astype(np.uint8)
        return np.repeat(grey[:, :, None], 3, axis=2)
    if pil.mode in ("RGBA", "LA", "PA") or "transparency" in pil.info:
        # Transparent pixels (an alpha channel, or a palette index or colour key that stands for
        # transparent) composite onto mid grey rather than an arbitrary stored colour.
        rgba = pil.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (128, 128, 128, 255))
        return np.asarray(Image.alpha_composite(background, rgba).convert("RGB"))
    # Pillow's RGB already is what we return: converting would copy 4 bytes a pixel for nothing.
    return _pixels(pil if pil.mode == "RGB" else pil.convert("RGB"))


_BAND_PIXELS = 1 << 20


def _pixels(pil: Image.Image) -> np.ndarray:
    """``np.asarray(pil)`` in row bands of about 1 MP: Pillow's ``tobytes`` would hold the whole image
    twice more (its chunks, then their join) besides its own 4-byte-a-pixel buffer."""
    if pil.width * pil.height <= _BAND_PIXELS:
        return np.asarray(pil)
    step = max(1, _BAND_PIXELS // pil.width)
    first = np.asarray(pil.crop((0, 0, pil.width, min(step, pil.height))))
    out = np.empty((pil.height, *first.shape[1:]), first.dtype)
    out[:step] = first
    for top in range(step, pil.height, step):
        out[top : top + step] = np.asarray(pil.crop((0, top, pil.width, min(top + step, pil.height))))
    return out


#: libjpeg's fill for image data the file does not hold: every missing block decodes to this grey.
_JPEG_FILL = 128
_FILL_ROWS = 4


def _fill_rows(reduction: int) -> int:
    """How many bottom rows of a 1/``reduction`` scale decode stand for the full image's last 4 (at
    least 1: a missing 8-px block row)."""
    return max(1, _FILL_ROWS // reduction)


def _is_fill(rows: np.ndarray) -> bool:
    """Whether these bottom rows are all exactly libjpeg's fill grey in every channel: the data may
    end before the image does (both JPEG paths decide by this one rule)."""
    return bool((rows == _JPEG_FILL).all())


def _check_complete_jpeg(pil: Image.Image, reduction: int = 1) -> None:
    """Raise Reject("unreadable") when a JPEG's data ended before its last rows (header lies, or a file
    cut and closed with an end marker): libjpeg fills them with exact mid-grey and reports nothing.

    Looks at the stored (pre-EXIF) bottom rows: all of the last 4 exactly 128 in every channel (the
    first filled rows are not exact: chroma upsampling and the data's last bits blur the edge). A
    complete photo whose bottom 4 rows are exactly that grey would be rejected too; JPEG noise makes
    that rare outside synthetic images. Decoded at 1/``reduction`` scale, the last 4 / ``reduction``
    rows (at least 1: a missing 8-px block row) stand for those 4.
    """
    rows = _fill_rows(reduction)
    if pil.format != "JPEG" or pil.mode not in ("L", "RGB") or pil.height < rows:
        return
    if not _is_fill(np.asarray(pil.crop((0, pil.height - rows, pil.width, pil.height)))):
        return
    filled = (np.asarray(pil).reshape(pil.height, -1) == _JPEG_FILL).all(axis=1)[::-1]
    count = int(np.argmin(filled)) if not filled.all() else pil.height
    raise Reject("unreadable", f"the last {count} of {pil.height} rows are decoder fill: the data ends before the image does")


def max_file_bytes(max_pixels: int) -> int:
    """The most bytes an image of ``max_pixels`` can take: 8 a pixel (16-bit RGBA, uncompressed) plus
    16 MiB of metadata. A bigger file is refused unread, so a worker never holds more of one file."""
    return 8 * max_pixels + (16 << 20)


def load_image(data: bytes, *, max_pixels: int) -> np.ndarray:
    """Decode ``data`` (any format Pillow reads, any mode) honouring EXIF orientation.

    Returns [H, W, 3] uint8 RGB. Raises :class:`Reject` with reason ``empty_file``, ``not_an_image``,
    ``too_many_pixels`` or ``unreadable`` (corrupt or truncated).
    """
    return load_image_reduced(data, max_pixels=max_pixels, longest=None).image


#: JPEG scales libjpeg decodes in the DCT domain (Pillow's ``draft``), largest reduction first.
_DRAFT_REDUCTIONS = (8, 4, 2)


def draft_reduction(size: tuple[int, int], longest: int | None) -> int:
    """The largest of 8, 4, 2 (else 1) by which a ``size`` (W, H) image can shrink and keep its
    longest side >= ``longest`` (``None``: 1, full resolution)."""
    if longest is None:
        return 1
    return next((r for r in _DRAFT_REDUCTIONS if -(-max(size) // r) >= longest), 1)


@dataclass(frozen=True)
class Decoded:
    """An upright image, possibly decoded at reduced scale (:func:`load_image_reduced`).

    ``image``: [h, w, 3] uint8 RGB; ``reduction``: 1, 2, 4 or 8, pixel (x, y) of ``image`` covers
    [r*x, r*(x+1)) x [r*y, r*(y+1)) of the full-resolution image, so coordinates scale by exactly
    ``reduction``; ``size``: (width, height) of the full-resolution upright image.
    """

    image: np.ndarray
    reduction: int
    size: tuple[int, int]

    def to_full(self, points: np.ndarray) -> np.ndarray:
        """[..., 2] positions in ``image`` as full-resolution positions: pixel centres at integers, so
        reduced pixel x (covering full pixels r*x .. r*x + r - 1) is centred on r*x + (r - 1) / 2."""
        return np.asarray(points, np.float64) * self.reduction + (self.reduction - 1) / 2

    def from_full(self, points: np.ndarray) -> np.ndarray:
        """The inverse of :meth:`to_full`: full-resolution positions in ``image``'s pixels."""
        return (np.asarray(points, np.float64) - (self.reduction - 1) / 2) / self.reduction


#: EXIF orientation -> the NumPy view that makes the stored pixels upright (Pillow's exif_transpose).
_ORIENT = {
    2: lambda a: a[:, ::-1],
    3: lambda a: a[::-1, ::-1],
    4: lambda a: a[::-1],
    5: lambda a: a.transpose(1, 0, 2),
    6: lambda a: a.transpose(1, 0, 2)[:, ::-1],
    7: lambda a: a.transpose(1, 0, 2)[::-1, ::-1],
    8: lambda a: a.transpose(1, 0, 2)[::-1],
}


def _decode_jpeg(data: bytes, pil: Image.Image, reduction: int) -> Decoded | None:
    """A colour or grey JPEG decoded by libjpeg-turbo straight into NumPy (simplejpeg), at 1/``reduction``
    scale, turned upright as its EXIF says: the same pixels as Pillow's path (same library, same
    settings; tests/test_decode.py holds them equal), 2-3x less CPU time, no 4-byte copy. None when
    libjpeg reports any problem with the data (``strict``): Pillow's path then says what it is."""
    import simplejpeg

    width, height = pil.size
    expected = (-(-height // reduction), -(-width // reduction))
    try:
        pixels = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=expected[0], min_width=expected[1], strict=True)
    except ValueError:
        return None
    if pixels.shape[:2] != expected or _is_fill(pixels[-_fill_rows(reduction) :]):
        return None  # another scale than asked, or the data may end early: Pillow's path decides
    orientation = pil.getexif().get(0x0112, 1)
    upright = (height, width) if orientation in (5, 6, 7, 8) else (width, height)
    if orientation in _ORIENT:
        pixels = np.ascontiguousarray(_ORIENT[orientation](pixels))
    return Decoded(pixels, reduction, upright)


def open_image(data: bytes) -> Image.Image:
    """The image's header, parsed (Pillow reads the pixels later, in :func:`decode_opened`), or a
    :class:`Reject`: ``empty_file``, ``not_an_image``, ``unreadable``. Its size is known from here:
    prepare counts a photo's pixels against its memory budget before decoding it."""
    if not data:
        raise Reject("empty_file", "0 bytes")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise Reject("not_an_image", "no known image format") from None
    except Exception as error:  # noqa: BLE001 - any decoder failure is a per-image reject
        raise Reject("unreadable", f"{type(error).__name__}: {error}") from None


def load_image_reduced(data: bytes, *, max_pixels: int, longest: int | None) -> Decoded:
    """:func:`load_image`, but a JPEG at least twice ``longest`` on its longest side is decoded at
    1/2, 1/4 or 1/8 scale (libjpeg's scaled IDCT: ~3-10x less work than the full image), as long as
    the longest side stays >= ``longest``. Same rejects as :func:`load_image` (``too_many_pixels``
    judged on the full size)."""
    return decode_opened(data, open_image(data), max_pixels=max_pixels, longest=longest)


def decode_opened(data: bytes, pil: Image.Image, *, max_pixels: int, longest: int | None) -> Decoded:
    """:func:`load_image_reduced` of ``data`` whose header :func:`open_image` parsed into ``pil``
    (closed here): the header is parsed once."""
    with pil:
        width, height = pil.size
        if width * height > max_pixels:
            raise Reject("too_many_pixels", f"{width}x{height} exceeds max_pixels={max_pixels}")
        if width == 0 or height == 0:
            raise Reject("unreadable", f"zero-sized image {width}x{height}")
        reduction = draft_reduction((width, height), longest) if pil.format == "JPEG" else 1
        if pil.format == "JPEG" and pil.mode in ("RGB", "L"):
            fast = _decode_jpeg(data, pil, reduction)
            if fast is not None:
                return fast
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if reduction > 1:
                    pil.draft(None, (max(1, width // reduction), max(1, height // reduction)))
                    # what libjpeg was set to: Pillow may refuse (multi-tile files) or pick less
                    longest_now = max(pil.size)
                    reduction = next(r for r in (*_DRAFT_REDUCTIONS, 1) if -(-max(width, height) // r) == longest_now)
                pil.load()
                _check_complete_jpeg(pil, reduction)
                # in place: a transposed copy would hold a second full-size image (decode memory)
                stored = pil.size
                ImageOps.exif_transpose(pil, in_place=True)
                upright = (width, height) if pil.size == stored else (height, width)
                return Decoded(_to_rgb(pil), reduction, upright)
        except Reject:
            raise
        except Exception as error:  # noqa: BLE001
            raise Reject("unreadable", f"{type(error).__name__}: {error}") from None
