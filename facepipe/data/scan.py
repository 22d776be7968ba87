"""Find every entry under a raw root, in a deterministic order, with its identity or why it is rejected.

Every entry below RAW becomes exactly one :class:`ScanItem`: a file for the workers to read, or a
reject the scan decides (its ``reason`` set). A folder's reject stands for everything in it; its
path ends in ``/``. Nothing raises for a layout, only for an unreadable RAW itself.

Names are read as bytes and written as text that is always valid UTF-8, losslessly: valid UTF-8
stays as it is, a byte that is not part of valid UTF-8 becomes ``\\xHH`` (two lowercase hex digits,
Python's ``backslashreplace``), and a literal backslash becomes ``\\\\`` so that the escaping stays
one-to-one. ``caf\\xe9.jpg`` in rejects.jsonl or labels.json is the Latin-1 file name ``café.jpg``;
:func:`unescape_path` gives the bytes back.

Symbolic links: a link whose target lies inside RAW is followed; one that leads outside RAW is
rejected as ``outside_raw_root`` unless ``follow_symlinks`` (``prepare.follow_symlinks``). A link
that never resolves, or a folder link back to a folder it lies in, is a ``symlink_loop``. A folder is
read once: a folder link to a folder inside RAW (read by its own path), or to one outside RAW that an
earlier link (in path order) already read, is one ``duplicate`` reject for the link.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from facepipe.data.decode import IMAGE_EXTENSIONS
from facepipe.errors import FacepipeError

#: Reasons the scan gives (the workers give the others: see README, "The shard set").
SCAN_REASONS = ("io_error", "not_a_file", "outside_raw_root", "symlink_loop")

_ESCAPES = re.compile(r"(\\\\|\\x[0-9a-f]{2})")

Parts = tuple[bytes, ...]
Ancestors = dict[tuple[int, int], Parts]  # (st_dev, st_ino) of each folder above an entry -> its parts


@dataclass(frozen=True)
class ScanItem:
    """One scanned entry. ``path``: escaped POSIX path relative to the raw root (``/`` at the end for a
    folder); ``identity``: its first folder, escaped (None at the top level); ``reason`` and ``detail``:
    set when the scan rejects it (the workers never see it then)."""

    path: str
    identity: str | None
    reason: str | None = None
    detail: str = ""


def escape_name(name: bytes) -> str:
    """A file or folder name (bytes) as valid UTF-8 text: ``\\`` -> ``\\\\``, invalid bytes -> ``\\xHH``."""
    return name.replace(b"\\", b"\\\\").decode("utf-8", "backslashreplace")


def unescape_path(path: str) -> bytes:
    """The exact bytes of an escaped name or relative path (inverse of :func:`escape_name`)."""
    out = bytearray()
    for index, piece in enumerate(_ESCAPES.split(path)):
        if index % 2 == 0:
            out += piece.encode("utf-8")
        else:
            out += b"\\" if piece == "\\\\" else bytes([int(piece[2:], 16)])
    return bytes(out)


class FileTooLarge(Exception):
    """A file of ``size`` bytes, more than the reader's limit: refused before any byte is read."""

    def __init__(self, size: int) -> None:
        super().__init__(f"{size} bytes")
        self.size = size


