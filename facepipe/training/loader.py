"""How many data loader processes each training process starts (``train.num_workers``)."""

from __future__ import annotations

import os

from facepipe.devices import available_cores

#: Data loader processes per training process at most: decoding and augmenting 112 px faces is cheap,
#: and every worker holds its own copy of the shard handles and decode buffers.
MAX_LOADER_WORKERS = 8


def loader_workers(setting: int | str, *, device_type: str, local_processes: int | None = None) -> int:
    """Data loader processes for each training process: ``setting``, or for ``auto`` the cores per
    training process on this node (``local_processes``, default torchrun's LOCAL_WORLD_SIZE) less the
    one the training process drives a GPU with, or half of them on the CPU, where the training
    process computes on the others; at least 1, at most ``MAX_LOADER_WORKERS``."""
    if setting != "auto":
        return int(setting)
    local = local_processes or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = max(1, available_cores() // max(local, 1))
    spare = cores - 1 if device_type == "cuda" else cores // 2
    return max(1, min(MAX_LOADER_WORKERS, spare))
