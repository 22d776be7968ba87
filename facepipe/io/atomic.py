"""Stage outputs that appear all at once, and never at the expense of what facepipe did not write.

A stage writes into a temporary sibling ``.OUT.partial-PID`` and renames it into place at the end, so a
crashed or killed run never leaves an ``OUT`` that looks complete. Before that it checks:

- ``OUT`` and each input are apart (neither lies inside the other, symlinks followed), so replacing
  ``OUT`` can never remove an input;
- an existing ``OUT`` is empty or positively an output of the same kind (:class:`OutputKind`: every
  file in it is one that kind writes, and its key file says so); anything else is refused.

Replacing renames the old ``OUT`` to ``.OUT.old-PID``, the new folder to ``OUT``, then deletes the old one.
A run killed between those renames leaves ``OUT`` missing and the old set aside: the next run of any
stage writing ``OUT`` puts it back (and removes leftovers of runs whose process is gone). Both kinds of
sibling hold :data:`MARKER`, naming the PID, from before they get their name until they lose it: a
folder is taken for such a leftover only when its PID is gone *and* it holds that marker, never by
its name alone (a user's ``.OUT.partial-999999`` is left alone, or refused when in the way). Single files
(checkpoints, weights) are written to ``.NAME.tmp-PID`` and renamed; :func:`remove_stale_temporaries`
removes those a killed run left.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import IO, Any

from facepipe.errors import FacepipeError

log = logging.getLogger("facepipe.io")

PARTIAL = ".partial-"
OLD = ".old-"
TMP = ".tmp-"
_STALE_TMP = re.compile(r"^\..+\.tmp-(\d+)$")
#: The file facepipe writes into its temporary and set-aside folders: what makes one recognisably ours.
MARKER = ".facepipe-temporary"
_MARKER_FORMAT = "facepipe-temporary-folder"


@dataclass(frozen=True)
class OutputKind:
    """What one kind of facepipe output folder holds, so that an existing one is positively recognised.

    ``patterns``: ``fnmatch`` patterns of the relative POSIX paths of every file it may hold
    (folders are implied). ``identify``: given a folder whose files all match, True when its key
    file says it is this kind (e.g. a manifest's format); None when the file names alone say so.
    """

    name: str
    patterns: tuple[str, ...]
    identify: Callable[[Path], bool] | None = None

    def foreign(self, folder: Path) -> str | None:
        """Why ``folder`` is not an output of this kind (None: it is one, or empty)."""
        for rel, plain in _files(folder):
            if rel == MARKER and _marked_by(folder) is not None:
                continue  # a publish killed just after its rename left it
            if not plain:
                return f"it holds {rel}, which is not a plain file or folder"
            if not any(fnmatchcase(rel, pattern) for pattern in self.patterns):
                return f"it holds {rel}, which a facepipe {self.name} does not"
        if any(folder.iterdir()) and self.identify is not None and not self.identify(folder):
            return f"its files are not those of a facepipe {self.name}"
        return None


def _files(folder: Path) -> Iterator[tuple[str, bool]]:
    """(relative POSIX path, is a plain file) of every file under ``folder``; a symlink, socket or
    device is not plain (facepipe writes none, so a folder holding one is never its output)."""
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False, onerror=_raise):
        here = Path(dirpath)
        for name in [*dirnames, *filenames]:
            mode = os.lstat(here / name).st_mode
            if not stat.S_ISDIR(mode):
                yield (here / name).relative_to(folder).as_posix(), stat.S_ISREG(mode)


def _raise(error: OSError) -> None:
    raise FacepipeError(f"cannot read {error.filename}: {error.strerror}")


def json_key_file(name: str, *keys: str, **values: Any) -> Callable[[Path], bool]:
    """An ``identify`` predicate: ``name`` is a JSON object holding ``keys`` and the given ``values``."""

    def identify(folder: Path) -> bool:
        try:
            data = json.loads((folder / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        return (
            isinstance(data, dict)
            and all(key in data for key in keys)
            and all(data.get(key) == value for key, value in values.items())
        )

    return identify


def check_apart(out: str | Path, sources: Mapping[str, str | Path]) -> None:
    """Refuse an output that is, holds or lies inside one of ``sources`` ({what: path}); links followed."""
    out_path = Path(out)
    target = out_path.resolve()
    for what, source in sources.items():
        resolved = Path(source).resolve()
        if resolved.is_relative_to(target):
            raise FacepipeError(f"the {what} {source} lies inside the output {out_path}; writing it would remove it")
        if target.is_relative_to(resolved):
            raise FacepipeError(f"the output {out_path} lies inside the {what} {source}")


def check_replaceable(out: str | Path, kind: OutputKind | None) -> None:
    """Refuse an existing ``out`` unless it is an empty folder or positively a ``kind`` output.

    ``kind`` None: only an absent or empty folder may be written.
    """
    out = Path(out)
    if out.is_symlink():  # replacing it would swap the link for a folder, not write where it points
        raise FacepipeError(f"output is a symbolic link; give the folder it points to: {out}")
    if out.exists() and not out.is_dir():
        raise FacepipeError(f"output exists and is not a folder: {out}")
    if not out.exists():
        return
    try:
        empty = not any(out.iterdir())
    except OSError as error:
        raise FacepipeError(f"cannot read the output folder {out}: {error.strerror}") from None
    if empty:
        return
    why = "it is not empty" if kind is None else kind.foreign(out)
    if why is not None:
        raise FacepipeError(f"refusing to replace {out}: {why}")


def check_output(out: str | Path, *, kind: OutputKind | None, sources: Mapping[str, str | Path] | None = None) -> None:
    """Everything a stage checks of its output before it starts work; raises FacepipeError.

    Also recovers an output left aside by a run killed while publishing it (see the module doc).
    """
    check_apart(out, sources or {})
    recover_interrupted(Path(out), kind)
    check_replaceable(out, kind)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def mark(folder: Path) -> None:
    """Write :data:`MARKER` naming this process into ``folder`` (a temporary or set-aside folder)."""
    (folder / MARKER).write_text(json.dumps({"format": _MARKER_FORMAT, "pid": os.getpid()}), encoding="utf-8")


def _marked_by(folder: Path) -> int | None:
    """The PID that :data:`MARKER` in ``folder`` names, else None (no marker, a link, other content)."""
    marker = folder / MARKER
    try:
        if marker.is_symlink() or not marker.is_file() or marker.stat().st_size > 256:
            return None
        data = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or set(data) != {"format", "pid"} or data["format"] != _MARKER_FORMAT:
        return None
    pid = data["pid"]
    return pid if isinstance(pid, int) and not isinstance(pid, bool) else None


def _unmark(folder: Path) -> None:
    if _marked_by(folder) is not None:
        (folder / MARKER).unlink()


def _dead_leftovers(out: Path, marker: str) -> list[Path]:
    """Siblings ``.OUT<marker>PID`` whose process is gone (the ones of live runs are theirs) and that
    hold :data:`MARKER` naming that PID; a folder of that name without it is left alone, with a warning.

    This process's own PID counts as gone: it has not started on ``out`` yet when this runs, so such a
    sibling is a killed run's whose PID came back (in a container every run may get the same PID).
    """
    found = []
    for path in sorted(out.parent.glob(f".{out.name}{marker}*")):
        pid = path.name[len(out.name) + 1 + len(marker) :]
        if not pid.isdigit() or (int(pid) != os.getpid() and _pid_alive(int(pid))):
            continue
        if not path.is_symlink() and path.is_dir() and _marked_by(path) == int(pid):
            found.append(path)
        else:
            log.warning("leaving %s: it is not a temporary folder facepipe wrote (no %s naming PID %s)", path, MARKER, pid)
    return found


def remove_stale_partials(out: Path) -> None:
    """Delete temporary siblings of ``out`` left by killed runs (their process is gone, their marker ours)."""
    for partial in _dead_leftovers(out, PARTIAL):
        log.info("removing %s left by an interrupted run", partial)
        shutil.rmtree(partial, ignore_errors=True)


def recover_interrupted(out: Path, kind: OutputKind | None) -> None:
    """Undo a publish killed between its renames: restore ``.OUT.old-PID`` (ours by its marker) when
    ``out`` is missing, else delete it (a later publish finished); drop a marker a killed publish left in ``out``."""
    for old in _dead_leftovers(out, OLD):
        if not out.exists():
            log.warning("restoring %s from %s (a run was killed while replacing it)", out, old.name)
            old.rename(out)
        else:
            log.info("removing %s left by an interrupted run", old)
            shutil.rmtree(old, ignore_errors=True)
    if out.is_dir() and not out.is_symlink():
        pid = _marked_by(out)
        if pid is not None and (pid == os.getpid() or not _pid_alive(pid)):
            _unmark(out)


def _set_aside_name(out: Path) -> Path:
    return out.parent / f".{out.name}{OLD}{os.getpid()}"


def _in_the_way(old: Path, out: Path) -> FacepipeError:
    return FacepipeError(f"{old} is in the way of replacing {out} and is not recognisably facepipe's: move it")


def _between_renames() -> None:
    """Fault-injection point of :func:`publish` (tests replace it to kill the run right here)."""


def publish(tmp: Path, out: Path, *, kind: OutputKind | None = None) -> None:
    """Move the finished folder ``tmp`` to ``out``, replacing an older ``out`` (checked again) only now."""
    old = None
    if out.exists():
        check_replaceable(out, kind)
        old = _set_aside_name(out)
        if os.path.lexists(old):  # recover_interrupted put back or removed every one of ours: not ours
            raise _in_the_way(old, out)
        mark(out)  # before the rename: the set-aside folder is recognisably ours from its first moment
        try:
            out.rename(old)
        except BaseException:
            _unmark(out)
            raise
    try:
        _between_renames()
        tmp.rename(out)
    except BaseException:
        if old is not None and not out.exists():
            old.rename(out)
            _unmark(out)
        raise
    _unmark(out)  # tmp's marker
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_output_dir(out: str | Path, *, kind: OutputKind | None = None) -> Iterator[Path]:
    """Yield an empty temporary folder; on success it becomes ``out``, on any exception it is removed.

    An existing ``out`` is replaced only when it is empty or positively a ``kind`` output (``kind``
    None: only when empty). Raises FacepipeError when ``out`` may not be replaced or its parent
    cannot be written.
    """
    out = Path(out)
    check_output(out, kind=kind)
    tmp = out.parent / f".{out.name}{PARTIAL}{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(out)
        if os.path.lexists(tmp):  # remove_stale_partials removed ours (this PID counts as gone)
            raise _in_the_way(tmp, out)
        tmp.mkdir()
        mark(tmp)
    except OSError as error:
        raise FacepipeError(f"cannot write the output next to {out}: {error.strerror}") from None
    try:
        yield tmp
        publish(tmp, out, kind=kind)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def temporary_name(path: Path) -> Path:
    """``.NAME.tmp-PID`` beside ``path``: where :func:`atomic_write` writes before renaming."""
    return path.with_name(f".{path.name}{TMP}{os.getpid()}")


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], None]) -> Path:
    """``write(handle)`` into a temporary sibling, fsync, then ``os.replace`` onto ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(path)
    try:
        with open(tmp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def remove_stale_temporaries(directory: str | Path) -> list[Path]:
    """Delete ``.NAME.tmp-PID`` files in ``directory`` whose process is gone; returns them."""
    directory = Path(directory)
    removed = []
    if not directory.is_dir():
        return removed
    for path in sorted(directory.iterdir()):
        match = _STALE_TMP.match(path.name)
        if match and path.is_file() and not path.is_symlink() and not _pid_alive(int(match.group(1))):
            log.info("removing %s left by an interrupted run", path)
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed
