"""Raw file bytes -> upright [H, W, 3] uint8 RGB, or a reject with a reason. Never raises anything else."""

from __future__ import annotations

import io
import warnings

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
    if pil.mode in ("RGBA", "LA", "PA") or (pil.mode == "P" and "transparency" in pil.info):
        # Transparent pixels composite onto mid grey rather than an arbitrary stored colour.
        rgba = pil.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (128, 128, 128, 255))
        return np.asarray(Image.alpha_composite(background, rgba).convert("RGB"))
    return np.asarray(pil.convert("RGB"))


def load_image(data: bytes, *, max_pixels: int) -> np.ndarray:
    """Decode ``data`` (any format Pillow reads, any mode) honouring EXIF orientation.

    Returns [H, W, 3] uint8 RGB. Raises :class:`Reject` with reason ``empty_file``, ``not_an_image``,
    ``too_many_pixels`` or ``unreadable`` (corrupt or truncated).
    """
    if not data:
        raise Reject("empty_file", "0 bytes")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pil = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise Reject("not_an_image", "no known image format") from None
    except Exception as error:  # noqa: BLE001 - any decoder failure is a per-image reject
        raise Reject("unreadable", f"{type(error).__name__}: {error}") from None
    with pil:
        width, height = pil.size
        if width * height > max_pixels:
            raise Reject("too_many_pixels", f"{width}x{height} exceeds max_pixels={max_pixels}")
        if width == 0 or height == 0:
            raise Reject("unreadable", f"zero-sized image {width}x{height}")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                pil.load()
                pil = ImageOps.exif_transpose(pil)
                return _to_rgb(pil)
        except Exception as error:  # noqa: BLE001
            raise Reject("unreadable", f"{type(error).__name__}: {error}") from None
