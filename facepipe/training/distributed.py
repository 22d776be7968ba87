"""Process groups and DDP: NCCL on CUDA, gloo on CPU, or a plain single process.

A process started by ``torchrun`` finds RANK / LOCAL_RANK / WORLD_SIZE (and the rendezvous address)
in its environment; without them, or with a world of one, training runs as a plain process with no
process group and no DDP wrapper. Nothing here runs at import time.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from facepipe.config import CommHook, DeviceChoice
from facepipe.devices import resolve_device

log = logging.getLogger("facepipe.training")


@dataclass(frozen=True)
class Distributed:
    """Where this process stands: its rank among ``world_size`` processes and its device."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0: the only process that writes files and logs at INFO."""
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        """A process group exists (more than one process)."""
        return self.world_size > 1


def init_distributed(preference: DeviceChoice = "auto") -> Distributed:
    """Join the process group that torchrun set up (if any) with the backend the device needs."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(preference, index=local_rank, what="train.device")  # each rank its own GPU
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            store=_attempt_store(),
            rank=rank,
            world_size=world_size,
            device_id=device if device.type == "cuda" else None,
        )
        log.info("joined process group: %d processes, backend %s", world_size, backend)
    return Distributed(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


def _attempt_store() -> dist.Store:
    """The rendezvous store of ``env://`` (torchrun's), with keys private to this restart attempt.

    torchrun keeps one store for the whole job: when ``--max-restarts`` restarts the group, the killed
    attempt's keys (every rank's address) are still there, and a rank that starts before a slower one
    connects to the dead process's address ("Gloo connectFullMesh failed ... Connection refused").
    torchrun numbers the attempts in TORCHELASTIC_RESTART_COUNT.
    """
    store, _, _ = next(dist.rendezvous("env://"))
    return dist.PrefixStore(f"facepipe-attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)


def shutdown(context: Distributed) -> None:
    if context.enabled and dist.is_initialized():
        dist.destroy_process_group()


@dataclass(frozen=True)
class HookOptions:
    """How gradients travel between ranks: the compression hook and PowerSGD's settings."""

    comm_hook: CommHook = "none"
    powersgd_rank: int = 1
    #: optimizer steps of plain all-reduce before PowerSGD compresses (PyTorch requires >= 2)
    powersgd_start_iter: int = 2


def powersgd_start(configured: int | None, *, total_steps: int, warmup_steps: int) -> int:
    """Optimizer steps of plain all-reduce before PowerSGD starts: ``configured``, or by default 10 % of
    ``total_steps`` and no earlier than the end of warmup (PyTorch's advice: compressing the large
    early gradients loses accuracy); at least 2, which PyTorch's error feedback needs."""
    if configured is not None:
        return max(configured, 2)
    return max(2, warmup_steps, math.ceil(0.1 * total_steps))


def wrap_model(model: nn.Module, context: Distributed, *, hooks: HookOptions = HookOptions()) -> tuple[nn.Module, Any]:
    """``model`` in DDP with the requested gradient-compression hook, and the hook's state (PowerSGD's,
    else None); ``model`` unchanged in a single process."""
    if not context.enabled:
        return model, None
    device_ids = [context.device.index] if context.device.type == "cuda" else None
    # No buffer broadcast before every forward (a collective per micro-step, across nodes too): in
    # training mode BatchNorm normalises with batch statistics, so the running statistics never
    # change the weights; they are averaged over ranks before each checkpoint (average_buffers).
    ddp = DistributedDataParallel(
        model, device_ids=device_ids, gradient_as_bucket_view=True, forward_sync_buffers=False
    )
    return ddp, register_comm_hook(ddp, hooks)


def register_comm_hook(model: DistributedDataParallel, hooks: HookOptions) -> Any:
    """PyTorch's built-in DDP communication hooks: compress gradients before the all-reduce. Returns
    the hook's state (a ``PowerSGDState``) or None."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if hooks.comm_hook == "none":
        return None
    if hooks.comm_hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hooks.comm_hook == "bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif hooks.comm_hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=hooks.powersgd_rank,
            start_powerSGD_iter=hooks.powersgd_start_iter,
        )
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return state
    else:
        raise ValueError(f"unknown comm hook {hooks.comm_hook!r}")
    return None


def reset_powersgd(state: Any) -> None:
    """Forget PowerSGD's error feedback and warm-start factors (they re-initialise on the next step).

    After a step that fp16 loss scaling skipped for inf/NaN gradients, both memories hold inf/NaN,
    which the hook adds to every later gradient: without this, every later step overflows too.
    """
    state.error_dict.clear()
    state.p_memory_dict.clear()
    state.q_memory_dict.clear()


def average_buffers(module: nn.Module, context: Distributed) -> None:
    """Replace the running mean and variance of every BatchNorm in ``module`` by their mean over ranks,
    in place; collective. Batch counters agree on every rank; other buffers (CurricularFace's ``t``)
    are the same on every rank by construction and are left alone.

    The running statistics are exponential averages, linear in the batch statistics, so averaging
    them at any point equals averaging every step's batch statistics over ranks: the same result
    whenever and however often this runs (up to rounding).
    """
    kinds = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
    norms = [m for m in module.modules() if isinstance(m, kinds) and m.track_running_stats]
    buffers = [b for m in norms for b in (m.running_mean, m.running_var) if b is not None]
    if not context.enabled or not buffers:
        return
    flat = torch.cat([b.detach().reshape(-1).double() for b in buffers])  # one collective, little rounding
    dist.all_reduce(flat)
    flat /= context.world_size
    for buffer, mean in zip(buffers, flat.split([b.numel() for b in buffers])):
        buffer.copy_(mean.view_as(buffer))


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (checkpoints hold the unwrapped weights)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Around forward + backward: with ``enabled`` False, DDP skips the gradient all-reduce.

    Accumulation micro-steps other than the last use it; the last one all-reduces the sum.
    """
    if enabled or not isinstance(model, DistributedDataParallel):
        yield
    else:
        with model.no_sync():
            yield


def all_gather_objects(obj: Any, context: Distributed) -> list[Any]:
    """``obj`` of every rank, in rank order (a list of one without a process group)."""
    if not context.enabled:
        return [obj]
    gathered: list[Any] = [None] * context.world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_object(obj: Any, context: Distributed) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not context.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_reduce_sum(tensor: torch.Tensor, context: Distributed) -> torch.Tensor:
    """Sum over ranks, in place (a sync point: call it only when logging)."""
    if context.enabled:
        dist.all_reduce(tensor)
    return tensor
