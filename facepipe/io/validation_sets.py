"""The insightface ``.bin`` validation sets a shard set carries: ``OUT/validation/<name>.bin``.

``facepipe import`` of an insightface folder brings along the ``.bin`` files that lie beside its
``train.rec`` (``lfw.bin``, ``cfp_fp.bin``, ``agedb_30.bin`` …), so the set holds everything the
folder offers for training and validation, and ``train`` validates on them (``train.validation``).
Each file is read with the restricted reader (:mod:`facepipe.io.insightface_bin`) before it is
copied: a set carries only files that load as plain data. The manifest lists each one under
:data:`MANIFEST_KEY` as ``{"file", "bytes", "sha256", "num_pairs"}``, sorted by file name (no
paths, no times: the manifest stays deterministic). They are checked as shards are: the cheap checks
(each listed file present with its size, nothing unlisted in the folder) before a run reads the set,
the sha256 and a restricted read of every file in ``verify``.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from facepipe.errors import FacepipeError, ForeignFileError
from facepipe.io.insightface_bin import load_bin_set
from facepipe.io.shards import sha256_file

#: The folder of a shard set that holds its validation sets.
VALIDATION_DIR = "validation"
#: The manifest key that lists them.
MANIFEST_KEY = "validation_sets"
#: What the folder may hold (:class:`facepipe.io.atomic.OutputKind` patterns of a shard set).
PATTERN = f"{VALIDATION_DIR}/*.bin"
SUFFIX = ".bin"


@dataclass(frozen=True)
class BinFile:
    """A ``.bin`` set to read, and the sha256 its bytes must have (None: given by path, listed nowhere)."""

    path: Path
    sha256: str | None = None


def bin_files_beside(folder: Path) -> list[Path]:
    """Every ``*.bin`` in ``folder`` but hidden files and folders, sorted by name (links are followed
    when read; one that leads nowhere is an error then, not skipped)."""
    return sorted(p for p in folder.iterdir() if p.suffix == SUFFIX and not p.name.startswith(".") and not p.is_dir())


def check_bin_files(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """The manifest entry of each file, once the restricted reader has read it as a well-formed set.

    Raises a one-line :class:`ForeignFileError` naming the first file that is unreadable, hostile,
    damaged or not a validation set; callers check before they write anything."""
    entries = []
    for path in paths:
        if not path.name.isprintable():  # surrogates of undecodable bytes: no UTF-8 name for the manifest
            raise ForeignFileError(f"{path!r}: a validation set's file name must be printable UTF-8 text")
        try:
            data = path.read_bytes()
        except OSError as error:
            raise ForeignFileError(f"{path}: cannot be read ({error.strerror})") from None
        bin_set = load_bin_set(data, path=path)
        digest = hashlib.sha256(data).hexdigest()
        entries.append({"file": path.name, "bytes": len(data), "sha256": digest, "num_pairs": bin_set.num_pairs})
    return entries


def copy_bin_files(paths: Sequence[Path], entries: Sequence[Mapping[str, Any]], root: Path) -> None:
    """Copy each checked file (``entries`` from :func:`check_bin_files`) into ``root/validation/``.
    A copy that does not hash to what was checked (the file changed in between) raises FacepipeError."""
    folder = root / VALIDATION_DIR
    folder.mkdir(exist_ok=True)
    for path, entry in zip(paths, entries, strict=True):
        target = folder / entry["file"]
        shutil.copyfile(path, target)
        if sha256_file(target) != entry["sha256"]:
            raise FacepipeError(f"{path} changed while it was imported: run the import again")


def listed_bin_files(root: Path, manifest: Mapping[str, Any]) -> list[BinFile]:
    """The sets the manifest lists, as files to read with their sha256 (empty: the set carries none)."""
    return [BinFile(root / VALIDATION_DIR / e["file"], e["sha256"]) for e in manifest.get(MANIFEST_KEY, [])]


def _well_formed(entries: Any) -> bool:
    """A list of entries whose file names stay inside the folder (a manifest is input like any other)."""
    if not isinstance(entries, list):
        return False
    fields = {"file": str, "bytes": int, "sha256": str, "num_pairs": int}
    return all(
        isinstance(e, dict) and all(isinstance(e.get(k), t) for k, t in fields.items())
        and e["file"].endswith(SUFFIX) and "/" not in e["file"] and "\\" not in e["file"] and not e["file"].startswith(".")
        for e in entries
    ) and len({e["file"] for e in entries}) == len(entries)


def bin_set_problems(root: Path, manifest: Mapping[str, Any]) -> list[str]:
    """The cheap checks (no file is read): the list is well formed, each listed file is there with
    its size, and the folder holds nothing unlisted (a set validates on what the manifest vouches for)."""
    entries = manifest.get(MANIFEST_KEY, [])
    if not _well_formed(entries):
        return [f"manifest {MANIFEST_KEY}: not a list of {{file, bytes, sha256, num_pairs}} of distinct .bin names"]
    problems = []
    for entry in entries:
        path = root / VALIDATION_DIR / entry["file"]
        if not path.is_file():
            problems.append(f"{VALIDATION_DIR}/{entry['file']}: missing")
        elif path.stat().st_size != entry["bytes"]:
            problems.append(f"{VALIDATION_DIR}/{entry['file']}: {path.stat().st_size} bytes, manifest says {entry['bytes']}")
    folder = root / VALIDATION_DIR
    listed = {entry["file"] for entry in entries}
    if folder.is_dir():
        problems += [f"{VALIDATION_DIR}/{p.name}: not listed in the manifest" for p in sorted(folder.iterdir()) if p.name not in listed]
    return problems


def verify_bin_sets(root: Path, manifest: Mapping[str, Any]) -> list[str]:
    """Beyond :func:`bin_set_problems`: each listed file that is there with its size hashes to its
    sha256, reads as a well-formed set with the restricted reader, and holds its number of pairs."""
    entries = manifest.get(MANIFEST_KEY, [])
    if not _well_formed(entries):
        return []  # bin_set_problems names it
    problems = []
    for entry in entries:
        path, name = root / VALIDATION_DIR / entry["file"], f"{VALIDATION_DIR}/{entry['file']}"
        if not path.is_file() or path.stat().st_size != entry["bytes"]:
            continue  # bin_set_problems names it
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            problems.append(f"{name}: sha256 differs from the manifest")
            continue
        try:
            pairs = load_bin_set(data, path=Path(name)).num_pairs
        except ForeignFileError as error:
            problems.append(str(error))
            continue
        if pairs != entry["num_pairs"]:
            problems.append(f"{name}: {pairs} pairs, manifest says {entry['num_pairs']}")
    return problems
