import hashlib
import json
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from tamper import edit_json, edit_shard, flip_byte, record_offset, shard_file, small_set
from train_helpers import linear_model, tiny_params, write_params

from facepipe.cli import main
from facepipe.data.dataset import FaceDataset, make_loader
from facepipe.io.model_dir import ModelSpec, save_model_dir
from facepipe.models import create_backbone
from facepipe.stages import train
from facepipe.io import ShardReader, ShardSet, ShardSetError, ShardWriter, decode_record, encode_record
from facepipe.io.records import RecordError, decode_header, decode_image, encode_image, payload_offset
from facepipe.io.shards import CorruptRecordError
from facepipe.synthetic.shards import write_synthetic_shard_set


def test_record_round_trip():
    image = np.random.default_rng(0).integers(0, 255, (112, 112, 3), dtype=np.uint8)
    payload = encode_image(image, encoding="png")
    header = {"label": 3, "path": "a/b.jpg", "landmarks": [[1.0, 2.0]] * 5, "score": 0.99, "sha256": "ab"}
    record = decode_record(encode_record(header, payload))
    assert record.header == header and record.label == 3 and record.path == "a/b.jpg"
    np.testing.assert_array_equal(record.image(), image)  # PNG is lossless


def test_record_rejects_foreign_bytes():
    with pytest.raises(RecordError, match="magic"):
        decode_record(b"\x89PNG\r\n\x1a\n" + b"\0" * 20)
    data = bytearray(encode_record({"label": 0}, b"x"))
    data[3] = 99
    with pytest.raises(RecordError, match="version 99"):
        decode_record(bytes(data))


def test_payload_offset_skips_the_header_and_checks_the_prefix():
    data = encode_record({"label": 1, "path": "a/b.jpg"}, b"IMAGE")
    assert payload_offset(data) == decode_header(data)[1] and data[payload_offset(data) :] == b"IMAGE"
    with pytest.raises(RecordError, match="magic"):
        payload_offset(b"JFIF" + data[4:])
    with pytest.raises(RecordError, match="truncated"):
        payload_offset(data[:12])
    with pytest.raises(RecordError, match="too short"):
        payload_offset(data[:5])


def write(tmp_path, n, per_shard):
    payloads = [encode_image(np.full((16, 16, 3), i, np.uint8)) for i in range(n)]
    with ShardWriter(tmp_path, samples_per_shard=per_shard) as writer:
        for i, payload in enumerate(payloads):
            writer.write(encode_record({"label": i % 3, "path": f"x/{i}.jpg"}, payload), label=i % 3)
    return writer.shards, payloads


def test_writer_rolls_by_count_and_reader_reads_back(tmp_path):
    shards, payloads = write(tmp_path, 7, 3)
    assert [s.num_samples for s in shards] == [3, 3, 1]
    assert [s.file for s in shards] == ["shard-00000.lmdb", "shard-00001.lmdb", "shard-00002.lmdb"]
    assert not list(tmp_path.glob("*.partial"))
    for info in shards:
        assert hashlib.sha256((tmp_path / info.file).read_bytes()).hexdigest() == info.sha256
    reader = ShardReader(tmp_path / "shard-00001.lmdb")
    assert len(reader) == 3
    assert reader.labels().tolist() == [0, 1, 2]
    assert [r.path for r in reader] == ["x/3.jpg", "x/4.jpg", "x/5.jpg"]
    assert reader.record(1).payload == payloads[4]
    with pytest.raises(IndexError):
        reader.get(3)
    assert reader.get_many([2, 0, 2]) == [reader.get(2), reader.get(0), reader.get(2)]
    with pytest.raises(IndexError, match="no sample 5"):
        reader.get_many([0, 5])


