"""Real corruptions of real small shard sets, shared by the integrity tests (readers, verify, inspect,
train, evaluate). Each helper changes bytes on disk the way a bad disk, a bad copy or a hand edit would."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb

from facepipe.io.manifest import HASHED_FILES, dumps
from facepipe.io.records import encode_run, run_records
from facepipe.io.shards import ShardReader, sha256_file
from facepipe.synthetic.shards import write_synthetic_shard_set

KEY = struct.Struct(">Q")
REJECTS = [
    {"path": "id0000/broken.jpg", "reason": "unreadable", "detail": "cannot identify image file"},
    {"path": "id0001/tiny.jpg", "reason": "face_too_small", "detail": "31 px < 40 px"},
]


def small_set(root: Path, **overrides: Any) -> Path:
    """3 identities x 4 faces of 32x32 in 3 shards (5, 5, 2 samples), 2 rejects: 14 scanned."""
    options = dict(num_identities=3, samples_per_identity=4, samples_per_shard=5, image_size=32, rejects=REJECTS)
    return write_synthetic_shard_set(root, **{**options, **overrides})


def shard_file(root: Path, index: int = 0) -> Path:
    return root / "shards" / f"shard-{index:05d}.lmdb"


def record_offset(path: Path, key: int) -> tuple[int, int]:
    """(file offset, length) of the record stored under ``key`` in shard file ``path``."""
    reader = ShardReader(path)
    raw = reader.get(key)
    reader.close()  # nothing of this process keeps the file mapped while a test edits it
    data = path.read_bytes()
    assert data.count(raw) == 1
    return data.index(raw), len(raw)


def flip_byte(path: Path, offset: int) -> None:
    """Invert one byte of ``path`` in place (same size, same inode)."""
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))


def edit_shard(path: Path, change: Callable[[lmdb.Transaction], None]) -> None:
    """Apply ``change`` to the shard's LMDB in one write transaction (keys: KEY.pack(run), b"__labels__",
    b"__meta__"; records: :func:`replace_record`, :func:`delete_record`)."""
    ShardReader(path).close()
    env = lmdb.open(str(path), subdir=False, lock=False, map_size=1 << 26)
    try:
        with env.begin(write=True) as txn:
            change(txn)
    finally:
        env.close()


def _run_of(path: Path, key: int) -> tuple[int, int | None]:
    """(LMDB key index, position) of record ``key`` in shard ``path``: its run and place in it
    (a version-2 shard: the key itself, position None)."""
    reader = ShardReader(path)
    per_run = reader.records_per_run
    reader.close()
    return (key // per_run, key % per_run) if per_run else (key, None)


def replace_record(path: Path, key: int, data: bytes) -> None:
    """Store ``data`` as record ``key`` of shard ``path``, its run re-packed with a sound table: only
    the record's own checks can see the change."""
    run, position = _run_of(path, key)

    def change(txn: lmdb.Transaction) -> None:
        if position is None:
            txn.put(KEY.pack(run), data)
            return
        records = [bytes(raw) for raw in run_records(txn.get(KEY.pack(run)))]
        records[position] = data
        txn.put(KEY.pack(run), encode_run(records))

    edit_shard(path, change)


def delete_record(path: Path, key: int) -> None:
    """Delete the stored value holding record ``key`` of shard ``path`` (its whole run goes missing)."""
    run, _ = _run_of(path, key)
    edit_shard(path, lambda txn: txn.delete(KEY.pack(run)))


def edit_json(root: Path, name: str, change: Callable[[Any], Any]) -> None:
    """Rewrite ``root/name`` (JSON) as ``change`` returns it; ``change`` may edit in place and return None."""
    path = root / name
    data = json.loads(path.read_text())
    changed = change(data)
    path.write_text(dumps(data if changed is None else changed))


def rehash(root: Path) -> None:
    """Make the manifest's hashes and sizes agree with the files again, as a careless tool or a forger
    would: only the deeper cross-checks can still see the change."""
    def update(manifest: dict[str, Any]) -> None:
        for entry in manifest["shards"]:
            path = root / "shards" / entry["file"]
            entry["sha256"], entry["bytes"] = sha256_file(path), path.stat().st_size
        manifest["files"] = {name: sha256_file(root / name) for name in HASHED_FILES}

    edit_json(root, "manifest.json", update)
