"""insightface / MXNet RecordIO packs (``train.rec`` + ``train.idx``), read and written without MXNet.

The framing (dmlc-core ``recordio``), little endian::

    u32 magic 0xced7230a | u32 lrec | data (len bytes) | zero padding to a multiple of 4

``lrec`` holds the part's length in its lower 29 bits and a continuation flag in its upper 3 bits:
0 a whole record, 1 its first part, 2 a middle part, 3 its last part. dmlc's writer splits a record
wherever the magic word appears at a 4-aligned offset of the data: the word itself is dropped and
the reader puts it back between parts. ``train.idx`` is text, one ``key<TAB>byte offset`` a line.

Every record of an insightface pack is an image record (MXNet's ``recordio.pack``)::

    IRHeader "<IfQQ": u32 flag | f32 label | u64 id | u64 id2 | [flag x f32 label array] | payload

With ``flag > 0`` the label is the float32 array after the header (and the f32 field is unused).
Packs built by insightface's tools start with a header record (key 0, flag > 0): its label
``[a, b]`` says images have keys ``1 .. a-1`` and identity records keys ``a .. b-1``, each with the
label ``[first, end)``: the key range of that identity's images.

Every number read here is bounded by what the file can hold before anything is allocated: a part's
length by the bytes left in the file, an index's keys and offsets by int64, property.txt's values by
int32. Labels and keys travel as float32: integers from :data:`FLOAT32_EXACT` on are rounded.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

MAGIC = 0xCED7230A
_MAGIC_BYTES = struct.pack("<I", MAGIC)
_FRAME = struct.Struct("<II")
_LENGTH_MASK = (1 << 29) - 1
_IR = struct.Struct("<IfQQ")  # MXNet's _IR_FORMAT "IfQQ": 24 bytes, no padding with native alignment either
WHOLE, FIRST, MIDDLE, LAST = 0, 1, 2, 3
#: float32 holds every integer below this exactly (2^24); a label from here on may be a rounded one.
FLOAT32_EXACT = 1 << 24
_INT64_END = 1 << 63
_INT32_END = 1 << 31


class RecordIOError(ValueError):
    """Bytes that are not a sound RecordIO record; ``truncated`` when the file ends inside it."""

    def __init__(self, message: str, *, truncated: bool = False) -> None:
        super().__init__(message)
        self.truncated = truncated


@dataclass(frozen=True)
class IRHeader:
    """MXNet's image-record header. ``label``: a float, or a tuple of floats (stored after the header,
    ``flag`` of them). ``id``/``id2``: free 64-bit fields (insightface writes the key into ``id``)."""

    flag: int
    label: float | tuple[float, ...]
    id: int = 0
    id2: int = 0

    @property
    def first_label(self) -> float:
        """The class label as insightface's readers take it: the float, or the array's first value."""
        return self.label[0] if isinstance(self.label, tuple) else self.label


def pack(header: IRHeader, payload: bytes) -> bytes:
    """An image record's bytes, as ``mxnet.recordio.pack``: a tuple label sets ``flag`` to its length."""
    if isinstance(header.label, tuple):
        labels = np.asarray(header.label, dtype="<f4")
        return _IR.pack(labels.size, 0.0, header.id, header.id2) + labels.tobytes() + payload
    return _IR.pack(0, float(header.label), header.id, header.id2) + payload


def unpack(data: bytes) -> tuple[IRHeader, bytes]:
    """(header, payload) of an image record, as ``mxnet.recordio.unpack``. Raises RecordIOError."""
    if len(data) < _IR.size:
        raise RecordIOError(f"record of {len(data)} bytes is shorter than its {_IR.size}-byte IRHeader")
    flag, label, id_, id2 = _IR.unpack_from(data)
    if flag == 0:
        return IRHeader(0, float(label), id_, id2), data[_IR.size :]
    end = _IR.size + 4 * flag
    if end > len(data):
        raise RecordIOError(f"IRHeader flag {flag} promises {flag} labels, the record ends after {len(data)} bytes")
    labels = np.frombuffer(data, dtype="<f4", count=flag, offset=_IR.size)
    return IRHeader(flag, tuple(float(v) for v in labels), id_, id2), data[end:]


def frame(data: bytes) -> bytes:
    """``data`` framed as dmlc's ``RecordIOWriter::WriteRecord`` frames it (split at 4-aligned magic words)."""
    if len(data) > _LENGTH_MASK:
        raise ValueError(f"a RecordIO record holds under 2^29 bytes, got {len(data)}")
    parts, start = [], 0
    for at in range(0, len(data) - 3, 4):
        if data[at : at + 4] == _MAGIC_BYTES:
            parts.append(data[start:at])
            start = at + 4
    parts.append(data[start:])
    out = bytearray()
    for number, part in enumerate(parts):
        if len(parts) == 1:
            flag = WHOLE
        else:
            flag = FIRST if number == 0 else LAST if number == len(parts) - 1 else MIDDLE
        out += _FRAME.pack(MAGIC, (flag << 29) | len(part)) + part + bytes(-len(part) % 4)
    return bytes(out)


