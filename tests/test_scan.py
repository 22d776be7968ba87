"""The raw-folder scan on hostile layouts: link loops, links out of RAW, unreadable folders, odd names.

Every entry below RAW becomes exactly one scan item: a file to decode, or a reject decided by the scan
(a folder's reject has a path ending in "/"). Permission problems are tested for real, by scanning as
another user (uid 65534) in a subprocess, since root reads everything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from facepipe.data.scan import escape_name, read_raw_file, scan_raw, unescape_path
from facepipe.errors import FacepipeError


def outcome(root: Path, **kw) -> dict[str, str | None]:
    """{path: reason} of a scan (None for a file to decode)."""
    return {item.path: item.reason for item in scan_raw(root, **kw)}


def touch(path: Path, data: bytes = b"x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_file_link_loop_is_a_reject(tmp_path):
    touch(tmp_path / "a" / "real.jpg")
    os.symlink("l2.jpg", tmp_path / "a" / "l1.jpg")
    os.symlink("l1.jpg", tmp_path / "a" / "l2.jpg")
    os.symlink("self.jpg", tmp_path / "a" / "self.jpg")
    assert outcome(tmp_path) == {
        "a/l1.jpg": "symlink_loop", "a/l2.jpg": "symlink_loop", "a/real.jpg": None, "a/self.jpg": "symlink_loop",
    }


def test_folder_link_to_an_ancestor_is_one_folder_reject(tmp_path):
    touch(tmp_path / "a" / "b" / "1.jpg")
    os.symlink("..", tmp_path / "a" / "up")
    os.symlink("../..", tmp_path / "a" / "b" / "top")
    os.symlink(".", tmp_path / "a" / "b" / "here")
    found = {i.path: (i.reason, i.detail) for i in scan_raw(tmp_path)}
    assert found == {
        "a/b/1.jpg": (None, ""),
        "a/b/here/": ("symlink_loop", "folder link leads back to RAW/a/b, a folder it lies in"),
        "a/b/top/": ("symlink_loop", "folder link leads back to RAW, a folder it lies in"),
        "a/up/": ("symlink_loop", "folder link leads back to RAW, a folder it lies in"),
    }


def test_links_inside_raw_are_followed(tmp_path):
    touch(tmp_path / "alice" / "1.jpg")
    touch(tmp_path / "bob" / "1.jpg", b"y")
    os.symlink("../bob/1.jpg", tmp_path / "alice" / "2.jpg")
    os.symlink("../bob", tmp_path / "alice" / "more")  # a sibling, not a loop: scanned by its own path
    assert outcome(tmp_path) == {"alice/1.jpg": None, "alice/2.jpg": None, "alice/more/": "duplicate", "bob/1.jpg": None}


def test_cross_linked_folders_are_read_once_each(tmp_path):
    """Folders that link to each other (no loop on any one path) would give every ordering of them as a
    path, n! of them: each real folder is read once, every other way to it is one folder reject."""
    names = [f"id{i}" for i in range(9)]
    for name in names:
        touch(tmp_path / name / "1.jpg", name.encode())
        for other in names:
            if other != name:
                os.symlink(f"../{other}", tmp_path / name / f"to-{other}")
    items = scan_raw(tmp_path)
    files = [i.path for i in items if i.reason is None]
    assert files == [f"{name}/1.jpg" for name in names]
    assert len(items) == 9 + 9 * 8 and {i.reason for i in items if i.reason} == {"duplicate"}
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    for name in ("x", "y"):
        touch(outside / name / "1.jpg", name.encode())
    os.symlink(outside / "y", outside / "x" / "to-y")
    os.symlink(outside / "x", outside / "y" / "to-x")
    os.symlink(outside / "x", tmp_path / "id0" / "ext-x")
    os.symlink(outside / "y", tmp_path / "id0" / "ext-y")
    followed = outcome(tmp_path, follow_symlinks=True)  # outside RAW: the first way in (in path order) reads it
    assert followed["id0/ext-x/1.jpg"] is None and followed["id0/ext-x/to-y/1.jpg"] is None
    assert followed["id0/ext-y/"] == "duplicate" and followed["id0/ext-x/to-y/to-x/"] == "symlink_loop"


def test_links_out_of_raw_are_refused_unless_followed(tmp_path):
    raw, outside = tmp_path / "raw", tmp_path / "outside"
    touch(outside / "secret.jpg")
    touch(outside / "faces" / "1.jpg")
    touch(raw / "alice" / "1.jpg")
    os.symlink(outside / "secret.jpg", raw / "alice" / "2.jpg")
    os.symlink("../../outside/faces", raw / "alice" / "more")
    os.symlink(outside / "faces", raw / "carol")
    os.symlink(outside / "missing.jpg", raw / "alice" / "3.jpg")
    refused = scan_raw(raw)
    assert {i.path: i.reason for i in refused} == {
        "alice/1.jpg": None, "alice/2.jpg": "outside_raw_root", "alice/3.jpg": "outside_raw_root",
        "alice/more/": "outside_raw_root", "carol/": "outside_raw_root",
    }
    assert all(str(tmp_path) not in i.detail for i in refused)  # rejects.jsonl holds no absolute paths
    assert outcome(raw, follow_symlinks=True) == {
        "alice/1.jpg": None, "alice/2.jpg": None, "alice/3.jpg": "io_error", "alice/more/1.jpg": None,
        "carol/": "duplicate",  # the same outside folder, already read through alice/more
    }


def test_a_raw_root_that_is_a_link_is_the_root(tmp_path):
    touch(tmp_path / "real" / "alice" / "1.jpg")
    os.symlink(tmp_path / "real", tmp_path / "raw")
    os.symlink(tmp_path / "raw" / "alice" / "1.jpg", tmp_path / "real" / "alice" / "2.jpg")  # through the root link
    assert outcome(tmp_path / "raw") == {"alice/1.jpg": None, "alice/2.jpg": None}


def test_dangling_links_and_special_files_are_rejects(tmp_path):
    touch(tmp_path / "a" / "1.jpg")
    os.symlink("nowhere.jpg", tmp_path / "a" / "dangling.jpg")
    os.mkfifo(tmp_path / "a" / "pipe.jpg")  # reading it would block forever
    assert outcome(tmp_path) == {"a/1.jpg": None, "a/dangling.jpg": "io_error", "a/pipe.jpg": "not_a_file"}
    with pytest.raises(OSError):
        read_raw_file(tmp_path, "a/pipe.jpg")  # and the reader refuses it too, without blocking


def test_non_utf8_names_are_escaped_losslessly_and_read_back(tmp_path):
    root = os.fsencode(tmp_path)
    names = [b"jos\xe9/caf\xe9.jpg", b"jos\xe9/plain.jpg", b"a\\b/x\\xe9.jpg", "zo\u00eb/\u00e9t\u00e9.jpg".encode()]
    for index, name in enumerate(names):
        os.makedirs(os.path.dirname(os.path.join(root, name)), exist_ok=True)
        with open(os.path.join(root, name), "wb") as handle:
            handle.write(bytes([index]))
    found = scan_raw(tmp_path)
    assert [(i.path, i.identity) for i in found] == [
        ("a\\\\b/x\\\\xe9.jpg", "a\\\\b"),  # a literal backslash is doubled, so the escaping stays one-to-one
        ("jos\\xe9/caf\\xe9.jpg", "jos\\xe9"),
        ("jos\\xe9/plain.jpg", "jos\\xe9"),
        ("zo\u00eb/\u00e9t\u00e9.jpg", "zo\u00eb"),  # valid UTF-8 stays as it is
    ]
    for item in found:
        item.path.encode("utf-8")  # writable as JSON / UTF-8 text
        name = unescape_path(item.path)
        assert name in names
        assert read_raw_file(tmp_path, item.path) == bytes([names.index(name)])
    assert scan_raw(tmp_path) == found  # stable across runs


@pytest.mark.parametrize("name", [b"plain", b"caf\xe9", b"\\", b"\\x41", b"\xff\xfe", b"\xc3", "\u00e9".encode(), b"a\\\\b"])
def test_escaping_round_trips(name):
    escaped = escape_name(name)
    escaped.encode("utf-8")
    assert unescape_path(escaped) == name


def test_an_unreadable_raw_root_is_a_clear_error(tmp_path, monkeypatch):
    # fault injection at the one listing call: root reads every folder, whatever its mode
    import facepipe.data.scan as scan

    def denied(path):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(scan, "_list_dir", denied)
    with pytest.raises(FacepipeError, match="cannot read the raw folder"):
        scan_raw(tmp_path)


_AS_NOBODY = """
import json, os, sys
from facepipe.data.scan import read_raw_file, scan_raw  # imported as root: Python's own files may be private
os.setgid(65534); os.setuid(65534)

