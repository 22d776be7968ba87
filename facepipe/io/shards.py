"""LMDB shards: a rolling writer and lazy, fork-safe readers.

A shard is a single-file LMDB environment (``subdir=False``). Records are stored in runs of
``records_per_run`` consecutive samples (``__meta__``; :func:`facepipe.io.records.encode_run`), one
LMDB value per run under the 8-byte big-endian run index: the values are large enough that LMDB's
rounding to whole 4 KiB pages costs < 2 % instead of ~30 % for one ~10 KB record per value, and
reading a sample still touches only the run's table and that sample's bytes (the map is read in
place). Sample ``i`` is record ``i % records_per_run`` of run ``i // records_per_run``. Two reserved
keys hold the per-shard label index (``__labels__``: int32 little endian, one per sample, readable
without touching image bytes) and a small JSON ``__meta__``. Version 2 shards (one record per value,
under the sample index) are still read.

Every read of a record (:meth:`ShardReader.get`, :meth:`~ShardReader.get_many`, iteration) checks
its CRC-32 (:mod:`facepipe.io.records`) and names the shard and key of a corrupt one.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from facepipe.errors import FacepipeError
from facepipe.io.records import (
    Record,
    RecordError,
    decode_record,
    encode_run,
    payload_offset,
    run_record,
    run_records,
    unsafe_path_reason,
)

SHARD_FORMAT = "facepipe-shard"
SHARD_VERSION = 3  # 3: records in runs (records.encode_run); 2: one record per value, records with a CRC-32
#: Shard versions this facepipe reads (it writes SHARD_VERSION).
READABLE_SHARD_VERSIONS = (2, 3)
RECORDS_PER_RUN = 16  # ~100-160 KB values for 112x112 JPEG faces: < 2 % lost to page rounding
SET_FORMAT = "facepipe-shards"
SET_VERSION = 3  # 3: generations (prepare --update) with per-generation exclusions; sources.jsonl
#: Set versions this facepipe reads: 2 (record CRC-32s; shard sizes and small files' hashes) and 3.
READABLE_SET_VERSIONS = (2, 3)

LABELS_KEY = b"__labels__"
META_KEY = b"__meta__"
_KEY = struct.Struct(">Q")
_MAP_SIZE = 1 << 40  # address space only: the file grows with its content
_TXN_RECORDS = 512  # records per write transaction; fixed so that the file bytes are deterministic


class ShardSetError(FacepipeError):
    """A shard or shard set that is missing, corrupt or of an unknown format."""


class CorruptRecordError(ShardSetError):
    """A record whose bytes fail their checks (CRC-32, prefix); names its shard file and key."""

    def __init__(self, shard: Path, key: int, reason: str) -> None:
        super().__init__(f"corrupt record: {shard} key {key}: {reason}")
        self.shard = shard
        self.key = key
        self.reason = reason


def _older(version: object, current: int) -> str:
    """The advice for a set or shard written by an older facepipe, else nothing."""
    return "; written by an older facepipe: re-run prepare" if isinstance(version, int) and version < current else ""


#: Where a set keeps its shard files, and the names they have there (:func:`shard_name`).
SHARDS_DIR = "shards"
SHARD_PATTERN = "shard-*.lmdb"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.lmdb"


def shard_path(root: str | Path, file: str) -> Path:
    """The shard file ``file`` (a manifest entry's name) of the set at ``root``."""
    return Path(root) / SHARDS_DIR / file


def shard_bytes(root: str | Path, manifest: dict[str, Any]) -> int:
    """The bytes on disk of the shards ``manifest`` lists."""
    return sum(shard_path(root, entry["file"]).stat().st_size for entry in manifest["shards"])


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    """The hex sha256 of a file's bytes, read ``chunk`` bytes at a time (shards, weights files)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class ShardInfo:
    """What the manifest says of one finished shard (``bytes``: the file's size)."""

    file: str
    num_samples: int
    sha256: str
    payload_bytes: int
    bytes: int

    def manifest_entry(self) -> dict[str, Any]:
        return {"file": self.file, "num_samples": self.num_samples, "sha256": self.sha256, "bytes": self.bytes}


class ShardWriter:
    """Streams records into ``shard-NNNNN.lmdb`` files under ``directory``, rolling by sample count.

    Records are grouped into runs of ``records_per_run`` (the last run of a shard may be shorter).
    Each finished shard is compacted into place and reported to ``on_shard``. Use as a context
    manager or call :meth:`close`; a writer that fails leaves only ``*.partial`` files behind.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        samples_per_shard: int,
        records_per_run: int = RECORDS_PER_RUN,
        on_shard: Callable[[ShardInfo], None] | None = None,
    ) -> None:
        if samples_per_shard < 1:
            raise ValueError("samples_per_shard must be >= 1")
        if records_per_run < 1:
            raise ValueError("records_per_run must be >= 1")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.samples_per_shard = samples_per_shard
        self.records_per_run = records_per_run
        self.on_shard = on_shard
        self._run: list[bytes] = []
        self.shards: list[ShardInfo] = []
        self._env: lmdb.Environment | None = None
        self._txn: lmdb.Transaction | None = None
        self._labels: list[int] = []
        self._payload_bytes = 0
        self._partial: Path | None = None

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def write(self, record: bytes, *, label: int, payload_bytes: int = 0) -> None:
        """Append one encoded record of class ``label``."""
        if self._env is None:
            self._open()
        self._run.append(record)
        self._labels.append(label)
        self._payload_bytes += payload_bytes
        if len(self._run) == self.records_per_run:
            self._put_run()
        if len(self._labels) >= self.samples_per_shard:
            self._finish()

    def _put_run(self) -> None:
        assert self._env is not None and self._txn is not None
        run_index = (len(self._labels) - 1) // self.records_per_run
        self._txn.put(_KEY.pack(run_index), encode_run(self._run), append=True)
        self._run = []
        if (run_index + 1) % max(1, _TXN_RECORDS // self.records_per_run) == 0:
            self._txn.commit()
            self._txn = self._env.begin(write=True)

    def close(self) -> list[ShardInfo]:
        """Finish the open shard (if any); returns every shard written."""
        if self._env is not None:
            self._finish()
        return self.shards

    def abort(self) -> None:
        if self._txn is not None:
            self._txn.abort()
        if self._env is not None:
            self._env.close()
        if self._partial is not None:
            self._partial.unlink(missing_ok=True)
        self._env = self._txn = self._partial = None
        self._run = []

    def _open(self) -> None:
        self._partial = self.directory / (shard_name(len(self.shards)) + ".partial")
        self._partial.unlink(missing_ok=True)
        self._env = lmdb.open(
            str(self._partial), subdir=False, map_size=_MAP_SIZE, lock=False, sync=False, meminit=True
        )
        self._txn = self._env.begin(write=True)
        self._labels = []
        self._run = []
        self._payload_bytes = 0

    def _finish(self) -> None:
        assert self._env is not None and self._txn is not None and self._partial is not None
        if self._run:
            self._put_run()
        labels = np.asarray(self._labels, dtype="<i4")
        self._txn.put(LABELS_KEY, labels.tobytes())
        meta = {
            "format": SHARD_FORMAT,
            "version": SHARD_VERSION,
            "num_samples": len(labels),
            "records_per_run": self.records_per_run,
        }
        self._txn.put(META_KEY, json.dumps(meta, sort_keys=True).encode())
        self._txn.commit()
        name = shard_name(len(self.shards))
        final = self.directory / name
        final.unlink(missing_ok=True)
        self._env.copy(str(final), compact=True)
        self._env.close()
        self._partial.unlink()
        info = ShardInfo(name, len(labels), sha256_file(final), self._payload_bytes, final.stat().st_size)
        self.shards.append(info)
        self._env = self._txn = self._partial = None
        if self.on_shard is not None:
            self.on_shard(info)


_readonly_envs: dict[tuple[int, int], lmdb.Environment] = {}
# Bumped whenever an environment of the cache is closed (a fork, ShardReader.close): readers hold on
# to their environment between reads and look it up again only after a bump.
_envs_epoch = 0


def _forget_inherited_envs() -> None:
    # An LMDB environment must not be used across fork(), and py-lmdb refuses to open a file again in
    # a child that inherited it open. Closing the child's copy of a read-only, lock-free environment
    # releases nothing the parent holds (no lock table; munmap and close act on this process only).
    global _envs_epoch
    for env in _readonly_envs.values():
        env.close()
    _readonly_envs.clear()
    _envs_epoch += 1


os.register_at_fork(after_in_child=_forget_inherited_envs)


def readonly_env(path: Path) -> lmdb.Environment:
    """The process-wide read-only environment of shard file ``path`` (one per file, opened on first use)."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        raise ShardSetError(f"shard missing: {path}") from None
    key = (stat.st_dev, stat.st_ino)  # a file replaced at the same path is a different shard
    env = _readonly_envs.get(key)
    if env is None:
        try:
            env = lmdb.open(str(path), subdir=False, readonly=True, lock=False, readahead=False, max_readers=1024)
        except lmdb.Error as error:
            raise ShardSetError(f"shard unreadable: {path} ({error})") from None
        _readonly_envs[key] = env
    return env


class ShardReader:
    """Read-only access to one shard; the LMDB environment is opened lazily, once per process and file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._len: int | None = None
        self._per_run: int | None = None  # records per LMDB value; 0: version 2, one record per sample key
        self._env: lmdb.Environment | None = None
        self._env_epoch = -1

    def __getstate__(self) -> dict[str, Any]:
        # An environment never travels to another process (a loader worker opens its own).
        return {"path": self.path, "_len": self._len, "_per_run": self._per_run}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"])
        self._len = state["_len"]
        self._per_run = state.get("_per_run")

    @property
    def env(self) -> lmdb.Environment:
        # Looked up (one stat) on first use and after a fork or close, not on every read.
        if self._env is None or self._env_epoch != _envs_epoch:
            self._env = readonly_env(self.path)
            self._env_epoch = _envs_epoch
        return self._env

    def close(self) -> None:
        """Close this file's environment in this process (other readers of it reopen on next use)."""
        global _envs_epoch
        for key, env in list(_readonly_envs.items()):
            if env.path() == str(self.path):
                env.close()
                del _readonly_envs[key]
        _envs_epoch += 1
        self._env = None

    def meta(self) -> dict[str, Any]:
        with self.env.begin() as txn:
            raw = txn.get(META_KEY)
        if raw is None:
            raise ShardSetError(f"not a facepipe shard (no {META_KEY.decode()}): {self.path}")
        meta = json.loads(raw)
        if meta.get("format") != SHARD_FORMAT or meta.get("version") not in READABLE_SHARD_VERSIONS:
            raise ShardSetError(
                f"unsupported shard format {meta.get('format')} v{meta.get('version')}: {self.path}"
                + _older(meta.get("version"), READABLE_SHARD_VERSIONS[0])
            )
        per_run = meta.get("records_per_run", 0) if meta["version"] >= 3 else 0
        if not isinstance(per_run, int) or per_run < (1 if meta["version"] >= 3 else 0):
            raise ShardSetError(f"shard meta has a bad records_per_run {per_run!r}: {self.path}")
        return meta

    @property
    def records_per_run(self) -> int:
        """Records per stored LMDB value (0: a version-2 shard, one record per sample key)."""
        if self._per_run is None:
            meta = self.meta()
            self._per_run = int(meta.get("records_per_run", 0)) if meta["version"] >= 3 else 0
        return self._per_run

    def __len__(self) -> int:
        if self._len is None:
            self._len = int(self.meta()["num_samples"])
        return self._len

    def labels(self) -> np.ndarray:
        """[N] int32 labels of every sample, without reading image bytes."""
        with self.env.begin() as txn:
            raw = txn.get(LABELS_KEY)
        if raw is None:
            raise ShardSetError(f"shard has no label index: {self.path}")
        return np.frombuffer(raw, dtype="<i4").astype(np.int64)

    def get(self, index: int) -> bytes:
        """The record bytes of sample ``index`` (0-based within this shard), checksum checked."""
        return self.get_many([index])[0]

    def get_many(self, indexes: Sequence[int]) -> list[bytes]:
        """The record bytes of several samples, read in one transaction (the training loader's batch
        read), each checksum checked."""
        per_run = self.records_per_run
        # buffers=True: values are views into the map, so only the bytes of the wanted records (and
        # their run's table) are read and copied, never the rest of their run.
        with self.env.begin(buffers=True) as txn:
            records = [self._copy(txn, index, per_run) for index in indexes]
        for index, raw in zip(indexes, records):
            self.checked(raw, index)
        return records

    def _copy(self, txn: lmdb.Transaction, index: int, per_run: int) -> bytes:
        """The stored bytes of sample ``index`` (unchecked), copied out of the map."""
        value = txn.get(_KEY.pack(index // per_run if per_run else index)) if index >= 0 else None
        if value is None:
            raise IndexError(f"{self.path.name}: no sample {index}")
        if not per_run:
            return bytes(value)
        try:
            return bytes(run_record(value, index % per_run))
        except IndexError:
            raise IndexError(f"{self.path.name}: no sample {index}") from None
        except RecordError as error:
            raise CorruptRecordError(self.path, index, str(error)) from None

    def checked(self, raw: bytes, index: int) -> bytes:
        """``raw`` if it is a sound record (prefix and CRC-32), else :class:`CorruptRecordError`."""
        try:
            payload_offset(raw)
        except RecordError as error:
            raise CorruptRecordError(self.path, index, str(error)) from None
        return raw

    def record(self, index: int) -> Record:
        try:
            return decode_record(self.get(index), verify=False)  # get() checked the CRC
        except RecordError as error:
            raise CorruptRecordError(self.path, index, str(error)) from None

    def __iter__(self) -> Iterator[Record]:
        """Every record in storage order (each run read once), checksums checked."""
        per_run = self.records_per_run
        with self.env.begin(buffers=True) as txn:
            for first in range(0, len(self), per_run or 1):
                value = txn.get(_KEY.pack(first // per_run if per_run else first))
                if value is None:
                    raise ShardSetError(f"{self.path}: no sample {first} of {len(self)}")
                try:
                    raws = run_records(value) if per_run else [value]
                except RecordError as error:
                    raise CorruptRecordError(self.path, first, str(error)) from None
                if len(raws) != min(per_run or 1, len(self) - first):
                    raise ShardSetError(f"{self.path}: run at sample {first} holds {len(raws)} records")
                for index, raw in enumerate(raws, start=first):
                    try:
                        record = decode_record(raw)  # copies the payload out of the map
                    except RecordError as error:
                        raise CorruptRecordError(self.path, index, str(error)) from None
                    yield record


class ShardSet:
    """A prepared shard set on disk: ``manifest.json``, ``labels.json`` and ``shards/``."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        manifest_path = self.root / "manifest.json"
        if not self.root.is_dir():
            raise ShardSetError(f"shard set not found: {self.root}")
        if not manifest_path.is_file():
            raise ShardSetError(f"not a prepared shard set (no manifest.json): {self.root}")
        try:
            self.manifest: dict[str, Any] = json.loads(manifest_path.read_text(encoding="utf-8"))
            self.identities: list[str] = json.loads((self.root / "labels.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise ShardSetError(f"unreadable shard set metadata in {self.root}: {error}") from None
        if not isinstance(self.manifest, dict):
            raise ShardSetError(f"manifest.json of {self.root} is not a JSON object")
        if self.manifest.get("format") != SET_FORMAT or self.manifest.get("version") not in READABLE_SET_VERSIONS:
            raise ShardSetError(
                f"unsupported shard set format {self.manifest.get('format')!r} "
                f"v{self.manifest.get('version')} in {self.root}"
                + _older(self.manifest.get("version"), READABLE_SET_VERSIONS[0])
            )
        if not isinstance(self.identities, list) or not all(isinstance(n, str) for n in self.identities):
            raise ShardSetError(f"labels.json of {self.root} is not a JSON list of names")
        files, counts = self._shard_list()
        self.readers = [ShardReader(shard_path(self.root, file)) for file in files]
        #: [S + 1] first stored (physical) sample index of each shard, excluded samples included.
        self.offsets = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        #: shard file -> sorted local indexes of its samples that a later generation removed
        self.excluded = self._exclusions(files, counts)
        #: [N] stored index of each live sample (None: nothing is excluded, live == stored)
        self.live: np.ndarray | None = None
        if self.excluded:
            mask = np.ones(int(self.offsets[-1]), dtype=bool)
            for shard, file in enumerate(files):
                mask[self.offsets[shard] + self.excluded.get(file, np.zeros(0, np.int64))] = False
            self.live = np.flatnonzero(mask)

    def _exclusions(self, files: list[str], counts: list[int]) -> dict[str, np.ndarray]:
        """The union of every generation's ``excluded`` map ({shard file: [local index]}), checked."""
        union: dict[str, set[int]] = {}
        try:
            for generation in self.manifest.get("generations", []):
                for file, indexes in generation.get("excluded", {}).items():
                    union.setdefault(file, set()).update(int(i) for i in indexes)
        except (AttributeError, TypeError, ValueError):
            raise ShardSetError(f"manifest.json of {self.root} has a malformed exclusion list") from None
        size = dict(zip(files, counts))
        for file, indexes in union.items():
            if file not in size or any(not 0 <= i < size[file] for i in indexes):
                raise ShardSetError(f"manifest.json of {self.root} excludes samples that {file!r} does not hold")
        return {file: np.asarray(sorted(indexes), dtype=np.int64) for file, indexes in sorted(union.items())}

    def stored(self, indexes: np.ndarray | int) -> np.ndarray | int:
        """Live sample index (what ``len``, ``labels``, ``get``, ``record`` count) -> stored index."""
        if self.live is None:
            return indexes
        return self.live[indexes] if isinstance(indexes, np.ndarray) else int(self.live[indexes])

    def _shard_list(self) -> tuple[list[str], list[int]]:
        """The manifest's shard files (each a safe path under shards/) and sample counts."""
        try:
            entries = [(entry["file"], int(entry["num_samples"])) for entry in self.manifest["shards"]]
        except (KeyError, TypeError, ValueError):
            raise ShardSetError(f"manifest.json of {self.root} has a malformed shard list") from None
        for file, count in entries:
            reason = unsafe_path_reason(file)
            if reason is not None or count < 0:
                raise ShardSetError(f"manifest.json of {self.root} lists a bad shard {file!r} ({reason or 'count'})")
        return [file for file, _ in entries], [count for _, count in entries]

    def __len__(self) -> int:
        """Live samples: those stored, less those a later generation excluded."""
        return int(self.offsets[-1]) if self.live is None else len(self.live)

    @property
    def num_identities(self) -> int:
        return len(self.identities)

    def locate(self, index: int) -> tuple[int, int]:
        """Live sample index -> (shard index, index within the shard)."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range [0, {len(self)})")
        index = self.stored(index)
        shard = int(np.searchsorted(self.offsets, index, side="right") - 1)
        return shard, int(index - self.offsets[shard])

    def get(self, index: int) -> bytes:
        shard, local = self.locate(index)
        return self.readers[shard].get(local)

    def record(self, index: int) -> Record:
        shard, local = self.locate(index)
        return self.readers[shard].record(local)

    def labels(self) -> np.ndarray:
        """[N] int64 labels of every live sample in stored order, from the per-shard label indexes."""
        if not self.readers:
            return np.zeros(0, dtype=np.int64)
        stored = np.concatenate([reader.labels() for reader in self.readers])
        return stored if self.live is None or len(stored) != int(self.offsets[-1]) else stored[self.live]

    def close(self) -> None:
        for reader in self.readers:
            reader.close()
