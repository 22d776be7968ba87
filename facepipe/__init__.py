"""facepipe: folders of raw face photos into a trained face recognizer, reproducibly and at scale."""

from facepipe import offline as _offline

_offline.apply()

__version__ = "0.1.0"

#: The library calls (facepipe/api.py), imported on first use so ``import facepipe`` stays light.
_API = ("embed", "compare", "search", "load_embeddings", "Embeddings")


def __getattr__(name: str):  # noqa: ANN202 - PEP 562 lazy attributes
    if name in _API:
        from facepipe import api

        return getattr(api, name)
    raise AttributeError(f"module 'facepipe' has no attribute {name!r}")
