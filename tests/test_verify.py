"""``facepipe verify`` and the cheap checks train/evaluate run first: every problem kind it reports,
each triggered by a real corruption of a real small shard set (tests/tamper.py), and the CLI's exit codes."""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from tamper import delete_record, edit_json, edit_shard, flip_byte, record_offset, rehash, replace_record, shard_file, small_set
from train_helpers import write_params

from facepipe.cli import main
from facepipe.config import EvaluateParams
from facepipe.io.manifest import check_shard_set, metadata_problems
from facepipe.io.records import encode_record
from facepipe.io.shards import ShardReader, ShardSet, ShardSetError
from facepipe.stages import evaluate
from facepipe.stages.inspect import verify


def put_record(root: Path, shard: int, key: int, *, payload: bytes | None = None, raw: bytes | None = None, **header) -> None:
    """Replace record ``key`` of shard ``shard`` by a sound record (valid CRC) with ``header`` changes,
    or by ``raw`` bytes; then rehash, so that only the record-level checks can see it."""
    reader = ShardReader(shard_file(root, shard))
    record = reader.record(key)
    reader.close()
    data = raw if raw is not None else encode_record({**record.header, **header}, record.payload if payload is None else payload)
    replace_record(shard_file(root, shard), key, data)
    rehash(root)


def sound_record_with_header(header: bytes, payload: bytes) -> bytes:
    """A version-2 record whose CRC is right but whose header bytes are whatever they are."""
    start = b"FPR" + bytes([2]) + struct.pack("<I", len(header))
    crc = zlib.crc32(payload, zlib.crc32(header, zlib.crc32(start)))
    return start + struct.pack("<I", crc) + header + payload


def labels_index(root: Path, shard: int, labels: list[int]) -> None:
    edit_shard(shard_file(root, shard), lambda txn: txn.put(b"__labels__", np.asarray(labels, "<i4").tobytes()))
    rehash(root)


