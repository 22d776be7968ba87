"""Seeded initial class centres that do not depend on how the classes are split across ranks.

Classes are cut into fixed blocks of ``BLOCK`` classes; block ``k`` is drawn from its own generator,
keyed by ``(seed, k)``. Any range of classes is the rows of the blocks it overlaps, so a rank builds
its shard without materialising all ``C × E`` centres, and the dense head (one range, all classes)
gets exactly the concatenation of every rank's shard, for any number of ranks.
"""

from __future__ import annotations

import numpy as np
import torch

#: Classes per generator block: big enough that a million classes need only ~1000 generators, small
#: enough that a rank draws at most two blocks' worth it does not keep (2 × 1024 × E floats).
BLOCK = 1024
INIT_STD = 0.01


def _block_generator(seed: int, block: int) -> torch.Generator:
    # SeedSequence mixes (seed, block) into well-separated 64-bit seeds; negative seeds wrap.
    state = np.random.SeedSequence([seed & 0xFFFFFFFFFFFFFFFF, block]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def init_centres(start: int, count: int, *, embedding_size: int, seed: int) -> torch.Tensor:
    """Initial centres of classes ``[start, start + count)``: ``[count, E]`` float32 from N(0, 0.01²).

    Row ``i`` depends only on ``seed``, ``start + i`` and ``E``, never on the range it is drawn in.
    """
    if start < 0 or count < 0:
        raise ValueError(f"class range must be non-negative, got start {start}, count {count}")
    # drawn into place block by block: the peak is the result plus one block, not twice the result
    centres = torch.empty(count, embedding_size)
    end = start + count
    for block in range(start // BLOCK, -(-end // BLOCK)):
        first = block * BLOCK
        # always the whole block: torch's normal sampler fills in chunks, so a shorter draw from the
        # same generator is not a prefix of the longer one
        drawn = torch.randn(BLOCK, embedding_size, generator=_block_generator(seed, block))
        lo, hi = max(start, first), min(end, first + BLOCK)
        centres[lo - start : hi - start] = drawn[lo - first : hi - first]
    return centres.mul_(INIT_STD)
