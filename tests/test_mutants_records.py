"""Records against the byte layout their docstring documents, built independently here (tests/README.md).

    b"FPR" | u8 version | u32 header length | u32 CRC-32 | header (sorted-key compact JSON) | payload
"""

from __future__ import annotations

import io
import json
import struct
import zlib

import numpy as np
import pytest
from PIL import Image, JpegImagePlugin

from facepipe.io.records import (
    RecordError,
    decode_header,
    decode_image,
    decode_record,
    encode_image,
    encode_record,
    encode_run,
    payload_offset,
    run_record,
    run_records,
    unsafe_path_reason,
)

HEADER = {"path": "b/c.jpg", "label": 7}
PAYLOAD = b"\xff\xd8 image bytes \xff\xd9"


def by_hand(header: dict, payload: bytes, *, version: int = 2) -> bytes:
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    assert head == b'{"label":7,"path":"b/c.jpg"}'
    before = b"FPR" + bytes([version]) + struct.pack("<I", len(head))
    crc = zlib.crc32(before + head + payload)  # every byte but the CRC field itself
    return before + struct.pack("<I", crc) + head + payload


def test_record_bytes_follow_the_documented_layout() -> None:
    data = encode_record(HEADER, PAYLOAD)
    assert data == by_hand(HEADER, PAYLOAD)
    assert payload_offset(data) == 12 + 28
    record = decode_record(data)
    assert (record.header, record.payload, record.label, record.path) == (HEADER, PAYLOAD, 7, "b/c.jpg")
    assert decode_header(memoryview(data)) == (HEADER, 40)


@pytest.mark.parametrize("position", [0, 3, 4, 8, 12, 39, 40, -1])
def test_any_flipped_byte_is_refused(position: int) -> None:
    data = bytearray(encode_record(HEADER, PAYLOAD))
    data[position] ^= 0x01
    with pytest.raises(RecordError):
        decode_record(bytes(data))


def test_the_checksum_can_be_skipped_only_on_request() -> None:
    data = bytearray(encode_record(HEADER, PAYLOAD))
    data[-1] ^= 0x01  # a payload byte
    with pytest.raises(RecordError, match="^record checksum mismatch"):
        payload_offset(bytes(data))
    assert payload_offset(bytes(data), verify=False) == 40
    with pytest.raises(RecordError, match="^record checksum mismatch"):
        decode_header(bytes(data))  # checked by default here too
    assert decode_record(bytes(data), verify=False).payload[:-1] == PAYLOAD[:-1]


def test_short_truncated_and_foreign_records() -> None:
    data = encode_record(HEADER, PAYLOAD)
    with pytest.raises(RecordError, match=r"^record too short \(11 bytes\)$"):
        payload_offset(data[:11])
    payload_offset(data[:40], verify=False)  # the prefix and the whole header: enough without the CRC
    with pytest.raises(RecordError, match="^record truncated inside its header$"):
        payload_offset(data[:39], verify=False)
    with pytest.raises(RecordError, match=r"^not a facepipe record \(bad magic\)$"):
        payload_offset(b"XPR" + data[3:])
    with pytest.raises(RecordError, match=r"^record version 1 is not supported \(this facepipe reads 2\) \(written by"):
        payload_offset(by_hand(HEADER, PAYLOAD, version=1))
    with pytest.raises(RecordError, match=r"^record version 3 is not supported \(this facepipe reads 2\)$"):
        payload_offset(by_hand(HEADER, PAYLOAD, version=3))


def raw_record(head: bytes, payload: bytes = b"") -> bytes:
    """A version-2 record around arbitrary header bytes, CRC included."""
    before = b"FPR\x02" + struct.pack("<I", len(head))
    return before + struct.pack("<I", zlib.crc32(before + head + payload)) + head + payload


def test_headers_that_are_not_json_objects() -> None:
    with pytest.raises(RecordError, match=r"^record header is not JSON \(Expecting value: line 1 column 1 \(char 0\)\)$"):
        decode_header(raw_record(b"nope"))
    with pytest.raises(RecordError, match="^record header is not a JSON object$"):
        decode_header(raw_record(b"[1, 2]"))
    assert decode_header(raw_record(b"{}", b"xy")) == ({}, 14)
    # exactly the 12-byte prefix of a record whose header is longer: truncated, not "too short"
    with pytest.raises(RecordError, match="^record truncated inside its header$"):
        payload_offset(encode_record(HEADER, PAYLOAD)[:12], verify=False)


def test_record_image_decodes_its_payload() -> None:
    image = np.random.default_rng(0).integers(0, 256, (6, 5, 3), dtype=np.uint8)
    record = decode_record(encode_record(HEADER, encode_image(image, encoding="png")))
    np.testing.assert_array_equal(record.image(), image)


def _jpeg(data: bytes) -> Image.Image:
    pil = Image.open(io.BytesIO(data))
    assert pil.format == "JPEG"
    return pil


