"""facepipe import on forged and unusual RecordIO packs (issue 17, items 1 and 2).

Every number a pack, its index or a header record holds is bounded by what the file can hold before
anything is allocated; a forged one is a counted reject or a one-line error. The packs here are
written in the order insightface's packers write them (``face2rec2.py``: identity records in the order
labels change, not by value), and read back as arcface_torch's MXFaceDataset reads them.

The forged-header runs go through the CLI in a subprocess whose data segment is limited
(``RLIMIT_DATA``; not ``RLIMIT_AS``: the LMDB shard writer maps a terabyte of address space), so a
regression that allocates by a forged number fails with a MemoryError instead of swapping.
"""

from __future__ import annotations

import json
import logging
import math
import resource
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_import import arcface_read, crop, records, rejects

from facepipe.cli import main
from facepipe.config import PrepareParams
from facepipe.io import insightface_rec
from facepipe.io.insightface_rec import FLOAT32_EXACT, MAGIC, IRHeader, RecordIOError, RecordIOWriter, frame, pack, read_index, read_property, scan_offsets
from facepipe.stages import import_rec
from facepipe.stages.inspect import verify

M = struct.pack("<I", MAGIC)
#: The CLI's data segment when it imports a tiny pack is about 1.05 GiB (torch, mostly); a forged
#: number that allocates 512 MiB or more must hit this limit.
DATA_LIMIT_MIB = 1280


def insightface_pack(folder: Path, labels: list[float], *, array_labels: bool = True, idx: bool = True) -> list[int]:
    """A pack in insightface's ``face2rec2.py`` layout: images with keys 1..n (label ``[label, 1]``
    arrays, or floats), then the header record 0 ``[n + 1, n + 1 + R]`` and R identity records, one per
    *run* of equal labels in image order, keyed in that order (not by label value); returns the keys."""
    folder.mkdir(parents=True, exist_ok=True)
    n = len(labels)
    runs: list[tuple[int, int]] = []
    for key, label in enumerate(labels, start=1):
        if key == 1 or label != labels[key - 2]:
            runs.append((key, key + 1))
        else:
            runs[-1] = (runs[-1][0], key + 1)
    with RecordIOWriter(folder / "train.rec", folder / "train.idx") as writer:
        writer.write(0, pack(IRHeader(2, (float(n + 1), float(n + 1 + len(runs)))), b""))
        for key, label in enumerate(labels, start=1):
            writer.write(key, pack(IRHeader(0, (label, 1.0) if array_labels else label, key), crop(100 + key)))
        for number, (first, end) in enumerate(runs):
            writer.write(n + 1 + number, pack(IRHeader(2, (float(first), float(end)), n + 1 + number), b""))
    if not idx:
        (folder / "train.idx").unlink()
    return list(range(1, n + 1))


def forge_header(folder: Path, images_end: float, identities_end: float) -> None:
    """Overwrite the two labels of header record 0 (at offset 0: frame 8 bytes, IRHeader 24)."""
    rec = bytearray((folder / "train.rec").read_bytes())
    rec[32:40] = struct.pack("<2f", images_end, identities_end)
    (folder / "train.rec").write_bytes(bytes(rec))


