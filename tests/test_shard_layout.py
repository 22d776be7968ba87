"""The inside of a shard (format 3): records packed in runs of consecutive samples, one LMDB value per
run. Storage close to the JPEG payload, random access equal to sequential reads, corruption inside a
run named by record, version-2 shards still read."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import lmdb
import numpy as np
import pytest
from tamper import flip_byte, record_offset, rehash, small_set

from facepipe.data.dataset import FaceDataset
from facepipe.io import ShardReader, ShardSet, ShardWriter, encode_record
from facepipe.io.records import RecordError, decode_record, encode_image, encode_run, run_record, run_records
from facepipe.io.shards import SHARD_VERSION, CorruptRecordError, ShardSetError
from facepipe.synthetic.shards import write_synthetic_shard_set
from facepipe.stages.inspect import summarize, verify

KEY = struct.Struct(">Q")


def records(n: int) -> list[bytes]:
    """``n`` small records of distinct sizes (payload i holds i + 1 bytes of value i)."""
    return [encode_record({"label": i % 3, "path": f"x/{i}.jpg"}, bytes([i % 256]) * (i + 1)) for i in range(n)]


def write(directory: Path, data: list[bytes], *, per_shard: int, per_run: int) -> list[Path]:
    with ShardWriter(directory, samples_per_shard=per_shard, records_per_run=per_run) as writer:
        for i, record in enumerate(data):
            writer.write(record, label=i % 3)
    return [directory / info.file for info in writer.shards]


def test_run_bytes_follow_the_documented_layout():
    """b"FPN" | u8 1 | u32 count | u32 CRC-32 of the 8 bytes before it and the ends | u32 end[count] | records."""
    parts = [b"first", b"", b"third record"]
    ends = struct.pack("<3I", 5, 5, 17)
    start = b"FPN" + bytes([1]) + struct.pack("<I", 3)
    by_hand = start + struct.pack("<I", zlib.crc32(start + ends)) + ends + b"".join(parts)
    assert encode_run(parts) == by_hand
    assert [bytes(view) for view in run_records(by_hand)] == parts
    assert bytes(run_record(by_hand, 2)) == b"third record" and bytes(run_record(by_hand, 1)) == b""
    with pytest.raises(IndexError, match="no record 3"):
        run_record(by_hand, 3)
    with pytest.raises(ValueError, match="at least one"):
        encode_run([])


def test_every_flipped_byte_of_a_run_table_is_caught():
    run = encode_run([b"a" * 10, b"b" * 20])
    for position in range(12 + 4 * 2):  # prefix, CRC field and the ends
        bad = bytearray(run)
        bad[position] ^= 0x01
        with pytest.raises(RecordError):
            run_record(bytes(bad), 1)
    with pytest.raises(RecordError, match="truncated"):
        run_record(run[:15], 0)


@pytest.mark.parametrize("per_run", [1, 3, 16])
def test_random_access_equals_sequential_reads(tmp_path, per_run):
    """Shards of 10 whose runs do not divide them (runs of 3: 3 + 3 + 3 + 1); every read path agrees."""
    data = records(23)
    paths = write(tmp_path, data, per_shard=10, per_run=per_run)
    assert [ShardReader(path).meta()["num_samples"] for path in paths] == [10, 10, 3]
    rng = np.random.default_rng(per_run)
    for shard, path in enumerate(paths):
        reader = ShardReader(path)
        stored = data[10 * shard : 10 * shard + len(reader)]
        assert reader.meta()["version"] == SHARD_VERSION and reader.records_per_run == per_run
        assert [decode_record(stored_record).payload for stored_record in stored] == [r.payload for r in reader]
        assert [reader.get(i) for i in range(len(reader))] == stored
        order = rng.permutation(len(reader)).tolist() * 2  # shuffled, each index twice
        assert reader.get_many(order) == [stored[i] for i in order]
        assert reader.labels().tolist() == [(10 * shard + i) % 3 for i in range(len(reader))]
        for missing in (len(reader), len(reader) + per_run, -1):
            with pytest.raises(IndexError, match=f"no sample {missing}"):
                reader.get(missing)


def test_a_synthetic_set_costs_at_most_ten_percent_over_its_jpeg_payload(tmp_path):
    """Format 2 stored one ~13 KB record per LMDB value and lost ~28 % to whole 4 KiB overflow pages
    (measured: the demo set 28.8 %, 10,000 synthetic faces 27.9 %); runs of 16 bring it to ~4-6 %."""
    root = write_synthetic_shard_set(tmp_path / "set", num_identities=8, samples_per_identity=20, samples_per_shard=100)
    summary = summarize(root)
    assert summary["samples"] == 160 and summary["storage_overhead"] <= 0.10, summary
    assert verify(root) == []


def corrupt_record(path: Path, key: int) -> None:
    offset, length = record_offset(path, key)
    flip_byte(path, offset + length // 2)


def test_corruption_inside_a_run_names_the_record_and_spares_its_neighbours(tmp_path):
    root = write_synthetic_shard_set(tmp_path / "set", num_identities=2, samples_per_identity=12, image_size=16,
                                     samples_per_shard=24)
    path = root / "shards" / "shard-00000.lmdb"
    corrupt_record(path, 5)  # in the middle of run 0 (records 0-15)
    shard_set = ShardSet(root)
    reader = shard_set.readers[0]
    named = "shard-00000.lmdb key 5: record checksum mismatch"
    for read in (
        lambda: reader.get(5),
        lambda: reader.get_many([4, 5, 6]),
        lambda: reader.record(5),
        lambda: list(reader),
        lambda: FaceDataset(shard_set).__getitems__([4, 5, 6]),
    ):
        with pytest.raises(CorruptRecordError, match=named):
            read()
    assert reader.get_many([0, 4, 6, 15, 16]) and reader.get(4) and reader.get(6)  # same run, still sound
    problems = verify(root)
    assert any(named in problem for problem in problems) and not any("key 4:" in p or "key 6:" in p for p in problems)


def test_a_damaged_run_table_names_the_record_asked_for(tmp_path):
    paths = write(tmp_path, records(20), per_shard=20, per_run=16)
    data = paths[0].read_bytes()
    table = data.index(b"FPN\x01" + struct.pack("<I", 16))
    flip_byte(paths[0], table + 12 + 4 * 7)  # end of record 7
    reader = ShardReader(paths[0])
    for key in (3, 7, 15):
        with pytest.raises(CorruptRecordError, match=f"shard-00000.lmdb key {key}: run table checksum mismatch"):
            reader.get(key)
    with pytest.raises(CorruptRecordError, match="key 0: run table checksum mismatch"):
        list(reader)
    assert reader.get_many([16, 19])  # the next run is sound


def write_version_2_shard(path: Path, data: list[bytes], labels: list[int]) -> None:
    """A shard as facepipe's format 2 wrote it: one record per value under the sample index."""
    env = lmdb.open(str(path), subdir=False, map_size=1 << 26, lock=False)
    with env.begin(write=True) as txn:
        for index, record in enumerate(data):
            txn.put(KEY.pack(index), record)
        txn.put(b"__labels__", np.asarray(labels, "<i4").tobytes())
        txn.put(b"__meta__", json.dumps({"format": "facepipe-shard", "num_samples": len(data), "version": 2}).encode())
    env.close()


