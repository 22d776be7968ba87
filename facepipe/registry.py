"""``Registry``: name -> builder tables filled by decorators at definition time (timm style).

Neutral ground for the registries of several layers: backbones (``facepipe.models``), margin heads
(``facepipe.heads``) and detectors (``facepipe.detection``, entries with traits) each keep an
instance; it is the one mechanism for whatever is chosen by name. The names a params file may use are
the ``Literal`` lists in ``facepipe.config``; tests/test_structure.py checks that they equal the
registries' names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

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