def read_record(handle: IO[bytes], offset: int) -> bytes:
    """The record starting at byte ``offset`` of a .rec file, its parts joined. Raises RecordIOError
    (``truncated`` set when the file ends inside the record)."""
    size = os.fstat(handle.fileno()).st_size
    handle.seek(offset)
    out = bytearray()
    expect_first = True
    while True:
        head = handle.read(_FRAME.size)
        if len(head) < _FRAME.size:
            raise RecordIOError(f"file ends inside the frame header at offset {handle.tell() - len(head)}", truncated=True)
        magic, lrec = _FRAME.unpack(head)
        if magic != MAGIC:
            raise RecordIOError(f"bad magic 0x{magic:08x} at offset {handle.tell() - _FRAME.size}")
        flag, length = lrec >> 29, lrec & _LENGTH_MASK
        if flag > LAST or (flag in (WHOLE, FIRST)) != expect_first:
            raise RecordIOError(f"continuation flag {flag} out of sequence at offset {handle.tell() - _FRAME.size}")
        short = length - (size - handle.tell())
        if short > 0:  # checked before reading: a forged length would otherwise be allocated first
            raise RecordIOError(f"file ends {short} bytes short of the part at offset {offset}", truncated=True)
        data = handle.read(length + (-length % 4))
        out += data[:length]
        if flag in (WHOLE, LAST):
            return bytes(out)
        out += _MAGIC_BYTES
        expect_first = False


def read_index(path: str | os.PathLike[str]) -> np.ndarray:
    """[N, 2] int64 ``(key, offset)`` of every line of a .idx file, in file order (blank lines
    skipped). Parsed in blocks, so a 5M-line index costs 80 MB. Raises RecordIOError naming the line."""
    blocks, line_number = [], 1
    with open(path, encoding="ascii", errors="replace") as handle:
        while lines := handle.readlines(_INDEX_BLOCK_BYTES):
            try:
                block = np.array([line.split() for line in lines if line.strip()], dtype=np.int64).reshape(-1, 2)
                if (block < 0).any() or len(block) != sum(1 for line in lines if line.strip()):
                    raise ValueError
            except (ValueError, OverflowError):
                raise _bad_line(path, lines, line_number) from None
            blocks.append(block)
            line_number += len(lines)
    return np.concatenate(blocks) if blocks else np.zeros((0, 2), dtype=np.int64)


_INDEX_BLOCK_BYTES = 8 << 20


def _bad_line(path: str | os.PathLike[str], lines: list[str], first_number: int) -> RecordIOError:
    """The error naming the first line of ``lines`` (the block that failed to parse) that is neither
    blank nor ``key<TAB>offset``: two whole numbers below 2^63, the only lines int64 parses."""
    number, line = next((n, line) for n, line in enumerate(lines, start=first_number) if not _index_line(line))
    return RecordIOError(f"{path} line {number} is not 'key<TAB>offset' (two whole numbers below 2^63): {line.strip()[:60]!r}")


def _index_line(line: str) -> bool:
    fields = line.split()
    return not fields or (len(fields) == 2 and all(field.isdigit() and int(field) < _INT64_END for field in fields))


def scan_offsets(path: str | os.PathLike[str], *, gaps: list[tuple[int, int]] | None = None) -> Iterator[int]:
    """Offsets of the records of a .rec file read front to back (for a pack without its .idx).

    A record that cannot be framed is yielded too (its reader rejects it); the scan then goes on at
    the next 4-aligned magic word that starts a whole record or a first part, as dmlc's own reader
    resynchronises (its writer never leaves an aligned magic word inside a part). Each stretch skipped
    so is appended to ``gaps`` as ``(offset, bytes)``, from the unframed record to the next one."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        offset = 0
        while offset < size:
            yield offset
            try:
                read_record(handle, offset)
                offset = handle.tell()
            except RecordIOError:
                start, offset = offset, _next_record_start(handle, offset + 4, size)
                if gaps is not None:
                    gaps.append((start, offset - start))


_SCAN_BLOCK_BYTES = 1 << 20


def _next_record_start(handle: IO[bytes], offset: int, size: int) -> int:
    """The first 4-aligned offset from ``offset`` (aligned) holding the magic word and an ``lrec`` of
    a whole record or a first part; ``size`` when there is none."""
    while offset < size:
        handle.seek(offset)
        block = handle.read(_SCAN_BLOCK_BYTES + 4)  # 4 more: the lrec after a magic word at the end
        words = np.frombuffer(block, dtype="<u4", count=len(block) // 4)
        for at in np.flatnonzero(words[:-1] == MAGIC).tolist():
            if words[at + 1] >> 29 in (WHOLE, FIRST):
                return offset + 4 * at
        offset += _SCAN_BLOCK_BYTES
    return size


class RecordIOWriter:
    """Writes records to ``rec`` and their ``key<TAB>offset`` lines to ``idx`` (MXNet's
    ``MXIndexedRecordIO`` in write mode). A context manager; nothing is renamed or synced here."""

    def __init__(self, rec: str | os.PathLike[str], idx: str | os.PathLike[str]) -> None:
        self._rec = open(rec, "wb")
        self._idx = open(idx, "w", encoding="ascii")

    def __enter__(self) -> RecordIOWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def write(self, key: int, data: bytes) -> None:
        """Append the record ``data`` under ``key``."""
        self._idx.write(f"{key}\t{self._rec.tell()}\n")
        self._rec.write(frame(data))

    def close(self) -> None:
        self._rec.close()
        self._idx.close()


def read_property(path: Path) -> tuple[int, int, int] | None:
    """``(num_classes, height, width)`` of insightface's ``property.txt`` (``"K,112,112"``); None when
    absent. Raises RecordIOError when it does not parse."""
    if not path.is_file():
        return None
    text = path.read_text(encoding="ascii", errors="replace").strip()
    try:
        num_classes, height, width = values = tuple(int(v) for v in text.split(","))
        if not all(0 < value < _INT32_END for value in values):
            raise ValueError
    except ValueError:
        raise RecordIOError(f"{path} is not 'num_classes,height,width' (three whole numbers in 1..2^31-1): {text[:60]!r}") from None
    return num_classes, height, width
