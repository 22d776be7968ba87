"""Find every file under a raw root, in a deterministic order, with its identity."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from facepipe.data.decode import IMAGE_EXTENSIONS


@dataclass(frozen=True)
class ScanItem:
    """One scanned file. ``path`` is POSIX, relative to the raw root; ``identity`` its first folder."""

    path: str
    identity: str | None


def scan_raw(root: str | Path) -> list[ScanItem]:
    """Every regular file below ``root`` (symlinks followed), sorted by relative path.

    Files directly in ``root`` have no identity (they become rejects). Sorting is by the path's
    components so that ``a/b`` comes before ``a-b/c`` regardless of the separator's byte value.
    """
    root = Path(root)
    found: list[tuple[str, ...]] = []
    stack = [()]
    while stack:
        parts = stack.pop()
        with os.scandir(root.joinpath(*parts)) as entries:
            for entry in entries:
                if entry.is_dir():
                    stack.append((*parts, entry.name))
                elif entry.is_file() or entry.is_symlink():
                    # a dangling link is still an input: it becomes an io_error reject, not a silent skip
                    found.append((*parts, entry.name))
    found.sort()
    return [ScanItem("/".join(parts), parts[0] if len(parts) > 1 else None) for parts in found]


def looks_like_image(path: str) -> bool:
    return os.path.splitext(path)[1].lower() in IMAGE_EXTENSIONS