def limited_cli(*runs: list[str | Path], timeout: float = 300) -> list[tuple[int | str, str]]:
    """``facepipe ARGS`` for each of ``runs``, one after the other in one subprocess (the imports cost
    most) whose data segment is limited to :data:`DATA_LIMIT_MIB`: (exit code, stderr) of each run, or
    (the exception's name, its text) when one escaped ``main``."""
    code = (
        "import contextlib, io, json, resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_DATA, ({DATA_LIMIT_MIB << 20}, {DATA_LIMIT_MIB << 20}))\n"
        "from facepipe.cli import main\n"
        "results = []\n"
        "for args in json.loads(sys.argv[1]):\n"
        "    err = io.StringIO()\n"
        "    try:\n"
        "        with contextlib.redirect_stderr(err):\n"
        "            results.append((main(args), err.getvalue()))\n"
        "    except BaseException as error:\n"
        "        results.append((type(error).__name__, str(error)))\n"
        "print(json.dumps(results))\n"
    )
    argv = json.dumps([[str(arg) for arg in run] for run in runs])
    done = subprocess.run([sys.executable, "-c", code, argv], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return [tuple(result) for result in json.loads(done.stdout.splitlines()[-1])]


@pytest.fixture
def data_limit():
    """This process's data segment limited to what it uses now plus 512 MiB for the test (restored
    after), so that a regression that allocates by a forged number fails instead of swapping."""
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    with open("/proc/self/status") as status:
        used = next(int(line.split()[1]) << 10 for line in status if line.startswith("VmData:"))
    resource.setrlimit(resource.RLIMIT_DATA, (min(used + (512 << 20), hard), hard))
    yield
    resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def f32(value: float) -> float:
    return float(np.float32(value))


# --- item 1: forged numbers -------------------------------------------------------------------


FORGED_HEADERS = [
    (13.0, 1e8, f"header record 0 promises {int(f32(1e8)) - 13} identity records, the index holds 17 keys"),
    (13.0, 1e6, "header record 0 promises 999987 identity records, the index holds 17 keys"),
    (13.0, 48.0, "header record 0 promises 35 identity records, the index holds 17 keys"),  # 34 would do
    (13.0, 1e12, f"header record 0 promises {int(f32(1e12)) - 13} identity records, the index holds 17 keys"),
    (13.0, 1e30, f"header record 0 gives impossible ranges [13.0, {f32(1e30)!r}]"),
    (13.0, math.nan, "header record 0 gives impossible ranges [13.0, nan]"),
    (13.0, math.inf, "header record 0 gives impossible ranges [13.0, inf]"),
    (math.inf, math.inf, "header record 0 gives impossible ranges [inf, inf]"),
    (math.nan, 17.0, "header record 0 gives impossible ranges [nan, 17.0]"),
    (1e12, 1e12, f"header record 0 promises {int(f32(1e12)) - 1} images, the index holds 17 keys"),
    (36.0, 36.0, "header record 0 promises 35 images, the index holds 17 keys"),  # 34 would do
    (12.5, 17.0, "header record 0 gives impossible ranges [12.5, 17.0]"),
    (13.0, 12.5, "header record 0 gives impossible ranges [13.0, 12.5]"),
    (13.0, 12.0, "header record 0 gives impossible ranges [13.0, 12.0]"),
    (0.0, 17.0, "header record 0 gives impossible ranges [0.0, 17.0]"),
    (-1.0, 17.0, "header record 0 gives impossible ranges [-1.0, 17.0]"),
    (13.0, 2.0**63, f"header record 0 gives impossible ranges [13.0, {2.0**63!r}]"),
]


@pytest.mark.parametrize("images_end, identities_end, message", FORGED_HEADERS)
def test_a_forged_header_is_one_line_and_writes_nothing(tmp_path, capsys, data_limit, images_end, identities_end, message):
    insightface_pack(tmp_path / "pack", [0, 0, 0, 1, 1, 1, 3, 3, 3, 4, 4, 4])
    forge_header(tmp_path / "pack", images_end, identities_end)
    assert main(["import", str(tmp_path / "pack"), str(tmp_path / "out"), "--workers", "1"]) == 2
    assert capsys.readouterr().err == f"facepipe import: error: {message}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pack"]


def test_the_header_may_promise_twice_the_keys_the_index_holds(tmp_path, data_limit):
    insightface_pack(tmp_path / "pack", [0, 0, 0, 1, 1, 1, 3, 3, 3, 4, 4, 4])
    forge_header(tmp_path / "pack", 35.0, 69.0)  # 34 images, 34 identity records: the index holds 17 keys
    report = import_rec.run(PrepareParams(), tmp_path / "pack", tmp_path / "out", workers=1, progress=False)
    assert report["counts"] == {"scanned": 34, "accepted": 12, "rejected": 22}
    # keys 13-16, the identity records, are now images: empty payloads, one empty_file and 3 copies of it
    assert report["rejected_by_reason"] == {"missing_record": 18, "empty_file": 1, "duplicate": 3}
    assert report["identity_records"] == {"read": 0, "missing": 34, "unusable": 0}


