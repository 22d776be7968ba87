import io

import numpy as np
import pytest
from PIL import Image

from facepipe.data.decode import Reject, load_image
from rawdata import astronaut, jpeg_bytes

FACE = astronaut()[:200, 100:300]


def encoded(image: Image.Image, fmt: str, **kw) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kw)
    return buffer.getvalue()


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "BMP", "WEBP", "TIFF"])
def test_formats_decode_to_rgb(fmt):
    out = load_image(encoded(Image.fromarray(FACE), fmt), max_pixels=10**7)
    assert out.shape == FACE.shape and out.dtype == np.uint8
    assert np.abs(out.astype(int) - FACE).mean() < 8


@pytest.mark.parametrize("mode", ["L", "RGBA", "CMYK", "P", "LA", "1"])
def test_modes_decode_to_rgb(mode):
    pil = Image.fromarray(FACE).convert(mode)
    fmt = "JPEG" if mode in ("L", "CMYK") else "PNG"
    out = load_image(encoded(pil, fmt), max_pixels=10**7)
    assert out.shape == FACE.shape and out.dtype == np.uint8


def test_16_bit_grey_keeps_its_range():
    grey = (np.linspace(0, 65535, 200 * 200).reshape(200, 200)).astype(np.uint16)
    out = load_image(encoded(Image.fromarray(grey), "PNG"), max_pixels=10**7)
    assert out[0, 0, 0] == 0 and out[-1, -1, 0] == 255 and 120 < out[100, 100, 0] < 135


def test_exif_orientation_is_honoured():
    upright = np.zeros((100, 60, 3), np.uint8)
    upright[:20] = 255  # white band on top
    stored = Image.fromarray(upright).rotate(90, expand=True)  # stored sideways: 60 x 100 (h x w)
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to view": undoes the 90 CCW rotation above
    out = load_image(encoded(stored, "JPEG", exif=exif.tobytes(), quality=95), max_pixels=10**7)
    assert out.shape == (100, 60, 3)
    assert out[:15].mean() > 200 and out[30:].mean() < 50


def test_rejects_carry_reasons():
    cases = {
        "empty_file": b"",
        "not_an_image": b"hello, I am text\n",
        "unreadable": jpeg_bytes(FACE)[:500],
        "too_many_pixels": encoded(Image.new("RGB", (2000, 1000)), "PNG"),
    }
    for reason, data in cases.items():
        with pytest.raises(Reject) as info:
            load_image(data, max_pixels=1_000_000)
        assert info.value.reason == reason, (reason, info.value)
        assert " at 0x" not in info.value.detail  # no object addresses: rejects.jsonl must be deterministic
