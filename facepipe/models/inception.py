"""facenet-pytorch's Inception-ResNet-v1 (Schroff et al., FaceNet) behind the backbone interface.

The modules are facenet-pytorch 2.5.3's own, adopted under their own names, so its published
``20180402-114759-vggface2.pt`` / ``20180408-102900-casia-webface.pt`` files load from a local path
(their pretraining classifier ``logits.*`` is not part of the backbone and is skipped). Unlike
facenet-pytorch's ``forward``, the embedding is returned unnormalized, like every backbone here.
"""

from __future__ import annotations

import torch
from torch import nn

from facepipe.models.backbone import Backbone
from facepipe.models.registry import register_backbone

_POOLED_CHANNELS = 1792
_PUBLISHED_EMBEDDING = 512


class InceptionResnetV1Backbone(Backbone):
    """``[B, 3, S, S]`` float in [-1, 1] -> ``[B, embedding_size]`` float; trained at ``S = 160``.

    Global average pooling makes the network accept other sizes (from about 80 up), but the
    published weights expect 160×160 faces. ``embedding_size`` other than 512 replaces
    ``last_linear``/``last_bn`` and so cannot take those weights.
    """

    ignored_weight_prefixes = ("logits.",)
    family = "facenet"

    def __init__(self, *, embedding_size: int, image_size: int) -> None:
        super().__init__(embedding_size=embedding_size, image_size=image_size)
        # Imported here: the facenet_pytorch package import also loads its detector stack, which
        # only this backbone's users should pay for. pretrained=None: nothing is downloaded.
        from facenet_pytorch.models.inception_resnet_v1 import InceptionResnetV1

        reference = InceptionResnetV1(pretrained=None, classify=False)
        for name, module in reference.named_children():
            self.add_module(name, module)
        if embedding_size != _PUBLISHED_EMBEDDING:
            self.last_linear = nn.Linear(_POOLED_CHANNELS, embedding_size, bias=False)
            self.last_bn = nn.BatchNorm1d(embedding_size, eps=0.001, momentum=0.1, affine=True)
        self.stem = [
            self.conv2d_1a,
            self.conv2d_2a,
            self.conv2d_2b,
            self.maxpool_3a,
            self.conv2d_3b,
            self.conv2d_4a,
            self.conv2d_4b,
        ]
        self.stages = [self.repeat_1, self.mixed_6a, self.repeat_2, self.mixed_7a, self.repeat_3, self.block8]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, 3, S, S]`` float in [-1, 1] -> ``[B, embedding_size]`` float, not normalized."""
        for layer in self.stem:
            x = layer(x)
        for stage in self.stages:
            x = self.run_stage(stage, x)
        x = self.dropout(torch.flatten(self.avgpool_1a(x), 1))
        with self.in_float32(x):
            return self.last_bn(self.last_linear(x.float()))


@register_backbone("inception_resnet_v1")
def inception_resnet_v1(*, embedding_size: int, image_size: int) -> InceptionResnetV1Backbone:
    """facenet-pytorch ``InceptionResnetV1(pretrained=None, classify=False)``, unnormalized output."""
    return InceptionResnetV1Backbone(embedding_size=embedding_size, image_size=image_size)
