"""One sample as bytes: a versioned, self-describing record. No pickle.

Layout (little endian)::

    b"FPR" | u8 version | u32 header length | header (UTF-8 JSON, sorted keys) | payload (image bytes)

The header holds at least ``label``, ``path`` (relative to the raw root, POSIX), ``landmarks``
([5, 2] in the original image), ``box`` ([x1, y1, x2, y2]), ``score``, ``sha256`` of the source file
and ``encoding`` of the payload.
"""

from __future__ import annotations

import io
import json
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

MAGIC = b"FPR"
VERSION = 1
_PREFIX = struct.Struct("<3sBI")


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
    return _PREFIX.pack(MAGIC, VERSION, len(head)) + head + payload


def payload_offset(data: bytes | memoryview) -> int:
    """Where the payload of a record starts, checking magic, version and length but not parsing the
    JSON header: the training hot path needs the image bytes only."""
    if len(data) < _PREFIX.size:
        raise RecordError(f"record too short ({len(data)} bytes)")
    magic, version, head_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise RecordError("not a facepipe record (bad magic)")
    if version != VERSION:
        raise RecordError(f"record version {version} is not supported (this facepipe reads {VERSION})")
    end = _PREFIX.size + head_len
    if end > len(data):
        raise RecordError("record truncated inside its header")
    return end


def decode_header(data: bytes | memoryview) -> tuple[dict[str, Any], int]:
    """The header of a record and the offset at which its payload starts."""
    end = payload_offset(data)
    return json.loads(bytes(data[_PREFIX.size : end])), end


def decode_record(data: bytes | memoryview) -> Record:
    header, start = decode_header(data)
    return Record(header=header, payload=bytes(data[start:]))


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
