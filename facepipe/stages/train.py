"""The train stage: a prepared shard set -> a trained backbone (docs/architecture.md, "Stages").

``facepipe train PREPARED OUT`` runs as one process; ``torchrun --nproc-per-node N -m facepipe train
PREPARED OUT`` runs the same code as N DDP processes (NCCL on CUDA, gloo on CPU). Writes::

    OUT/backbone.pt      backbone state_dict            OUT/model.json   how to rebuild it
    OUT/checkpoints/     step-NNNNNNNN.pt (resume)      OUT/metrics.json, OUT/plots/metrics/  (dvclive)
    OUT/plots/training.png  the same curves, drawn (opens offline)

A run resumes from the newest checkpoint in OUT/checkpoints when its parameters and data match.
OUT must be absent, empty or a model folder (only files train writes); ``--fresh`` removes only
checkpoints. backbone.pt and model.json of an earlier run are removed before training starts and
written again, atomically and model.json last, when it ends: never mixed between runs.
"""

from __future__ import annotations


import hashlib
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from facepipe.config import TrainParams
from facepipe.data.augment import Augmenter
from facepipe.data.dataset import FaceDataset, IdentitySelection, make_loader
from facepipe.data.batch_order import ShardOrderSampler
from facepipe.errors import FacepipeError
from facepipe.heads import create_head, create_model_parallel_head
from facepipe.io.manifest import check_shard_set, shard_set_crop
from facepipe.io.atomic import check_output, remove_stale_temporaries
from facepipe.io.shards import ShardSet
from facepipe.io.model_dir import (
    CHECKPOINT_DIR,
    MODEL_FOLDER,
    SPEC_FILE,
    WEIGHTS_FILE,
    ModelSpec,
    Normalization,
    remove_model_files,
    save_model_dir,
)
from facepipe.models import create_backbone
from facepipe.models.pretrained import load_init_weights
from facepipe.training.checkpoint import agreed_resume_point, encode_class_names, remove_checkpoints
from facepipe.training.distributed import (
    Distributed,
    broadcast_object,
    init_distributed,
    powersgd_start,
    shutdown,
)
from facepipe.training.metrics import TrainMetrics, draw_curves
from facepipe.training.optimizer import build_optimizer
from facepipe.training.schedule import Plan, build_scheduler, make_plan, milestone_steps
from facepipe.training.loader import loader_workers
from facepipe.training.memory import batch_limit, cached_batch_size, find_batch_size
from facepipe.training.trainer import AMP_DTYPES, FaceModel, LoopOptions, Trainer
from facepipe.training.validation import BEST_DIR, Validator, validation_files

log = logging.getLogger("facepipe.train")

#: Parameters that change how a run reports or is laid out, never what it computes: a resumed run
#: may change them.
OPERATIONAL_KEYS = frozenset(
    {
        "num_workers",
        "log_every",
        "checkpoint_every",
        "keep_checkpoints",
        "nproc_per_node",
        "device",
        "skip_corrupt_records",
        "validation",  # what is measured while training, not what is trained
        "keep_best",
        "head_parallel",  # checkpoints hold all class centres in class order whichever head wrote them
    }
)
#: How one optimizer step is split over processes and micro-batches: a resumed run may change them
#: (e.g. at another world size) as long as the effective batch stays the checkpoint's.
LAYOUT_KEYS = frozenset({"batch_size", "accum_steps"})

#: Builds the model to train: (params, num_classes=, image_size=) -> FaceModel.
ModelFactory = Callable[..., FaceModel]


@dataclass(frozen=True)
class TrainReport:
    """What a run did (returned; the metric history is in OUT/metrics.json and OUT/plots)."""

    out: str
    steps: int
    total_steps: int
    epochs_done: int
    resumed_from_step: int | None
    num_samples: int
    num_classes: int
    world_size: int
    effective_batch: int
    lr: float
    loss: float | None
    accuracy: float | None
    samples_per_s: float
    elapsed_s: float
    skipped_records: int = 0  # corrupt records skipped (train.skip_corrupt_records), this process