def read(path):
    try:
        return read_raw_file(sys.argv[1], path).decode()
    except OSError as error:
        return type(error).__name__
print(json.dumps([[i.path, i.reason, i.detail, i.reason or read(i.path)] for i in scan_raw(sys.argv[1])]))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to another uid")
def test_unreadable_folders_are_folder_rejects_as_another_user():
    """A real permission problem: the scan runs as uid 65534 on a tree with a folder it cannot list."""
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "raw"
        touch(raw / "alice" / "1.jpg", b"a1")
        touch(raw / "alice" / "private" / "2.jpg")
        touch(raw / "bob" / "1.jpg", b"b1")
        touch(raw / "noexec" / "1.jpg")
        touch(raw / "bob" / "locked.jpg").chmod(0o000)
        for path in [Path(tmp), *raw.rglob("*")]:
            if path.name != "locked.jpg":
                path.chmod(0o755 if path.is_dir() else 0o644)
        (raw / "alice" / "private").chmod(0o000)
        (raw / "noexec").chmod(0o644)  # listable names, but no entry can be reached
        result = subprocess.run(
            [sys.executable, "-c", _AS_NOBODY, str(raw)], capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stderr
        found = {path: (reason, detail, read) for path, reason, detail, read in json.loads(result.stdout)}
    # each entry exactly once: readable files, one reject line for the folder, reads that fail as the
    # worker will see them (its OSError becomes an io_error reject)
    assert found == {
        "alice/1.jpg": (None, "", "a1"),
        "alice/private/": ("io_error", "folder cannot be read: PermissionError: Permission denied", "io_error"),
        "bob/1.jpg": (None, "", "b1"),
        "bob/locked.jpg": (None, "", "PermissionError"),
        "noexec/1.jpg": found["noexec/1.jpg"],
    }
    assert found["noexec/1.jpg"][2] in ("io_error", "PermissionError")
