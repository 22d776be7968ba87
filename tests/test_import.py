"""facepipe import (insightface RecordIO packs, folders of aligned faces) and facepipe export-rec.

Packs are written here with facepipe.io.insightface_rec in insightface's layout (MXNet's pack/unpack and
dmlc's framing, checked byte by byte in test_recordio.py), and read back the way arcface_torch's
MXFaceDataset reads them (:func:`arcface_read`).
"""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from facepipe.alignment import align_face
from facepipe.cli import main
from facepipe.config import PrepareParams
from facepipe.data.dataset import FaceDataset
from facepipe.detection import create_detector
from facepipe.detection.prealigned import aligned_landmarks
from facepipe.io import ShardSet
from facepipe.io.insightface_rec import MAGIC, IRHeader, RecordIOWriter, pack, read_index, read_record, unpack
from facepipe.stages import export_rec, import_rec
from facepipe.stages.inspect import verify

PARAMS = PrepareParams(samples_per_shard=5)
M = struct.pack("<I", MAGIC)


def crop(seed: int, size: int = 112, *, fmt: str = "JPEG") -> bytes:
    """A smooth, distinct [size, size] RGB image as JPEG (or PNG) bytes."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (7, 7, 3), dtype=np.uint8)
    pil = Image.fromarray(small).resize((size, size), Image.BICUBIC)
    buffer = io.BytesIO()
    pil.save(buffer, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def write_pack(
    folder: Path,
    items: list[tuple[int, bytes]],
    *,
    header: bool,
    array_labels: bool = False,
    identities: list[int] | None = None,
) -> list[int]:
    """insightface's layout: optional header record 0, images, identity records (the key range of each
    identity: ``identities[i]`` of item i, default its label; grouped); returns the image keys."""
    folder.mkdir(parents=True, exist_ok=True)
    identities = identities or [label for label, _ in items]
    n, labels = len(items), sorted(set(identities))
    first = 1 if header else 0
    keys = list(range(first, first + n))
    with RecordIOWriter(folder / "train.rec", folder / "train.idx") as writer:
        if header:
            writer.write(0, pack(IRHeader(2, (n + 1.0, n + 1.0 + len(labels))), b""))
        for key, (label, payload) in zip(keys, items):
            writer.write(key, pack(IRHeader(0, (float(label), 0.0) if array_labels else float(label), key), payload))
        if header:
            for identity in labels:
                held = [key for key, owner in zip(keys, identities) if owner == identity]
                writer.write(n + 1 + identity, pack(IRHeader(2, (float(held[0]), float(held[-1] + 1))), b""))
    (folder / "property.txt").write_text(f"{len(labels)},112,112\n")
    return keys


def arcface_read(folder: Path) -> list[tuple[int, bytes]]:
    """(label, image bytes) as arcface_torch's MXFaceDataset yields them."""
    index = dict(read_index(folder / "train.idx"))
    with open(folder / "train.rec", "rb") as handle:
        header, _ = unpack(read_record(handle, index[0]))
        keys = range(1, int(header.label[0])) if header.flag > 0 else list(index)
        out = []
        for key in keys:
            image_header, payload = unpack(read_record(handle, index[key]))
            out.append((int(image_header.first_label), payload))
    return out


def rejects(root: Path) -> dict[str, str]:
    return {r["path"]: r["reason"] for r in map(json.loads, (root / "rejects.jsonl").read_text().splitlines())}


def records(root: Path) -> dict[str, tuple[int, bytes]]:
    shard_set = ShardSet(root)
    return {record.path: (record.label, record.payload) for reader in shard_set.readers for record in reader}


@pytest.fixture
def header_pack(tmp_path):
    """3 identities with array labels, plus one of each per-record problem."""
    items = [(0, crop(0)), (0, crop(1)), (0, crop(2)), (1, crop(99))]  # key 4: label 1 in identity 0's range
    items += [(1, crop(10)), (1, crop(14, 160)), (1, crop(15, fmt="PNG"))]  # key 6 resized, key 7 re-encoded
    items += [(2, crop(20)), (2, crop(21)), (2, crop(22))]
    items += [(2, b"this is not an image"), (2, crop(0)), (2, b"")]  # keys 11-13: not_an_image, duplicate, empty_file
    folder = tmp_path / "pack"
    owners = [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2, 2]
    keys = write_pack(folder, items, header=True, array_labels=True, identities=owners)
    return folder, dict(zip(keys, items))


