"""Batch arithmetic and the learning-rate schedule: pure functions of the configuration.

Derived values (effective batch, scaled rate, steps) are computed here and passed along, never
written back into the configuration.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from facepipe.config import Decay, LRScaling, TrainParams
from facepipe.errors import FacepipeError


def effective_batch(batch_size: int, *, world_size: int, accum_steps: int) -> int:
    """Samples per optimizer step: per-process batch x processes x accumulation steps."""
    return batch_size * world_size * accum_steps


def scale_lr(lr: float, *, reference_batch: int, effective_batch: int, rule: LRScaling) -> float:
    """The rate for ``effective_batch`` given ``lr`` for ``reference_batch`` (linear / square-root rule)."""
    ratio = effective_batch / reference_batch
    if rule == "linear":
        return lr * ratio
    if rule == "sqrt":
        return lr * math.sqrt(ratio)
    if rule == "none":
        return lr
    raise ValueError(f"unknown lr scaling {rule!r}")


def steps_per_epoch(num_samples: int, effective_batch: int) -> int:
    """Optimizer steps in one epoch; the incomplete last step is dropped."""
    return num_samples // effective_batch


def warmup_steps(warmup_epochs: float, steps_per_epoch: int) -> int:
    return round(warmup_epochs * steps_per_epoch)


def lr_factor(
    step: int,
    *,
    total_steps: int,
    warmup_steps: int,
    decay: Decay,
    power: float = 2.0,
    min_ratio: float = 0.0,
    milestones: Sequence[int] = (),
    gamma: float = 0.1,
) -> float:
    """Multiplier of the peak rate for optimizer step ``step`` (0-based).

    Linear warmup ``(step + 1) / warmup_steps`` (never 0, so the first step moves the weights), then
    from 1 down to ``min_ratio`` at ``total_steps``: ``cosine`` is ``m + (1 - m)(1 + cos(pi t)) / 2``,
    ``poly`` is ``m + (1 - m)(1 - t)^power``, with t the fraction of the decay done. ``step`` is
    PyTorch's MultiStepLR in optimizer steps: ``gamma`` to the number of ``milestones`` (steps) at or
    before ``step`` (``min_ratio`` does not apply).
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "step":
        return gamma ** sum(step >= milestone for milestone in milestones)
    t = min(max((step - warmup_steps) / max(total_steps - warmup_steps, 1), 0.0), 1.0)
    if decay == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * t))
    elif decay == "poly":
        shape = (1.0 - t) ** power
    else:
        raise ValueError(f"unknown decay {decay!r}")
    return min_ratio + (1.0 - min_ratio) * shape


def build_scheduler(
    optimizer: Optimizer,
    *,
    total_steps: int,
    warmup_steps: int,
    decay: Decay,
    power: float = 2.0,
    min_ratio: float = 0.0,
    milestones: Sequence[int] = (),
    gamma: float = 0.1,
) -> LambdaLR:
    """A scheduler stepped once per optimizer step; each group's ``lr`` is its peak rate."""
    milestones = tuple(milestones)

    def factor(step: int) -> float:
        return lr_factor(
            step,
            total_steps=total_steps,
            warmup_steps=warmup_steps,
            decay=decay,
            power=power,
            min_ratio=min_ratio,
            milestones=milestones,
            gamma=gamma,
        )

    return LambdaLR(optimizer, factor)


@dataclass(frozen=True)
class Plan:
    """What the configuration means for a given dataset and world size."""

    world_size: int
    batch_size: int
    accum_steps: int
    effective_batch: int
    lr: float
    epochs: int
    steps_per_epoch: int
    total_steps: int
    warmup_steps: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def milestone_steps(milestones: Sequence[int], steps_per_epoch: int) -> tuple[int, ...]:
    """``train.milestones`` (epochs) as optimizer steps: the first step of each of those epochs."""
    return tuple(epoch * steps_per_epoch for epoch in milestones)


def make_plan(params: TrainParams, *, num_samples: int, world_size: int) -> Plan:
    """Effective batch, scaled peak rate and step counts of a run over ``num_samples`` samples."""
    batch = effective_batch(params.batch_size, world_size=world_size, accum_steps=params.accum_steps)
    per_epoch = steps_per_epoch(num_samples, batch)
    if per_epoch == 0:
        raise FacepipeError(
            f"{num_samples} training samples do not fill one optimizer step of {batch} "
            f"(train.batch_size {params.batch_size} x {world_size} processes x train.accum_steps {params.accum_steps})"
        )
    return Plan(
        world_size=world_size,
        batch_size=params.batch_size,
        accum_steps=params.accum_steps,
        effective_batch=batch,
        lr=scale_lr(params.lr, reference_batch=params.reference_batch, effective_batch=batch, rule=params.lr_scaling),
        epochs=params.epochs,
        steps_per_epoch=per_epoch,
        total_steps=per_epoch * params.epochs,
        warmup_steps=warmup_steps(params.warmup_epochs, per_epoch),
    )