def test_jpeg_default_quality_and_chroma_subsampling() -> None:
    image = np.random.default_rng(1).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    # the documented default is JPEG at quality 95: the same quantization tables as Pillow's quality 95
    reference = io.BytesIO()
    Image.fromarray(image).save(reference, format="JPEG", quality=95)
    assert _jpeg(encode_image(image)).quantization == Image.open(reference).quantization
    # full-resolution colour (4:4:4, sampling 0) from quality 90 up, 4:2:0 (sampling 2) below
    assert JpegImagePlugin.get_sampling(_jpeg(encode_image(image, quality=90))) == 0
    assert JpegImagePlugin.get_sampling(_jpeg(encode_image(image, quality=89))) == 2


def test_png_is_lossless_for_any_memory_layout_and_other_encodings_are_refused() -> None:
    image = np.random.default_rng(2).integers(0, 256, (7, 9, 3), dtype=np.uint8)
    mirrored = image[:, ::-1]  # a strided view
    data = encode_image(mirrored, encoding="png")
    assert Image.open(io.BytesIO(data)).format == "PNG"
    np.testing.assert_array_equal(decode_image(data), mirrored)
    with pytest.raises(ValueError, match="^unknown encoding 'gif'$"):
        encode_image(image, encoding="gif")


def test_decode_image_gives_rgb_whatever_the_stored_mode() -> None:
    grey = io.BytesIO()
    Image.fromarray(np.array([[0, 128], [255, 7]], dtype=np.uint8), mode="L").save(grey, format="PNG")
    np.testing.assert_array_equal(decode_image(grey.getvalue()), np.repeat([[[0], [128]], [[255], [7]]], 3, axis=2))


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("a/b.jpg", None),
        ("b.jpg", None),
        ("a..b/c.d", None),
        ("", "empty or not a string"),
        (None, "empty or not a string"),
        (b"a.jpg", "empty or not a string"),
        ("a/\0b", "contains a NUL byte"),
        ("/a/b", "absolute"),
        ("a//b", "has an empty, '.' or '..' part"),
        ("a/./b", "has an empty, '.' or '..' part"),
        ("../b", "has an empty, '.' or '..' part"),
        ("a/", "has an empty, '.' or '..' part"),
    ],
)
def test_unsafe_path_reasons(path: object, reason: str | None) -> None:
    assert unsafe_path_reason(path) == reason


# -- runs of records (format 3) -----------------------------------------------------------------------
#   b"FPN" | u8 1 | u32 count | u32 CRC-32 of the 8 bytes before it and the table | u32 end[count] | records


def run_by_hand(parts: list[bytes], *, magic: bytes = b"FPN", version: int = 1) -> bytes:
    ends = struct.pack(f"<{len(parts)}I", *np.cumsum([len(part) for part in parts]).tolist())
    start = magic + bytes([version]) + struct.pack("<I", len(parts))
    return start + struct.pack("<I", zlib.crc32(start + ends)) + ends + b"".join(parts)


def test_run_bytes_follow_the_documented_layout() -> None:
    parts = [b"first", b"", b"third record"]
    run = run_by_hand(parts)
    assert struct.unpack_from("<I", run, 8)[0] >= 1 << 31  # a CRC past 2**31: written unsigned
    assert encode_run(parts) == run
    for data in (run, memoryview(run), bytearray(run)):
        assert [bytes(view) for view in run_records(data)] == parts
        assert [bytes(run_record(data, position)) for position in range(3)] == parts  # record 0 too
    for position in (3, -1):
        with pytest.raises(IndexError, match=rf"^run of 3 records has no record {position}$"):
            run_record(run, position)


def test_a_run_whose_table_ends_the_value_holds_empty_records() -> None:
    """The table may end exactly where the value ends (every record empty): not truncated."""
    for parts in ([b""], [b"", b""]):
        run = encode_run(parts)
        assert len(run) == 12 + 4 * len(parts) and run == run_by_hand(parts)
        assert [bytes(view) for view in run_records(run)] == parts
        assert bytes(run_record(run, len(parts) - 1)) == b""


def test_run_reader_refusals_name_the_problem_whole() -> None:
    run = encode_run([b"ab", b"cde"])  # prefix 12 + table 8 + records 5
    for read in (run_records, lambda data: run_record(data, 0)):
        with pytest.raises(RecordError, match=r"^run too short \(11 bytes\)$"):
            read(run[:11])
        for cut in (12, 19):  # the whole prefix (not "too short") but not the whole table
            with pytest.raises(RecordError, match="^run truncated inside its table$"):
                read(run[:cut])
        foreign = r"^not a facepipe run of version 1 \(bad magic or version\)$"
        with pytest.raises(RecordError, match=foreign):  # the magic alone wrong, the CRC made to fit
            read(run_by_hand([b"ab", b"cde"], magic=b"FPX"))
        with pytest.raises(RecordError, match=foreign):  # the version alone wrong
            read(run_by_hand([b"ab", b"cde"], version=2))
        bad = bytearray(run)
        bad[16] ^= 0x01  # the end of record 1
        with pytest.raises(RecordError, match=r"^run table checksum mismatch \(corrupt bytes\)$"):
            read(bytes(bad))
