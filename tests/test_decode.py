import io
import re
import tracemalloc

import numpy as np
import pytest
from PIL import Image

import facepipe.data.extract as extract
from facepipe.config import PrepareParams
from facepipe.data.decode import Reject, load_image, load_image_reduced
from facepipe.data.extract import process_chunk
from rawdata import StandInDetector, astronaut, jpeg_bytes, variant

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


def _claim_more_rows(data: bytes, extra: int) -> bytes:
    """The same JPEG with its frame header (SOF0 or SOF2) claiming ``extra`` rows its data does not hold."""
    data = bytearray(data)
    at = max(data.find(b"\xff\xc0"), data.find(b"\xff\xc2"))
    height = int.from_bytes(data[at + 5 : at + 7], "big")
    data[at + 5 : at + 7] = (height + extra).to_bytes(2, "big")
    return bytes(data)


@pytest.mark.parametrize("progressive", [False, True])
@pytest.mark.parametrize("extra", [32, 200])
def test_jpeg_whose_header_claims_rows_its_data_lacks_is_unreadable(progressive, extra):
    # libjpeg fills the missing rows with flat grey and Pillow reports nothing: the face above them
    # would be detected on a half-grey picture, or rejected as no_face
    data = _claim_more_rows(jpeg_bytes(FACE, quality=90, progressive=progressive), extra)
    with pytest.raises(Reject) as info:
        load_image(data, max_pixels=10**7)
    assert info.value.reason == "unreadable"
    # the fill starts within an MCU row (16 px) of the real data's end: the last real bits decode to a few blocks
    match = re.fullmatch(r"the last (\d+) of (\d+) rows are decoder fill: the data ends before the image does", info.value.detail)
    assert match and int(match[2]) == FACE.shape[0] + extra and extra - 32 <= int(match[1]) <= extra, info.value.detail


@pytest.mark.parametrize("fill", [0, 127, 255])
def test_flat_bottom_rows_of_a_complete_jpeg_are_not_mistaken_for_missing_data(fill):
    image = FACE.copy()
    image[-40:] = fill  # letterboxed: a flat band, but not libjpeg's exact fill
    out = load_image(jpeg_bytes(image, quality=95), max_pixels=10**7)
    assert out.shape == FACE.shape


def test_a_chunk_holds_a_bounded_number_of_decoded_pixels(tmp_path, monkeypatch):
    """Six 3.8 MP photos in one chunk, a budget of 8 MP: the worker decodes, detects and aligns them
    two at a time, and its peak of traced memory (numpy arrays, bytes) stays near two photos' worth.
    Before the budget, the whole chunk was decoded first (6 x 11.5 MB of pixels held at once)."""
    photo = np.asarray(Image.fromarray(astronaut()).resize((2400, 1600)))
    paths = []
    for index in range(6):
        (tmp_path / "a").mkdir(exist_ok=True)
        (tmp_path / "a" / f"{index}.jpg").write_bytes(jpeg_bytes(variant(photo, angle=index), quality=80))
        paths.append(f"a/{index}.jpg")
    detector = StandInDetector()
    monkeypatch.setattr(extract, "get_detector", lambda *a, **k: detector)
    monkeypatch.setattr(extract, "DECODE_BUDGET_PIXELS", 8_000_000, raising=False)
    params = PrepareParams(max_pixels=10**7)
    tracemalloc.start()
    try:
        bounded = process_chunk(paths, str(tmp_path), params, "cpu")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [len(call) for call in detector.calls] == [2, 2, 2]
    photo_bytes = photo.nbytes  # 11.5 MB
    assert peak < 3.5 * photo_bytes, f"peak {peak / 1e6:.0f} MB"
    # the budget changes how a chunk is batched, not what comes out of it here
    monkeypatch.setattr(extract, "DECODE_BUDGET_PIXELS", 10**9)
    whole = process_chunk(paths, str(tmp_path), params, "cpu")
    assert len(detector.calls) == 4 and len(detector.calls[-1]) == 6
    assert [o.header for o in bounded] == [o.header for o in whole] and all(o.accepted for o in whole)
    assert [o.payload for o in bounded] == [o.payload for o in whole]