def build_model(params: TrainParams, *, num_classes: int, image_size: int) -> FaceModel:
    """Backbone and margin head from the registries, as ``params`` names them."""
    backbone = create_backbone(
        params.backbone,
        embedding_size=params.embedding_size,
        image_size=image_size,
        gradient_checkpointing=params.gradient_checkpointing,
    )
    return FaceModel(backbone, build_head(params, num_classes=num_classes))


def build_head(params: TrainParams, *, num_classes: int) -> nn.Module:
    """The margin head ``params`` names, dense or sharded across the process group (``head_parallel``).

    Its centres come from ``train.seed`` alone: the same for both kinds and any number of processes.
    """
    if params.head == "softmax" and params.margin is not None:
        log.warning("train.margin %s does not apply to head softmax (nor train.scale): ignored", params.margin)
    kwargs = {"embedding_size": params.embedding_size, "num_classes": num_classes, "scale": params.scale}
    if params.head_parallel == "sharded" and dist.is_initialized() and dist.get_world_size() > 1:
        return create_model_parallel_head(
            params.head, margin=params.margin, seed=params.seed, sample_rate=params.sample_rate, **kwargs
        )
    # one process: the sharded head would hold every class, which is the dense head
    if params.sample_rate < 1:
        log.warning(
            "train.sample_rate %s applies to the sharded head of 2+ processes: one process uses all classes",
            params.sample_rate,
        )
    return create_head(params.head, margin=params.margin, seed=params.seed, **kwargs)


def data_fingerprint(dataset: FaceDataset) -> str:
    """Identifies the training data: the shard files' hashes, the records a grown set excludes from
    them, and the classes trained on.

    Exclusions belong to it: an update that only deletes photos keeps every shard file and adds
    exclusions, and the samples read are then others. A set without exclusions hashes as before, so
    checkpoints of earlier versions on such sets still resume.
    """
    digest = hashlib.sha256()
    digest.update(json.dumps([s["sha256"] for s in dataset.shards.manifest["shards"]]).encode())
    digest.update(json.dumps(dataset.class_names).encode())
    excluded = dataset.shards.excluded
    if excluded:
        digest.update(json.dumps({file: indexes.tolist() for file, indexes in excluded.items()}).encode())
    return digest.hexdigest()


def check_resumable(
    state: dict[str, Any],
    *,
    params: TrainParams,
    fingerprint: str,
    num_samples: int,
    source: Path,
    effective_batch: int | None = None,
) -> None:
    """A checkpoint may continue this run only if it trained the same thing on the same data (the
    same fingerprint and the same number of samples).

    ``batch_size`` and ``accum_steps`` may differ when this run's ``effective_batch`` (samples per
    optimizer step, all processes) equals the checkpoint's: the same steps, laid out differently.
    Not CurricularFace's ``accum_steps`` between 1 and more: its ``t`` moves before use at 1 and
    after the step above 1 (a different run).
    """
    ignored = OPERATIONAL_KEYS
    if effective_batch is not None and state.get("plan", {}).get("effective_batch") == effective_batch:
        ignored = OPERATIONAL_KEYS | LAYOUT_KEYS
        saved_accum = state["config"].get("accum_steps", 1)
        if params.head == "curricularface" and (saved_accum > 1) != (params.accum_steps > 1):
            ignored = ignored - {"accum_steps"}
    wanted = {k: v for k, v in params.model_dump(mode="json").items() if k not in ignored}
    # a key the checkpoint lacks was added to TrainParams after it was written: it trained with the default
    defaults = TrainParams.model_construct().model_dump(mode="json")
    saved = {k: state["config"].get(k, defaults.get(k)) for k in state["config"].keys() | defaults.keys()}
    saved = {k: v for k, v in saved.items() if k not in ignored}
    changed = sorted(k for k in saved.keys() | wanted.keys() if saved.get(k) != wanted.get(k))
    if changed:
        first = changed[0]
        raise FacepipeError(
            f"{source} was written with other train params ({', '.join(changed)}; e.g. {first}: "
            f"{saved.get(first)!r} -> {wanted.get(first)!r}); remove {source.parent} or run with --fresh"
        )
    saved_samples = state["data"].get("num_samples")
    if saved_samples != num_samples:
        raise FacepipeError(
            f"{source} was trained on other data ({saved_samples} samples, now {num_samples});"
            f" remove {source.parent} or run with --fresh"
        )
    if state["data"]["fingerprint"] != fingerprint:
        raise FacepipeError(
            f"{source} was trained on other data (shards, excluded samples or identities differ);"
            f" remove {source.parent} or run with --fresh"
        )


