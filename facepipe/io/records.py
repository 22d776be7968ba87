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

A *run* packs consecutive records into one stored value (shard format 3), so that a ~10 KB record
no longer rounds up to whole 4 KiB LMDB overflow pages on its own::

    b"FPN" | u8 run version | u32 count | u32 CRC-32 | u32 end[count] | record 0 | record 1 | ...

``end[i]`` is where record ``i`` ends, counted from the first record's first byte (record ``i``
starts at ``end[i - 1]``, record 0 at 0). The CRC-32 covers the 8 bytes before it and the ends, so a
damaged table is named as such; each record keeps its own CRC-32 for its bytes. Reading one record
touches the table and that record's bytes only.
"""

from __future__ import annotations

import io
import json
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

import numpy as np
from PIL import Image

MAGIC = b"FPR"
VERSION = 2
_PREFIX = struct.Struct("<3sBII")
_CRC_AT = 8  # offset of the CRC field: the magic, version and header length come before it


RUN_MAGIC = b"FPN"
RUN_VERSION = 1
_RUN_PREFIX = struct.Struct("<3sBII")
_RUN_CRC_AT = 8


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


def encode_run(records: Sequence[bytes]) -> bytes:
    """Pack encoded records (at least one) into one run value; deterministic for equal inputs."""
    if not records:
        raise ValueError("a run holds at least one record")
    ends = np.cumsum([len(record) for record in records], dtype=np.int64)
    if ends[-1] >= 1 << 32:
        raise ValueError(f"a run of {len(records)} records is {int(ends[-1])} bytes: at most 4 GiB")
    table = ends.astype("<u4").tobytes()
    start = _RUN_PREFIX.pack(RUN_MAGIC, RUN_VERSION, len(records), 0)[:_RUN_CRC_AT]
    crc = zlib.crc32(table, zlib.crc32(start))
    return b"".join([start, struct.pack("<I", crc), table, *records])


def _run_table(view: memoryview) -> tuple[int, int]:
    """(offset of the first record, number of records) of a run, after checking its prefix and the
    CRC-32 of its table, which covers the count too (raises :class:`RecordError`)."""
    if len(view) < _RUN_PREFIX.size:
        raise RecordError(f"run too short ({len(view)} bytes)")
    magic, version, count, crc = _RUN_PREFIX.unpack_from(view)
    if magic != RUN_MAGIC or version != RUN_VERSION:
        raise RecordError(f"not a facepipe run of version {RUN_VERSION} (bad magic or version)")
    first = _RUN_PREFIX.size + 4 * count
    if first > len(view):
        raise RecordError("run truncated inside its table")
    if zlib.crc32(view[_RUN_PREFIX.size : first], zlib.crc32(view[:_RUN_CRC_AT])) != crc:
        raise RecordError("run table checksum mismatch (corrupt bytes)")
    return first, count


def _run_slice(view: memoryview, first: int, position: int) -> memoryview:
    start = first + (struct.unpack_from("<I", view, _RUN_PREFIX.size + 4 * (position - 1))[0] if position else 0)
    end = first + struct.unpack_from("<I", view, _RUN_PREFIX.size + 4 * position)[0]
    if not start <= end <= len(view):
        raise RecordError("run table does not match the run's bytes (corrupt run)")
    return view[start:end]


def run_record(data: bytes | memoryview, position: int) -> memoryview:
    """Record ``position`` of a run, as a view into ``data`` (no copy). The run's table is checked
    (:class:`RecordError`); the record's own CRC-32 is the caller's to check. IndexError when the run
    holds no record ``position``."""
    view = memoryview(data)
    first, count = _run_table(view)
    if not 0 <= position < count:
        raise IndexError(f"run of {count} records has no record {position}")
    return _run_slice(view, first, position)


def run_records(data: bytes | memoryview) -> list[memoryview]:
    """Every record of a run, as views into ``data`` (see :func:`run_record`)."""
    view = memoryview(data)
    first, count = _run_table(view)
    return [_run_slice(view, first, position) for position in range(count)]


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