def read_raw_file(root: str | Path, path: str, *, max_bytes: int | None = None) -> bytes:
    """The bytes of the scanned file ``path`` (escaped, relative to ``root``). Raises OSError, also
    for anything that is not a regular file (a FIFO is opened without blocking and refused), and
    :class:`FileTooLarge` above ``max_bytes``."""
    fd = os.open(os.path.join(os.fsencode(root), unescape_path(path)), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with open(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if max_bytes is not None and info.st_size > max_bytes:
            raise FileTooLarge(info.st_size)
        return handle.read()


def looks_like_image(path: str) -> bool:
    return os.path.splitext(path)[1].lower() in IMAGE_EXTENSIONS


def _list_dir(path: bytes) -> list[os.DirEntry[bytes]]:
    """The entries of one folder; the scan's only listing call (tests inject failures here)."""
    with os.scandir(path) as entries:
        return list(entries)


def _describe(error: OSError) -> str:
    return f"{type(error).__name__}: {error.strerror or error}"


def scan_raw(root: str | Path, *, follow_symlinks: bool = False) -> list[ScanItem]:
    """Every entry below ``root``, sorted by the bytes of its path's components (so ``a/b`` comes
    before ``a-b/c``, and the order is the same whatever the names' encoding).

    Regular files and links to them come back without a reason; so do files directly in ``root``
    (the workers reject them as ``outside_identity_folder``). Raises FacepipeError only when
    ``root`` itself cannot be listed.
    """
    top = os.fsencode(root)
    try:
        info = os.stat(top)
        entries = _list_dir(top)
    except OSError as error:
        raise FacepipeError(f"cannot read the raw folder {root}: {_describe(error)}") from None
    real_top = os.path.realpath(top)
    found: list[tuple[Parts, str | None, str]] = []
    # Folders are entered depth first in the bytes order of their names, so "the first way in" is the
    # first in path order, whatever order the file system lists them in.
    entered: set[tuple[int, int]] = set()
    stack: list[tuple[Parts, Iterator[os.DirEntry[bytes]], Ancestors]] = [
        ((), _in_order(entries), {(info.st_dev, info.st_ino): ()})
    ]
    while stack:
        parts, pending, ancestors = stack[-1]
        entry = next(pending, None)
        if entry is None:
            stack.pop()
            continue
        here = (*parts, entry.name)
        try:
            kind, detail, key = _classify(
                entry, ancestors, real_top=real_top, follow_symlinks=follow_symlinks, entered=entered
            )
        except OSError as error:
            kind, detail, key = "io_error", _describe(error), None
        if kind != "folder":
            found.append((here + (b"",) if key else here, None if kind == "file" else kind, detail))
            continue
        try:
            inner = _list_dir(entry.path)
        except OSError as error:
            found.append((here + (b"",), "io_error", f"folder cannot be read: {_describe(error)}"))
            continue
        entered.add(key)
        stack.append((here, _in_order(inner), {**ancestors, key: here}))
    found.sort()
    return [_item(parts, reason, detail) for parts, reason, detail in found]


def _in_order(entries: list[os.DirEntry[bytes]]) -> Iterator[os.DirEntry[bytes]]:
    return iter(sorted(entries, key=lambda entry: entry.name))


def _item(parts: Parts, reason: str | None, detail: str) -> ScanItem:
    # a folder's parts end with b"" (its path then ends in "/"), which also sorts it before its own files
    names = [escape_name(name) for name in parts]
    return ScanItem("/".join(names), names[0] if len(names) > 1 else None, reason, detail)


def _classify(
    entry: os.DirEntry[bytes],
    ancestors: Ancestors,
    *,
    real_top: bytes,
    follow_symlinks: bool,
    entered: set[tuple[int, int]],
) -> tuple[str, str, tuple[int, int] | None]:
    """``("file" | "folder" | reason, detail, key)`` for one entry; ``key`` is (st_dev, st_ino) when it
    leads to a folder (the folder's reject path then ends in "/"). ``entered``: the folders read so far.
    May raise OSError (-> io_error)."""
    target = None
    if entry.is_symlink():
        target = os.path.realpath(entry.path)
        if not follow_symlinks and os.path.commonpath([target, real_top]) != real_top:
            key = (0, 0) if os.path.isdir(target) else None  # a folder's reject reads "name/"
            return "outside_raw_root", "the link leads outside the raw folder (prepare.follow_symlinks is off)", key
        try:
            info = os.stat(entry.path)
        except OSError as error:
            if error.errno == errno.ELOOP:
                return "symlink_loop", "the link leads back to itself", None
            return "io_error", f"dangling link: {_describe(error)}", None
    elif entry.is_dir(follow_symlinks=False):
        info = entry.stat(follow_symlinks=False)
    elif entry.is_file(follow_symlinks=False):
        return "file", "", None  # from the folder listing alone: no stat per file
    else:
        info = entry.stat(follow_symlinks=False)
    if stat.S_ISDIR(info.st_mode):
        key = (info.st_dev, info.st_ino)
        ancestor = ancestors.get(key)
        if ancestor is not None:
            where = "/".join(["RAW", *(escape_name(name) for name in ancestor)])
            return "symlink_loop", f"folder link leads back to {where}, a folder it lies in", key
        if target is not None:
            # Folders that link to each other would otherwise be read once per path through them (n! paths
            # for n cross-linked folders): a folder is read once, by its own path when it lies in RAW.
            if os.path.commonpath([target, real_top]) == real_top:
                where = "/".join(["RAW", *(escape_name(name) for name in os.path.relpath(target, real_top).split(b"/"))])
                return "duplicate", f"folder link to {where}, which is read by its own path", key
            if key in entered:
                return "duplicate", "folder link to a folder outside RAW that an earlier link already read", key
        return "folder", "", key
    if stat.S_ISREG(info.st_mode):
        return "file", "", None
    return "not_a_file", f"not a regular file ({_file_type(info.st_mode)})", None


def _file_type(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "unknown type"


def file_stats(raw: Path, items: Iterable[ScanItem]) -> dict[str, tuple[int, int]]:
    """{scan path: (size, mtime_ns)} of every file the workers will read, taken before they read it
    (a file that changes after its stat is seen as changed by the next update, never missed)."""
    root = os.fsencode(raw)
    stats = {}
    for item in items:
        if item.reason is None:
            try:
                info = os.stat(os.path.join(root, unescape_path(item.path)))
            except OSError:
                continue  # the worker reports it (io_error)
            stats[item.path] = (info.st_size, info.st_mtime_ns)
    return stats