@pytest.mark.slow  # one subprocess: 10-20 s of imports
def test_forged_headers_and_a_forged_frame_length_under_a_memory_limit(tmp_path):
    """Each forged number under a data-segment limit: the old reader allocated by the header's
    identity range (7.8 GB at 1e8) and read a 512 MiB part of a 10 kB file, and fails here."""
    runs = []
    for number, (images_end, identities_end, _) in enumerate(FORGED_HEADERS):
        insightface_pack(tmp_path / f"pack{number}", [0, 0, 0, 1, 1, 1, 3, 3, 3, 4, 4, 4])
        forge_header(tmp_path / f"pack{number}", images_end, identities_end)
        runs.append(["import", tmp_path / f"pack{number}", tmp_path / f"out{number}", "--workers", "1"])
    keys = insightface_pack(tmp_path / "frame", [0, 0, 1, 1])
    at = dict(read_index(tmp_path / "frame" / "train.idx"))[keys[1]]
    rec = bytearray((tmp_path / "frame" / "train.rec").read_bytes())
    rec[at + 4 : at + 8] = struct.pack("<I", (1 << 29) - 1)  # a whole record of 512 MiB in a 10 kB file
    (tmp_path / "frame" / "train.rec").write_bytes(bytes(rec))
    runs.append(["import", tmp_path / "frame", tmp_path / "frame-out", "--workers", "1"])
    results = limited_cli(*runs)
    wanted = [(2, f"facepipe import: error: {message}\n") for _, _, message in FORGED_HEADERS]
    assert results == [*wanted, (0, "")]
    assert rejects(tmp_path / "frame-out") == {"train.rec#2": "truncated_record"}
    assert not any((tmp_path / f"out{number}").exists() for number in range(len(FORGED_HEADERS)))


def test_missing_and_unusable_identity_records_are_counted_in_one_warning(tmp_path, caplog, data_limit):
    folder = tmp_path / "pack"
    insightface_pack(folder, [0, 0, 1, 1, 2, 2])  # identity records 7, 8, 9
    forge_header(folder, 7.0, 15.0)  # promises identity records 7..14: 10..14 are not in the index
    index = dict(read_index(folder / "train.idx"))
    rec = bytearray((folder / "train.rec").read_bytes())
    rec[index[8] + 32 : index[8] + 40] = struct.pack("<2f", 3.0, math.inf)  # identity 1: [3, inf)
    rec[index[9] + 32 : index[9] + 40] = struct.pack("<2f", math.nan, 7.0)  # identity 2: [nan, 7)
    (folder / "train.rec").write_bytes(bytes(rec))
    with caplog.at_level(logging.WARNING, logger="facepipe.import"):
        report = import_rec.run(PrepareParams(), folder, tmp_path / "out", workers=1, progress=False)
    assert report["counts"] == {"scanned": 6, "accepted": 6, "rejected": 0}
    assert report["identity_records"] == {"read": 1, "missing": 5, "unusable": 2}
    warnings = [r.getMessage() for r in caplog.records if r.name == "facepipe.import"]
    assert warnings == [
        "7 of 8 identity records of the header are missing (5) or unusable (2), e.g. key 8: range [3.0, inf]"
        " is not within the image keys 1..6; key 9: range [nan, 7.0] is not within the image keys 1..6;"
        " key 10: missing from the index: their images are checked against their own labels only"
    ]


