"""Shard format 3 (records in runs) against format 2 (one record per LMDB value): bytes and read time.

    .venv/bin/python benchmarks/shard_storage_bench.py [--faces 10000] [--prepared DIR ...] [--repeats 7]

1. storage over the JPEG payload of the same records stored both ways (and with runs of 8 and 32),
   on a synthetic set of ``--faces`` 112x112 faces (shards of 10,000, prepare's default) and on
   every ``--prepared`` set given (e.g. a prepare of `facepipe sample-data`);
2. the training loader's batched read (``ShardReader.get_many``, batches of 64 in random order within
   a shard) of 2,000 faces from each layout, alternating, against the JPEG decode of the same records.

Format 2 is written here as facepipe wrote it (one value per sample under its index); the reader
reads both, so the read path compared is the one a user gets.
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

import lmdb
import numpy as np

from facepipe.io import ShardReader, ShardSet, ShardWriter
from facepipe.io.records import decode_image, decode_record, payload_offset
from facepipe.synthetic.shards import write_synthetic_shard_set


def write_format_2(path: Path, records: list[bytes], labels: list[int]) -> int:
    """One shard as format 2 stored it; returns its size in bytes."""
    partial = path.with_suffix(".partial")
    env = lmdb.open(str(partial), subdir=False, map_size=1 << 36, lock=False, sync=False, meminit=True)
    with env.begin(write=True) as txn:
        for index, record in enumerate(records):
            txn.put(struct.pack(">Q", index), record, append=True)
        txn.put(b"__labels__", np.asarray(labels, "<i4").tobytes())
        meta = {"format": "facepipe-shard", "num_samples": len(records), "version": 2}
        txn.put(b"__meta__", json.dumps(meta, sort_keys=True).encode())
    env.copy(str(path), compact=True)
    env.close()
    partial.unlink()
    return path.stat().st_size


def storage(name: str, root: Path, tmp: Path, *, per_shard: int = 10_000) -> dict[str, object]:
    """Overhead over the JPEG payload of the records of ``root`` in format 2 and in runs of 8/16/32."""
    shard_set = ShardSet(root)
    records = [shard_set.get(i) for i in range(len(shard_set))]
    labels = shard_set.labels().tolist()
    payload = sum(len(decode_record(record).payload) for record in records)
    out: dict[str, object] = {"set": name, "faces": len(records), "payload_bytes_per_face": round(payload / len(records))}
    out["record_headers"] = round(sum(map(len, records)) / payload - 1, 4)  # in every layout
    (tmp / "v2").mkdir(parents=True)
    sizes = [
        write_format_2(tmp / "v2" / f"{first}.lmdb", records[first : first + per_shard], labels[first : first + per_shard])
        for first in range(0, len(records), per_shard)
    ]
    out["format 2"] = round(sum(sizes) / payload - 1, 4)
    for per_run in (8, 16, 32):
        with ShardWriter(tmp / f"v3-{per_run}", samples_per_shard=per_shard, records_per_run=per_run) as writer:
            for record, label in zip(records, labels):
                writer.write(record, label=label)
        out[f"format 3, runs of {per_run}"] = round(sum(info.bytes for info in writer.shards) / payload - 1, 4)
    return out


def read_times(tmp: Path, repeats: int) -> dict[str, float]:
    """µs per record of batched reads from both layouts (same 2,000 faces) and of their JPEG decode."""
    root = write_synthetic_shard_set(tmp / "set", num_identities=100, samples_per_identity=20, samples_per_shard=500)
    shard_set = ShardSet(root)
    records, labels = [shard_set.get(i) for i in range(len(shard_set))], shard_set.labels().tolist()
    (tmp / "v2").mkdir(parents=True)
    for k in range(4):
        write_format_2(tmp / "v2" / f"shard-{k:05d}.lmdb", records[500 * k : 500 * (k + 1)], labels[500 * k : 500 * (k + 1)])
    layouts = {
        "format 2": [ShardReader(tmp / "v2" / f"shard-{k:05d}.lmdb") for k in range(4)],
        "format 3": shard_set.readers,
    }
    rng = np.random.default_rng(0)

    def one_pass(readers: list[ShardReader]) -> float:
        start = time.perf_counter()
        for reader in readers:
            order = rng.permutation(500).tolist()
            for first in range(0, 500, 64):
                reader.get_many(order[first : first + 64])
        return (time.perf_counter() - start) / len(records) * 1e6

    times: dict[str, list[float]] = {name: [] for name in layouts}
    for _ in range(repeats):
        for name, readers in layouts.items():
            times[name].append(one_pass(readers))
    start = time.perf_counter()
    for record in records[:500]:
        decode_image(memoryview(record)[payload_offset(record, verify=False) :])
    result = {name: statistics.median(values) for name, values in times.items()}
    result["JPEG decode"] = (time.perf_counter() - start) / 500 * 1e6
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faces", type=int, default=10_000)
    parser.add_argument("--prepared", type=Path, nargs="*", default=[])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="facepipe-shard-bench-") as tmp_name:
        tmp = Path(tmp_name)
        for number, root in enumerate(args.prepared):
            print(json.dumps(storage(str(root), root, tmp / f"p{number}")), flush=True)
        synthetic = write_synthetic_shard_set(
            tmp / "synthetic", num_identities=args.faces // 10, samples_per_identity=10, samples_per_shard=10_000
        )
        print(json.dumps(storage(f"synthetic {args.faces}", synthetic, tmp / "s")), flush=True)
        times = read_times(tmp / "read", args.repeats)
        extra = times["format 3"] - times["format 2"]
        print(
            f"get_many, µs per record: format 2 {times['format 2']:.1f}, format 3 {times['format 3']:.1f} "
            f"({extra:+.1f}); JPEG decode {times['JPEG decode']:.0f}: the difference is "
            f"{100 * extra / times['JPEG decode']:+.2f}% of a decode",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
