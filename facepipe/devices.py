"""Which torch device a process computes on: one rule for training ranks, evaluation, the detectors
and prepare's Dask workers.

``auto`` is the GPU when CUDA is available, else the CPU; ``cuda`` insists on a GPU; ``cuda:N`` names
one. A process given an ``index`` (a training rank's local rank) takes the GPU of that index. Prepare's
local Dask workers are each shown one GPU (``CUDA_VISIBLE_DEVICES``, as dask-cuda does), so inside a
worker ``auto`` is that GPU: see :func:`worker_gpus`.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from facepipe.errors import FacepipeError

if TYPE_CHECKING:
    import torch


def available_cores() -> int:
    """Cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _no_gpu_here() -> bool:
    """True when this Linux machine has no GPU that torch could use: no NVIDIA driver and no NVIDIA or
    ROCm device node. torch is then not imported only to learn that (3 s of a worker's start-up)."""
    if not sys.platform.startswith("linux"):
        return False  # elsewhere only torch can tell
    dev = Path("/dev")
    return not (Path("/proc/driver/nvidia").exists() or any(dev.glob("nvidia[0-9]*")) or (dev / "kfd").exists())


def cuda_device_count() -> int:
    """GPUs this process can see (0 without CUDA); does not initialise CUDA, nor import torch on a
    machine without a GPU driver."""
    if _no_gpu_here():
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


_DEVICE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")


def resolve_device_name(
    preference: str = "auto", *, index: int = 0, device_count: int | None = None, what: str = "device"
) -> str:
    """The device for ``preference`` (``auto`` | ``cpu`` | ``cuda`` | ``cuda:N``), as ``cpu`` or
    ``cuda:N``: ``cuda:index`` for ``auto`` (with CUDA) and ``cuda``. ``device_count`` overrides the
    GPUs found (tests); ``what`` names the setting in the one-line error for a GPU that is not there.
    Imports nothing for ``cpu``, nor for ``auto`` on a machine without a GPU driver."""
    match = _DEVICE.match(preference) if preference != "auto" else None
    if preference != "auto" and match is None:
        raise FacepipeError(f"{what}: {preference!r} is not a device (auto, cpu, cuda or cuda:N)")
    if match is not None and match.group(1) == "cpu":
        if match.group(2) not in (None, "0"):  # one CPU device: "cpu:5" is a typo, not a choice
            raise FacepipeError(f"{what}: {preference!r} is not a device: the CPU is cpu (or cpu:0)")
        return "cpu"
    count = cuda_device_count() if device_count is None else device_count
    if match is None and count == 0:
        return "cpu"
    if count == 0:
        raise FacepipeError(f"{what} is {preference!r} but no CUDA device is available")
    chosen = index if match is None or match.group(2) is None else int(match.group(2))
    if chosen >= count:
        raise FacepipeError(f"{what}: cuda:{chosen} does not exist ({count} GPU(s) visible)")
    return f"cuda:{chosen}"


def resolve_device(
    preference: str = "auto", *, index: int = 0, device_count: int | None = None, what: str = "device"
) -> torch.device:
    """:func:`resolve_device_name` as a ``torch.device``."""
    import torch

    return torch.device(resolve_device_name(preference, index=index, device_count=device_count, what=what))


def worker_gpus(n_workers: int, *, device_count: int, visible: str | None = None) -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` of each of ``n_workers`` worker processes: worker i gets GPU
    i mod N of the N this process sees (``visible``: its own ``CUDA_VISIBLE_DEVICES``, default the
    environment's), so the workers spread evenly over the GPUs instead of all sharing the first."""
    if device_count < 1:
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    ids = [part.strip() for part in visible.split(",") if part.strip()] if visible else []
    ids = ids[:device_count] if len(ids) >= device_count else [str(i) for i in range(device_count)]
    return [ids[i % device_count] for i in range(n_workers)]