def test_a_reader_travels_without_its_environment_and_reopens_after_close(tmp_path):
    """Loader workers receive readers by pickle (no LMDB handle inside) and open their own."""
    write(tmp_path, 4, 4)
    reader = ShardReader(tmp_path / "shard-00000.lmdb")
    first = reader.get(1)
    copy = pickle.loads(pickle.dumps(reader))
    assert copy.get(1) == first and len(copy) == 4
    other = ShardReader(tmp_path / "shard-00000.lmdb")
    other.get(0)
    reader.close()  # closes the process-wide environment both readers used
    assert other.get(1) == first and reader.get_many([1]) == [first]


def test_shard_bytes_are_deterministic(tmp_path):
    a, _ = write(tmp_path / "a", 10, 4)
    b, _ = write(tmp_path / "b", 10, 4)
    assert [s.sha256 for s in a] == [s.sha256 for s in b]


def test_shard_set_indexes_globally(tmp_path):
    root = write_synthetic_shard_set(tmp_path / "set", num_identities=3, samples_per_identity=5, samples_per_shard=4)
    shard_set = ShardSet(root)
    assert len(shard_set) == 15 and shard_set.num_identities == 3
    assert shard_set.labels().tolist() == [0] * 5 + [1] * 5 + [2] * 5
    assert shard_set.locate(9) == (2, 1)
    assert shard_set.record(14).path == "id0002/0004.jpg"
    assert decode_image(shard_set.record(0).payload).shape == (112, 112, 3)


def test_shard_set_errors_are_clear(tmp_path):
    with pytest.raises(ShardSetError, match="not found"):
        ShardSet(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ShardSetError, match="no manifest.json"):
        ShardSet(tmp_path / "empty")
    root = write_synthetic_shard_set(tmp_path / "set", samples_per_shard=100)
    (root / "shards" / "shard-00000.lmdb").unlink()
    with pytest.raises(ShardSetError, match="shard missing"):
        ShardSet(root).labels()


# -- integrity on read (issue 8, item 7) -----------------------------------------------------------------


def test_the_record_checksum_covers_every_byte():
    """Any single flipped byte of a record, prefix, CRC field, header or payload, fails to decode."""
    data = encode_record({"label": 1, "path": "a/b.jpg"}, b"IMAGE BYTES" * 3)
    assert decode_record(data).payload == b"IMAGE BYTES" * 3
    for position in range(len(data)):
        bad = bytearray(data)
        bad[position] ^= 0x01
        with pytest.raises(RecordError):
            decode_record(bytes(bad))
        with pytest.raises(RecordError):
            payload_offset(bytes(bad))
    assert "checksum" in str(pytest.raises(RecordError, decode_record, data[:-1] + b"X").value)


def test_the_fast_path_may_skip_the_crc_only_when_asked():
    data = bytearray(encode_record({"label": 1}, b"IMAGE"))
    data[-1] ^= 0x01
    assert payload_offset(bytes(data), verify=False) == len(data) - 5  # a caller that checked already
    with pytest.raises(RecordError, match="checksum"):
        payload_offset(bytes(data))


def test_older_records_shards_and_sets_ask_for_a_new_prepare(tmp_path):
    head = json.dumps({"label": 0}).encode()
    version_1 = b"FPR" + bytes([1]) + struct.pack("<I", len(head)) + head + b"IMAGE"
    with pytest.raises(RecordError, match="re-run prepare"):
        decode_record(version_1)
    root = small_set(tmp_path / "set")
    edit_json(root, "manifest.json", lambda manifest: {**manifest, "version": 1})
    with pytest.raises(ShardSetError, match="v1 .*re-run prepare"):
        ShardSet(root)
    root = small_set(tmp_path / "set2")
    edit_shard(shard_file(root), lambda txn: txn.put(b"__meta__", b'{"format": "facepipe-shard", "version": 1}'))
    with pytest.raises(ShardSetError, match="re-run prepare"):
        len(ShardSet(root).readers[0])


# Where in record key 1 of shard 0 a byte flips: magic, length field, CRC field, header, payload, last byte.
FLIPS = {"magic": 0, "length": 5, "crc": 9, "header": 30, "payload": 0.5, "last": -1}


