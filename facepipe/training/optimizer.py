"""The optimizer: SGD with momentum, Adam (L2 weight decay, facenet-pytorch's and arcface_torch's
fine-tuning choice) or AdamW, weight decay only where it regularizes; a learning-rate scale per module."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from facepipe.config import OptimizerName


def parameter_groups(
    modules: Iterable[nn.Module], *, weight_decay: float, lr_scales: Sequence[float] | None = None
) -> list[dict[str, Any]]:
    """Weights of dimension >= 2 decay; biases and norm / PReLU weights (1-D) do not.

    Decaying a BatchNorm scale or a bias only shrinks the function's range, it does not regularize.
    Modules of equal ``lr_scales`` entry (default: all 1) share two groups (decay, no decay), in
    order of first appearance; each group's ``lr_scale`` multiplies the scheduled rate. With one scale
    the layout is the two groups of every earlier checkpoint.
    """
    modules = list(modules)
    scales = [1.0] * len(modules) if lr_scales is None else [float(scale) for scale in lr_scales]
    if len(scales) != len(modules):
        raise ValueError(f"{len(scales)} lr scales for {len(modules)} modules")
    groups: dict[float, tuple[list[nn.Parameter], list[nn.Parameter]]] = {}
    for module, scale in zip(modules, scales):
        decay, no_decay = groups.setdefault(scale, ([], []))
        for parameter in module.parameters():
            if parameter.requires_grad:
                (decay if parameter.ndim >= 2 else no_decay).append(parameter)
    return [
        group
        for scale, (decay, no_decay) in groups.items()
        for group in (
            {"params": decay, "weight_decay": weight_decay, "lr_scale": scale},
            {"params": no_decay, "weight_decay": 0.0, "lr_scale": scale},
        )
    ]


def build_optimizer(
    modules: Iterable[nn.Module],
    *,
    name: OptimizerName,
    lr: float,
    momentum: float,
    weight_decay: float,
    lr_scales: Sequence[float] | None = None,
) -> torch.optim.Optimizer:
    """``momentum`` is SGD's momentum or Adam's / AdamW's beta1; ``lr_scales``: one per module (each
    group's rate is ``lr`` times its module's scale; see :func:`parameter_groups`)."""
    groups = parameter_groups(modules, weight_decay=weight_decay, lr_scales=lr_scales)
    for group in groups:
        group["lr"] = lr * group["lr_scale"]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum)
    if name == "adam":  # L2: weight_decay * w added to the gradient, as torch.optim.Adam defines it
        return torch.optim.Adam(groups, lr=lr, betas=(momentum, 0.999))
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=(momentum, 0.999))
    raise ValueError(f"unknown optimizer {name!r}")
