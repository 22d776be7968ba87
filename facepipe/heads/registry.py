"""The margin registry: ``@register_head("arcface")`` on a ``Margin`` subclass."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from facepipe.registry import Registry

if TYPE_CHECKING:
    from facepipe.heads.margins import Margin

HEADS: Registry[type[Margin]] = Registry("head")


def register_head(name: str) -> Callable[[type[Margin]], type[Margin]]:
    """Class decorator: make ``create_head(name, ...)`` use the decorated margin."""
    return HEADS.register(name)


def list_heads() -> list[str]:
    """Names accepted by ``create_head`` and ``create_model_parallel_head``, sorted."""
    return HEADS.names()
