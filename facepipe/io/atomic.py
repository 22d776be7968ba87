"""Stage outputs that appear all at once: write into a temporary sibling, rename into place at the end.

A crashed or killed run leaves only a hidden ``.OUT.partial-PID`` folder (removed by the next run once
its process is gone), never an ``OUT`` that looks complete. An older ``OUT`` is replaced only after
the new one is finished.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from facepipe.errors import FacepipeError

log = logging.getLogger("facepipe.io")

PARTIAL = ".partial-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_partials(out: Path) -> None:
    """Delete temporary siblings of ``out`` left by killed runs (their process is gone)."""
    for partial in out.parent.glob(f".{out.name}{PARTIAL}*"):
        pid = partial.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            log.info("removing %s left by an interrupted run", partial)
            shutil.rmtree(partial, ignore_errors=True)


def publish(tmp: Path, out: Path) -> None:
    """Move the finished folder ``tmp`` to ``out``, replacing an older ``out`` only now."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_output_dir(out: str | Path) -> Iterator[Path]:
    """Yield an empty temporary folder; on success it becomes ``out``, on any exception it is removed.

    Raises FacepipeError when ``out`` exists as a file or its parent cannot be written.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FacepipeError(f"output exists and is not a folder: {out}")
    tmp = out.parent / f".{out.name}{PARTIAL}{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(out)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as error:
        raise FacepipeError(f"cannot write the output next to {out}: {error.strerror}") from None
    try:
        yield tmp
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
