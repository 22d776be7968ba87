"""No raw folder layout crashes prepare: link loops, links out of RAW, unreadable folders, special
files and names that are not UTF-8 all end as accounted rejects, and the run completes.

Two levels: a property test over random trees (scan, the chunk worker with a stand-in detector, and
the real writer: accounting, rejects.jsonl, labels.json), and one real prepare run on real photos.
Unreadable folders come from fault injection at the scan's one listing call (``scan._list_dir``):
the tests run as root, who reads everything (tests/test_scan.py covers real permissions as another uid).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import facepipe.data.extract as extract
import facepipe.data.scan as scan
from facepipe.config import PrepareParams
from facepipe.data.scan import scan_raw, unescape_path
from facepipe.io import ShardSet
from facepipe.stages import prepare
from facepipe.stages.inspect import verify
from rawdata import TEST_PARAMS, StandInDetector, astronaut, hopper, in_process, jpeg_bytes, save, variant

SET_FILES = ("manifest.json", "labels.json", "rejects.jsonl")


def deny(folders: set[bytes]):
    """Fault injection: listing any of ``folders`` (absolute, bytes) fails as it would without permission."""
    real = scan._list_dir

    def list_dir(path: bytes):
        if os.path.realpath(path) in folders:
            raise PermissionError(13, "Permission denied")
        return real(path)

    return list_dir


def read_set(out: Path) -> tuple[list[str], list[dict], dict]:
    shard_set = ShardSet(out)
    records = [shard_set.record(i).path for i in range(len(shard_set))]
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text(encoding="utf-8").splitlines()]
    return records, rejects, shard_set.manifest


# -- property: random hostile trees ---------------------------------------------------------------

NAMES = st.sampled_from([b"a", b"b.jpg", b"caf\xe9.jpg", b"\xff", b"x\\y", b"x\\xe9", "\u00e9t\u00e9".encode(), b"sp ace.png"])
KINDS = st.sampled_from(["face", "junk", "empty", "folder", "folder", "fifo", "locked", "link", "link", "link"])
LINKS = st.sampled_from(["self", "parent", "root", "outside_file", "outside_dir", "missing", "sibling", "chain"])


@st.composite
def trees(draw, depth: int = 0) -> dict[bytes, object]:
    """{name: kind | subtree | ("link", target)} for one folder; depth-limited."""
    entries: dict[bytes, object] = {}
    for name in draw(st.lists(NAMES, max_size=4 if depth < 2 else 2, unique=True)):
        kind = draw(KINDS)
        if kind in ("folder", "locked"):
            kind = (kind, draw(trees(depth + 1))) if depth < 2 else "face"
        elif kind == "link":
            kind = ("link", draw(LINKS))
        entries[name] = kind
    return entries


def face_png(size: int = 64) -> bytes:
    image = np.zeros((size, size, 3), np.uint8)
    image[..., 1] = np.arange(size, dtype=np.uint8)[:, None] * 3
    return jpeg_bytes(image, quality=90)


def build(folder: bytes, tree: dict, *, root: bytes, outside: bytes, locked: set[bytes], counter: list[int]) -> None:
    """Make ``tree`` in ``folder``. Links may point at RAW (``root``), at ``outside`` or anywhere in
    between: nothing else may lie beside RAW, since ``..`` at the top leads there."""
    os.makedirs(folder, exist_ok=True)
    for name, kind in tree.items():
        path = os.path.join(folder, name)
        counter[0] += 1
        if kind == "face":
            # distinct bytes per file (no duplicates): a face image the stand-in detector accepts
            with open(path, "wb") as handle:
                handle.write(face_png(64 + counter[0] % 64))
        elif kind in ("junk", "empty"):
            with open(path, "wb") as handle:
                handle.write(b"junk %d" % counter[0] if kind == "junk" else b"")
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind[0] in ("folder", "locked"):
            build(path, kind[1], root=root, outside=outside, locked=locked, counter=counter)
            if kind[0] == "locked":
                locked.add(os.path.realpath(path))
        else:
            target = {
                "self": name, "parent": b"..", "root": root, "outside_file": os.path.join(outside, b"secret.jpg"),
                "outside_dir": outside, "missing": b"nowhere.jpg", "sibling": b"b.jpg", "chain": b"a",
            }[kind[1]]
            os.symlink(target, path)


@settings(max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(tree=trees(), follow=st.booleans())
def test_random_hostile_trees_are_fully_accounted(tree, follow):
    params = PrepareParams(**{**TEST_PARAMS, "chunk_size": 3, "follow_symlinks": follow})
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as tmp_out, pytest.MonkeyPatch.context() as patch:
        base = os.fsencode(tmp)
        outside = os.path.join(base, b"outside")
        os.makedirs(os.path.join(outside, b"faces"))
        with open(os.path.join(outside, b"secret.jpg"), "wb") as handle:
            handle.write(face_png(200))
        raw, locked = os.path.join(base, b"raw"), set()
        build(raw, {b"anchor": ("folder", {b"1.jpg": "face"}), **tree}, root=raw, outside=outside, locked=locked, counter=[0])
        patch.setattr(scan, "_list_dir", deny(locked))
        patch.setattr(extract, "get_detector", lambda *a, **k: StandInDetector())
        raw_path, out = Path(os.fsdecode(raw)), Path(tmp_out) / "out"

        report = prepare.run(params, raw_path, out, submit=in_process(raw_path, params), progress=False)

        items = scan_raw(raw_path, follow_symlinks=follow)
        records, rejects, manifest = read_set(out)
        paths = records + [r["path"] for r in rejects]
        # every scanned path exactly once, in a shard or in rejects.jsonl, and nothing else
        assert sorted(paths) == sorted(item.path for item in items) and len(set(paths)) == len(paths)
        counts = manifest["counts"]
        assert counts == report["counts"] == {"scanned": len(items), "accepted": len(records), "rejected": len(rejects)}
        real_raw = os.path.realpath(raw)
        for item in items:
            name = os.path.join(raw, unescape_path(item.path.rstrip("/")))
            assert os.path.lexists(name)  # the escaping round-trips to the real name
            if not follow and item.path in records:
                assert os.path.realpath(name).startswith(real_raw + b"/")  # nothing read from outside RAW
        for folder in locked:
            rel = os.path.relpath(folder, real_raw)
            if not rel.startswith(b".."):
                assert not any(unescape_path(p).startswith(rel + b"/") for p in records)
        labels = json.loads((out / "labels.json").read_text(encoding="utf-8"))
        assert sorted(labels) == sorted({p.split("/", 1)[0] for p in records})
        assert "anchor/1.jpg" in records


# -- one real prepare run on a small hostile tree of real photos ------------------------------------


def header_lies_jpeg(image: np.ndarray) -> bytes:
    """A JPEG whose frame header claims twice the rows its data holds (libjpeg fills the rest with grey)."""
    data = bytearray(jpeg_bytes(image, quality=90))
    at = data.find(b"\xff\xc0")
    height = int.from_bytes(data[at + 5 : at + 7], "big")
    data[at + 5 : at + 7] = (2 * height).to_bytes(2, "big")
    return bytes(data)


def make_hostile_raw(base: Path) -> tuple[Path, dict[str, str], set[bytes]]:
    """Real faces plus every hostile entry; returns RAW, {path: expected reason} and the folders to deny."""
    raw, outside = base / "raw", base / "outside"
    save(hopper(), raw / "hopper" / "0001.jpg", quality=92)
    save(variant(astronaut(), angle=5), raw / "astro" / "0001.jpg", quality=90)
    save(variant(hopper(), angle=-7), outside / "hopper_elsewhere.jpg", quality=91)
    rawb = os.fsencode(raw)
    os.makedirs(os.path.join(rawb, b"jos\xe9"))
    shutil.copy(raw / "astro" / "0001.jpg", os.path.join(rawb, b"jos\xe9", b"caf\xe9.jpg"))  # a cross-identity duplicate
    save(variant(astronaut(), angle=-8, scale=0.9), Path(os.fsdecode(os.path.join(rawb, b"jos\xe9", b"0002.jpg"))), quality=89)
    save(variant(hopper(), scale=0.9, pad=20), Path(os.fsdecode(os.path.join(rawb, b"hopper", b"f\xfcr.jpg"))), quality=93)
    os.symlink("l2.jpg", raw / "hopper" / "l1.jpg")
    os.symlink("l1.jpg", raw / "hopper" / "l2.jpg")
    os.symlink("..", raw / "astro" / "up")
    os.symlink(outside / "hopper_elsewhere.jpg", raw / "hopper" / "elsewhere.jpg")
    os.symlink(outside, raw / "outsider")
    save(hopper(), raw / "astro" / "private" / "0001.jpg", quality=80)
    os.mkfifo(raw / "astro" / "pipe.jpg")
    (raw / "astro" / "lies.jpg").write_bytes(header_lies_jpeg(astronaut()))
    expected = {
        "astro/lies.jpg": "unreadable",
        "astro/pipe.jpg": "not_a_file",
        "astro/private/": "io_error",
        "astro/up/": "symlink_loop",
        "hopper/elsewhere.jpg": "outside_raw_root",
        "hopper/l1.jpg": "symlink_loop",
        "hopper/l2.jpg": "symlink_loop",
        "jos\\xe9/caf\\xe9.jpg": "duplicate",
        "outsider/": "outside_raw_root",
    }
    return raw, expected, {os.path.realpath(os.fsencode(raw / "astro" / "private"))}


def test_prepare_completes_on_a_hostile_tree_of_real_photos(tmp_path, monkeypatch):
    raw, expected, locked = make_hostile_raw(tmp_path)
    monkeypatch.setattr(scan, "_list_dir", deny(locked))
    params = PrepareParams(**TEST_PARAMS)
    outs = [tmp_path / "one", tmp_path / "two"]
    for out in outs:
        prepare.run(params, raw, out, submit=in_process(raw, params), progress=False)
    records, rejects, manifest = read_set(outs[0])
    assert {r["path"]: r["reason"] for r in rejects} == expected
    assert sorted(records) == ["astro/0001.jpg", "hopper/0001.jpg", "hopper/f\\xfcr.jpg", "jos\\xe9/0002.jpg"]
    assert manifest["counts"] == {"scanned": 13, "accepted": 4, "rejected": 9}
    assert json.loads((outs[0] / "labels.json").read_text(encoding="utf-8")) == ["astro", "hopper", "jos\\xe9"]
    dup = next(r for r in rejects if r["reason"] == "duplicate")
    assert dup["detail"] == "same bytes as astro/0001.jpg (another identity)"
    assert verify(outs[0]) == []  # escaped paths and folder rejects pass every cross-check
    # the same tree gives the same bytes: escaped names are stable across runs
    for name in SET_FILES:
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
