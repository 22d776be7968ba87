"""One sample as bytes: a versioned, self-describing record. No pickle.

Layout (little endian)::

    b"FPR" | u8 version | u32 header length | u32 CRC-32 | header (UTF-8 JSON, sorted keys) | payload (image bytes)

The CRC-32 (zlib's) covers every byte of the record but its own four: the magic, version and length
before it, then header and payload. It sits in the fixed-width prefix so that the training loader,
which slices the payload out without parsing the header, checks it for ~2 us per 6 KB record (< 1%
of a JPEG decode). Version 1 records (no checksum) are refused: their sets must be prepared again.

The header holds at least ``label``, ``path`` (relative to the raw root, POSIX), ``landmarks``
([5, 2] in the original image), ``box`` ([x1, y1, x2, y2]), ``score``, ``sha256`` of the source file
and ``encoding`` of the payload.
"""

from __future__ import annotations

import io
import json
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

import numpy as np
from PIL import Image

MAGIC = b"FPR"
VERSION = 2
_PREFIX = struct.Struct("<3sBII")
_CRC_AT = 8  # offset of the CRC field: the magic, version and header length come before it


class RecordError(ValueError):
    """Bytes that are not a facepipe record of a known version."""


@dataclass(frozen=True)
class Record:
    """A decoded record header plus its still-encoded image payload."""

    header: dict[str, Any]
    payload: bytes = field(repr=False)

    @property
    def label(self) -> int:
        return int(self.header["label"])

    @property
    def path(self) -> str:
        return str(self.header["path"])

    def image(self) -> np.ndarray:
        """The face as [H, W, 3] uint8 RGB."""
        return decode_image(self.payload)


def encode_record(header: dict[str, Any], payload: bytes) -> bytes:
    """Serialize ``header`` (JSON-able) and ``payload``; deterministic for equal inputs."""
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    start = _PREFIX.pack(MAGIC, VERSION, len(head), 0)[:_CRC_AT]
    crc = zlib.crc32(payload, zlib.crc32(head, zlib.crc32(start)))
    return start + struct.pack("<I", crc) + head + payload


def record_checksum(data: bytes | memoryview) -> int:
    """The CRC-32 of a record's bytes as :func:`encode_record` computes it (skipping the CRC field)."""
    view = memoryview(data)
    return zlib.crc32(view[_PREFIX.size :], zlib.crc32(view[:_CRC_AT]))


def payload_offset(data: bytes | memoryview, *, verify: bool = True) -> int:
    """Where the payload of a record starts, checking magic, version, length and (unless ``verify``
    is False: the caller checked it already) the CRC-32, without parsing the JSON header: the
    training hot path needs the image bytes only. Raises :class:`RecordError`."""
    if len(data) < _PREFIX.size:
        raise RecordError(f"record too short ({len(data)} bytes)")
    magic, version, head_len, crc = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise RecordError("not a facepipe record (bad magic)")
    if version != VERSION:
        older = " (written by an older facepipe: re-run prepare)" if version < VERSION else ""
        raise RecordError(f"record version {version} is not supported (this facepipe reads {VERSION}){older}")
    end = _PREFIX.size + head_len
    if end > len(data):
        raise RecordError("record truncated inside its header")
    if verify and record_checksum(data) != crc:
        raise RecordError("record checksum mismatch (corrupt bytes)")
    return end


def decode_header(data: bytes | memoryview, *, verify: bool = True) -> tuple[dict[str, Any], int]:
    """The header of a record and the offset at which its payload starts (checksum checked unless
    ``verify`` is False). Raises :class:`RecordError`."""
    end = payload_offset(data, verify=verify)
    try:
        header = json.loads(bytes(data[_PREFIX.size : end]))
    except ValueError as error:
        raise RecordError(f"record header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise RecordError("record header is not a JSON object")
    return header, end


def decode_record(data: bytes | memoryview, *, verify: bool = True) -> Record:
    """Header and payload of a record (checksum checked unless ``verify`` is False)."""
    header, start = decode_header(data, verify=verify)
    return Record(header=header, payload=bytes(data[start:]))


def unsafe_path_reason(path: object) -> str | None:
    """Why ``path`` may not name a file under a folder (None when it may): it must be a non-empty,
    relative POSIX path without ``..``, ``.`` or empty parts or NUL bytes. Record paths
    come from data, so nothing derives a file name from one without this check."""
    if not isinstance(path, str) or not path:
        return "empty or not a string"
    if "\0" in path:
        return "contains a NUL byte"
    if PurePosixPath(path).is_absolute():
        return "absolute"
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "has an empty, '.' or '..' part"
    return None


def encode_image(image: np.ndarray, *, encoding: str = "jpeg", quality: int = 95) -> bytes:
    """[H, W, 3] uint8 RGB -> JPEG or PNG bytes (deterministic for equal input)."""
    buffer = io.BytesIO()
    pil = Image.fromarray(np.ascontiguousarray(image), mode="RGB")
    if encoding == "jpeg":
        pil.save(buffer, format="JPEG", quality=quality, subsampling=0 if quality >= 90 else 2)
    elif encoding == "png":
        pil.save(buffer, format="PNG", compress_level=6)
    else:
        raise ValueError(f"unknown encoding {encoding!r}")
    return buffer.getvalue()


def decode_image(payload: bytes | memoryview) -> np.ndarray:
    """JPEG or PNG bytes -> [H, W, 3] uint8 RGB."""
    with Image.open(io.BytesIO(payload)) as pil:
        return np.asarray(pil.convert("RGB"))