@pytest.mark.parametrize("where", FLIPS)
def test_a_flipped_byte_fails_every_read_path_naming_shard_and_key(tmp_path, where):
    root = small_set(tmp_path / "set")
    offset, length = record_offset(shard_file(root), 1)
    at = FLIPS[where]
    flip_byte(shard_file(root), offset + (int(at * length) if isinstance(at, float) else at % length))
    shard_set = ShardSet(root)
    reader = shard_set.readers[0]
    named = "shard-00000.lmdb key 1"
    for read in (
        lambda: reader.get(1),
        lambda: reader.get_many([0, 1, 2]),
        lambda: reader.record(1),
        lambda: list(reader),
        lambda: shard_set.get(1),
        lambda: shard_set.record(1),
        lambda: FaceDataset(shard_set).__getitems__([0, 1, 2]),
        lambda: FaceDataset(shard_set)[1],
    ):
        with pytest.raises(CorruptRecordError, match=named):
            read()
    assert reader.get(0) and reader.get_many([0, 2, 3])  # the other records still read


def test_skip_corrupt_records_fills_the_batch_and_counts(tmp_path):
    root = small_set(tmp_path / "set")
    offset, length = record_offset(shard_file(root), 1)
    flip_byte(shard_file(root), offset + length // 2)
    dataset = FaceDataset(root, skip_corrupt=True, normalize=False)
    batch = dataset.__getitems__([(0, 10), (1, 11), (2, 12)])
    assert len(batch) == 3 and dataset.skipped == 1
    # Item 1's place went to a sound item of the same batch (item 2: its pixels and its label).
    sound = FaceDataset(root, normalize=False).__getitems__([(0, 10), (2, 12)])
    assert torch.equal(batch[0][0], sound[0][0]) and torch.equal(batch[2][0], sound[1][0])
    assert torch.equal(batch[1][0], sound[1][0]) and batch[1][1] == sound[1][1]
    dataset.__getitems__([(1, 0), (3, 1)])
    assert dataset.skipped == 2  # every read of it counts
    with pytest.raises(ShardSetError, match="every record of a batch"):
        dataset.__getitems__([(1, 0)])
    with pytest.raises(CorruptRecordError, match="shard-00000.lmdb key 1"):
        FaceDataset(root).__getitems__([(0, 0), (1, 1)])  # off by default


@pytest.mark.multiprocess
def test_skipped_records_are_counted_across_loader_workers(tmp_path):
    root = small_set(tmp_path / "set")
    offset, length = record_offset(shard_file(root), 1)
    flip_byte(shard_file(root), offset + length // 2)
    dataset = FaceDataset(root, skip_corrupt=True, normalize=False)
    batches = [[(0, 0), (1, 1)], [(1, 2), (2, 3)], [(3, 4), (4, 5)], [(1, 6), (5, 7)]]
    loader = make_loader(dataset, batches, num_workers=2)
    assert [len(labels) for _, labels in loader] == [2, 2, 2, 2]
    assert dataset.skipped == 3


def write_pairs(root: Path, path: Path) -> Path:
    """4 same and 4 different pairs over the 12 faces of ``small_set`` (identity = index // 4)."""
    shard_set = ShardSet(root)
    pairs = [(0, 1), (2, 3), (4, 5), (6, 7), (0, 4), (1, 8), (5, 9), (2, 10)]
    lines = [
        json.dumps({"index1": a, "path1": shard_set.record(a).path, "index2": b, "path2": shard_set.record(b).path,
                    "same": a // 4 == b // 4})
        for a, b in pairs
    ]
    shard_set.close()
    path.write_text("\n".join(lines) + "\n")
    return path


def cli_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_train_and_evaluate_stop_on_a_flipped_byte_naming_shard_and_key(tmp_path, capsys):
    root = small_set(tmp_path / "set", image_size=16)
    pairs = write_pairs(root, tmp_path / "pairs.jsonl")
    spec = ModelSpec(backbone="mobilefacenet", embedding_size=16, image_size=16)
    torch.manual_seed(0)
    save_model_dir(tmp_path / "model", create_backbone(spec.backbone, embedding_size=16, image_size=16), spec)
    params = write_params(tmp_path / "params.yaml", epochs=1, batch_size=4, reference_batch=4)  # every sample read
    with open(params, "a") as handle:
        handle.write(f"evaluate:\n  pairs: {pairs}\n  device: cpu\n  folds: 2\n")
    offset, length = record_offset(shard_file(root, 1), 1)  # sample 6, in a pair and in every epoch
    flip_byte(shard_file(root, 1), offset + length // 2)
    err = cli_error(capsys, ["train", str(root), str(tmp_path / "out"), "--params", str(params)])
    assert "shard-00001.lmdb key 1" in err and "checksum" in err
    err = cli_error(capsys, ["evaluate", str(tmp_path / "model"), str(root), str(tmp_path / "eval"), "--params", str(params)])
    assert "shard-00001.lmdb key 1" in err and "checksum" in err
    assert not (tmp_path / "eval").exists()


def test_train_skips_corrupt_records_when_asked_and_reports_the_count(tmp_path):
    root = small_set(tmp_path / "set", image_size=16)
    offset, length = record_offset(shard_file(root, 1), 1)
    flip_byte(shard_file(root, 1), offset + length // 2)
    params = tiny_params(epochs=2, batch_size=4, reference_batch=4, skip_corrupt_records=True)
    report = train.run(params, root, tmp_path / "out", model_factory=linear_model)
    assert report.steps == 6 and report.skipped_records == 2  # 12 samples in 3 batches: read once an epoch


def test_the_manifest_records_sizes_and_small_file_hashes_deterministically(tmp_path):
    a, b = small_set(tmp_path / "a"), small_set(tmp_path / "b")
    assert (a / "manifest.json").read_bytes() == (b / "manifest.json").read_bytes()
    manifest = json.loads((a / "manifest.json").read_text())
    assert manifest["version"] == 3 and manifest["files"] == {  # 3: generations (prepare --update)
        name: hashlib.sha256((a / name).read_bytes()).hexdigest() for name in ("labels.json", "rejects.jsonl")
    }
    assert [s["bytes"] for s in manifest["shards"]] == [shard_file(a, i).stat().st_size for i in range(3)]


# -- runs of records (format 3): limits found by mutation testing ---------------------------------------


def test_a_run_refuses_no_records_and_more_than_4_gib_naming_the_limit():
    from facepipe.io.records import encode_run

    with pytest.raises(ValueError, match=r"^a run holds at least one record$"):
        encode_run([])

    class Sized:  # stands in for a record of that many bytes: only len() is read before the limit check
        def __init__(self, size: int) -> None:
            self.size = size

        def __len__(self) -> int:
            return self.size

    # exactly 4 GiB no longer fits the table's uint32 offsets; the message gives the run's total
    with pytest.raises(ValueError, match=r"^a run of 3 records is 4294967296 bytes: at most 4 GiB$"):
        encode_run([Sized(1 << 31), Sized(1 << 30), Sized(1 << 30)])


def test_a_run_table_offset_past_2_gib_is_corrupt_not_negative():
    """Offsets are unsigned: an entry of 0x90000000 (with a valid table CRC) points past the run's end."""
    import zlib

    from facepipe.io import records as records_module
    from facepipe.io.records import encode_run, run_record

    run = bytearray(encode_run([b"first", b"second"]))
    table_at = records_module._RUN_PREFIX.size
    struct.pack_into("<I", run, table_at, 0x9000_0000)  # the end of record 0, the start of record 1
    crc = zlib.crc32(bytes(run[table_at : table_at + 8]), zlib.crc32(bytes(run[: records_module._RUN_CRC_AT])))
    struct.pack_into("<I", run, records_module._RUN_CRC_AT, crc)
    with pytest.raises(RecordError, match=r"^run table does not match the run's bytes \(corrupt run\)$"):
        run_record(bytes(run), 1)
