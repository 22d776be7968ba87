"""An embedding folder: what ``facepipe embed`` writes and ``search`` / ``load_embeddings`` read.

::

    OUT/embed.json              the commit: format, model (runtime, file sha256, ...), the faces
                                params, settings, counts, the parts in row order, index.jsonl's sha256
    OUT/parts/part-NNNNN.npy    float32 [faces, E]: the rows of the part's photos, in order
    OUT/parts/part-NNNNN.jsonl  line 1 {"part", "settings", "faces", "embeddings_sha256"}, then one
                                line per photo: {"path", "sha256", "size", "mtime_ns"} and either
                                "faces": [{"box", "landmarks", "score"}] or "reason", "detail"
    OUT/index.jsonl             one line per embedding row: {"path", "identity", "face", "box",
                                "landmarks", "score", "sha256"}
    OUT/rejects.jsonl           one {"path", "reason", "detail"} per photo without an embedding
    OUT/report.json             counts and timings of the last run

Every file is written to a temporary name and renamed. A part's ``.npy`` is written before its
``.jsonl``, which records the ``.npy``'s sha256: a part whose ``.jsonl`` exists and matches is
complete. ``embed.json`` is written last and is the only thing a reader trusts: parts it does not
list (a killed run's) are reused by the next run when they are exactly what it would write, and
removed once a new ``embed.json`` no longer needs them.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from facepipe.errors import FacepipeError
from facepipe.io.atomic import OutputKind, atomic_write, json_key_file
from facepipe.io.manifest import dumps, read_jsonl

FORMAT = "facepipe-embeddings"
VERSION = 1
MANIFEST = "embed.json"
INDEX = "index.jsonl"
REJECTS = "rejects.jsonl"
REPORT = "report.json"
PARTS = "parts"
_PART = re.compile(r"^part-(\d{5,})\.(npy|jsonl)$")

#: What ``embed`` writes: an existing OUT holding anything else is refused, never written into.
EMBEDDING_FOLDER = OutputKind(
    "embedding folder",
    patterns=(
        MANIFEST, INDEX, REJECTS, REPORT, f".{MANIFEST}.tmp-*", f".{INDEX}.tmp-*", f".{REJECTS}.tmp-*", f".{REPORT}.tmp-*",
        f"{PARTS}/part-*.npy", f"{PARTS}/part-*.jsonl", f"{PARTS}/.part-*.tmp-*",
    ),  # fmt: skip
    identify=lambda folder: json_key_file(MANIFEST, format=FORMAT)(folder) if (folder / MANIFEST).exists() else (folder / PARTS).is_dir(),
)  # without embed.json (a first run killed before its commit): the parts/ folder every run makes first


def part_name(number: int) -> str:
    return f"part-{number:05d}"


def part_number(name: str) -> int:
    return int(name.removeprefix("part-"))


@dataclass(frozen=True)
class Part:
    """One part as read back: its header line, its photos' lines, and its embeddings."""

    name: str
    header: dict[str, Any]
    files: list[dict[str, Any]]
    embeddings: np.ndarray


def _npy_bytes(embeddings: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(embeddings, dtype=np.float32), allow_pickle=False)
    return buffer.getvalue()


def write_part(folder: Path, name: str, settings: str, files: Sequence[dict[str, Any]], embeddings: np.ndarray) -> None:
    """Write one part: the ``.npy``, then the ``.jsonl`` that names its sha256 (the part's commit)."""
    faces = sum(len(entry.get("faces", ())) for entry in files)
    if faces != len(embeddings):
        raise RuntimeError(f"{name}: {faces} faces listed, {len(embeddings)} embeddings")
    data = _npy_bytes(embeddings)
    atomic_write(folder / PARTS / f"{name}.npy", lambda handle: handle.write(data))
    header = {"part": name, "settings": settings, "faces": faces, "embeddings_sha256": hashlib.sha256(data).hexdigest()}
    text = "".join(json.dumps(line, sort_keys=True) + "\n" for line in (header, *files))
    atomic_write(folder / PARTS / f"{name}.jsonl", lambda handle: handle.write(text.encode()))