def test_a_file_larger_than_any_allowed_image_is_rejected_unread(tmp_path, monkeypatch):
    """A 17 MB file (sparse: no disk used) when max_pixels=1000 allows at most 8 kB + 16 MiB: its size
    alone rejects it, before a byte is read into the worker."""
    (tmp_path / "a").mkdir()
    with open(tmp_path / "a" / "huge.jpg", "wb") as handle:
        handle.truncate(17 << 20)
    monkeypatch.setattr(extract, "get_detector", lambda *a, **k: StandInDetector())
    tracemalloc.start()
    try:
        (outcome,) = process_chunk(["a/huge.jpg"], str(tmp_path), PrepareParams(max_pixels=1000, min_face_size=12), "cpu")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (outcome.reason, outcome.sha256) == ("file_too_large", None)
    assert outcome.detail == "17825792 bytes; an image of max_pixels=1000 takes at most 16785216"
    assert peak < 1 << 20


def pillow_only(data: bytes, longest: int | None):
    """What the decoder gives without its libjpeg-turbo fast path (Pillow's own JPEG path)."""
    from facepipe.data import decode

    fast, decode._decode_jpeg = decode._decode_jpeg, lambda *args: None
    try:
        return decode.load_image_reduced(data, max_pixels=10**8, longest=longest)
    finally:
        decode._decode_jpeg = fast


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("longest", [None, 320, 160])
def test_the_fast_jpeg_path_gives_pillows_pixels(orientation, longest):
    """simplejpeg (libjpeg-turbo straight into NumPy) against Pillow: the same pixels, scale and size,
    for every EXIF orientation, full and reduced scale (1/2 and 1/4 of 640 px), 4:2:0, 4:4:4 and grey."""
    from facepipe.data.decode import _decode_jpeg, load_image_reduced

    photo = np.ascontiguousarray(np.concatenate([astronaut()[:480], astronaut()[:480, :128]], axis=1))  # 640 x 480
    exif = Image.Exif()
    exif[0x0112] = orientation
    for image, options in ((photo, {}), (photo, {"subsampling": 0}), (photo[..., 1], {})):
        data = encoded(Image.fromarray(image), "JPEG", quality=90, exif=exif.tobytes(), **options)
        with Image.open(io.BytesIO(data)) as pil:
            assert _decode_jpeg(data, pil, 1 if longest is None else 640 // longest) is not None  # the fast path ran
        fast, slow = load_image_reduced(data, max_pixels=10**8, longest=longest), pillow_only(data, longest)
        assert (fast.reduction, fast.size) == (slow.reduction, slow.size)
        assert fast.image.flags.c_contiguous and fast.image.dtype == np.uint8
        np.testing.assert_array_equal(fast.image, slow.image)


@pytest.mark.parametrize("damage", ["cut", "cut_closed", "zeros"])
def test_a_damaged_jpeg_leaves_the_fast_path_to_pillow(damage):
    """libjpeg's warnings are errors on the fast path (nothing printed): Pillow's path then rejects
    the file as it always did, or decodes it when Pillow reads it whole."""
    from facepipe.data.decode import _decode_jpeg

    data = jpeg_bytes(FACE, quality=95)
    broken = {"cut": data[: len(data) // 2], "cut_closed": data[: len(data) // 2] + b"\xff\xd9",
              "zeros": data[:700] + bytes(200) + data[900:]}[damage]  # fmt: skip
    with Image.open(io.BytesIO(broken)) as pil:
        assert _decode_jpeg(broken, pil, 1) is None
    try:
        expected = pillow_only(broken, None)
    except Reject as reject:
        with pytest.raises(Reject) as info:
            load_image(broken, max_pixels=10**7)
        assert (info.value.reason, info.value.detail) == (reject.reason, reject.detail)
    else:
        np.testing.assert_array_equal(load_image(broken, max_pixels=10**7), expected.image)


def test_a_header_that_does_not_open_is_a_reject_naming_the_problem():
    """open_image's three rejects, reason and detail whole (the detail is what rejects.jsonl shows)."""
    from facepipe.data.decode import open_image

    cases = [
        (b"", "empty_file", "0 bytes"),
        (b"plain text, no image", "not_an_image", "no known image format"),
        (b"BM" + bytes(20), "unreadable", "OSError: Unsupported BMP header type (0)"),
    ]
    for data, reason, detail in cases:
        with pytest.raises(Reject) as info:
            open_image(data)
        assert (info.value.reason, info.value.detail) == (reason, detail)


def test_the_pixel_limit_is_inclusive_and_its_rejects_say_the_size():
    from PIL import Image

    from facepipe.data.decode import decode_opened, load_image_reduced

    data = encoded(Image.new("RGB", (10, 10), (1, 2, 3)), "PNG")
    assert load_image_reduced(data, max_pixels=100, longest=None).image.shape == (10, 10, 3)  # exactly the limit
    with pytest.raises(Reject) as info:
        load_image_reduced(data, max_pixels=99, longest=None)
    assert (info.value.reason, info.value.detail) == ("too_many_pixels", "10x10 exceeds max_pixels=99")
    for size in ((0, 5), (5, 0)):  # Pillow refuses such headers at open; a plugin that did not is caught here
        with pytest.raises(Reject) as info:
            decode_opened(b"", Image.new("RGB", size), max_pixels=100, longest=None)
        assert (info.value.reason, info.value.detail) == ("unreadable", f"zero-sized image {size[0]}x{size[1]}")


def test_only_colour_and_grey_jpegs_take_the_direct_libjpeg_path(monkeypatch):
    """The fast path is for what it decodes (JPEG, RGB or L); anything else goes to Pillow unasked."""
    from PIL import Image

    from facepipe.data import decode

    asked, direct = [], decode._decode_jpeg
    monkeypatch.setattr(decode, "_decode_jpeg", lambda data, pil, reduction: asked.append(pil.format) or direct(data, pil, reduction))
    for fmt in ("PNG", "JPEG", "BMP"):
        decode.load_image(encoded(Image.new("RGB", (40, 30), (9, 99, 199)), fmt), max_pixels=10**6)
    decode.load_image(encoded(Image.new("L", (40, 30), 77), "JPEG"), max_pixels=10**6)
    decode.load_image(encoded(Image.new("CMYK", (40, 30), (1, 2, 3, 4)), "JPEG"), max_pixels=10**6)
    assert asked == ["JPEG", "JPEG"]


def test_a_grey_jpeg_cut_short_is_unreadable_like_a_colour_one():
    grey = np.asarray(Image.fromarray(FACE).convert("L"))
    data = _claim_more_rows(encoded(Image.fromarray(grey), "JPEG", quality=90), 64)
    with pytest.raises(Reject) as info:
        load_image(data, max_pixels=10**7)
    assert info.value.reason == "unreadable" and "rows are decoder fill" in info.value.detail


@pytest.mark.parametrize("fmt", ["PNG", "CMYK JPEG"])
def test_only_colour_and_grey_jpegs_are_judged_by_the_fill_rule(fmt):
    # an exact mid-grey band at the bottom of a PNG, or of a CMYK JPEG (whose 128 is a colour, not
    # libjpeg's fill of colour and grey data), is a picture: nothing is missing
    image = FACE.copy()
    image[-24:] = 128
    if fmt == "PNG":
        data = encoded(Image.fromarray(image), "PNG")
    else:
        cmyk = np.concatenate([image, np.full((*image.shape[:2], 1), 128, np.uint8)], axis=2)
        data = encoded(Image.fromarray(cmyk, "CMYK"), "JPEG", quality=95)
        assert (np.asarray(Image.open(io.BytesIO(data)))[-4:] == 128).all()  # the band decodes exact
    assert load_image(data, max_pixels=10**7).shape == FACE.shape


def test_the_fill_rule_looks_at_the_last_four_rows_of_a_full_scale_decode():
    from facepipe.data.decode import _check_complete_jpeg

    # 10 rows: an 8-row block of black, then a 2-row block of exact mid-grey (flat blocks encode exactly)
    image = np.zeros((10, 16), np.uint8)
    image[8:] = 128
    pil = Image.open(io.BytesIO(encoded(Image.fromarray(image), "JPEG", quality=95)))
    assert (np.asarray(pil)[-2:] == 128).all() and (np.asarray(pil)[-4:-2] == 0).all()
    _check_complete_jpeg(pil)  # the last 4 rows are not all fill: complete
    with pytest.raises(Reject):
        _check_complete_jpeg(pil, 2)  # at 1/2 scale, 2 rows stand for those 4


@pytest.mark.parametrize("height", [3, 4])
def test_an_image_as_high_as_the_rows_the_rule_reads_is_judged_and_a_lower_one_is_not(height):
    from facepipe.data.decode import _check_complete_jpeg

    pil = Image.open(io.BytesIO(encoded(Image.new("L", (16, height), 128), "JPEG", quality=95)))
    assert (np.asarray(pil) == 128).all()  # a flat block encodes exactly
    if height < 4:
        _check_complete_jpeg(pil)  # fewer rows than the rule reads: not judged
        return
    with pytest.raises(Reject) as info:  # every row is fill: the count says all of them
        _check_complete_jpeg(pil)
    assert info.value.detail == "the last 4 of 4 rows are decoder fill: the data ends before the image does"


def test_a_jpeg_cut_mid_scan_is_unreadable_with_pillows_words():
    # no end marker: libjpeg's fast path refuses it (strict), Pillow's raises; the reject names the error
    data = jpeg_bytes(FACE, quality=90)
    with pytest.raises(Reject) as info:
        load_image(data[: len(data) // 2], max_pixels=10**7)
    assert info.value.reason == "unreadable"
    assert info.value.detail.startswith("OSError: image file is truncated"), info.value.detail


def test_a_few_missing_rows_are_found_in_a_quarter_scale_decode():
    # a grey JPEG whose header claims 16 rows its data lacks: at 1/4 scale its last 2 rows are fill,
    # which is all the rule reads there (4 rows would take in real ones and pass the photo)
    grey = np.asarray(Image.fromarray(FACE).convert("L"))
    data = _claim_more_rows(encoded(Image.fromarray(grey), "JPEG", quality=90), 16)
    with pytest.raises(Reject) as info:
        load_image_reduced(data, max_pixels=10**7, longest=50)
    assert info.value.reason == "unreadable" and info.value.detail.startswith("the last 2 of 54 rows are decoder fill")


def test_a_reject_reads_as_its_reason_and_detail():
    assert (str(Reject("unreadable", "cut short")), Reject("unreadable", "cut short").detail) == ("unreadable: cut short", "cut short")
    bare = Reject("empty_file")
    assert (str(bare), bare.reason, bare.detail) == ("empty_file", "empty_file", "")


def _rgb_of(pil: Image.Image) -> np.ndarray:
    from facepipe.data.decode import _to_rgb

    out = _to_rgb(pil)
    assert out.dtype == np.uint8 and out.shape == (pil.height, pil.width, 3)
    return out


def test_deep_grey_scales_its_whole_range_into_8_bits():
    # 16-bit: 65535 is white whatever the values; 32-bit "I": 255 is white unless a value is above it
    sixteen = Image.fromarray(np.asarray([[0, 257, 32768, 65535]], np.uint16))
    assert sixteen.mode.startswith("I;16")
    np.testing.assert_array_equal(_rgb_of(sixteen)[0, :, 0], [0, 1, 128, 255])
    low = Image.fromarray(np.asarray([[0, 100, 255]], np.int32))
    assert low.mode == "I"
    np.testing.assert_array_equal(_rgb_of(low)[0], [[0] * 3, [100] * 3, [255] * 3])
    high = Image.fromarray(np.asarray([[0, 256, 65535]], np.int32))
    np.testing.assert_array_equal(_rgb_of(high)[0, :, 0], [0, 1, 255])  # 256 * 255 / 65535 + 0.5 rounds to 1
    big_endian = Image.frombytes("I;16B", (3, 1), np.asarray([0, 255, 65535], ">u2").tobytes())
    np.testing.assert_array_equal(_rgb_of(big_endian)[0, :, 1], [0, 1, 255])  # 16-bit: 255 is dark
    little_endian = Image.frombytes("I;16L", (3, 1), np.asarray([0, 32768, 65535], "<u2").tobytes())
    np.testing.assert_array_equal(_rgb_of(little_endian)[0, :, 2], [0, 128, 255])
    dim = Image.fromarray(np.asarray([[0, 255]], np.uint16))  # 16-bit whatever its values: 255 is dark
    np.testing.assert_array_equal(_rgb_of(dim)[0, :, 0], [0, 1])
    just_over = Image.fromarray(np.asarray([[0, 256]], np.int32))  # one value above 255: 16-bit range
    np.testing.assert_array_equal(_rgb_of(just_over)[0, :, 0], [0, 1])
    # rounding at 65535 (not 65536), and clipping both ways of what 32-bit values exceed the range
    wide = Image.fromarray(np.asarray([[-1000, 60000, 65407, 100000]], np.int32))
    np.testing.assert_array_equal(_rgb_of(wide)[0, :, 0], [0, 233, 255, 255])


def test_float_grey_is_zero_to_one_clipped():
    pil = Image.fromarray(np.asarray([[-1.0, 0.0, 0.5, 1.0, 2.0, 0.6098039150238037]], np.float32))
    assert pil.mode == "F"
    # in float64: 0.6098039... * 255 + 0.5 is just under 156 (in float32 it rounds up to 156)
    np.testing.assert_array_equal(_rgb_of(pil)[0], [[0] * 3, [0] * 3, [128] * 3, [255] * 3, [255] * 3, [155] * 3])


@pytest.mark.parametrize("mode", ["RGBA", "LA", "PA", "P"])
def test_transparent_pixels_composite_onto_mid_grey(mode):
    rgba = np.asarray([[[255, 0, 0, 0], [255, 0, 0, 255], [0, 0, 255, 128]]], np.uint8)
    pil = Image.fromarray(rgba, "RGBA")
    if mode == "LA":
        pil = pil.convert("LA")
    elif mode == "PA":
        pil = pil.convert("PA")
    elif mode == "P":  # a palette with a transparent index
        pil = Image.fromarray(np.asarray([[0, 1, 2]], np.uint8), "P")
        pil.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255])
        pil.info["transparency"] = 0
    out = _rgb_of(pil)
    np.testing.assert_array_equal(out[0, 0], [128, 128, 128])  # fully transparent: the grey
    if mode == "RGBA":
        np.testing.assert_array_equal(out[0, 1], [255, 0, 0])
        np.testing.assert_allclose(out[0, 2], [64, 64, 191], atol=1)  # half blue over the grey
    if mode == "P":
        np.testing.assert_array_equal(out[0, 1:], [[0, 255, 0], [0, 0, 255]])


def test_a_palette_image_without_transparency_keeps_its_colours():
    pil = Image.fromarray(np.asarray([[0, 1]], np.uint8), "P")
    pil.putpalette([10, 20, 30, 40, 50, 60])
    np.testing.assert_array_equal(_rgb_of(pil)[0], [[10, 20, 30], [40, 50, 60]])


@pytest.mark.parametrize(("width", "height"), [(13, 29), (13, 7), (150, 4), (10, 10)])
def test_pixels_read_in_bands_are_the_whole_image(monkeypatch, width, height):
    from facepipe.data import decode

    monkeypatch.setattr(decode, "_BAND_PIXELS", 100)  # bands of 7 rows at 13 px; 1 row when a row is wider
    image = np.random.default_rng(width).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = decode._pixels(Image.fromarray(image))
    assert out.shape == image.shape and out.dtype == np.uint8
    np.testing.assert_array_equal(out, image)
    grey = decode._pixels(Image.fromarray(image[:, :, 0]))
    np.testing.assert_array_equal(grey, image[:, :, 0])


def test_a_large_image_is_read_without_a_second_copy_of_its_pixels():
    # np.asarray(pil) peaks at twice the pixels (Pillow's chunks, then their join); in 1 MP bands, the
    # result and one band
    from facepipe.data import decode

    pil = Image.new("RGB", (4000, 3000), (1, 2, 3))
    pil.load()
    tracemalloc.start()
    try:
        out = decode._pixels(pil)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (out == (1, 2, 3)).all() and peak < 1.5 * out.nbytes, peak / out.nbytes


@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_a_colour_key_transparency_composites_onto_mid_grey_too(mode):
    # PNG's tRNS chunk on an RGB or grey image: one colour stands for transparent, as a palette index can
    key = (10, 20, 30) if mode == "RGB" else 10
    image = Image.new(mode, (2, 1), key)
    image.putpixel((1, 0), (200, 100, 50) if mode == "RGB" else 200)
    data = encoded(image, "PNG", transparency=key)
    assert Image.open(io.BytesIO(data)).info["transparency"] == key
    out = load_image(data, max_pixels=10**6)
    np.testing.assert_array_equal(out[0, 0], [128, 128, 128])
    np.testing.assert_array_equal(out[0, 1], [200, 100, 50] if mode == "RGB" else [200] * 3)
