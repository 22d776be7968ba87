"""Records against the byte layout their docstring documents, built independently here (tests/README.md).

    b"FPR" | u8 version | u32 header length | u32 CRC-32 | header (sorted-key compact JSON) | payload
"""

from __future__ import annotations

import json
import struct
import zlib

import pytest

from facepipe.io.records import RecordError, decode_header, decode_record, encode_record, payload_offset

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