@pytest.mark.parametrize(
    "line, number",
    [
        ("2\t100000000000000000000000", 3),  # an offset past int64: was an OverflowError traceback
        ("100000000000000000000000\t5", 3),
        ("-2\t5", 3),
        ("2\t5\t7", 3),
    ],
)
def test_an_index_line_out_of_range_or_with_three_columns_is_one_line(tmp_path, capsys, line, number):
    insightface_pack(tmp_path / "pack", [0, 0, 1])
    lines = (tmp_path / "pack" / "train.idx").read_text().splitlines()
    lines[number - 1] = line
    (tmp_path / "pack" / "train.idx").write_text("\n".join(lines) + "\n")
    assert main(["import", str(tmp_path / "pack"), str(tmp_path / "out"), "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert err == f"facepipe import: error: {tmp_path / 'pack' / 'train.idx'} line {number} is not 'key<TAB>offset' (two whole numbers below 2^63): {line!r}\n"
    assert not (tmp_path / "out").exists()


def test_an_index_with_three_columns_on_every_line_is_refused(tmp_path):
    insightface_pack(tmp_path / "pack", [0, 0, 1, 1, 1])  # 8 lines: 24 numbers were re-paired into 12 entries
    idx = tmp_path / "pack" / "train.idx"
    idx.write_text("".join(f"{line}\t0\n" for line in idx.read_text().splitlines()))
    with pytest.raises(RecordIOError, match=r"^.*train\.idx line 1 is not 'key<TAB>offset' \(two whole numbers below 2\^63\): '0\\t0\\t0'$"):
        read_index(idx)


def test_without_an_index_a_bad_record_does_not_hide_the_records_after_it(tmp_path, caplog):
    folder = tmp_path / "pack"
    keys = insightface_pack(folder, [0, 0, 0, 1, 1, 1], idx=False)
    rec = bytearray((folder / "train.rec").read_bytes())
    offsets = list(scan_offsets(folder / "train.rec"))
    assert len(offsets) == 9  # header, 6 images, 2 identity records
    at = offsets[keys[2]]
    rec[at : at + 4] = b"JUNK"  # image key 3's magic word
    (folder / "train.rec").write_bytes(bytes(rec))
    assert list(scan_offsets(folder / "train.rec")) == offsets
    with caplog.at_level(logging.WARNING, logger="facepipe.import"):
        report = import_rec.run(PrepareParams(), folder, tmp_path / "out", workers=1, progress=False)
    assert report["counts"] == {"scanned": 6, "accepted": 5, "rejected": 1}
    assert rejects(tmp_path / "out") == {"train.rec#3": "bad_record"}
    assert sorted(records(tmp_path / "out")) == [f"{label}/train.rec#{key}" for key, label in [(1, 0), (2, 0), (4, 1), (5, 1), (6, 1)]]
    skipped = offsets[keys[3]] - at
    assert [r.getMessage() for r in caplog.records if r.name == "facepipe.import"] == [
        f"train.rec has no index: {skipped} bytes in 1 place(s) could not be framed and were skipped"
        f" to the next record (first at offset {at})"
    ]


def test_scan_offsets_resynchronises_on_the_next_aligned_whole_or_first_part(tmp_path):
    records_ = [b"a" * 5, b"AAAA" + M + b"BB", b"c" * 8, b"d"]  # the second is split in two parts
    framed = [frame(r) for r in records_]
    path = tmp_path / "r.rec"
    blob = bytearray(b"".join(framed))
    starts = np.cumsum([0] + [len(f) for f in framed[:-1]]).tolist()
    path.write_bytes(bytes(blob))
    assert list(scan_offsets(path)) == starts
    blob[starts[1] : starts[1] + 4] = b"\0\0\0\0"  # its first part's magic: the last part must not count
    path.write_bytes(bytes(blob))
    assert list(scan_offsets(path)) == starts
    path.write_bytes(bytes(blob) + b"tail")  # 4 stray bytes at the end: one unframed place
    assert list(scan_offsets(path)) == [*starts, len(blob)]


@pytest.mark.parametrize("label", [1e30, -1.0, 2.5, math.nan, math.inf, float(FLOAT32_EXACT)])
def test_a_label_that_no_float32_integer_holds_is_a_bad_label(tmp_path, label):
    insightface_pack(tmp_path / "pack", [0, 0, label, 1], array_labels=False)
    report = import_rec.run(PrepareParams(), tmp_path / "pack", tmp_path / "out", workers=1, progress=False)
    assert report["counts"] == {"scanned": 4, "accepted": 3, "rejected": 1}
    assert rejects(tmp_path / "out") == {"train.rec#3": "bad_label"}
    detail = json.loads((tmp_path / "out" / "rejects.jsonl").read_text())["detail"]
    assert detail == f"label {f32(label)!r} is not a whole number in [0, 2^24)"
    assert json.loads((tmp_path / "out" / "labels.json").read_text()) == ["0", "1"]


@pytest.mark.parametrize("text", ["-3,112,112", "3,0,112", "3,112,99999999999", "3,112", "x"])
def test_property_txt_out_of_range_is_refused(tmp_path, text):
    (tmp_path / "property.txt").write_text(text + "\n")
    with pytest.raises(RecordIOError, match=r"^.*property\.txt is not 'num_classes,height,width' \(three whole numbers in 1\.\.2\^31-1\): "):
        read_property(tmp_path / "property.txt")


def test_property_txt_in_range_reads(tmp_path):
    (tmp_path / "property.txt").write_text("93431,112,112\n")
    assert read_property(tmp_path / "property.txt") == (93431, 112, 112)
    assert read_property(tmp_path / "absent.txt") is None


# --- item 2: labels that are not 0..K-1 ---------------------------------------------------------


@pytest.mark.parametrize(
    "labels, names",
    [
        ([0, 0, 0, 1, 1, 1, 3, 3, 3, 4, 4, 4], ["0", "1", "3", "4"]),  # a gap: identity records keyed 0, 1, 2, 3
        ([1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4], ["1", "2", "3", "4"]),  # 1-based
        ([7, 7, 7, 2, 2, 2, 9, 9, 9, 2, 2, 2], ["7", "2", "9"]),  # not ascending; label 2 in two ranges
    ],
)
def test_labels_that_are_not_0_to_k_import_every_image_as_arcface_torch_reads_them(tmp_path, labels, names):
    folder = tmp_path / "pack"
    insightface_pack(folder, labels)
    assert [label for label, _ in arcface_read(folder)] == labels  # arcface_torch: all 12, labels as they are
    report = import_rec.run(PrepareParams(), folder, tmp_path / "out", workers=1, progress=False)
    assert report["counts"] == {"scanned": 12, "accepted": 12, "rejected": 0}
    assert json.loads((tmp_path / "out" / "labels.json").read_text()) == names
    runs = sum(1 for key in range(len(labels)) if key == 0 or labels[key] != labels[key - 1])
    assert report["identity_records"] == {"read": runs, "missing": 0, "unusable": 0}
    stored = records(tmp_path / "out")
    assert {path: names[label] for path, (label, _) in stored.items()} == {
        f"{label}/train.rec#{key}": str(label) for key, label in enumerate(labels, start=1)
    }
    assert verify(tmp_path / "out") == []


def test_an_image_whose_label_differs_from_its_identity_range_is_a_mismatch(tmp_path):
    folder = tmp_path / "pack"
    insightface_pack(folder, [1, 1, 1, 3, 3, 3])
    index = dict(read_index(folder / "train.idx"))
    rec = bytearray((folder / "train.rec").read_bytes())
    rec[index[2] + 32 : index[2] + 36] = struct.pack("<f", 3.0)  # key 2 says 3, in the range of label 1
    (folder / "train.rec").write_bytes(bytes(rec))
    report = import_rec.run(PrepareParams(), folder, tmp_path / "out", workers=1, progress=False)
    assert report["counts"] == {"scanned": 6, "accepted": 5, "rejected": 1}
    line = json.loads((tmp_path / "out" / "rejects.jsonl").read_text())
    assert line == {
        "path": "3/train.rec#2", "reason": "label_mismatch",
        "detail": "label 3, but the header puts key 2 in the identity range of label 1",
    }


def test_a_pack_with_nothing_importable_exits_non_zero_and_writes_nothing(tmp_path, capsys):
    folder = tmp_path / "pack"
    folder.mkdir()
    with RecordIOWriter(folder / "train.rec", folder / "train.idx") as writer:
        writer.write(0, pack(IRHeader(0, 0.0, 0), b""))
        writer.write(1, pack(IRHeader(0, 1e30, 1), crop(1)))
        for key in range(2, 4):
            writer.write(key, pack(IRHeader(0, float(key), key), b"not an image %d" % key))
    assert main(["import", str(folder), str(tmp_path / "out"), "--workers", "1"]) == 2
    err = capsys.readouterr().err
    reasons = "not_an_image 2, bad_label 1, empty_file 1"  # most frequent first, then by name
    assert err == f"facepipe import: error: nothing imported from {folder / 'train.rec'}: all 4 records were rejected ({reasons})\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pack"]


def test_the_scan_finds_a_record_a_whole_read_block_past_an_unframed_one(tmp_path):
    """The resynchronising scan reads 1 MiB blocks (plus the word after them): a record starting on
    the last word of the first block, and one far into a later block, are both found."""
    path = tmp_path / "r.rec"
    junk = b"JUNK" * ((1 << 20) // 4)  # the scan resumes at offset 4: the block ends at 4 + 2^20
    second_junk = b"JUNK" * 250_000  # the late record 95 % into its block
    path.write_bytes(junk + frame(b"found") + second_junk + frame(b"late"))
    gaps: list[tuple[int, int]] = []
    first = 1 << 20
    late = first + len(frame(b"found")) + len(second_junk)
    assert list(scan_offsets(path, gaps=gaps)) == [0, first, first + len(frame(b"found")), late]
    assert gaps == [(0, first), (first + len(frame(b"found")), len(second_junk))]


def test_the_scan_reads_in_bounded_blocks(tmp_path):
    """A pack of gigabytes without its index is skipped over block by block, never read whole."""
    path = tmp_path / "r.rec"
    path.write_bytes(b"JUNK" * (3 << 18) + frame(b"end"))  # 3 MiB of junk
    sizes: list[int | None] = []

    class Counting:
        def __init__(self, handle):
            self.handle = handle

        def __getattr__(self, name):
            return getattr(self.handle, name)

        def read(self, size=-1):
            sizes.append(size)
            return self.handle.read(size)

    with open(path, "rb") as handle:
        assert insightface_rec._next_record_start(Counting(handle), 4, path.stat().st_size) == 3 << 20
    assert sizes == [(1 << 20) + 4] * 3


def _rewrite(folder: Path, key: int, at: int, data: bytes) -> None:
    """Overwrite bytes ``at`` .. of record ``key`` (frame header 8 bytes, IRHeader 24, labels)."""
    offset = dict(read_index(folder / "train.idx"))[key]
    rec = bytearray((folder / "train.rec").read_bytes())
    rec[offset + at : offset + at + len(data)] = data
    (folder / "train.rec").write_bytes(bytes(rec))


@pytest.mark.parametrize(
    "at, data, why",
    [
        (32, struct.pack("<2f", 2.0, 2.0), "range [2.0, 2.0] is not within the image keys 1..6"),
        (32, struct.pack("<2f", 0.0, 3.0), "range [0.0, 3.0] is not within the image keys 1..6"),
        (32, struct.pack("<2f", 5.0, 8.0), "range [5.0, 8.0] is not within the image keys 1..6"),
        (32, struct.pack("<2f", 3.0, 4.5), "range [3.0, 4.5] is not within the image keys 1..6"),
        (8, struct.pack("<I", 0), "label 0.0 is not a range [first, end)"),
        (8, struct.pack("<I", 1), "label (3.0,) is not a range [first, end)"),
        (0, b"JUNK", "bad magic 0x4b4e554a at offset {offset}"),
    ],
)
def test_an_unusable_identity_record_is_named_in_the_one_warning(tmp_path, caplog, at, data, why):
    folder = tmp_path / "pack"
    insightface_pack(folder, [0, 0, 1, 1, 2, 2])  # identity records 7 [1, 3), 8 [3, 5), 9 [5, 7)
    _rewrite(folder, 8, at, data)
    with caplog.at_level(logging.WARNING, logger="facepipe.import"):
        report = import_rec.run(PrepareParams(), folder, tmp_path / "out", workers=1, progress=False)
    assert report["counts"] == {"scanned": 6, "accepted": 6, "rejected": 0}
    assert report["identity_records"] == {"read": 2, "missing": 0, "unusable": 1}
    why = why.format(offset=dict(read_index(folder / "train.idx"))[8])
    assert [r.getMessage() for r in caplog.records if r.name == "facepipe.import"] == [
        f"1 of 3 identity records of the header are missing (0) or unusable (1), e.g. key 8: {why}:"
        " their images are checked against their own labels only"
    ]


def test_one_missing_identity_record_is_the_one_example(tmp_path, caplog):
    folder = tmp_path / "pack"
    insightface_pack(folder, [0, 0, 1, 1, 2, 2])
    forge_header(folder, 7.0, 11.0)  # identity records 7, 8, 9 and a missing 10
    with caplog.at_level(logging.WARNING, logger="facepipe.import"):
        report = import_rec.run(PrepareParams(), folder, tmp_path / "out", workers=1, progress=False)
    assert report["identity_records"] == {"read": 3, "missing": 1, "unusable": 0}
    assert [r.getMessage() for r in caplog.records if r.name == "facepipe.import"] == [
        "1 of 4 identity records of the header are missing (1) or unusable (0), e.g. key 10: missing from the index:"
        " their images are checked against their own labels only"
    ]


def test_missing_identity_records_show_the_first_three(tmp_path, caplog, data_limit):
    folder = tmp_path / "pack"
    insightface_pack(folder, [0, 0, 1, 1, 2, 2])  # 10 keys
    forge_header(folder, 7.0, 27.0)  # identity records 7..26: 17 missing
    with caplog.at_level(logging.WARNING, logger="facepipe.import"):
        import_rec.run(PrepareParams(), folder, tmp_path / "out", workers=1, progress=False)
    assert [r.getMessage() for r in caplog.records if r.name == "facepipe.import"] == [
        "17 of 20 identity records of the header are missing (17) or unusable (0), e.g. key 10: missing from the"
        " index; key 11: missing from the index; key 12: missing from the index: their images are checked against"
        " their own labels only"
    ]


def test_a_range_s_label_is_its_first_readable_image_s(tmp_path):
    folder = tmp_path / "pack"
    insightface_pack(folder, [5, 5, 5, 5, 6, 6])  # identity records 7 [1, 5), 8 [5, 7)
    _rewrite(folder, 1, 0, b"JUNK")  # key 1 unreadable: key 2 gives the range its label
    _rewrite(folder, 2, 32, struct.pack("<f", 6.0))  # key 2 says 6: the range's label
    report = import_rec.run(PrepareParams(), folder, tmp_path / "out", workers=1, progress=False)
    assert rejects(tmp_path / "out") == {"train.rec#1": "bad_record", "5/train.rec#3": "label_mismatch", "5/train.rec#4": "label_mismatch"}
    assert report["counts"] == {"scanned": 6, "accepted": 3, "rejected": 3}


def test_a_header_without_identity_records_and_one_without_images(tmp_path, capsys):
    folder = tmp_path / "pack"
    insightface_pack(folder, [0, 0, 1, 1, 2, 2])  # 10 keys
    forge_header(folder, 7.0, 7.0)  # no identity records: keys 7-9 are strays
    report = import_rec.run(PrepareParams(), folder, tmp_path / "out", workers=1, progress=False)
    assert report["counts"] == {"scanned": 9, "accepted": 6, "rejected": 3}
    assert report["identity_records"] == {"read": 0, "missing": 0, "unusable": 0}
    assert set(rejects(tmp_path / "out").values()) == {"bad_record"}
    forge_header(folder, 1.0, 1.0)  # no images: every key but the header is a stray
    assert main(["import", str(folder), str(tmp_path / "none"), "--workers", "1"]) == 2
    rec = folder / "train.rec"
    assert capsys.readouterr().err == f"facepipe import: error: nothing imported from {rec}: all 9 records were rejected (bad_record 9)\n"


def test_a_key_at_two_offsets_and_an_empty_index_are_one_line(tmp_path, capsys):
    folder = tmp_path / "pack"
    insightface_pack(folder, [0, 0, 1])
    lines = (folder / "train.idx").read_text().splitlines()
    (folder / "train.idx").write_text("\n".join([*lines, lines[2].split()[0] + "\t0", lines[2]]) + "\n")  # key 2 at 0
    assert main(["import", str(folder), str(tmp_path / "out"), "--workers", "1"]) == 2
    assert capsys.readouterr().err == f"facepipe import: error: key 2 appears twice in {folder / 'train.idx'} with different offsets\n"
    (folder / "train.idx").write_text("\n".join([*lines, lines[2]]) + "\n")  # the same line twice: one record
    report = import_rec.run(PrepareParams(), folder, tmp_path / "out", workers=1, progress=False)
    assert report["counts"] == {"scanned": 3, "accepted": 3, "rejected": 0}
    (folder / "train.idx").write_text("\n")
    assert main(["import", str(folder), str(tmp_path / "none"), "--workers", "1"]) == 2
    assert capsys.readouterr().err == f"facepipe import: error: no records in {folder / 'train.idx'}\n"
    (folder / "train.idx").unlink()
    (folder / "train.rec").write_bytes(b"")
    assert main(["import", str(folder), str(tmp_path / "none"), "--workers", "1"]) == 2
    assert capsys.readouterr().err == f"facepipe import: error: no records in {folder / 'train.rec'}\n"


def test_keys_of_a_pack_without_header_are_read_in_file_order(tmp_path):
    folder = tmp_path / "pack"
    folder.mkdir()
    with RecordIOWriter(folder / "train.rec", folder / "train.idx") as writer:
        for key, label in [(9, 0), (3, 1), (5, 0)]:
            writer.write(key, pack(IRHeader(0, float(label), key), crop(key)))
    report = import_rec.run(PrepareParams(samples_per_shard=1), folder, tmp_path / "out", workers=1, progress=False)
    assert report["counts"] == {"scanned": 3, "accepted": 3, "rejected": 0}
    assert report["identity_records"] == {"read": 0, "missing": 0, "unusable": 0}
    assert list(records(tmp_path / "out")) == ["0/train.rec#9", "1/train.rec#3", "0/train.rec#5"]  # one a shard


def test_a_range_whose_first_image_is_missing_takes_its_label_from_the_next(tmp_path):
    folder = tmp_path / "pack"
    insightface_pack(folder, [4, 4, 4, 6])  # identity records 5 [1, 4), 6 [4, 5)
    lines = (folder / "train.idx").read_text().splitlines()
    (folder / "train.idx").write_text("\n".join(line for line in lines if not line.startswith("1\t")) + "\n")
    _rewrite(folder, 3, 32, struct.pack("<f", 6.0))  # key 3 says 6 in the range of label 4 (from key 2)
    report = import_rec.run(PrepareParams(), folder, tmp_path / "out", workers=1, progress=False)
    assert rejects(tmp_path / "out") == {"train.rec#1": "missing_record", "6/train.rec#3": "label_mismatch"}
    assert report["identity_records"] == {"read": 2, "missing": 0, "unusable": 0}


def test_an_identity_record_with_more_than_two_labels_uses_the_first_two(tmp_path):
    folder = tmp_path / "pack"
    folder.mkdir()
    with RecordIOWriter(folder / "train.rec", folder / "train.idx") as writer:
        writer.write(0, pack(IRHeader(2, (3.0, 4.0)), b""))
        writer.write(1, pack(IRHeader(0, 8.0, 1), crop(1)))
        writer.write(2, pack(IRHeader(0, 9.0, 2), crop(2)))
        writer.write(3, pack(IRHeader(3, (1.0, 3.0, 7.0)), b""))
    report = import_rec.run(PrepareParams(), folder, tmp_path / "out", workers=1, progress=False)
    assert report["identity_records"] == {"read": 1, "missing": 0, "unusable": 0}
    assert rejects(tmp_path / "out") == {"9/train.rec#2": "label_mismatch"}


def test_a_header_with_one_label_is_one_line_and_one_with_three_uses_the_first_two(tmp_path, capsys):
    folder = tmp_path / "pack"
    insightface_pack(folder, [0, 0, 1])
    _rewrite(folder, 0, 8, struct.pack("<I", 1))  # flag 1: the label array is [4.0]
    assert main(["import", str(folder), str(tmp_path / "out"), "--workers", "1"]) == 2
    message = "header record 0 has flag 1 but not the two labels [images end, identities end]"
    assert capsys.readouterr().err == f"facepipe import: error: {message}\n"
    three = tmp_path / "three"
    three.mkdir()
    with RecordIOWriter(three / "train.rec", three / "train.idx") as writer:
        writer.write(0, pack(IRHeader(3, (3.0, 4.0, 99.0)), b""))
        for key in (1, 2):
            writer.write(key, pack(IRHeader(0, 5.0, key), crop(key)))
        writer.write(3, pack(IRHeader(2, (1.0, 3.0)), b""))
    report = import_rec.run(PrepareParams(), three, tmp_path / "out", workers=1, progress=False)
    assert report["counts"] == {"scanned": 2, "accepted": 2, "rejected": 0}
    assert report["identity_records"] == {"read": 1, "missing": 0, "unusable": 0}
