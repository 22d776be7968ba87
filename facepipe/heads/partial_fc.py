"""Partial FC class sampling: the centres one rank of the sharded head uses in one forward.

At ``sample_rate`` r < 1 every step trains against a subset of each rank's classes: all classes
with a sample in the global batch (positives) plus random others, ``ceil(r * local classes)`` in all
(more when the positives alone exceed that). The draw comes from a generator keyed by (seed, step,
micro-batch, first class of the rank), so a resumed run draws the same subsets.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def sample_count(num_local: int, sample_rate: float) -> int:
    """Centres kept per forward on a rank holding ``num_local`` classes (before adding positives)."""
    return min(num_local, math.ceil(sample_rate * num_local))


def sample_classes(
    local_labels: torch.Tensor, *, num_local: int, sample_rate: float, key: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of this rank's classes to use, and the labels in that subset.

    ``local_labels`` ``[N]`` int64: this rank's class index of each sample of the global batch, -1
    where the class lives on another rank. Returns ``index`` ``[K]`` int64 sorted class indices in
    [0, num_local) (every positive among them) and ``labels`` ``[N]``: each label's position in
    ``index``, -1 where it was -1.
    """
    seed = int(np.random.SeedSequence([abs(int(k)) for k in key]).generate_state(1, dtype=np.uint64)[0] >> 1)
    scores = torch.rand(num_local, generator=torch.Generator().manual_seed(seed)).to(local_labels.device)
    positives = local_labels[local_labels >= 0]
    scores[positives] = 2.0  # above every random score: positives are always kept
    keep = max(sample_count(num_local, sample_rate), int(torch.unique(positives).numel()))
    index = torch.topk(scores, keep, sorted=False).indices.sort().values
    remapped = torch.searchsorted(index, local_labels.clamp_min(0))
    return index, torch.where(local_labels >= 0, remapped, torch.full_like(local_labels, -1))