def seed_process(seed: int, rank: int) -> None:
    """Per-rank generators (dropout, anything random in the model), distinct and reproducible."""
    state = np.random.SeedSequence([seed, rank]).generate_state(2)
    torch.manual_seed(int(state[0]))
    np.random.seed(int(state[1]))
    random.seed(int(state[0]))


def run(
    params: TrainParams,
    prepared: str | Path,
    out: str | Path,
    *,
    identities: IdentitySelection = None,
    max_steps: int | None = None,
    fresh: bool = False,
    model_factory: ModelFactory | None = None,
    trust_unverified: bool = False,
) -> TrainReport:
    """Train on the shard set ``prepared`` (optionally only ``identities``), writing into ``out``.

    ``max_steps`` stops after that many optimizer steps in all (checkpointing there) without
    changing the schedule, which stays that of the full run; ``fresh`` deletes old checkpoints
    instead of resuming from them; ``trust_unverified`` lets a version-1 checkpoint (no checksum)
    be resumed from. Call it once per process; under torchrun every rank calls it.
    """
    check_output(out, kind=MODEL_FOLDER, sources={"shard set": prepared})
    context = init_distributed(params.device)
    if not context.is_main:
        logging.getLogger("facepipe").setLevel(logging.WARNING)
    try:
        return _train(
            params,
            context,
            prepared=Path(prepared),
            out=Path(out),
            identities=identities,
            max_steps=max_steps,
            fresh=fresh,
            model_factory=model_factory or build_model,
            trust_unverified=trust_unverified,
        )
    finally:
        shutdown(context)


def _train(
    params: TrainParams,
    context: Distributed,
    *,
    prepared: Path,
    out: Path,
    identities: IdentitySelection,
    max_steps: int | None,
    fresh: bool,
    model_factory: ModelFactory,
    trust_unverified: bool = False,
) -> TrainReport:
    """One run, in order: data, plan, model and head, resume, loader, the loop, the model folder."""
    started = time.perf_counter()
    _warn_single_process(params, context)
    dataset = _open_dataset(params, prepared, identities=identities)
    model = _build_on_device(params, context, dataset=dataset, model_factory=model_factory)
    init = load_init_weights(model.backbone, params.init_from) if params.init_from is not None else None
    params = _resolve_batch_size(params, model, context, dataset=dataset, checkpoints=out / CHECKPOINT_DIR, fresh=fresh)
    plan = make_plan(params, num_samples=len(dataset), world_size=context.world_size)
    _log_plan(dataset, plan)
    trainer = _make_trainer(model, params, plan, context, normalization=_normalization(model))
    fingerprint = data_fingerprint(dataset)
    resumed_from = _resume(
        trainer,
        out / CHECKPOINT_DIR,
        params=params,
        fingerprint=fingerprint,
        num_samples=len(dataset),
        fresh=fresh,
        trust_unverified=trust_unverified,
    )
    _start(out, context, resumed_from=resumed_from, init=init)

    spec = _model_spec(params, dataset, model, init=init)
    options = _loop_options(params, out, max_steps=max_steps, dataset=dataset, fingerprint=fingerprint, spec=spec)
    validator = _validator(params, context, out=out, spec=spec, resumed=resumed_from, shard_set=dataset.shards)
    options = replace(options, validator=validator)
    state, samples_per_s = _fit(
        trainer, params, context, dataset=dataset, options=options, out=out, resumed_from=resumed_from, batch=plan.effective_batch
    )
    _write_model(out, model, spec=spec, context=context, skipped=dataset.skipped)
    return TrainReport(
        out=str(out),
        steps=state.step,
        total_steps=plan.total_steps,
        epochs_done=state.epoch,
        resumed_from_step=resumed_from,
        num_samples=len(dataset),
        num_classes=dataset.num_classes,
        world_size=context.world_size,
        effective_batch=plan.effective_batch,
        lr=plan.lr,
        loss=trainer.last_metrics.get("loss"),
        accuracy=trainer.last_metrics.get("accuracy"),
        samples_per_s=samples_per_s,
        elapsed_s=time.perf_counter() - started,
        skipped_records=dataset.skipped,
    )


