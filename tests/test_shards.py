import hashlib

import numpy as np
import pytest

from facepipe.io import ShardReader, ShardSet, ShardSetError, ShardWriter, decode_record, encode_record
import pickle

from facepipe.io.records import RecordError, decode_header, decode_image, encode_image, payload_offset
from facepipe.io.synthetic import write_synthetic_shard_set


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