def read_part_lines(folder: Path, name: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(header, photo lines) of a part this run wrote or kept (no check of its embeddings)."""
    lines = list(read_jsonl(folder / PARTS / f"{name}.jsonl"))
    return lines[0], lines[1:]


def read_part(folder: Path, name: str) -> Part | None:
    """The complete part ``name`` of ``folder``, or None when it is missing, partial or corrupt."""
    lines_path, npy_path = folder / PARTS / f"{name}.jsonl", folder / PARTS / f"{name}.npy"
    try:
        lines = list(read_jsonl(lines_path))
        data = npy_path.read_bytes()
    except (OSError, ValueError, FacepipeError):
        return None
    if not lines or not isinstance(lines[0], dict) or lines[0].get("part") != name:
        return None
    header = lines[0]
    if hashlib.sha256(data).hexdigest() != header.get("embeddings_sha256"):
        return None
    try:  # bytes that hash right but are no plain array (crafted): unusable, never unpickled
        embeddings = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError):
        return None
    if embeddings.dtype != np.float32 or embeddings.ndim != 2:
        return None
    return Part(name, header, lines[1:], embeddings)


def index_lines(files: Iterable[dict[str, Any]]) -> Iterable[dict[str, Any]]:
    """index.jsonl's lines of parts' photo lines: one per face, in row order."""
    for entry in files:
        for number, face in enumerate(entry.get("faces", ())):
            yield {
                "path": entry["path"],
                "identity": identity_of(entry["path"]),
                "face": number,
                **face,
                "sha256": entry["sha256"],
            }


def identity_of(path: str) -> str | None:
    """The identity folder of a scan path (its first component), None for a file at RAW's top."""
    head, slash, _ = path.partition("/")
    return head if slash else None


def write_jsonl(path: Path, lines: Iterable[dict[str, Any]]) -> str:
    """Write ``lines`` as JSONL atomically; returns the file's sha256."""
    digest = hashlib.sha256()

    def write(handle: Any) -> None:
        for line in lines:
            data = (json.dumps(line, sort_keys=True) + "\n").encode()
            digest.update(data)
            handle.write(data)

    atomic_write(path, write)
    return digest.hexdigest()


def commit(folder: Path, manifest: dict[str, Any]) -> None:
    """Write ``embed.json`` (the commit), then remove the part files it does not list."""
    atomic_write(folder / MANIFEST, lambda handle: handle.write(dumps(manifest).encode()))
    listed = {entry["name"] for entry in manifest["parts"]}
    for path in sorted((folder / PARTS).glob("part-*")):
        match = _PART.match(path.name)
        if match and path.stem not in listed and path.is_file() and not path.is_symlink():
            path.unlink()


def read_manifest(folder: str | Path) -> dict[str, Any]:
    """embed.json of an embedding folder; a one-line FacepipeError when it is not one."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        raise FacepipeError(f"not an embedding folder (no {MANIFEST}; facepipe embed writes it): {folder}")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise FacepipeError(f"{path}: unreadable ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise FacepipeError(f"{path}: not a facepipe embedding manifest")
    if manifest.get("version") != VERSION:
        raise FacepipeError(f"{path}: version {manifest.get('version')!r}; this facepipe reads version {VERSION}")
    return manifest


@dataclass(frozen=True)
class Embeddings:
    """An embedding folder in memory: ``matrix`` [N, E] float32 unit rows, ``rows`` its index lines
    (path, identity, face, box, landmarks, score, sha256), ``manifest`` embed.json."""

    matrix: np.ndarray
    rows: list[dict[str, Any]]
    manifest: dict[str, Any]

    @property
    def keys(self) -> list[str]:
        """Each row's identity: its identity folder, or its path for a photo at RAW's top."""
        return [row["identity"] if row["identity"] is not None else row["path"] for row in self.rows]


def load_embeddings(folder: str | Path) -> Embeddings:
    """Read a committed embedding folder, checking every part and the index against embed.json."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    index_path = folder / INDEX
    try:
        if hashlib.sha256(index_path.read_bytes()).hexdigest() != manifest["index_sha256"]:
            raise FacepipeError(f"{index_path}: differs from the one {MANIFEST} records (an interrupted run: run embed again)")
    except OSError as error:
        raise FacepipeError(f"{index_path}: unreadable ({error.strerror})") from None
    blocks = []
    for entry in manifest["parts"]:
        part = read_part(folder, entry["name"])
        if part is None or part.header["embeddings_sha256"] != entry["sha256"]:
            raise FacepipeError(f"{folder / PARTS / entry['name']}: missing or corrupt (run embed again)")
        blocks.append(part.embeddings)
    size = manifest["model"]["embedding_size"]
    matrix = np.concatenate(blocks) if blocks else np.zeros((0, size), np.float32)
    rows = list(read_jsonl(index_path))
    if len(rows) != len(matrix):
        raise FacepipeError(f"{index_path}: {len(rows)} lines for {len(matrix)} embeddings")
    return Embeddings(matrix.reshape(len(rows), size), rows, manifest)
