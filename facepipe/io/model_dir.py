"""The model folder: what ``train`` writes and ``evaluate`` / ``export`` read.

::

    MODEL/backbone.pt   the backbone's state_dict only (tensors; read with weights_only=True)
    MODEL/model.json    how to rebuild it: {"backbone", "embedding_size", "image_size"}; how its
                        input was made ("crop", "normalization"); the starting weights ("init_from":
                        kind, file name, sha256); and the sha256 of backbone.pt ("weights_sha256"),
                        checked whenever it is loaded
    MODEL/checkpoints/  MODEL/metrics.json  MODEL/plots/metrics/   written while training

``model.json`` is written last, after ``backbone.pt`` is in place (each by a temporary file and a
rename), and removed first when a run starts that will replace them: weights and spec never come
from two runs, and a folder without ``model.json`` is not (yet) a model.

The backbone takes [B, 3, image_size, image_size] float RGB, (pixel - mean) / std with the
``normalization`` of model.json (its family's: arcface (x - 127.5) / 127.5, facenet (x - 127.5) / 128),
and returns [B, embedding_size] embeddings. Every reader of a model takes the normalisation and the
crop from model.json; a model.json without them (written before they were recorded) means arcface.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from facepipe.config import NORMALIZATIONS, CropName
from facepipe.errors import FacepipeError
from facepipe.io.atomic import OutputKind, atomic_write, json_key_file
from facepipe.io.manifest import dumps
from facepipe.io.shards import sha256_file

if TYPE_CHECKING:  # torch and the backbones load only where weights are read or written
    import torch

    from facepipe.models import Backbone

WEIGHTS_FILE = "backbone.pt"
SPEC_FILE = "model.json"
CHECKPOINT_DIR = "checkpoints"
_WEIGHTS_HASH = "weights_sha256"


def _is_model_folder(folder: Path) -> bool:
    # metrics.json alone is too common a name to say "ours"; with it alone, ask for dvclive's shape
    if {p.name for p in folder.iterdir()} != {"metrics.json"}:
        return True
    return json_key_file("metrics.json", "step")(folder)


#: What ``train`` writes: an existing OUT holding anything else is not replaced or written into.
MODEL_FOLDER = OutputKind(
    "model folder",
    patterns=(
        WEIGHTS_FILE,
        SPEC_FILE,
        f".{WEIGHTS_FILE}.tmp-*",
        f".{SPEC_FILE}.tmp-*",
        "metrics.json",
        "plots/metrics/*.tsv",
        "plots/training.png",  # facepipe.training.metrics.CURVES_FILE
        f"{CHECKPOINT_DIR}/step-*.pt",
        f"{CHECKPOINT_DIR}/step-*.pt.corrupt",
        f"{CHECKPOINT_DIR}/.step-*.pt.tmp-*",
        f"best/{WEIGHTS_FILE}",  # train.keep_best: the backbone of the best validation step, a model folder itself
        f"best/{SPEC_FILE}",
        f"best/.{WEIGHTS_FILE}.tmp-*",
        f"best/.{SPEC_FILE}.tmp-*",
        ".gitignore",  # DVC's, for the outs train writes (dvc.yaml); train writes into OUT, never removes it
    ),
    identify=_is_model_folder,
)


class ModelSpec(BaseModel):
    """The content of ``model.json``: the arguments of ``create_backbone`` that fix the weights' shapes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    backbone: str
    embedding_size: int = Field(ge=1)
    image_size: int = Field(ge=16)
    crop: CropName = "arcface"
    normalization: Normalization = Field(default_factory=lambda: Normalization.of("arcface"))
    init_from: dict[str, str] | None = None
    #: the training set's prepare params (its manifest's ``params``): how ``embed`` finds and cuts faces
    faces: dict[str, Any] | None = None


class Normalization(BaseModel):
    """Network input = (pixel - mean) / std, pixel in [0, 255]; the model family's (``NORMALIZATIONS``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    family: str
    mean: float
    std: float

    @classmethod
    def of(cls, family: str) -> Normalization:
        mean, std = NORMALIZATIONS[family]
        return cls(family=family, mean=mean, std=std)

    def describe(self) -> str:
        return f"RGB (pixel - {self.mean:g}) / {self.std:g} ({self.family})"


ModelSpec.model_rebuild()


def write_model_spec(model_dir: str | Path, spec: ModelSpec, *, weights_sha256: str | None = None) -> None:
    """Write ``model.json`` atomically (``weights_sha256``: of ``backbone.pt``, checked on load)."""
    content = spec.model_dump() | ({_WEIGHTS_HASH: weights_sha256} if weights_sha256 else {})
    atomic_write(Path(model_dir) / SPEC_FILE, lambda handle: handle.write(dumps(content).encode()))


def read_model_spec(model_dir: str | Path) -> ModelSpec:
    """Read and validate ``model.json``; every problem is a one-line FacepipeError."""
    return _read_model_json(model_dir)[0]


def _read_model_json(model_dir: str | Path) -> tuple[ModelSpec, str | None]:
    """(spec, sha256 of backbone.pt or None when model.json predates it)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FacepipeError(f"model folder not found: {model_dir}")
    path = model_dir / SPEC_FILE
    if not path.is_file():
        raise FacepipeError(f"not a model folder (no {SPEC_FILE}; the train stage writes it): {model_dir}")
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
        weights_sha256 = content.pop(_WEIGHTS_HASH, None) if isinstance(content, dict) else None
        return ModelSpec.model_validate(content), weights_sha256
    except (OSError, ValueError) as error:
        if isinstance(error, ValidationError):
            first = error.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "top level"
            raise FacepipeError(f"{path}: {where}: {first['msg']}") from None
        raise FacepipeError(f"{path}: unreadable ({error})") from None


def save_model_dir(model_dir: str | Path, model: torch.nn.Module, spec: ModelSpec) -> None:
    """Write ``backbone.pt`` (state_dict of ``model``), then ``model.json`` with its sha256, each atomically."""
    import torch

    model_dir = Path(model_dir)
    weights = atomic_write(model_dir / WEIGHTS_FILE, lambda handle: torch.save(model.state_dict(), handle))
    write_model_spec(model_dir, spec, weights_sha256=sha256_file(weights))


def remove_model_files(model_dir: str | Path) -> None:
    """Remove ``model.json`` (first: it marks a model) and ``backbone.pt`` of an earlier run."""
    for name in (SPEC_FILE, WEIGHTS_FILE):
        path = Path(model_dir) / name
        if path.is_file() and not path.is_symlink():
            path.unlink()


def load_backbone(model_dir: str | Path, *, device: torch.device | str = "cpu") -> tuple[Backbone, ModelSpec]:
    """Rebuild the backbone described by ``model.json`` with the weights of ``backbone.pt``, in eval mode."""
    from facepipe.models import create_backbone

    model_dir = Path(model_dir)
    spec, weights_sha256 = _read_model_json(model_dir)
    weights = model_dir / WEIGHTS_FILE
    if not weights.is_file():
        raise FacepipeError(f"model folder has no {WEIGHTS_FILE}: {model_dir}")
    if weights_sha256 is not None and sha256_file(weights) != weights_sha256:
        raise FacepipeError(f"{weights}: sha256 differs from the one in {SPEC_FILE} (corrupt, or from another run)")
    try:
        model = create_backbone(
            spec.backbone, embedding_size=spec.embedding_size, image_size=spec.image_size, weights=weights
        )
    except ValueError as error:  # an unknown backbone name; weight problems are FacepipeErrors already
        raise FacepipeError(f"{model_dir / SPEC_FILE}: {error}") from None
    return model.to(device).eval(), spec
