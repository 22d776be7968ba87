"""Device memory: the largest batch that fits (``train.batch_size: auto``) and the peak a run used.

The search runs trial steps (forward, backward and an optimizer step that allocates the optimizer's
state) on random data of the run's shape: halving from the upper limit until one fits, then a
bisection between the largest batch that fit and the smallest that did not. The model's weights,
buffers and random generators are restored afterwards, so the run trains exactly as with the found
batch written in params.yaml.
"""

from __future__ import annotations

import logging
import resource
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from facepipe.errors import FacepipeError
from facepipe.training.checkpoint import list_checkpoints
from facepipe.training.distributed import Distributed

log = logging.getLogger("facepipe.training")

#: The largest per-process batch ``auto`` tries: beyond it, a margin-based head gains nothing on a
#: GPU that is already busy, and the linear rate scaling gets far from its reference batch.
AUTO_BATCH_LIMIT = 2048

#: Runs one trial step at a batch size; raises torch.OutOfMemoryError when it does not fit.
Probe = Callable[[int], None]


def largest_batch(probe: Probe, *, limit: int) -> int:
    """The largest batch in [1, ``limit``] for which ``probe`` does not run out of memory, assuming
    every smaller batch fits too: halve from ``limit`` until one fits, then bisect. Raises a
    FacepipeError when not even a batch of 1 fits."""
    fits, fails = 0, limit + 1
    batch = limit
    while batch >= 1:
        if _fits(probe, batch):
            fits = batch
            break
        fails, batch = batch, batch // 2
    if fits == 0:
        raise FacepipeError("train.batch_size auto: not even a batch of 1 fits in the device's memory")
    while fails - fits > 1:  # invariant: fits fits, fails does not (or is past the limit)
        middle = (fits + fails) // 2
        if _fits(probe, middle):
            fits = middle
        else:
            fails = middle
    return fits


def _fits(probe: Probe, batch: int) -> bool:
    try:
        probe(batch)
    except torch.OutOfMemoryError:
        outcome = False
    else:
        outcome = True
    release_cached_memory()  # after the except block: the traceback no longer holds the activations
    log.info("batch_size auto: a batch of %d %s", batch, "fits" if outcome else "runs out of memory")
    return outcome


def release_cached_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def trial_probe(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    image_size: int,
    num_classes: int,
    device: torch.device,
    amp_dtype: torch.dtype | None,
) -> Probe:
    """A probe running ``model`` (images [b, 3, S, S] float in [-1, 1], labels [b] -> HeadOutput) on
    random data, backward, and ``optimizer.step()`` (which allocates its state). It changes the
    weights and buffers: :func:`find_batch_size` restores them."""

    def probe(batch: int) -> None:
        images = torch.rand(batch, 3, image_size, image_size, device=device) * 2 - 1
        labels = torch.randint(0, num_classes, (batch,), device=device)
        try:
            with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
                loss = model(images, labels).loss
            loss.backward()
            optimizer.step()
        finally:
            optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return probe


def find_batch_size(
    model: nn.Module,
    make_optimizer: Callable[[], torch.optim.Optimizer],
    *,
    context: Distributed,
    image_size: int,
    num_classes: int,
    limit: int,
    amp_dtype: torch.dtype | None = None,
) -> int:
    """The largest per-process batch (<= ``limit``) whose trial step fits on every rank (the minimum
    over ranks, so all ranks agree); ``model`` and the random generators are left as they were."""
    saved = {name: value.detach().to("cpu", copy=True) for name, value in model.state_dict().items()}
    devices = [context.device] if context.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        optimizer = make_optimizer()
        probe = trial_probe(
            model, optimizer, image_size=image_size, num_classes=num_classes, device=context.device, amp_dtype=amp_dtype
        )
        found = largest_batch(probe, limit=limit)
        del optimizer, probe
    model.load_state_dict(saved)
    release_cached_memory()
    if context.enabled:
        agreed = torch.tensor(found, device=context.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        found = int(agreed.item())
    return found


#: On the CPU, memory rarely limits the batch, time does, and running out of it is fatal rather
#: than an exception: ``auto`` tries no more than this there.
CPU_AUTO_BATCH_LIMIT = 128


def batch_limit(num_samples: int, *, world_size: int, accum_steps: int, device: torch.device) -> int:
    """The largest batch ``auto`` tries: the device's limit, and no more than one optimizer step's
    share of the samples (a larger batch would leave no step in an epoch)."""
    device_limit = AUTO_BATCH_LIMIT if device.type == "cuda" else CPU_AUTO_BATCH_LIMIT
    return max(1, min(device_limit, num_samples // (world_size * accum_steps)))


def cached_batch_size(checkpoints: Path) -> int | None:
    """The per-process batch the newest readable checkpoint in ``checkpoints`` trained with: a resumed
    ``auto`` run keeps it instead of searching again (which could find another and change the run).
    Memory-mapped, so only the small plan is read."""
    for _, path in reversed(list_checkpoints(checkpoints)):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            return int(state["plan"]["batch_size"])
        except Exception:  # noqa: BLE001  (a corrupt one: the resume will say so; try the previous)
            continue
    return None


def peak_memory_mb(device: torch.device, *, reset: bool = True) -> float:
    """This process's peak memory in MiB: CUDA memory allocated by tensors since the last reset on a
    GPU; on the CPU, the peak resident set size of the process so far (it cannot be reset)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