def _fit(
    trainer: Trainer,
    params: TrainParams,
    context: Distributed,
    *,
    dataset: FaceDataset,
    options: LoopOptions,
    out: Path,
    resumed_from: int | None,
    batch: int,
) -> tuple[Any, float]:
    """The training loop over the loader; returns its final state and the samples per second it ran
    at (``batch``: samples a step takes over all ranks)."""
    sampler, loader = _make_loader(params, context, dataset=dataset)
    start_step, fit_started = trainer.state.step, time.perf_counter()
    metrics = TrainMetrics(out, enabled=context.is_main, resume_step=resumed_from)
    if options.validator is not None and resumed_from is not None:
        options.validator.recover(out)  # the history TrainMetrics kept: rows up to the checkpoint
    try:
        state = trainer.fit(loader, sampler, options=options, metrics=metrics)
    finally:
        metrics.close()
    return state, (state.step - start_step) * batch / max(time.perf_counter() - fit_started, 1e-9)


def _start(out: Path, context: Distributed, *, resumed_from: int | None, init: Any) -> None:
    """Say which weights a resumed run goes on from, and clear an older run's model files."""
    if resumed_from is not None and init is not None:
        log.info("resuming from the checkpoint of step %d: its weights replace train.init_from's", resumed_from)
    if context.is_main:
        remove_model_files(out)  # this run replaces them: never leave an older run's beside its checkpoints


def _model_spec(params: TrainParams, dataset: FaceDataset, model: Any, *, init: Any) -> ModelSpec:
    """What model.json records of the model: its backbone, input size, crop and normalization, and
    the weights it started from (``init``: ``load_init_weights``' result, or None)."""
    return ModelSpec(
        backbone=params.backbone,
        embedding_size=params.embedding_size,
        image_size=dataset.image_size,
        crop=shard_set_crop(dataset.shards.manifest),
        normalization=Normalization.of(getattr(model.backbone, "family", "arcface")),
        init_from=None if init is None else init.as_dict(),
        faces=dataset.shards.manifest.get("params"),
    )


def _open_dataset(params: TrainParams, prepared: Path, *, identities: IdentitySelection) -> FaceDataset:
    """The training samples, checked cheaply first; items are uint8 ``[3, S, S]`` images, augmented."""
    shard_set = check_shard_set(prepared)  # counts, sizes, small files' hashes: seconds, before any work
    # uint8 batches between processes (4x fewer bytes); the trainer maps them to [-1, 1] on the device
    dataset = FaceDataset(
        shard_set, identities=identities, seed=params.seed, normalize=False, skip_corrupt=params.skip_corrupt_records
    )
    dataset.augment = Augmenter(params.augment, image_size=dataset.image_size)
    return dataset


def _resolve_batch_size(
    params: TrainParams, model: FaceModel, context: Distributed, *, dataset: FaceDataset, checkpoints: Path, fresh: bool
) -> TrainParams:
    """``params`` with ``batch_size: auto`` made a number: the batch this run's checkpoints were written
    with (a resumed run keeps it), else the largest that fits the device (trial steps, same on every
    rank). The rate then scales with it like any batch. Other params come back unchanged."""
    if params.batch_size != "auto":
        return params
    cached = cached_batch_size(checkpoints) if context.is_main and not fresh else None
    found = broadcast_object(cached, context)
    source = "largest that fits" if found is None else "from the checkpoints"
    if found is None:
        limit = batch_limit(
            len(dataset), world_size=context.world_size, accum_steps=params.accum_steps, device=context.device
        )
        found = find_batch_size(
            model,
            lambda: build_optimizer(
                [model], name=params.optimizer, lr=params.lr, momentum=params.momentum, weight_decay=params.weight_decay
            ),
            context=context,
            image_size=dataset.image_size,
            num_classes=dataset.num_classes,
            limit=limit,
            amp_dtype=AMP_DTYPES[params.amp],
        )
    log.info("batch_size auto: %d per process (%s)", found, source)
    return params.model_copy(update={"batch_size": found})


