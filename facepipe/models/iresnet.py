"""IResNet (Deng et al., ArcFace) with the module names of insightface ``arcface_torch``.

Parameter and buffer names and shapes equal ``arcface_torch/backbones/iresnet.py``, so its
published ``backbone.pth`` files load with ``strict=True``. Its ``fp16`` switch is not needed here:
mixed precision comes from ``torch.autocast`` around the call.
"""

from __future__ import annotations

import torch
from torch import nn

from facepipe.models.backbone import Backbone, halved_side
from facepipe.models.registry import register_backbone

#: residual blocks per stage; stage widths are 64, 128, 256, 512 and each stage halves the side
IRESNET_LAYERS: dict[str, tuple[int, int, int, int]] = {
    "iresnet18": (2, 2, 2, 2),
    "iresnet34": (3, 4, 6, 3),
    "iresnet50": (3, 4, 14, 3),
    "iresnet100": (3, 13, 30, 3),
}
STAGE_WIDTHS = (64, 128, 256, 512)
_BN_EPS = 1e-5


class IBasicBlock(nn.Module):
    """BN-conv3×3-BN-PReLU-conv3×3(stride)-BN plus a (projected) shortcut; no activation after the sum."""

    def __init__(self, in_channels: int, channels: int, stride: int) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_channels, eps=_BN_EPS)
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels, eps=_BN_EPS)
        self.prelu = nn.PReLU(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn3 = nn.BatchNorm2d(channels, eps=_BN_EPS)
        self.downsample: nn.Sequential | None = None
        if stride != 1 or in_channels != channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(channels, eps=_BN_EPS),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, C_in, H, W]`` -> ``[B, C, ceil(H/stride), ceil(W/stride)]``."""
        out = self.bn3(self.conv2(self.prelu(self.bn2(self.conv1(self.bn1(x))))))
        shortcut = x if self.downsample is None else self.downsample(x)
        return out + shortcut


class IResNet(Backbone):
    """Stem (conv3×3, BN, PReLU), four stride-2 stages of ``IBasicBlock``, then BN-flatten-FC-BN.

    ``[B, 3, S, S]`` float in [-1, 1] -> ``[B, embedding_size]`` float; ``S`` is the
    ``image_size`` the model was built for (the FC layer's width depends on it).
    """

    def __init__(self, layers: tuple[int, ...], *, embedding_size: int, image_size: int) -> None:
        super().__init__(embedding_size=embedding_size, image_size=image_size)
        side = halved_side(image_size, len(STAGE_WIDTHS))  # 112 -> 7
        self.conv1 = nn.Conv2d(3, STAGE_WIDTHS[0], 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(STAGE_WIDTHS[0], eps=_BN_EPS)
        self.prelu = nn.PReLU(STAGE_WIDTHS[0])
        in_channels = STAGE_WIDTHS[0]
        for index, (blocks, width) in enumerate(zip(layers, STAGE_WIDTHS), start=1):
            stage = nn.Sequential(
                IBasicBlock(in_channels, width, stride=2),
                *(IBasicBlock(width, width, stride=1) for _ in range(blocks - 1)),
            )
            self.add_module(f"layer{index}", stage)
            in_channels = width
        self.bn2 = nn.BatchNorm2d(in_channels, eps=_BN_EPS)
        self.dropout = nn.Dropout(p=0.0)
        self.fc = nn.Linear(in_channels * side * side, embedding_size)
        self.features = nn.BatchNorm1d(embedding_size, eps=_BN_EPS)
        self.stages = [self.layer1, self.layer2, self.layer3, self.layer4]
        self._initialize()

    def _initialize(self) -> None:
        # The initialisation of arcface_torch, so that training recipes tuned there carry over.
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.normal_(module.weight, 0.0, 0.1)
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        # A fixed unit scale on the embedding BN: only its shift is learned (as in arcface_torch).
        nn.init.ones_(self.features.weight)
        self.features.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, 3, S, S]`` float in [-1, 1] -> ``[B, embedding_size]`` float, not normalized."""
        x = self.prelu(self.bn1(self.conv1(x)))
        for stage in self.stages:
            x = self.run_stage(stage, x)
        x = self.dropout(torch.flatten(self.bn2(x), 1))
        with self.in_float32(x):
            return self.features(self.fc(x.float()))


@register_backbone("iresnet18")
def iresnet18(*, embedding_size: int, image_size: int) -> IResNet:
    """arcface_torch ``iresnet18``: 2, 2, 2, 2 blocks."""
    return IResNet(IRESNET_LAYERS["iresnet18"], embedding_size=embedding_size, image_size=image_size)


@register_backbone("iresnet34")
def iresnet34(*, embedding_size: int, image_size: int) -> IResNet:
    """arcface_torch ``iresnet34``: 3, 4, 6, 3 blocks."""
    return IResNet(IRESNET_LAYERS["iresnet34"], embedding_size=embedding_size, image_size=image_size)


@register_backbone("iresnet50")
def iresnet50(*, embedding_size: int, image_size: int) -> IResNet:
    """arcface_torch ``iresnet50``: 3, 4, 14, 3 blocks."""
    return IResNet(IRESNET_LAYERS["iresnet50"], embedding_size=embedding_size, image_size=image_size)


@register_backbone("iresnet100")
def iresnet100(*, embedding_size: int, image_size: int) -> IResNet:
    """arcface_torch ``iresnet100``: 3, 13, 30, 3 blocks."""
    return IResNet(IRESNET_LAYERS["iresnet100"], embedding_size=embedding_size, image_size=image_size)
