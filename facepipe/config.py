"""Typed ``params.yaml``: one frozen pydantic model per stage section; unknown keys are errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, ValidationError, field_validator

from facepipe.errors import FacepipeError


class ParamsError(FacepipeError):
    """A params file or section that cannot be used; the message is one line naming the problem."""


class Section(BaseModel):
    """Base of every stage section: immutable, strict about unknown keys."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class PrepareParams(Section):
    """``prepare``: raw photos -> aligned faces in LMDB shards. Every field changes the output."""

    image_size: int = Field(112, ge=16, le=1024, description="side of the aligned square face, pixels")
    encoding: Literal["jpeg", "png"] = "jpeg"
    quality: int = Field(95, ge=1, le=100, description="JPEG quality of the stored faces")
    detector: Literal["mtcnn"] = "mtcnn"
    min_face_size: int = Field(40, ge=12, description="shorter side of the face box in the original image")
    score_threshold: float = Field(0.95, ge=0.0, le=1.0)
    face_selection: Literal["largest", "center", "highest_score"] = "largest"
    detect_size: int = Field(
        640, ge=64, description="longest image side seen by the detector; larger images are downscaled"
    )
    max_pixels: int = Field(40_000_000, ge=1, description="images above this many pixels are rejected")
    chunk_size: int = Field(32, ge=1, description="images per unit of parallel work (one detector batch)")
    samples_per_shard: int = Field(10_000, ge=1)


class SampleDataParams(Section):
    """``sample_data``: the built-in offline demo dataset."""

    identities: int = Field(40, ge=2)
    images_per_identity: int = Field(8, ge=1)
    seed: int = 0
    bad_files: bool = True


class SplitParams(Section):
    """``split``: identity-disjoint train / validation identities and verification pairs."""

    val_identities: StrictInt | StrictFloat = Field(
        0.25, gt=0, description="held-out identities: a fraction in (0, 1) or a count (integer >= 1)"
    )
    num_pairs: int = Field(600, ge=2, description="verification pairs, half same-identity, half different")
    seed: int = 0

    @field_validator("val_identities")
    @classmethod
    def _fraction_or_count(cls, value: int | float) -> int | float:
        if isinstance(value, float) and not value < 1:
            raise ValueError("a fraction must be < 1; write a count as an integer")
        return value


class EvaluateParams(Section):
    """``evaluate``: embeddings of the pair images -> verification metrics."""

    pairs: str = Field(
        "data/split/pairs.jsonl", description="facepipe pairs.jsonl from split, or an LFW-format pairs.txt"
    )
    batch_size: int = Field(64, ge=1)
    flip: bool = Field(True, description="add the embedding of the mirrored image before normalizing")
    folds: int = Field(10, ge=2, description="cross-validation folds for the accuracy")
    far_targets: tuple[float, ...] = Field((1e-3, 1e-4), description="false accept rates to report TAR at")
    device: str = Field("auto", description="auto, cpu, cuda, cuda:N")

    @field_validator("far_targets")
    @classmethod
    def _rates(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        if not all(0 < far < 1 for far in value):
            raise ValueError("every false accept rate must lie in (0, 1)")
        return value


class ExportParams(Section):
    """``export``: ONNX and TorchScript files, each checked against the PyTorch model."""

    formats: tuple[Literal["onnx", "torchscript"], ...] = Field(("onnx", "torchscript"), min_length=1)
    opset: int = Field(17, ge=11, description="ONNX opset version")
    check_batch_size: int = Field(
        3, ge=1, description="random batch compared with PyTorch; differs from the traced batch to test the dynamic axis"
    )
    atol: float = Field(1e-4, ge=0, description="a check fails where |exported - torch| > atol + rtol * |torch|")
    rtol: float = Field(1e-3, ge=0)
    seed: int = 0


SECTIONS: dict[str, type[Section]] = {
    "prepare": PrepareParams,
    "sample_data": SampleDataParams,
    "split": SplitParams,
    "evaluate": EvaluateParams,
    "export": ExportParams,
}

S = TypeVar("S", bound=Section)


def _describe(error: ValidationError, section: str) -> str:
    first = error.errors()[0]
    where = ".".join(str(p) for p in (section, *first["loc"]))
    if first["type"] == "extra_forbidden":
        return f"unknown key {where!r}"
    return f"{where}: {first['msg']}"


def parse_section(model: type[S], section: str, raw: Any) -> S:
    """Validate one section's mapping (``None`` means all defaults)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ParamsError(f"section {section!r} must be a mapping, got {type(raw).__name__}")
    try:
        return model.model_validate(raw)
    except ValidationError as error:
        raise ParamsError(_describe(error, section)) from None


def read_params_file(path: str | Path) -> dict[str, Any]:
    """The whole params file as a mapping; a missing file reads as empty (all defaults)."""
    path = Path(path)
    if not path.exists():
        return {}
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ParamsError(f"{path}: not valid YAML ({str(error).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ParamsError(f"{path}: top level must be a mapping of stage sections")
    return data


def load_section(path: str | Path, section: str, model: type[S] | None = None) -> S:
    """Read and validate only ``section`` of the params file at ``path``."""
    model = model or SECTIONS[section]  # type: ignore[assignment]
    data = read_params_file(path)
    try:
        return parse_section(model, section, data.get(section))
    except ParamsError as error:
        raise ParamsError(f"{path}: {error}") from None