def test_pack_with_header_imports_verifies_and_loads(header_pack, tmp_path):
    folder, by_key = header_pack
    out = tmp_path / "set"
    report = import_rec.run(PARAMS, folder, out, workers=1, progress=False)
    assert report["counts"] == {"scanned": 13, "accepted": 9, "rejected": 4}
    assert rejects(out) == {
        "1/train.rec#4": "label_mismatch",
        "2/train.rec#11": "not_an_image",
        "2/train.rec#12": "duplicate",
        "2/train.rec#13": "empty_file",
    }
    assert report["resized"] == 1 and report["num_identities"] == 3
    assert verify(out) == []
    assert json.loads((out / "labels.json").read_text()) == ["0", "1", "2"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"] == {"format": "insightface-recordio", "file": "train.rec", "header_record": True, "property": [3, 112, 112]}
    assert manifest["params"]["detector"] == "none"
    stored = records(out)
    assert len(stored) == 9 and {path.split("#")[0] for path in stored} == {"0/train.rec", "1/train.rec", "2/train.rec"}
    for path, (label, payload) in stored.items():
        key = int(path.split("#")[1])
        assert label == by_key[key][0]
        if key not in (6, 7):  # 112x112 JPEGs are stored byte for byte
            assert payload == by_key[key][1]
    resized = Image.open(io.BytesIO(stored["1/train.rec#6"][1]))
    assert resized.size == (112, 112) and resized.format == "JPEG"
    dataset = FaceDataset(out)
    batch = dataset.__getitems__(list(range(len(dataset))))
    assert [tuple(image.shape) for image, _ in batch] == [(3, 112, 112)] * 9
    assert sorted(label for _, label in batch) == sorted(label for label, _ in stored.values())


def test_pack_without_header_continuation_and_a_truncated_last_record(tmp_path):
    jpeg = crop(3)
    with_magic = jpeg + b"\0" * (-len(jpeg) % 4) + M + b"tail"  # after the JPEG's end: decoders ignore it
    items = [(0, crop(1)), (0, with_magic), (1, crop(2)), (1, crop(4)), (1, crop(5))]
    folder = tmp_path / "pack"
    write_pack(folder, items, header=False)
    (folder / "property.txt").unlink()
    rec = (folder / "train.rec").read_bytes()
    assert M + struct.pack("<I", (1 << 29) | (24 + len(jpeg) + (-len(jpeg) % 4))) in rec  # a first part
    (folder / "train.rec").write_bytes(rec[:-30])  # cut inside the last record
    out = tmp_path / "set"
    report = import_rec.run(PARAMS, folder / "train.rec", out, workers=1, progress=False)
    assert report["counts"] == {"scanned": 5, "accepted": 4, "rejected": 1}
    reject = json.loads((out / "rejects.jsonl").read_text())
    assert reject["path"] == "train.rec#4" and reject["reason"] == "truncated_record" and "file ends" in reject["detail"]
    stored = records(out)
    assert stored["0/train.rec#1"] == (0, with_magic)  # parts joined, the magic word put back
    assert {path: label for path, (label, _) in stored.items()} == {
        "0/train.rec#0": 0, "0/train.rec#1": 0, "1/train.rec#2": 1, "1/train.rec#3": 1,
    }
    assert verify(out) == []
    assert json.loads((out / "manifest.json").read_text())["source"]["header_record"] is False


def test_export_rec_gives_insightface_s_layout_and_imports_back(header_pack, tmp_path):
    folder, _ = header_pack
    first = tmp_path / "set"
    import_rec.run(PARAMS, folder, first, workers=1, progress=False)
    exported = tmp_path / "export"
    summary = export_rec.run(first, exported, progress=False)
    assert summary["num_images"] == 9 and summary["num_identities"] == 3
    assert (exported / "property.txt").read_text() == "3,112,112\n"
    read = arcface_read(exported)
    assert [label for label, _ in read] == sorted(label for label, _ in read)  # grouped by label, ascending
    assert sorted(read) == sorted(records(first).values())
    # identity records n+1.. give each label's key range
    index = dict(read_index(exported / "train.idx"))
    with open(exported / "train.rec", "rb") as handle:
        ranges = [unpack(read_record(handle, index[10 + label]))[0].label for label in range(3)]
    assert [int(a) for a, _ in ranges] == [1] + [int(b) for _, b in ranges[:-1]] and ranges[-1][1] == 10.0
    assert [label for label, _ in read] == [label for label in range(3) for _ in range(int(ranges[label][1] - ranges[label][0]))]
    again = tmp_path / "again"
    import_rec.run(PARAMS, exported, again, workers=1, progress=False)
    assert json.loads((again / "labels.json").read_text()) == json.loads((first / "labels.json").read_text())
    assert sorted(records(again).values()) == sorted(records(first).values())
    assert verify(again) == []
    export_rec.run(first, exported, progress=False)  # its own output is replaced


@pytest.mark.multiprocess
def test_two_dask_workers_write_the_same_bytes_as_one(header_pack, tmp_path, monkeypatch):
    folder, _ = header_pack
    monkeypatch.setattr(import_rec, "CHUNK_RECORDS", 3)  # 5 chunks over 2 workers
    import_rec.run(PARAMS, folder, tmp_path / "one", workers=1, progress=False)
    report = import_rec.run(PARAMS, folder, tmp_path / "two", workers=2, progress=False)
    assert report["workers"] == 2 and report["scheduler"] == "local"
    written = sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*") if p.is_file())
    assert written == sorted(p.relative_to(tmp_path / "two") for p in (tmp_path / "two").rglob("*") if p.is_file())
    for path in written:
        if path.name != "report.json":
            assert (tmp_path / "one" / path).read_bytes() == (tmp_path / "two" / path).read_bytes(), path


def test_prealigned_detector_copies_112_crops_and_pads_96_wide_ones():
    image = np.asarray(Image.open(io.BytesIO(crop(7))))
    detector = create_detector("none")
    (face,) = detector.detect([image])[0]
    assert face.score == 1.0 and face.box.tolist() == [0, 0, 112, 112]
    assert np.array_equal(align_face(image, face.landmarks, 112), image)
    narrow = image[:, 8:104]  # a 96 x 112 SphereFace-style crop of the same face
    aligned = align_face(narrow, aligned_landmarks(96, 112), 112)
    assert np.array_equal(aligned[:, 8:104], narrow) and not aligned[:, :8].any() and not aligned[:, 104:].any()


@pytest.mark.multiprocess
def test_aligned_folder_import_through_the_cli(tmp_path, capsys):
    raw = tmp_path / "aligned"
    for name, payload in {
        "ann/1.jpg": crop(1), "ann/2.png": crop(2, fmt="PNG"), "bob/1.jpg": crop(3, 160), "bob/2.jpg": crop(4),
        "bob/cut.jpg": crop(5)[:400], "bob/notes.txt": b"hello",
    }.items():
        (raw / name).parent.mkdir(parents=True, exist_ok=True)
        (raw / name).write_bytes(payload)
    out = tmp_path / "set"
    assert main(["import", str(raw), str(out), "--workers", "1", "--params", str(_params(tmp_path))]) == 0
    assert "import: scanned 6, accepted 4, rejected 2" in capsys.readouterr().out
    assert rejects(out) == {"bob/cut.jpg": "unreadable", "bob/notes.txt": "not_an_image"}
    assert json.loads((out / "report.json").read_text())["resized"] == 1
    assert verify(out) == []
    stored = {path: Image.open(io.BytesIO(payload)) for path, (_, payload) in records(out).items()}
    assert {path: image.size for path, image in stored.items()} == dict.fromkeys(["ann/1.jpg", "ann/2.png", "bob/1.jpg", "bob/2.jpg"], (112, 112))
    source = np.asarray(Image.open(raw / "ann/2.png"), dtype=np.int16)
    assert np.abs(np.asarray(stored["ann/2.png"], dtype=np.int16) - source).mean() < 2  # copied, then JPEG q95


def _params(tmp_path: Path) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text("prepare:\n  samples_per_shard: 3\n")
    return path


@pytest.mark.parametrize(
    "setup, args, message",
    [
        (None, ["import", "{tmp}/nothing", "{tmp}/out"], "nothing to import at"),
        ("pack", ["import", "{tmp}/pack", "{tmp}/pack/out"], "lies inside the pack folder"),
        ("pack", ["import", "{tmp}/pack/train.rec", "{tmp}"], "lies inside the output"),
        ("pack", ["import", "{tmp}/pack", "{tmp}/user"], "refusing to replace"),
        ("badidx", ["import", "{tmp}/pack", "{tmp}/out"], "line 2 is not 'key<TAB>offset'"),
        ("badheader", ["import", "{tmp}/pack", "{tmp}/out"], "record 0 (the header of an insightface pack) is unreadable"),
        ("badrange", ["import", "{tmp}/pack", "{tmp}/out"], "header record 0 promises 99 images, the index holds 5 keys"),
        (None, ["export-rec", "{tmp}/nothing", "{tmp}/out"], "shard set not found"),
        ("pack", ["export-rec", "{tmp}/pack", "{tmp}/out"], "not a prepared shard set"),
    ],
)
def test_cli_errors_are_one_line_and_write_nothing(tmp_path, capsys, setup, args, message):
    if setup:
        write_pack(tmp_path / "pack", [(0, crop(1)), (0, crop(2))], header=True)
        (tmp_path / "user").mkdir()
        (tmp_path / "user" / "mine.txt").write_text("keep me")
    if setup == "badidx":
        (tmp_path / "pack" / "train.idx").write_text("0\t0\n1\tnope\n")
    if setup == "badrange":
        write_pack(tmp_path / "pack", [(0, crop(1)), (0, crop(2))], header=False)
        with RecordIOWriter(tmp_path / "pack" / "train.rec", tmp_path / "pack" / "train.idx") as writer:
            writer.write(0, pack(IRHeader(2, (100.0, 101.0)), b""))
            for key in range(1, 5):
                writer.write(key, pack(IRHeader(0, 0.0, key), crop(key)))
    if setup == "badheader":
        rec = tmp_path / "pack" / "train.rec"
        rec.write_bytes(b"\0" * 8 + rec.read_bytes()[8:])
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert main([arg.format(tmp=tmp_path) for arg in args]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err, err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert (tmp_path / "user" / "mine.txt").read_text() == "keep me" if setup else True


def test_cli_import_inspect_and_export_rec(tmp_path, capsys):
    write_pack(tmp_path / "pack", [(0, crop(1)), (0, crop(2)), (1, crop(3))], header=True)
    out, exported = tmp_path / "set", tmp_path / "exported"
    assert main(["import", str(tmp_path / "pack"), str(out), "--workers", "1", "--params", str(_params(tmp_path))]) == 0
    assert "import: scanned 3, accepted 3, rejected 0; 2 identities in 1 shard(s)" in capsys.readouterr().out
    assert main(["inspect", str(out)]) == 0 and main(["verify", str(out)]) == 0
    capsys.readouterr()
    assert main(["export-rec", str(out), str(exported)]) == 0
    assert "export-rec: 3 images of 2 identities (112x112)" in capsys.readouterr().out
    assert sorted(p.name for p in exported.iterdir()) == ["export.json", "property.txt", "train.idx", "train.rec"]


def test_missing_and_stray_keys_are_rejects_and_a_pack_without_idx_is_scanned(tmp_path):
    folder = tmp_path / "pack"
    write_pack(folder, [(0, crop(1)), (0, crop(2)), (1, crop(3))], header=True)
    lines = (folder / "train.idx").read_text().splitlines()
    end = int(lines[-1].split()[1])
    kept = [line for line in lines if not line.startswith("2\t")] + [f"99\t{end}", lines[1]]  # key 1 listed twice
    (folder / "train.idx").write_text("\n".join(kept) + "\n")
    report = import_rec.run(PARAMS, folder, tmp_path / "set", workers=1, progress=False)
    assert report["counts"] == {"scanned": 4, "accepted": 2, "rejected": 2}
    assert rejects(tmp_path / "set") == {"train.rec#2": "missing_record", "train.rec#99": "bad_record"}
    (folder / "train.idx").unlink()
    report = import_rec.run(PARAMS, folder, tmp_path / "scanned", workers=1, progress=False)
    assert report["counts"] == {"scanned": 3, "accepted": 3, "rejected": 0}  # keys are positions: header, images, ids
    assert sorted(records(tmp_path / "scanned")) == ["0/train.rec#1", "0/train.rec#2", "1/train.rec#3"]


@pytest.fixture
def cluster_free(monkeypatch):
    """prepare's Dask runner replaced by the chunk worker in this process (a real prepare, no cluster)."""
    from facepipe.stages import prepare

    runner = prepare.chunk_runner
    monkeypatch.setattr(prepare, "chunk_runner", lambda *args, **options: runner(*args, **{**options, "here": True}))


def test_an_aligned_folder_import_that_accepts_nothing_exits_2_and_writes_nothing(tmp_path, capsys, cluster_free):
    """As a pack with nothing importable: a folder import whose every file is rejected is an error, not an empty set."""
    raw = tmp_path / "aligned"
    for name, payload in {"ann/1.jpg": crop(1)[:300], "ann/2.jpg": b"", "bob/1.png": crop(2, 8, fmt="PNG")}.items():
        (raw / name).parent.mkdir(parents=True, exist_ok=True)
        (raw / name).write_bytes(payload)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert main(["import", str(raw), str(tmp_path / "set"), "--params", str(_params(tmp_path))]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"nothing imported from {raw}: all 3 files were rejected" in err, err
    assert "unreadable 1" in err and "empty_file 1" in err and "image_too_small 1" in err, err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before + [Path("params.yaml")]


# --- stages/import_rec.py function by function (its mutation tests, tests/README.md) ---


def test_a_pack_is_a_rec_file_or_a_folder_with_train_rec(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "data.rec").write_bytes(b"")
    assert import_rec.is_pack(tmp_path / "data.rec") and not import_rec.is_pack(tmp_path / "notes.txt")
    assert not import_rec.is_pack(tmp_path / "missing.rec") and not import_rec.is_pack(tmp_path)
    (tmp_path / "train.rec").write_bytes(b"")
    assert import_rec.is_pack(tmp_path)


def test_an_identity_is_export_recs_name_for_its_label_else_the_label():
    pack = import_rec.RecPack(Path("train.rec"), None, None, ("alice", "bob"))
    assert [pack.identity(label) for label in (0, 1, 2, 30)] == ["alice", "bob", "2", "30"]
    assert import_rec.RecPack(Path("train.rec"), None, None).identity(1) == "1"


def test_find_pack_refuses_what_is_not_a_pack_in_one_line(tmp_path):
    from facepipe.errors import FacepipeError

    (tmp_path / "notes.txt").write_text("x")
    for source in (tmp_path / "missing.rec", tmp_path / "notes.txt", tmp_path):
        with pytest.raises(FacepipeError) as error:
            import_rec.find_pack(source)
        assert str(error.value) == f"no RecordIO pack at {source} (expected a .rec file or a folder with train.rec)"



def test_find_pack_takes_export_recs_names_when_they_are_usable_folder_names(tmp_path, ascii_locale):
    from facepipe.errors import FacepipeError
    from facepipe.io.insightface_rec import RecordIOError, read_property

    folder = tmp_path / "pack"
    write_pack(folder, [(0, crop(0)), (1, crop(1))], header=True)

    def names(value: object, fmt: str = "facepipe-rec-export", key: str = "identities") -> object:
        (folder / "export.json").write_text(json.dumps({"format": fmt, key: value}, ensure_ascii=False), encoding="utf-8")
        return import_rec.find_pack(folder).names

    pack = import_rec.find_pack(folder)
    assert (pack.rec, pack.idx, pack.prop, pack.names) == (folder / "train.rec", folder / "train.idx", (2, 112, 112), None)
    assert names(["José", "王"]) == ("José", "王")  # read as UTF-8 whatever the locale
    assert names(["a", "b"], fmt="other") is None
    assert names(["a", "b"], key="names") is None
    for unusable in (["a", "a"], ["a", "b/c"], ["a", ".."], ["a", ""], "ab", {"a": 1}, [1, "1"]):
        assert names(unusable) is None, unusable
    (folder / "export.json").write_text("{nope", encoding="utf-8")
    assert import_rec.find_pack(folder).names is None
    (folder / "export.json").write_text("[]", encoding="utf-8")
    assert import_rec.find_pack(folder).names is None
    (folder / "property.txt").write_text("x\n")
    with pytest.raises(RecordIOError) as direct:
        read_property(folder / "property.txt")
    with pytest.raises(FacepipeError) as error:
        import_rec.find_pack(folder)
    assert str(error.value) == str(direct.value) and str(direct.value)


def test_layout_chunks_are_the_images_size_at_a_time_with_none_for_minus_one():
    keys = np.arange(1, 6, dtype=np.int64)
    offsets = np.array([0, 40, -1, 120, 160], dtype=np.int64)
    expected = np.array([7, 7, 7, -1, 9], dtype=np.int64)
    layout = import_rec.Layout(keys, offsets, expected, True, np.zeros(0, dtype=np.int64), {})
    assert list(layout.chunks(2)) == [[(1, 0, 7), (2, 40, 7)], [(3, None, 7), (4, 120, None)], [(5, 160, 9)]]
    assert list(layout.chunks(5)) == [[(1, 0, 7), (2, 40, 7), (3, None, 7), (4, 120, None), (5, 160, 9)]]
    assert all(type(v) is int for chunk in layout.chunks(2) for ref in chunk for v in ref if v is not None)


def test_the_outcome_of_each_kind_of_image_record(tmp_path):
    import hashlib

    from facepipe.data.decode import Reject, load_image
    from facepipe.data.extract import Outcome
    from facepipe.io.insightface_rec import RecordIOError

    tall = io.BytesIO()
    Image.fromarray(np.full((112, 96, 3), 120, np.uint8)).save(tall, format="JPEG", quality=90)
    items = [(3, crop(0)), (2.5, crop(1)), (4, tall.getvalue()), (5, b"this is not an image")]
    folder = tmp_path / "pack"
    write_pack(folder, items, header=False)
    offsets = dict(read_index(folder / "train.idx").tolist())
    pack = import_rec.RecPack(folder / "train.rec", folder / "train.idx", None, ("a", "b", "c", "alice", "bob", "eve"))
    params = PrepareParams()

    def outcome(key: int, offset: int | None, expected: int | None = None) -> Outcome:
        with open(pack.rec, "rb") as handle:
            return import_rec._image_outcome(handle, pack, key, offset, params, expected)

    sha = [hashlib.sha256(payload).hexdigest() for _, payload in items]
    assert outcome(9, None, 3) == Outcome("train.rec#9", None, reason="missing_record", detail="the header's image range holds this key; the .idx does not")
    assert outcome(1, offsets[1]) == Outcome("train.rec#1", None, reason="bad_label", detail="label 2.5 is not a whole number in [0, 2^24)")
    assert outcome(0, offsets[0], 5) == Outcome(
        "alice/train.rec#0", sha[0], reason="label_mismatch", detail="label 3, but the header puts key 0 in the identity range of label 5")
    with pytest.raises(Reject) as reject:
        load_image(items[3][1], max_pixels=params.max_pixels)
    assert outcome(3, offsets[3]) == Outcome("eve/train.rec#3", sha[3], reason=reject.value.reason, detail=reject.value.detail)
    whys = set()
    for offset in (offsets[0] + 4, (folder / "train.rec").stat().st_size - 2):  # not at a record; inside the last bytes
        with open(pack.rec, "rb") as handle, pytest.raises(RecordIOError) as error:
            from facepipe.io.insightface_rec import read_record as read

            read(handle, offset)
        why = "truncated_record" if error.value.truncated else "bad_record"
        assert outcome(0, offset) == Outcome("train.rec#0", None, reason=why, detail=str(error.value))
        whys.add(why)
    assert whys == {"bad_record", "truncated_record"}
    accepted = outcome(0, offsets[0], 3)
    assert accepted == Outcome("alice/train.rec#0", sha[0], header=accepted.header, payload=items[0][1])  # stored as it is
    assert accepted.header == {
        "path": "alice/train.rec#0", "sha256": sha[0], "box": [0.0, 0.0, 112.0, 112.0],
        "landmarks": [[38.295, 51.696], [73.532, 51.501], [56.025, 71.737], [41.549, 92.365], [70.73, 92.204]],
        "score": 1.0, "source_size": [112, 112], "encoding": "jpeg", "size": [112, 112],
        "source": {"file": "train.rec", "key": 0, "label": 3},
    }
    resized = outcome(2, offsets[2]).header
    assert (resized["path"], resized["box"], resized["source_size"], resized["size"]) == ("bob/train.rec#2", [0.0, 0.0, 96.0, 112.0], [96, 112], [112, 112])
    assert resized["landmarks"][0] == [30.295, 51.696] and resized["source"] == {"file": "train.rec", "key": 2, "label": 4}


def test_aligned_payload_refuses_small_crops_and_aligns_the_rest_onto_the_output(tmp_path):
    from facepipe.data.decode import Reject
    from facepipe.io.records import decode_image

    params = PrepareParams(min_face_size=40)
    with pytest.raises(Reject) as reject:
        import_rec.aligned_payload(crop(1, 39), params)
    assert (reject.value.reason, reject.value.detail) == ("image_too_small", "39x39 is smaller than min_face_size=40")
    stored, image = import_rec.aligned_payload(crop(1, 40), params)  # at the bound: aligned onto 112
    assert image.shape == (40, 40, 3) and decode_image(stored).shape == (112, 112, 3)
    small = PrepareParams(image_size=96, encoding="png")
    stored, image = import_rec.aligned_payload(crop(2), small)
    assert stored.startswith(b"\x89PNG\r\n\x1a\n") and decode_image(stored).shape == (96, 96, 3) and image.shape == (112, 112, 3)
    low, high = (import_rec.aligned_payload(crop(3, 160), PrepareParams(quality=q))[0] for q in (30, 95))
    assert low.startswith(b"\xff\xd8\xff") and len(low) < len(high)


def test_stray_keys_are_bad_records_named_by_the_rec_and_key():
    from facepipe.data.extract import Outcome

    pack = import_rec.RecPack(Path("/x/data.rec"), None, None)
    layout = import_rec.Layout(*(np.zeros(0, dtype=np.int64),) * 3, True, np.array([7, 9], dtype=np.int64), {})
    detail = "the key lies outside the header record's image and identity ranges"
    assert import_rec._stray_outcomes(pack, layout) == [
        Outcome("data.rec#7", None, reason="bad_record", detail=detail), Outcome("data.rec#9", None, reason="bad_record", detail=detail)]


def test_the_import_report_counts_bytes_workers_and_rate():
    from types import SimpleNamespace

    counts = {"counts": {"scanned": 10, "accepted": 8, "rejected": 2}, "rejected_by_reason": {"bad_label": 2}, "num_identities": 3, "num_shards": 2}
    built = SimpleNamespace(
        manifest={"counts": counts["counts"]}, counts=lambda: counts, shard_bytes=5000,
        builder=SimpleNamespace(payload_bytes=4000, resized=["a", "b"]),
    )
    assert import_rec._report(built, workers=1, elapsed=4.0006) == {
        **counts, "payload_bytes": 4000, "shard_bytes": 5000, "resized": 2, "workers": 1, "scheduler": "in-process",
        "timings_s": {"total": 4.001}, "images_per_s": 2.5,
    }
    report = import_rec._report(built, workers=2, elapsed=0.0)
    assert (report["scheduler"], report["timings_s"], report["images_per_s"]) == ("local", {"total": 0.0}, 10e9)
    assert import_rec._report(built, workers=3, elapsed=3.0)["images_per_s"] == 3.33


@pytest.fixture()
def runners(monkeypatch):
    """import_rec's chunk runner recorded ((args, options) of each) and always run in this process, so
    that a run that would start a cluster is seen without starting one; ``events`` logs each submission
    and each progress step in order."""
    from contextlib import contextmanager

    calls: list = []
    events: list = []
    real = import_rec.chunk_runner

    @contextmanager
    def recorded(*args, **options):
        calls.append((args, options))
        with real(*args, **{**options, "here": True}) as (submit, n_workers):
            yield (lambda chunk: events.append("submit") or submit(chunk)), n_workers

    class Recording(import_rec.Progress):
        def __init__(self, total, **kwargs):
            super().__init__(total, **kwargs)
            events.append(("bar", total, kwargs))

        def update(self, n=1):
            events.append(("done", n))
            super().update(n)

    monkeypatch.setattr(import_rec, "chunk_runner", recorded)
    monkeypatch.setattr(import_rec, "Progress", Recording)
    return calls, events


def test_a_small_pack_is_read_in_this_process_timed_and_its_resized_crops_warned(tmp_path, monkeypatch, caplog, runners, ascii_locale):
    import logging
    from types import SimpleNamespace

    folder = tmp_path / "pack"
    write_pack(folder, [(0, crop(0)), (0, crop(1)), (1, crop(2, 160))], header=False)
    for suffix in (".rec", ".idx"):  # a name that only UTF-8 writes into the manifest
        (folder / f"train{suffix}").rename(folder / f"José{suffix}")
    ticks = iter([10.0, 14.0006])
    monkeypatch.setattr(import_rec, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    params = PrepareParams(detector="retinaface", detector_weights="w.onnx", samples_per_shard=2)
    out = tmp_path / "set"
    with caplog.at_level(logging.WARNING, logger="facepipe"):
        report = import_rec.run(params, folder / "José.rec", out)  # no worker count: one, in this process
    calls, events = runners
    aligned = params.model_copy(update={"detector": "none", "detector_weights": None})
    assert calls == [((import_rec.import_chunk, import_rec.find_pack(folder / "José.rec"), aligned), {"here": True, "workers": 1, "broadcast": True})]
    assert events == [("bar", 3, {"desc": "import", "enabled": True}), "submit", ("done", 3)]
    payload = sum(len(p) for _, p in records(out).values())
    assert report == {
        "counts": {"scanned": 3, "accepted": 3, "rejected": 0}, "rejected_by_reason": {}, "num_identities": 2, "num_shards": 2,
        "payload_bytes": payload, "shard_bytes": sum(p.stat().st_size for p in (out / "shards").iterdir()), "resized": 1,
        "workers": 1, "scheduler": "in-process", "timings_s": {"total": 4.001}, "images_per_s": 0.75,
        "identity_records": {"read": 0, "missing": 0, "unusable": 0}, "validation_sets": {},
    }
    assert json.loads((out / "manifest.json").read_text(encoding="utf-8"))["source"]["file"] == "José.rec"
    assert [r.getMessage() for r in caplog.records if r.name.startswith("facepipe")] == [
        "1 aligned face(s) were not 112x112 and were resized (first: 1/José.rec#2)"]


def test_packs_from_in_process_below_start_a_worker_per_core(tmp_path, monkeypatch, runners):
    write_pack(tmp_path / "pack", [(0, crop(0)), (0, crop(1)), (1, crop(2))], header=False)
    monkeypatch.setattr(import_rec, "default_workers", lambda: 5)
    calls, _ = runners
    monkeypatch.setattr(import_rec, "IN_PROCESS_BELOW", 3)
    report = import_rec.run(PARAMS, tmp_path / "pack", tmp_path / "a", progress=False)
    assert (report["workers"], report["scheduler"], calls[-1][1]) == (5, "local", {"here": False, "workers": 5, "broadcast": True})
    monkeypatch.setattr(import_rec, "IN_PROCESS_BELOW", 4)
    report = import_rec.run(PARAMS, tmp_path / "pack", tmp_path / "b", progress=False)
    assert (report["workers"], report["scheduler"], calls[-1][1]) == (1, "in-process", {"here": True, "workers": 1, "broadcast": True})
    report = import_rec.run(PARAMS, tmp_path / "pack", tmp_path / "c", workers=2, progress=False)
    assert (report["workers"], report["scheduler"], calls[-1][1]) == (2, "local", {"here": False, "workers": 2, "broadcast": True})


def test_an_import_keeps_two_chunks_a_worker_plus_one_in_flight(tmp_path, monkeypatch, runners):
    write_pack(tmp_path / "pack", [(i % 2, crop(i)) for i in range(7)], header=False)
    monkeypatch.setattr(import_rec, "CHUNK_RECORDS", 1)
    _, events = runners
    import_rec.run(PARAMS, tmp_path / "pack", tmp_path / "set", workers=2, progress=False)
    steps = ["done" if isinstance(event, tuple) and event[0] == "done" else event for event in events[1:]]
    assert events[0] == ("bar", 7, {"desc": "import", "enabled": False})
    assert steps == ["submit"] * 5 + ["done", "submit", "done", "submit", "done"] + ["done"] * 4  # 2 x 2 + 1 in flight


def test_an_output_among_the_packs_files_is_refused_naming_the_file(tmp_path):
    from facepipe.errors import FacepipeError

    folder = tmp_path / "pack"
    write_pack(folder, [(0, crop(0)), (1, crop(1))], header=False)
    (folder / "lfw.bin").write_bytes(b"")  # refused only after the output is checked
    rec, idx, lfw = folder / "train.rec", folder / "train.idx", folder / "lfw.bin"
    for source, out, message in (
        (rec, folder, f"the record file {rec} lies inside the output {folder}; writing it would remove it"),
        (rec, idx / "set", f"the output {idx / 'set'} lies inside the index file {idx}"),
        (rec, lfw / "set", f"the output {lfw / 'set'} lies inside the validation set lfw.bin {lfw}"),
        (folder, folder / "set", f"the output {folder / 'set'} lies inside the pack folder {folder}"),
    ):
        with pytest.raises(FacepipeError) as error:
            import_rec.run(PARAMS, source, out, workers=1, progress=False)
        assert str(error.value) == message


def test_a_rec_file_without_its_index_imports_and_an_import_replaces_its_own_set(tmp_path):
    folder = tmp_path / "pack"
    write_pack(folder, [(0, crop(0)), (1, crop(1))], header=False)
    (folder / "train.idx").unlink()
    out = tmp_path / "set"
    assert import_rec.run(PARAMS, folder / "train.rec", out, workers=1, progress=False)["counts"]["accepted"] == 2
    write_pack(folder, [(0, crop(0)), (1, crop(1)), (1, crop(2))], header=False)
    assert import_rec.run(PARAMS, folder / "train.rec", out, workers=1, progress=False)["counts"]["accepted"] == 3


def test_the_layout_of_a_pack_without_header_is_every_key_in_file_order_without_ranges(tmp_path):
    folder = tmp_path / "pack"
    write_pack(folder, [(0, crop(0)), (1, crop(1)), (0, crop(2))], header=False)
    pack = import_rec.find_pack(folder)
    with open(pack.rec, "rb") as handle:
        layout = import_rec.read_layout(pack, handle)
    index = read_index(folder / "train.idx")
    assert (layout.keys.tolist(), layout.offsets.tolist()) == (index[:, 0].tolist(), index[:, 1].tolist())
    assert layout.expected.tolist() == [-1, -1, -1] and layout.header is False and layout.stray.tolist() == []
    assert layout.identity_records == {"read": 0, "missing": 0, "unusable": 0}
    assert [array.dtype for array in (layout.keys, layout.offsets, layout.expected, layout.stray)] == [np.int64] * 4  # as documented


def test_the_layout_of_a_header_pack_gives_each_image_its_ranges_label_or_minus_one(tmp_path):
    folder = tmp_path / "pack"
    write_pack(folder, [(0, crop(0)), (0, crop(1)), (1, crop(2))], header=True)  # identity records: keys 4 and 5
    lines = (folder / "train.idx").read_text().splitlines()
    (folder / "train.idx").write_text("".join(f"{line}\n" for line in lines if not line.startswith("5\t")))
    pack = import_rec.find_pack(folder)
    with open(pack.rec, "rb") as handle:
        layout = import_rec.read_layout(pack, handle)
    assert layout.keys.tolist() == [1, 2, 3] and layout.expected.tolist() == [0, 0, -1] and layout.header is True
    assert layout.identity_records == {"read": 1, "missing": 1, "unusable": 0}
    assert [array.dtype for array in (layout.keys, layout.offsets, layout.expected, layout.stray)] == [np.int64] * 4


def test_a_ranges_label_is_read_from_its_own_images_only(tmp_path):
    def expected(items: list, owners: list[int]) -> list[int]:
        folder = tmp_path / f"pack{len(items)}"
        write_pack(folder, items, header=True, identities=owners)
        pack = import_rec.find_pack(folder)
        with open(pack.rec, "rb") as handle:
            return import_rec.read_layout(pack, handle).expected.tolist()

    # range 0 is keys 1-2: its first image's label is not whole, its last one's gives the label
    assert expected([(2.5, crop(0)), (0, crop(1)), (1, crop(2))], [0, 0, 1]) == [0, 0, 1]
    # range 0 is key 1 alone, with no whole label: none, not the next range's
    assert expected([(2.5, crop(0)), (1, crop(1))], [0, 1]) == [-1, 1]


def test_the_warning_draws_only_the_missing_keys_it_shows(caplog):
    import logging

    def missing():  # a forged header may promise millions: only the first three are drawn
        yield from (5, 6, 7)
        raise AssertionError("a fourth missing key was drawn")

    with caplog.at_level(logging.WARNING, logger="facepipe.import"):
        import_rec._warn_identity_records([], {"read": 1, "missing": 10**6, "unusable": 0}, missing())
    assert [r.getMessage() for r in caplog.records] == [
        "1000000 of 1000001 identity records of the header are missing (1000000) or unusable (0), e.g. key 5: missing from the"
        " index; key 6: missing from the index; key 7: missing from the index: their images are checked against their own labels only"]
