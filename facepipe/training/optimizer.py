"""The optimizer: SGD with momentum or AdamW, weight decay only where it regularizes."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from facepipe.config import OptimizerName


def parameter_groups(modules: Iterable[nn.Module], *, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: weights of dimension >= 2 decay; biases and norm / PReLU weights (1-D) do not.

    Decaying a BatchNorm scale or a bias only shrinks the function's range, it does not regularize.
    """
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for module in modules:
        for parameter in module.parameters():
            if parameter.requires_grad:
                (decay if parameter.ndim >= 2 else no_decay).append(parameter)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(
    modules: Iterable[nn.Module],
    *,
    name: OptimizerName,
    lr: float,
    momentum: float,
    weight_decay: float,
) -> torch.optim.Optimizer:
    """``momentum`` is SGD's momentum or AdamW's beta1."""
    groups = parameter_groups(modules, weight_decay=weight_decay)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=(momentum, 0.999))
    raise ValueError(f"unknown optimizer {name!r}")
