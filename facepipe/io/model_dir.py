"""The model folder: what ``train`` writes and ``evaluate`` / ``export`` read.

::

    MODEL/backbone.pt   the backbone's state_dict only (tensors; read with weights_only=True)
    MODEL/model.json    how to rebuild it: {"backbone", "embedding_size", "image_size"}

The backbone takes [B, 3, image_size, image_size] float RGB in [-1, 1] (pixel / 127.5 - 1) and
returns [B, embedding_size] embeddings.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from facepipe.errors import FacepipeError
from facepipe.io.manifest import dumps
from facepipe.models import Backbone, create_backbone

WEIGHTS_FILE = "backbone.pt"
SPEC_FILE = "model.json"


class ModelSpec(BaseModel):
    """The content of ``model.json``: the arguments of ``create_backbone`` that fix the weights' shapes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    backbone: str
    embedding_size: int = Field(ge=1)
    image_size: int = Field(ge=16)


def write_model_spec(model_dir: str | Path, spec: ModelSpec) -> None:
    (Path(model_dir) / SPEC_FILE).write_text(dumps(spec.model_dump()))


def read_model_spec(model_dir: str | Path) -> ModelSpec:
    """Read and validate ``model.json``; every problem is a one-line FacepipeError."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FacepipeError(f"model folder not found: {model_dir}")
    path = model_dir / SPEC_FILE
    if not path.is_file():
        raise FacepipeError(f"not a model folder (no {SPEC_FILE}; the train stage writes it): {model_dir}")
    try:
        return ModelSpec.model_validate(json.loads(path.read_text()))
    except (OSError, ValueError) as error:
        if isinstance(error, ValidationError):
            first = error.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "top level"
            raise FacepipeError(f"{path}: {where}: {first['msg']}") from None
        raise FacepipeError(f"{path}: unreadable ({error})") from None


def save_model_dir(model_dir: str | Path, model: torch.nn.Module, spec: ModelSpec) -> None:
    """Write ``backbone.pt`` (state_dict of ``model``) and ``model.json`` into ``model_dir``."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), model_dir / WEIGHTS_FILE)
    write_model_spec(model_dir, spec)


def load_backbone(model_dir: str | Path, *, device: torch.device | str = "cpu") -> tuple[Backbone, ModelSpec]:
    """Rebuild the backbone described by ``model.json`` with the weights of ``backbone.pt``, in eval mode."""
    model_dir = Path(model_dir)
    spec = read_model_spec(model_dir)
    weights = model_dir / WEIGHTS_FILE
    if not weights.is_file():
        raise FacepipeError(f"model folder has no {WEIGHTS_FILE}: {model_dir}")
    try:
        model = create_backbone(
            spec.backbone, embedding_size=spec.embedding_size, image_size=spec.image_size, weights=weights
        )
    except ValueError as error:  # an unknown backbone name; weight problems are FacepipeErrors already
        raise FacepipeError(f"{model_dir / SPEC_FILE}: {error}") from None
    return model.to(device).eval(), spec