def flip_in_record(root: Path, shard: int, key: int) -> None:
    offset, length = record_offset(shard_file(root, shard), key)
    flip_byte(shard_file(root, shard), offset + length // 2)


def edit_counts(**counts: int) -> Callable[[Path], None]:
    return lambda root: edit_json(root, "manifest.json", lambda m: m["counts"].update(counts))


def drop(key: str) -> Callable[[dict], None]:
    def change(mapping: dict) -> None:
        del mapping[key]

    return change


def swap_names(root: Path) -> None:
    edit_json(root, "labels.json", lambda names: [names[1], names[0], *names[2:]])


def first_reject_is_accepted_path(root: Path) -> None:
    lines = (root / "rejects.jsonl").read_text().splitlines()
    lines[0] = json.dumps({"path": "id0000/0000.jpg", "reason": "unreadable", "detail": ""}, sort_keys=True)
    (root / "rejects.jsonl").write_text("\n".join(lines) + "\n")
    rehash(root)


def garbage_reject_line(root: Path) -> None:
    lines = (root / "rejects.jsonl").read_text().splitlines()
    (root / "rejects.jsonl").write_text(lines[0] + "\nnot json\n")
    rehash(root)


# small_set: shard 0 = id0000 x 4 + id0001 key 4, shard 1 = id0001 x 3 + id0002 x 2, shard 2 = id0002 x 2.
CORRUPTIONS: dict[str, tuple[Callable[[Path], None], str]] = {
    # shards against the manifest
    "shard missing": (lambda r: shard_file(r, 2).unlink(), "shard-00002.lmdb: missing"),
    "shard grew": (lambda r: open(shard_file(r, 0), "ab").write(b"\0" * 4096), "shard-00000.lmdb: 28672 bytes, manifest says 24576"),
    "shard bytes changed": (lambda r: flip_in_record(r, 0, 2), "shard-00000.lmdb: sha256 differs from the manifest"),
    "meta count": (
        lambda r: (edit_shard(shard_file(r, 1), lambda t: t.put(b"__meta__", b'{"format": "facepipe-shard", "num_samples": 4, "version": 2}')), rehash(r)),
        "shard-00001.lmdb: 4 samples, manifest says 5",
    ),
    "label index short": (lambda r: labels_index(r, 0, [0, 0, 0, 0]), "shard-00000.lmdb: label index holds 4 labels, manifest says 5"),
    "label index outside labels.json": (lambda r: labels_index(r, 0, [0, 0, 0, 0, 7]), "shard-00000.lmdb: label index has labels outside"),
    "label index unreadable": (lambda r: (edit_shard(shard_file(r, 0), lambda t: t.delete(b"__labels__")), rehash(r)), "no label index"),
    # records
    "record checksum": (lambda r: (flip_in_record(r, 0, 2), rehash(r)), "shard-00000.lmdb key 2: record checksum mismatch"),
    "record missing": (lambda r: (delete_record(shard_file(r, 1), 3), rehash(r)), "shard-00001.lmdb key 3: record missing"),
    "header not JSON": (lambda r: put_record(r, 0, 1, raw=sound_record_with_header(b"{not json", b"x")), "shard-00000.lmdb key 1: record header is not JSON"),
    "payload not an image": (lambda r: put_record(r, 0, 1, payload=b"not an image"), "shard-00000.lmdb key 1: payload does not decode"),
    "record label != label index": (lambda r: labels_index(r, 0, [0, 0, 0, 1, 1]), "shard-00000.lmdb key 3: label 0 != label index 1"),
    "record label outside labels.json": (lambda r: put_record(r, 2, 0, label=3), "shard-00002.lmdb key 0: label 3 outside labels.json's 3 identities"),
    "path with ..": (lambda r: put_record(r, 0, 1, path="id0000/../../../x.jpg"), "shard-00000.lmdb key 1: unsafe path 'id0000/../../../x.jpg'"),
    "absolute path": (lambda r: put_record(r, 0, 1, path="/abs/x.jpg"), "shard-00000.lmdb key 1: unsafe path '/abs/x.jpg' (absolute)"),
    "path under another identity": (lambda r: put_record(r, 0, 1, path="id0002/x.jpg"), "key 1: path 'id0002/x.jpg' is not under 'id0000'"),
    "path twice": (lambda r: put_record(r, 0, 1, path="id0000/0000.jpg"), "key 1: path 'id0000/0000.jpg' also at shard-00000.lmdb key 0"),
    # labels.json
    "labels.json names swapped": (swap_names, "labels.json: sha256 differs from the manifest"),
    "labels.json names swapped, hash updated": (lambda r: (swap_names(r), rehash(r)), "path 'id0000/0000.jpg' is not under 'id0001'"),
    "labels.json name twice": (lambda r: (edit_json(r, "labels.json", lambda n: [n[0], n[0], n[2]]), rehash(r)), "labels.json: an identity name appears twice"),
    "num_identities": (lambda r: edit_json(r, "manifest.json", lambda m: m.update(num_identities=4)), "manifest num_identities 4 != 3 names in labels.json"),
    # counts and rejects
    "counts.accepted": (edit_counts(accepted=11, scanned=13), "manifest counts: accepted 11 != 12 samples in the shards"),
    "counts.rejected": (edit_counts(rejected=3, scanned=15), "manifest counts: rejected 3 != 2 lines in rejects.jsonl"),
    "counts.scanned": (edit_counts(scanned=20), "manifest counts: scanned != accepted + rejected"),
    "counts not integers": (edit_counts(scanned="14"), "manifest counts: scanned, accepted and rejected must all be integers"),
    "num_samples": (lambda r: edit_json(r, "manifest.json", lambda m: m.update(num_samples=13)), "manifest num_samples 13 != 12, the sum over shards"),
    "rejects.jsonl edited": (lambda r: open(r / "rejects.jsonl", "a").write("\n"), "rejects.jsonl: sha256 differs from the manifest"),
    "rejects.jsonl missing": (lambda r: (r / "rejects.jsonl").unlink(), "rejects.jsonl: missing"),
    "reject line not JSON": (garbage_reject_line, "rejects.jsonl line 2: not a JSON object with path and reason"),
    "rejected path also accepted": (first_reject_is_accepted_path, "rejects.jsonl line 1: 'id0000/0000.jpg' also at shard-00000.lmdb key 0"),
    "rejected_by_reason": (
        lambda r: edit_json(r, "manifest.json", lambda m: m.update(rejected_by_reason={"unreadable": 2})),
        "manifest rejected_by_reason differs from the reasons in rejects.jsonl",
    ),
    "no hashes of the small files": (lambda r: edit_json(r, "manifest.json", drop("files")), "manifest.json records no hashes"),
}


@pytest.fixture
def sound_set(tmp_path: Path) -> Path:
    root = small_set(tmp_path / "set")
    assert verify(root) == []
    return root


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_verify_reports_each_kind_of_corruption(sound_set, kind):
    corrupt, expected = CORRUPTIONS[kind]
    corrupt(sound_set)
    problems = verify(sound_set)
    assert any(expected in problem for problem in problems), problems


def test_record_problems_beyond_twenty_per_shard_are_counted(tmp_path):
    root = small_set(tmp_path / "set", samples_per_identity=10, samples_per_shard=30)
    edit_json(root, "labels.json", lambda names: ["x", "y", "z"])
    rehash(root)
    problems = verify(root)
    assert sum("is not under" in p for p in problems) == 20
    assert "shard-00000.lmdb: 10 more record problems" in problems


def test_the_cheap_checks_need_no_record(sound_set):
    """What train and evaluate run first: counts, sizes, small files' hashes, label indexes."""
    assert metadata_problems(ShardSet(sound_set)) == []
    flip_in_record(sound_set, 0, 2)  # a record's bytes: found when read, not by the cheap checks
    assert metadata_problems(ShardSet(sound_set)) == []
    edit_counts(accepted=11, scanned=13)(sound_set)
    assert metadata_problems(ShardSet(sound_set)) == ["manifest counts: accepted 11 != 12 samples in the shards"]


# The four sets of issue 8, item 8, that verify, train and evaluate used to accept.
INCONSISTENT = {
    "accepted": (edit_counts(accepted=11, scanned=13), "accepted 11 != 12"),
    "rejected": (edit_counts(rejected=3, scanned=15), "rejected 3 != 2 lines"),
    "num_identities": (lambda r: edit_json(r, "manifest.json", lambda m: m.update(num_identities=2)), "num_identities 2 != 3"),
    "swapped names": (swap_names, "labels.json: sha256 differs"),
}


@pytest.mark.parametrize("kind", INCONSISTENT)
def test_train_and_evaluate_refuse_an_inconsistent_set_before_starting(sound_set, tmp_path, capsys, kind):
    corrupt, expected = INCONSISTENT[kind]
    corrupt(sound_set)
    params = write_params(tmp_path / "params.yaml", epochs=1)
    assert main(["train", str(sound_set), str(tmp_path / "out"), "--params", str(params)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err and "facepipe verify" in err, err
    assert not (tmp_path / "out" / "checkpoints").exists()
    with pytest.raises(ShardSetError, match=expected):
        evaluate.run(EvaluateParams(device="cpu"), tmp_path / "model", sound_set, tmp_path / "eval", pairs=tmp_path / "p.jsonl")
    with pytest.raises(ShardSetError, match="inconsistent"):
        check_shard_set(sound_set)


def test_verify_cli_exit_codes(sound_set, tmp_path, capsys):
    assert main(["verify", str(sound_set)]) == 0
    assert "OK (12 samples" in capsys.readouterr().out
    flip_in_record(sound_set, 1, 3)
    assert main(["verify", str(sound_set)]) == 1
    out = capsys.readouterr().out
    assert "shard-00001.lmdb key 3: record checksum mismatch" in out and "problem(s) found" in out
    (tmp_path / "empty").mkdir()
    assert main(["verify", str(tmp_path / "empty")]) == 2
    assert "no manifest.json" in capsys.readouterr().err
    edit_json(sound_set, "manifest.json", lambda m: m.update(version=1))
    assert main(["verify", str(sound_set)]) == 2
    assert "re-run prepare" in capsys.readouterr().err


def test_a_bad_shard_list_is_a_clear_error(sound_set):
    edit_json(sound_set, "manifest.json", lambda m: m["shards"][0].update(file="../../elsewhere.lmdb"))
    with pytest.raises(ShardSetError, match="bad shard '../../elsewhere.lmdb'"):
        ShardSet(sound_set)
    edit_json(sound_set, "manifest.json", lambda m: drop("file")(m["shards"][0]))
    with pytest.raises(ShardSetError, match="malformed shard list"):
        ShardSet(sound_set)
