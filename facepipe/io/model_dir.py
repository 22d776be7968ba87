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
from torch import nn

from facepipe.errors import FacepipeError
from facepipe.io.manifest import dumps
from facepipe.models import create_backbone

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


def save_model_dir(model_dir: str | Path, model: nn.Module, spec: ModelSpec) -> None:
    """Write ``backbone.pt`` (state_dict of ``model``) and ``model.json`` into ``model_dir``."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), model_dir / WEIGHTS_FILE)
    write_model_spec(model_dir, spec)


def load_backbone(model_dir: str | Path, *, device: torch.device | str = "cpu") -> tuple[nn.Module, ModelSpec]:
    """Rebuild the backbone described by ``model.json`` with the weights of ``backbone.pt``, in eval mode."""
    model_dir = Path(model_dir)
    spec = read_model_spec(model_dir)
    weights = model_dir / WEIGHTS_FILE
    if not weights.is_file():
        raise FacepipeError(f"model folder has no {WEIGHTS_FILE}: {model_dir}")
    try:
        model = create_backbone(spec.backbone, embedding_size=spec.embedding_size, image_size=spec.image_size)
    except (KeyError, ValueError) as error:
        raise FacepipeError(f"{model_dir / SPEC_FILE}: cannot build backbone {spec.backbone!r} ({error})") from None
    try:
        state = torch.load(weights, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises many kinds for corrupt or non-tensor files
        raise FacepipeError(f"{weights}: not a loadable state_dict ({type(error).__name__})") from None
    if not isinstance(state, dict):
        raise FacepipeError(f"{weights}: expected a state_dict, found {type(state).__name__}")
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as error:  # shape mismatches are raised even when strict=False
        detail = next((line.strip() for line in str(error).splitlines()[1:] if line.strip()), str(error))
        raise FacepipeError(f"{weights} does not fit {spec.backbone}: {detail}") from None
    if result.missing_keys or result.unexpected_keys:
        example = (result.missing_keys or result.unexpected_keys)[0]
        raise FacepipeError(
            f"{weights} does not fit {spec.backbone} (embedding_size {spec.embedding_size}): "
            f"{len(result.missing_keys)} missing and {len(result.unexpected_keys)} unexpected keys, e.g. {example!r}"
        )
    return model.to(device).eval(), spec
