"""MobileFaceNet (Chen et al., 2018) with the module names of insightface ``arcface_torch``.

Names and shapes equal ``arcface_torch/backbones/mobilefacenet.py`` (``get_mbf``: blocks
1, 4, 6, 2, width scale 2), so its published weights load with ``strict=True``.
"""

from __future__ import annotations

import torch
from torch import nn

from facepipe.models.backbone import Backbone, halved_side
from facepipe.models.registry import register_backbone

_GDC_CHANNELS = 512


class LinearBlock(nn.Module):
    """Conv (no bias), BN, no activation: the linear bottleneck of MobileNetV2;
    ``[B, in, H, W]`` -> ``[B, out, H', W']``."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        *,
        kernel: int = 1,
        stride: int = 1,
        padding: int = 0,
        groups: int = 1,
    ) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, kernel, stride, padding, groups=groups, bias=False),
            nn.BatchNorm2d(out_channels),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class ConvBlock(LinearBlock):
    """Conv (no bias), BN, PReLU (``layers.2``, as arcface_torch names it)."""

    def __init__(self, in_channels: int, out_channels: int, **conv: int) -> None:
        super().__init__(in_channels, out_channels, **conv)
        self.layers.append(nn.PReLU(out_channels))


class DepthWise(nn.Module):
    """Inverted bottleneck: 1×1 expand to ``hidden``, 3×3 depthwise (stride), 1×1 linear project."""

    def __init__(self, in_channels: int, out_channels: int, *, hidden: int, stride: int, residual: bool) -> None:
        super().__init__()
        self.residual = residual
        self.layers = nn.Sequential(
            ConvBlock(in_channels, hidden),
            ConvBlock(hidden, hidden, kernel=3, stride=stride, padding=1, groups=hidden),
            LinearBlock(hidden, out_channels),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers(x)
        return x + out if self.residual else out


class Residual(nn.Module):
    """``blocks`` stride-1 residual ``DepthWise`` blocks at constant width."""

    def __init__(self, channels: int, *, blocks: int, hidden: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            *(DepthWise(channels, channels, hidden=hidden, stride=1, residual=True) for _ in range(blocks))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class GDC(nn.Module):
    """Global depthwise conv over the whole ``side × side`` map, then linear + BN1d to the embedding."""

    def __init__(self, embedding_size: int, *, side: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            LinearBlock(_GDC_CHANNELS, _GDC_CHANNELS, kernel=side, groups=_GDC_CHANNELS),
            nn.Flatten(),
            nn.Linear(_GDC_CHANNELS, embedding_size, bias=False),
            nn.BatchNorm1d(embedding_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class MobileFaceNet(Backbone):
    """``[B, 3, S, S]`` float in [-1, 1] -> ``[B, embedding_size]`` float (not normalized).

    Four stride-2 steps (112 -> 7); the GDC kernel spans the final map, so its shape depends on
    ``image_size`` and published 112×112 weights need ``image_size=112``.
    """

    def __init__(
        self,
        *,
        embedding_size: int,
        image_size: int,
        blocks: tuple[int, int, int, int] = (1, 4, 6, 2),
        scale: int = 2,
    ) -> None:
        super().__init__(embedding_size=embedding_size, image_size=image_size)
        narrow, wide = 64 * scale, 128 * scale
        if blocks[0] == 1:
            # groups=64 (not a full depthwise) is what the reference model has
            first: nn.Module = ConvBlock(narrow, narrow, kernel=3, padding=1, groups=64)
        else:
            first = Residual(narrow, blocks=blocks[0], hidden=128)
        self.layers = nn.ModuleList(
            [
                ConvBlock(3, narrow, kernel=3, stride=2, padding=1),
                first,
                DepthWise(narrow, narrow, hidden=128, stride=2, residual=False),
                Residual(narrow, blocks=blocks[1], hidden=128),
                DepthWise(narrow, wide, hidden=256, stride=2, residual=False),
                Residual(wide, blocks=blocks[2], hidden=256),
                DepthWise(wide, wide, hidden=512, stride=2, residual=False),
                Residual(wide, blocks=blocks[3], hidden=256),
            ]
        )
        self.conv_sep = ConvBlock(wide, _GDC_CHANNELS)
        self.features = GDC(embedding_size, side=halved_side(image_size, 4))
        self._initialize()

    def _initialize(self) -> None:
        # The initialisation of arcface_torch, so that training recipes tuned there carry over.
        for module in self.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, 3, S, S]`` float in [-1, 1] -> ``[B, embedding_size]`` float."""
        for stage in self.layers:
            x = self.run_stage(stage, x)
        with self.in_float32(x):
            return self.features(self.conv_sep(x.float()))


@register_backbone("mobilefacenet")
def mobilefacenet(*, embedding_size: int, image_size: int) -> MobileFaceNet:
    """arcface_torch ``mbf``: blocks 1, 4, 6, 2 and width scale 2."""
    return MobileFaceNet(embedding_size=embedding_size, image_size=image_size)
