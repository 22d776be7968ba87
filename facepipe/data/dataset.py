"""A torch ``Dataset`` over a prepared shard set: read -> decode -> augment -> [-1, 1] tensor.

Reading is ``facepipe.io``'s job (LMDB environments open lazily, once per process, read-only and
without a lock, so every DataLoader worker has its own; every record's CRC-32 is checked as it is
read); this module decides *which* samples form the dataset and what each one becomes.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from facepipe.data.augment import Augmenter, to_tensor, to_uint8_tensor
from facepipe.errors import FacepipeError
from facepipe.io import ShardReader, ShardSet, ShardSetError
from facepipe.io.records import RecordError, decode_image, payload_offset
from facepipe.io.shards import CorruptRecordError

log = logging.getLogger("facepipe.data")

_SKIP_SLOTS = 64  # counters of skipped records: this process and up to 63 loader workers

#: Identities to train on: names, a path to a JSON list of names, or ``None`` for all of them.
IdentitySelection = Sequence[str] | str | os.PathLike[str] | None


def read_identity_list(path: str | os.PathLike[str]) -> list[str]:
    """A JSON file holding a list of identity names (what the split stage writes)."""
    path = Path(path)
    try:
        names = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FacepipeError(f"identity list not found: {path}") from None
    except (OSError, ValueError) as error:
        raise FacepipeError(f"identity list unreadable: {path} ({error})") from None
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise FacepipeError(f"identity list must be a JSON list of names: {path}")
    return names


def select_identities(all_names: Sequence[str], wanted: IdentitySelection) -> np.ndarray:
    """Original labels of the ``wanted`` identities, ascending: [K] int64 (all labels for ``None``)."""
    if wanted is None:
        return np.arange(len(all_names), dtype=np.int64)
    names = read_identity_list(wanted) if isinstance(wanted, (str, os.PathLike)) else list(wanted)
    position = dict(zip(all_names, range(len(all_names))))
    labels = np.fromiter(map(position.get, names, itertools.repeat(-1)), dtype=np.int64, count=len(names))
    if (labels < 0).any():
        unknown = [name for name in names if name not in position]
        raise FacepipeError(
            f"{len(unknown)} identities are not in the shard set, e.g. {unknown[0]!r} "
            "(was the identity list made from another prepared set?)"
        )
    if not names:
        raise FacepipeError("the identity list is empty")
    labels.sort()  # a plain sort, not np.unique: numpy 2's hash-based unique is 75x slower at 750k labels
    return labels[np.concatenate(([True], labels[1:] != labels[:-1]))]


class FaceDataset(Dataset):
    """Samples of a shard set, optionally restricted to some identities.

    Items are ordered as stored (shard by shard), and ``dataset[key]`` is ``(image, label)`` with
    image [3, S, S] float32 in [-1, 1] (or, with ``normalize=False``, the uint8 pixels: a quarter of
    the bytes between loader processes; :func:`facepipe.data.augment.normalize` then maps a batch to
    [-1, 1] on its device, bit for bit as here) and label an int in [0, num_classes). ``key`` is an item
    index, or ``(item index, augmentation seed)`` as the training sampler yields them. Labels are
    remapped to 0..K-1 in the order of the shard set's ``labels.json``; that is decided from the
    per-shard label indexes alone, without reading image bytes.

    A corrupt record (bad CRC-32, or a payload that does not decode) raises
    :class:`~facepipe.io.shards.CorruptRecordError` naming its shard and key. With ``skip_corrupt``
    it is logged and counted instead (:attr:`skipped`, summed over loader workers) and its place in
    the batch goes to another item of the same batch, so batch shapes stay equal on every rank.
    """

    def __init__(
        self,
        shards: ShardSet | str | os.PathLike[str],
        *,
        identities: IdentitySelection = None,
        augment: Augmenter | None = None,
        seed: int = 0,
        normalize: bool = True,
        skip_corrupt: bool = False,
    ) -> None:
        self.shards = shards if isinstance(shards, ShardSet) else ShardSet(shards)
        self.augment = augment
        self.seed = seed
        self.normalize = normalize
        self.skip_corrupt = skip_corrupt
        # Shared memory travels to loader workers with the dataset; one slot per process, no lock.
        self._skipped = torch.zeros(_SKIP_SLOTS, dtype=torch.int64).share_memory_()
        original = self.shards.labels()
        if len(original) != len(self.shards):
            raise ShardSetError(
                f"label indexes hold {len(original)} samples, the manifest {len(self.shards)}: {self.shards.root}"
            )
        if len(original) and (original.min() < 0 or original.max() >= self.shards.num_identities):
            raise ShardSetError(
                f"labels outside labels.json's {self.shards.num_identities} identities: {self.shards.root}"
            )
        kept = select_identities(self.shards.identities, identities)
        remap = np.full(self.shards.num_identities, -1, dtype=np.int64)
        remap[kept] = np.arange(len(kept))
        #: [M] global sample index of each item, ascending (storage order).
        self.indices = np.flatnonzero(remap[original] >= 0)
        #: [M] int64 label of each item in [0, num_classes).
        self.labels = remap[original[self.indices]]
        #: [M] shard of each item and its index within that shard.
        stored = self.shards.stored(self.indices)  # a grown set (prepare --update) skips excluded samples
        self.item_shards = np.searchsorted(self.shards.offsets, stored, side="right") - 1
        self.item_local = stored - self.shards.offsets[self.item_shards]
        self.class_names = [self.shards.identities[label] for label in kept]

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def image_size(self) -> int:
        return int(self.shards.manifest["image"]["size"])

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def skipped(self) -> int:
        """Corrupt records skipped so far, in this process and its loader workers (``skip_corrupt``)."""
        return int(self._skipped.sum())

    def read(self, item: int) -> bytes:
        """The stored record bytes of item ``item`` (checksum checked)."""
        return self.shards.readers[self.item_shards[item]].get(int(self.item_local[item]))

    def read_many(self, items: Sequence[int]) -> list[bytes | None]:
        """The stored record bytes of several items, checksums checked: one read transaction per
        shard touched. None in place of a corrupt record when ``skip_corrupt``."""
        items = np.asarray(items, dtype=np.int64)
        shards, local = self.item_shards[items], self.item_local[items]
        out: list[bytes | None] = [b""] * len(items)
        for shard in np.unique(shards):
            where = np.flatnonzero(shards == shard)
            reader, keys = self.shards.readers[shard], local[where].tolist()
            try:
                raws: list[bytes | None] = list(reader.get_many(keys))
            except CorruptRecordError:
                if not self.skip_corrupt:
                    raise
                raws = [self._get_or_skip(reader, key) for key in keys]  # rare: find which ones
            for position, raw in zip(where, raws):
                out[position] = raw
        return out

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, int]:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: Sequence[int | tuple[int, int]]) -> list[tuple[torch.Tensor, int]]:
        """A batch of items, one stage at a time over the whole batch (what the DataLoader calls).

        Read all, decode all, augment all, convert all: each stage's code stays hot in the CPU
        caches, ~10% faster than taking every image through all stages in turn.
        """
        pairs = [key if isinstance(key, tuple) else (key, self.seed * 1_000_003 + key) for key in keys]
        raws = self.read_many([item for item, _ in pairs])
        images = [self._decode(item, raw) for (item, _), raw in zip(pairs, raws)]
        if any(image is None for image in images):
            pairs, images = self._fill_skipped(pairs, images)
        if self.augment is not None:
            images = [self.augment(image, seed) for image, (_, seed) in zip(images, pairs)]
        convert = to_tensor if self.normalize else to_uint8_tensor
        return [(convert(image), int(self.labels[item])) for image, (item, _) in zip(images, pairs)]

    def _decode(self, item: int, raw: bytes | None) -> np.ndarray | None:
        if raw is None:
            return None
        try:
            return decode_image(memoryview(raw)[payload_offset(raw, verify=False) :])  # read_many checked the CRC
        except (RecordError, OSError, ValueError) as error:
            reader = self.shards.readers[int(self.item_shards[item])]
            corrupt = CorruptRecordError(reader.path, int(self.item_local[item]), f"payload does not decode ({error})")
            if not self.skip_corrupt:
                raise corrupt from None
            return self._skip(corrupt)

    def _get_or_skip(self, reader: ShardReader, key: int) -> bytes | None:
        try:
            return reader.get(key)
        except CorruptRecordError as error:
            return self._skip(error)

    def _skip(self, error: CorruptRecordError) -> None:
        info = get_worker_info()
        self._skipped[0 if info is None else 1 + info.id % (_SKIP_SLOTS - 1)] += 1
        log.warning("skipping %s", error)
        return None

    def _fill_skipped(
        self, pairs: list[tuple[int, int]], images: list[np.ndarray | None]
    ) -> tuple[list[tuple[int, int]], list[np.ndarray]]:
        """Each skipped item's place goes to a sound item of the batch (with the place's own
        augmentation seed): batch sizes stay what the sampler planned on every rank."""
        sound = [position for position, image in enumerate(images) if image is not None]
        if not sound:
            raise ShardSetError(f"every record of a batch of {len(images)} is corrupt in {self.shards.root}")
        filled_pairs, filled_images = list(pairs), list(images)
        for position in (p for p, image in enumerate(images) if image is None):
            donor = sound[position % len(sound)]
            filled_pairs[position] = (pairs[donor][0], pairs[position][1])
            filled_images[position] = images[donor]
        return filled_pairs, filled_images  # type: ignore[return-value]


def _init_worker(worker_id: int) -> None:
    import cv2

    # Loader workers are the parallelism; OpenCV's own threads would only oversubscribe the cores.
    cv2.setNumThreads(1)


def make_loader(
    dataset: FaceDataset,
    sampler: Sampler[list[tuple[int, int]]],
    *,
    num_workers: int,
    pin_memory: bool = False,
) -> DataLoader:
    """A DataLoader of (images [b, 3, S, S] float32 in [-1, 1], labels [b] int64) batches.

    Workers persist across epochs (each keeps its LMDB environments open). The loader has its own
    generator, so creating its iterator never draws from the global torch RNG that a resumed run
    restores. Workers start from a fork server, not a fork of this process: a process that already
    runs other threads (a Dask or Prefect client, a logging or OpenMP pool) can fork a child that
    deadlocks on a lock one of those threads held.
    """
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        multiprocessing_context="forkserver" if num_workers > 0 else None,
        worker_init_fn=_init_worker if num_workers > 0 else None,
        generator=torch.Generator().manual_seed(dataset.seed),
    )