def _build_on_device(
    params: TrainParams, context: Distributed, *, dataset: FaceDataset, model_factory: ModelFactory
) -> FaceModel:
    """Backbone + head (``build_head`` chooses dense or sharded) on this process's device, seeded."""
    _configure_device(context)
    torch.manual_seed(params.seed)  # identical initial weights on every rank
    model = model_factory(params, num_classes=dataset.num_classes, image_size=dataset.image_size)
    model.to(context.device)
    seed_process(params.seed, context.rank)
    return model


def _make_loader(
    params: TrainParams, context: Distributed, *, dataset: FaceDataset
) -> tuple[ShardOrderSampler, DataLoader]:
    """This rank's deterministic sample order (shards shuffled, then a buffer) and the loader over it."""
    sampler = ShardOrderSampler(
        dataset.item_shards,
        batch_size=params.batch_size,
        rank=context.rank,
        world_size=context.world_size,
        accum_steps=params.accum_steps,
        buffer_size=params.shuffle_buffer,
        seed=params.seed,
    )
    workers = loader_workers(params.num_workers, device_type=context.device.type)
    loader = make_loader(dataset, sampler, num_workers=workers, pin_memory=context.device.type == "cuda")
    return sampler, loader


def _write_model(out: Path, model: FaceModel, *, spec: ModelSpec, context: Distributed, skipped: int) -> None:
    """The model folder's backbone (never the head), spec and drawn curves; rank 0 only."""
    if skipped:
        log.warning("skipped %d corrupt record reads (train.skip_corrupt_records); see the warnings above", skipped)
    if context.is_main:
        draw_curves(out)
        save_model_dir(out, model.backbone.cpu(), spec)  # CPU tensors: backbone.pt loads on any machine
        log.info("wrote %s and %s in %s", WEIGHTS_FILE, SPEC_FILE, out)


def _warn_single_process(params: TrainParams, context: Distributed) -> None:
    if context.world_size == 1 and params.nproc_per_node > 1:
        log.warning(
            "train.nproc_per_node is %d but this is a single process: launch with "
            "torchrun --nproc-per-node %d -m facepipe train ... for DDP",
            params.nproc_per_node,
            params.nproc_per_node,
        )


def _log_plan(dataset: FaceDataset, plan: Plan) -> None:
    log.info(
        "%d samples of %d identities; %d process(es) x batch %d x accum %d = %d per step; lr %.4g; %d steps",
        len(dataset),
        dataset.num_classes,
        plan.world_size,
        plan.batch_size,
        plan.accum_steps,
        plan.effective_batch,
        plan.lr,
        plan.total_steps,
    )


def _configure_device(context: Distributed) -> None:
    if context.device.type == "cuda":
        # Fixed input shapes: let cuDNN pick the fastest kernels; TF32 convolutions for amp=off. Matmuls
        # stay full float32: TF32 keeps 10 mantissa bits (relative error ~1e-3), and the head's cosines
        # feed arccos, which near cos = 1 turns 1e-3 into 0.045 rad, a tenth of ArcFace's margin.
        torch.backends.cudnn.benchmark = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cuda.matmul.allow_tf32 = False


def _loop_options(
    params: TrainParams, out: Path, *, max_steps: int | None, dataset: FaceDataset, fingerprint: str, spec: ModelSpec
) -> LoopOptions:
    """How often to log and save, and what each checkpoint carries besides the training state."""
    return LoopOptions(
        out=out / CHECKPOINT_DIR,
        checkpoint_every=params.checkpoint_every,
        keep_checkpoints=params.keep_checkpoints,
        log_every=None if params.log_every == "auto" else params.log_every,  # None: from the run's length
        max_steps=max_steps,
        checkpoint_extra={
            "config": params.model_dump(mode="json"),
            "data": {"fingerprint": fingerprint, "num_samples": len(dataset), "num_classes": dataset.num_classes},
            "model": spec.model_dump(),
            "class_names": encode_class_names(dataset.class_names),  # once per run, not per checkpoint
        },
    )


def _normalization(model: FaceModel) -> tuple[float, float]:
    """(mean, std) of the backbone's family: the pixel normalisation model.json records."""
    normalization = Normalization.of(getattr(model.backbone, "family", "arcface"))
    return normalization.mean, normalization.std


