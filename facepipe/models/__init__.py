"""Backbones: a registry of face-embedding networks (docs/architecture.md, "Rooms").

``create_backbone(name, ...)`` builds one; every backbone maps ``[B, 3, S, S]`` float images in
[-1, 1] to ``[B, embedding_size]`` float embeddings (not normalized).
"""

# Importing the architecture modules fills the registry.
from facepipe.models import inception, iresnet, mobilefacenet  # noqa: F401
from facepipe.models.backbone import Backbone, WeightsError
from facepipe.models.registry import create_backbone, list_backbones, register_backbone

__all__ = [
    "Backbone",
    "WeightsError",
    "create_backbone",
    "list_backbones",
    "register_backbone",
]
