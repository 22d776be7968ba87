"""Name -> builder registries (timm style) and the backbone factory.

``Registry`` is generic: the backbone registry lives here and the margin-head registry in
``facepipe.heads`` is another instance of the same class.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from facepipe.models.backbone import Backbone

T = TypeVar("T")


class Registry(Generic[T]):
    """A mapping from names to builders, filled by a decorator at definition time."""

    def __init__(self, kind: str) -> None:
        self._kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator that files its target under ``name``; a name can be registered once."""

        def add(entry: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self._kind} {name!r} is already registered")
            self._entries[name] = entry
            return entry

        return add

    def get(self, name: str) -> T:
        """The entry for ``name``; an unknown name raises ``ValueError`` listing the known ones."""
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(self.names()) or "(none)"
            raise ValueError(f"unknown {self._kind} {name!r}; known: {known}") from None

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries


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
