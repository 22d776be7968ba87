"""The backbone registry (a ``facepipe.registry.Registry``) and the backbone factory."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Protocol

from facepipe.models.backbone import Backbone
from facepipe.registry import Registry


class BackboneBuilder(Protocol):
    """What ``@register_backbone`` decorates: builds an untrained backbone."""

    def __call__(self, *, embedding_size: int, image_size: int) -> Backbone: ...


BACKBONES: Registry[BackboneBuilder] = Registry("backbone")


def register_backbone(name: str) -> Callable[[BackboneBuilder], BackboneBuilder]:
    """Decorator: make ``create_backbone(name, ...)`` call the decorated builder."""
    return BACKBONES.register(name)


def list_backbones() -> list[str]:
    """Names accepted by ``create_backbone``, sorted."""
    return BACKBONES.names()


def create_backbone(
    name: str,
    *,
    embedding_size: int = 512,
    image_size: int = 112,
    gradient_checkpointing: bool = False,
    weights: str | os.PathLike[str] | None = None,
) -> Backbone:
    """Build a registered backbone.

    The result maps ``[B, 3, image_size, image_size]`` float images in [-1, 1] to
    ``[B, embedding_size]`` float embeddings (not normalized). ``weights`` is a local state-dict
    file loaded strictly (``torch.load(..., weights_only=True)``); nothing is ever downloaded.
    Unknown names raise ``ValueError`` naming the known ones.
    """
    builder = BACKBONES.get(name)
    if embedding_size < 1:
        raise ValueError(f"embedding_size must be positive, got {embedding_size}")
    if image_size < 1:
        raise ValueError(f"image_size must be positive, got {image_size}")
    backbone = builder(embedding_size=embedding_size, image_size=image_size)
    backbone.gradient_checkpointing = gradient_checkpointing
    if weights is not None:
        backbone.load_weights(weights)
    return backbone
