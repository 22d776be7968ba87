"""Distributed, shard-aware batch sampling with per-sample augmentation seeds.

One epoch's order is the same on every rank (it depends on ``seed`` and the epoch only):

1. shuffle the order of the shards;
2. walk the shards in that order, each in storage order, and shuffle within consecutive windows of
   ``buffer_size`` samples.

Reads therefore stay inside a window of one or two shard files at a time (sequential enough for
slow disks and network storage, and friendly to the page cache) while batches still mix many
identities. The stream is dealt out to the ranks round robin, so after every rank has taken k
batches exactly the first ``k * batch_size * world_size`` samples of the stream are consumed. That
makes "position in the epoch" one number (samples consumed), valid for any world size.

Each stream position also carries its own augmentation seed, drawn from (``seed``, epoch): ranks and
loader workers get different randomness, and the same run reproduces it exactly.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from torch.utils.data import Sampler

_ORDER, _AUGMENT = 0, 1  # independent random streams per epoch


def shuffled_stream(item_shards: np.ndarray, *, epoch: int, seed: int, buffer_size: int) -> np.ndarray:
    """One epoch's order of all items: [M] int64, a permutation of 0..M-1.

    ``item_shards`` ([M] int) is the shard of each item; items of one shard must be contiguous and in
    storage order (as ``FaceDataset`` lists them).
    """
    rng = np.random.default_rng([seed, epoch, _ORDER])
    num_items = len(item_shards)
    starts = np.flatnonzero(np.r_[True, item_shards[1:] != item_shards[:-1]]) if num_items else np.zeros(0, int)
    stops = np.r_[starts[1:], num_items].astype(np.int64)
    perm = rng.permutation(len(starts))
    stream = np.concatenate([np.arange(starts[s], stops[s], dtype=np.int64) for s in perm] or [np.zeros(0, np.int64)])
    window = np.arange(num_items) // buffer_size
    return stream[np.lexsort((rng.random(num_items), window))]


def augment_seeds(num_items: int, *, epoch: int, seed: int) -> np.ndarray:
    """[M] int64 augmentation seed of each stream position in ``epoch``."""
    rng = np.random.default_rng([seed, epoch, _AUGMENT])
    return rng.integers(0, np.iinfo(np.int64).max, size=num_items, dtype=np.int64)


class ShardOrderSampler(Sampler[list[tuple[int, int]]]):
    """Batch sampler of one rank: yields lists of ``(item, augmentation seed)`` of ``batch_size``.

    Drops the tail of the stream that does not fill a whole optimizer step of every rank
    (``batch_size * world_size * accum_steps`` samples), so every rank runs the same number of
    micro-steps and each optimizer step is complete. Call :meth:`set_epoch` before each epoch.
    """

    def __init__(
        self,
        item_shards: np.ndarray,
        *,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        accum_steps: int = 1,
        buffer_size: int = 4096,
        seed: int = 0,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.item_shards = np.asarray(item_shards)
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.accum_steps = accum_steps
        self.buffer_size = buffer_size
        self.seed = seed
        self.epoch = 0
        self.start_sample = 0

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all ranks."""
        return self.batch_size * self.world_size * self.accum_steps

    def steps_per_epoch(self) -> int:
        """Optimizer steps in a whole epoch."""
        return len(self.item_shards) // self.global_batch

    def epoch_finished(self, consumed: int) -> bool:
        """Whether an epoch with ``consumed`` samples (all ranks) taken has no whole optimizer step left."""
        return len(self.item_shards) - consumed < self.global_batch

    def set_epoch(self, epoch: int, start_sample: int = 0) -> None:
        """Select ``epoch``'s order and skip its first ``start_sample`` samples (consumed before a resume)."""
        self.epoch = epoch
        self.start_sample = start_sample

    def _usable(self) -> int:
        remaining = max(len(self.item_shards) - self.start_sample, 0)
        return remaining // self.global_batch * self.global_batch

    def __len__(self) -> int:
        """Batches this rank yields for the current epoch and start."""
        return self._usable() // (self.batch_size * self.world_size)

    def rank_items(self) -> tuple[np.ndarray, np.ndarray]:
        """This rank's items and their seeds for the current epoch and start: two [len * batch_size] arrays."""
        stream = shuffled_stream(self.item_shards, epoch=self.epoch, seed=self.seed, buffer_size=self.buffer_size)
        seeds = augment_seeds(len(stream), epoch=self.epoch, seed=self.seed)
        mine = slice(self.start_sample + self.rank, self.start_sample + self._usable(), self.world_size)
        return stream[mine], seeds[mine]

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        items, seeds = self.rank_items()
        items_list, seeds_list = items.tolist(), seeds.tolist()
        for start in range(0, len(items_list), self.batch_size):
            yield list(zip(items_list[start : start + self.batch_size], seeds_list[start : start + self.batch_size]))