def _validator(
    params: TrainParams, context: Distributed, *, out: Path, spec: ModelSpec, resumed: int | None, shard_set: ShardSet
) -> Validator | None:
    """``train.validation`` on rank 0 (sets read and decoded now: a bad set fails before training); without
    it, the validation sets ``shard_set`` carries, if any. Every rank decides the same from the manifest."""
    files = validation_files(params.validation, shard_set=shard_set)
    if files and spec.crop != "arcface":  # every rank stops, none waits for rank 0
        raise FacepipeError(
            f"train.validation sets hold ArcFace-aligned faces; this run trains on {spec.crop} crops (prepare.crop)"
        )
    if not files or not context.is_main:
        return None
    if resumed is None and (out / BEST_DIR).is_dir():
        remove_model_files(out / BEST_DIR)  # an earlier run's best
    return Validator(
        params.validation, files=files, image_size=spec.image_size, device=context.device, out=out,
        keep_best=params.keep_best, spec=spec,
    )


def _make_trainer(
    model: FaceModel, params: TrainParams, plan: Plan, context: Distributed, *, normalization: tuple[float, float]
) -> Trainer:
    # one module when the rates are equal: the two parameter groups every earlier checkpoint holds
    modules, scales = ([model], None) if params.backbone_lr_scale == 1 else (
        [model.backbone, model.head],
        [params.backbone_lr_scale, 1.0],
    )
    optimizer = build_optimizer(
        modules,
        name=params.optimizer,
        lr=plan.lr,
        momentum=params.momentum,
        weight_decay=params.weight_decay,
        lr_scales=scales,
    )
    scheduler = build_scheduler(
        optimizer,
        total_steps=plan.total_steps,
        warmup_steps=plan.warmup_steps,
        decay=params.decay,
        power=params.poly_power,
        min_ratio=params.min_lr_ratio,
        milestones=milestone_steps(params.milestones, plan.steps_per_epoch),
        gamma=params.gamma,
    )
    return Trainer(
        model,
        optimizer,
        scheduler,
        context=context,
        plan=plan,
        amp=params.amp,
        grad_clip=params.grad_clip,
        comm_hook=params.comm_hook,
        powersgd_rank=params.powersgd_rank,
        channels_last=params.channels_last,
        normalization=normalization,
        freeze_epochs=params.freeze_epochs,
        powersgd_start_iter=powersgd_start(
            params.powersgd_start_iter, total_steps=plan.total_steps, warmup_steps=plan.warmup_steps
        ),
    )


def _resume(
    trainer: Trainer,
    checkpoints: Path,
    *,
    params: TrainParams,
    fingerprint: str,
    num_samples: int,
    fresh: bool,
    trust_unverified: bool = False,
) -> int | None:
    """Load the newest checkpoint (rank 0 picks it; all ranks must hold the same one and the same data);
    returns its step, or None for a new run."""
    context = trainer.context
    if context.is_main:
        for folder in (checkpoints.parent, checkpoints):
            remove_stale_temporaries(folder)  # left by a killed run
        if fresh and checkpoints.exists():
            log.info("--fresh: removing the checkpoints in %s", checkpoints)
            remove_checkpoints(checkpoints)
    data = {"data fingerprint": fingerprint[:16], "samples": num_samples}
    found = agreed_resume_point(checkpoints, context, fresh=fresh, data=data, unverified_ok=trust_unverified)
    if found is None:
        return None
    latest, state = found
    check_resumable(
        state,
        params=params,
        fingerprint=fingerprint,
        num_samples=num_samples,
        source=Path(latest),
        effective_batch=trainer.plan.effective_batch,
    )
    trainer.load_checkpoint_state(state, source=str(latest))
    log.info("resuming from %s (step %d, epoch %d)", latest, trainer.state.step, trainer.state.epoch)
    return int(state["step"])


def summary_line(report: TrainReport) -> str:
    loss = "n/a" if report.loss is None else f"{report.loss:.4f}"
    return (
        f"trained {report.steps}/{report.total_steps} steps ({report.epochs_done} epochs) on {report.num_samples} "
        f"samples of {report.num_classes} identities with {report.world_size} process(es): loss {loss}, "
        f"{report.samples_per_s:.1f} samples/s -> {report.out}"
    )