def test_version_2_shards_are_still_read(tmp_path):
    data = records(7)
    write_version_2_shard(tmp_path / "shard-00000.lmdb", data, [0, 1, 2, 0, 1, 2, 0])
    reader = ShardReader(tmp_path / "shard-00000.lmdb")
    assert reader.records_per_run == 0 and len(reader) == 7
    assert [reader.get(i) for i in range(7)] == data and reader.get_many([6, 0, 6]) == [data[6], data[0], data[6]]
    assert [r.path for r in reader] == [f"x/{i}.jpg" for i in range(7)]
    assert reader.labels().tolist() == [0, 1, 2, 0, 1, 2, 0]
    with pytest.raises(IndexError, match="no sample 7"):
        reader.get(7)


def test_a_set_of_version_2_shards_reads_trains_and_verifies(tmp_path):
    """A set prepared before format 3 (its shards rewritten here as format 2 wrote them, the manifest's
    hashes and sizes updated): the dataset, iteration and verify work without a new prepare."""
    root = small_set(tmp_path / "set")
    before = ShardSet(root)
    expected = [before.get(i) for i in range(len(before))]
    for reader in before.readers:
        data, labels = [reader.get(i) for i in range(len(reader))], reader.labels().tolist()
        reader.close()
        reader.path.unlink()
        write_version_2_shard(reader.path, data, labels)
    rehash(root)
    shard_set = ShardSet(root)
    assert [reader.records_per_run for reader in shard_set.readers] == [0, 0, 0]
    assert [shard_set.get(i) for i in range(len(shard_set))] == expected
    assert [record.path for reader in shard_set.readers for record in reader] == [decode_record(r).path for r in expected]
    images = FaceDataset(shard_set).__getitems__([0, 11, 5])
    assert [label for _, label in images] == [0, 2, 1]
    assert verify(root) == []


def test_unknown_shard_versions_and_run_sizes_are_refused(tmp_path):
    for number, meta in enumerate([{"version": 4, "records_per_run": 16}, {"version": 3, "records_per_run": 0},
                                   {"version": 3}]):
        path = tmp_path / f"shard-{number:05d}.lmdb"
        write_version_2_shard(path, records(2), [0, 1])
        env = lmdb.open(str(path), subdir=False, map_size=1 << 26, lock=False)
        with env.begin(write=True) as txn:
            txn.put(b"__meta__", json.dumps({"format": "facepipe-shard", "num_samples": 2, **meta}).encode())
        env.close()
        with pytest.raises(ShardSetError, match="unsupported shard format|bad records_per_run"):
            ShardReader(path).get(0)


def test_writer_refuses_a_run_size_below_one(tmp_path):
    with pytest.raises(ValueError, match="records_per_run"):
        ShardWriter(tmp_path, samples_per_shard=4, records_per_run=0)


def test_a_large_image_set_reads_back_pixel_for_pixel(tmp_path):
    """Runs of PNG faces (lossless, ~20 KB each): the images decode back exactly through the dataset."""
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (48, 48, 3), dtype=np.uint8) for _ in range(18)]
    data = [encode_record({"label": 0, "path": f"a/{i}.png"}, encode_image(image, encoding="png")) for i, image in enumerate(images)]
    paths = write(tmp_path, data, per_shard=18, per_run=16)
    reader = ShardReader(paths[0])
    for i in (17, 0, 15, 16):
        np.testing.assert_array_equal(reader.record(i).image(), images[i])
