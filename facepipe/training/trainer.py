"""The training loop: one step function for every precision, accumulation and DDP, plus resume.

One optimizer step is ``accum_steps`` micro-steps. Each micro-step runs forward under autocast
(off / bf16 / fp16) and backward on ``loss / accum_steps`` through the GradScaler (a pass-through
unless fp16); only the last micro-step all-reduces gradients. Then: unscale, clip, step, update the
scale, advance the schedule. Counters (step, epoch, samples consumed in the epoch) count optimizer
steps, and together with the deterministic sampler they are the whole position of a run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader

from facepipe.config import Precision
from facepipe.data.augment import normalize
from facepipe.data.batch_order import ShardOrderSampler
from facepipe.errors import FacepipeError
from facepipe.heads import HeadOutput, Margin, ModelParallelMarginHead
from facepipe.progress import Progress
from facepipe.training.checkpoint import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_VERSION,
    capture_rng_state,
    restore_rng_state,
    save_checkpoint,
)
from facepipe.training.distributed import (
    CommHook,
    Distributed,
    HookOptions,
    all_gather_objects,
    all_reduce_sum,
    average_buffers,
    gradient_sync,
    reset_powersgd,
    wrap_model,
)
from facepipe.training.memory import peak_memory_mb
from facepipe.training.metrics import TrainMetrics
from facepipe.training.validation import PREFIX as VAL_PREFIX
from facepipe.training.validation import Validator
from facepipe.training.schedule import Plan

log = logging.getLogger("facepipe.training")

AMP_DTYPES = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}

Batch = tuple[torch.Tensor, torch.Tensor]


class FaceModel(nn.Module):
    """Backbone + margin head, trained as one module (one optimizer; one DDP wrapper around both
    with a dense head, around the backbone alone with a sharded one)."""

    def __init__(self, backbone: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> HeadOutput:
        """images [B, 3, S, S] float in [-1, 1], labels [B] int64 -> the head's loss and top-1 count."""
        return self.head.loss_and_correct(self.backbone(images), labels)


def head_is_sharded(head: nn.Module) -> bool:
    """A model-parallel head holds a different slice of the classes on each rank."""
    return isinstance(head, ModelParallelMarginHead)


def check_precision(amp: Precision, device: torch.device) -> None:
    """Fail early, in one line, on a precision the device cannot run."""
    if amp == "fp16" and device.type != "cuda":
        raise FacepipeError("train.amp: fp16 needs a CUDA device (use bf16 or off on CPU)")
    if amp == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise FacepipeError(f"train.amp: bf16 is not supported by {torch.cuda.get_device_name(device)}")


@dataclass
class TrainState:
    """Where a run stands; ``epoch_samples`` counts samples (all ranks) consumed in ``epoch``."""

    step: int = 0
    epoch: int = 0
    epoch_samples: int = 0


@dataclass
class StepStats:
    """Sums over micro-batches of one rank, kept on the device so that logging alone synchronizes."""

    totals: torch.Tensor  # [3]: sum of per-sample loss, correct predictions, samples

    @classmethod
    def zeros(cls, device: torch.device) -> StepStats:
        return cls(torch.zeros(3, dtype=torch.float64, device=device))


@dataclass
class LoopOptions:
    """How the loop reports and saves: everything here only changes side effects, never the weights."""

    out: Path | None = None
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    log_every: int | None = 20  # None: auto_log_every(total steps)
    max_steps: int | None = None
    checkpoint_extra: dict[str, Any] = field(default_factory=dict)
    validator: Validator | None = None  # train.validation, on rank 0 only


class Trainer:
    """Owns the model (DDP-wrapped when distributed), optimizer, schedule, scaler and position."""

    def __init__(
        self,
        model: FaceModel,
        optimizer: Optimizer,
        scheduler: LambdaLR,
        *,
        context: Distributed,
        plan: Plan,
        amp: Precision = "off",
        grad_clip: float | None = None,
        comm_hook: CommHook = "none",
        powersgd_rank: int = 1,
        powersgd_start_iter: int = 2,
        channels_last: bool = False,
        normalization: tuple[float, float] = (127.5, 127.5),
        freeze_epochs: int = 0,
    ) -> None:
        check_precision(amp, context.device)
        #: (mean, std) of the model's pixel normalisation (model.json), applied on the device
        self.normalization = normalization
        #: epochs at the start with the backbone frozen: no gradient, eval-mode BatchNorm (statistics kept)
        self.freeze_epochs = freeze_epochs
        self.context = context
        self.plan = plan
        self.module = model
        self.sharded = head_is_sharded(model.head)
        # margins with batch statistics (CurricularFace's t) move once per optimizer step
        self.margins = [module for module in model.modules() if isinstance(module, Margin)]
        for margin in self.margins:
            margin.deferred = plan.accum_steps > 1
        # A sharded head holds different classes on each rank: only the backbone is data-parallel,
        # and the centres' gradients are never all-reduced.
        wrapped = model.backbone if self.sharded else model
        self.channels_last = channels_last
        if channels_last:  # before DDP, which registers the parameters' layout for its buckets
            model.backbone.to(memory_format=torch.channels_last)
        hooks = HookOptions(comm_hook, powersgd_rank=powersgd_rank, powersgd_start_iter=powersgd_start_iter)
        self.model, self.hook_state = wrap_model(wrapped, context, hooks=hooks)
        self.comm_hook = comm_hook if context.enabled else "none"
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.amp_dtype = AMP_DTYPES[amp]
        self.grad_clip = grad_clip
        self.scaler = torch.amp.GradScaler(context.device.type, enabled=amp == "fp16")
        self.state = TrainState()
        self.stats = StepStats.zeros(context.device)
        self.last_lr = plan.lr
        #: The latest metric point: loss, accuracy, lr, samples_per_s.
        self.last_metrics: dict[str, float] = {}

    # -- one optimizer step -------------------------------------------------------------------------

    def train_step(self, micro_batches: Sequence[Batch]) -> float:
        """One optimizer step over ``micro_batches`` (each images [b, 3, S, S] uint8 pixels or float
        in [-1, 1], labels [b]).

        The loss is the mean over all samples of the step: each micro-batch's mean divided by their
        number, so k micro-batches of b equal one batch of k*b. Returns the learning rate used.
        """
        device = self.context.device
        frozen = self.backbone_frozen
        self.model.train()
        if frozen:
            self.module.backbone.eval()  # BatchNorm normalises with, and keeps, its running statistics
        last = len(micro_batches) - 1
        mean, std = self.normalization
        for index, (images, labels) in enumerate(micro_batches):
            images = normalize(images.to(device, non_blocking=True), mean=mean, std=std)  # uint8 batches, on the device
            if self.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            labels = labels.to(device, non_blocking=True)
            if self.sharded:  # Partial FC's draw: a function of the step, so a resumed run repeats it
                self.module.head.sample_key = (self.state.step, index)
            with gradient_sync(self.model, enabled=index == last):
                with torch.autocast(
                    device.type, dtype=self.amp_dtype or torch.float32, enabled=self.amp_dtype is not None
                ):
                    # the heads compute cosines, margins and softmax in float32 whatever the autocast
                    output = self._forward(images, labels, frozen=frozen)
                self.scaler.scale(output.loss / len(micro_batches)).backward()
            self._accumulate(output)
        if frozen:
            self._average_head_gradients()
        self.last_lr = self.optimizer.param_groups[-1]["lr"]  # the head's: backbone_lr_scale scales only the backbone
        self.scaler.unscale_(self.optimizer)
        if self.grad_clip is not None:
            self._clip_gradients(self.grad_clip)
        self._scaled_step()
        for margin in self.margins:
            margin.end_step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.state.step += 1
        self.state.epoch_samples += self.plan.effective_batch
        return self.last_lr

    def _scaled_step(self) -> None:
        """Step the optimizer through the GradScaler (which skips a step with inf/NaN gradients)."""
        watch = self.hook_state is not None and self.scaler.is_enabled()
        scale = self.scaler.get_scale() if watch else 0.0  # a sync, only for PowerSGD with fp16
        self.scaler.step(self.optimizer)
        self.scaler.update()
        # The scale drops only on a skipped step. The gradients were all-reduced, so every rank sees
        # the same overflow and resets alike.
        if watch and self.scaler.get_scale() < scale:
            reset_powersgd(self.hook_state)
            log.warning("step %d skipped (fp16 overflow): PowerSGD's error feedback reset", self.state.step)

    @property
    def backbone_frozen(self) -> bool:
        """True during the first ``freeze_epochs`` epochs: a function of the position, so resuming repeats it."""
        return self.state.epoch < self.freeze_epochs

    def _forward(self, images: torch.Tensor, labels: torch.Tensor, *, frozen: bool = False) -> HeadOutput:
        if frozen:
            # The backbone outside DDP and autograd: no backbone gradient, so the optimizer leaves its
            # weights (and their momentum / Adam moments) exactly as they are.
            with torch.no_grad():
                embeddings = self.module.backbone(images)
            return self.module.head.loss_and_correct(embeddings, labels)
        if self.sharded:
            return self.module.head.loss_and_correct(self.model(images), labels)
        return self.model(images, labels)

    def _average_head_gradients(self) -> None:
        """What DDP does for a replicated (dense) head when the frozen step bypasses it: the mean over
        ranks. A sharded head's rows are per rank and already see the global batch."""
        if not self.context.enabled or self.sharded:
            return
        for parameter in self.module.head.parameters():
            if parameter.grad is not None:
                dist.all_reduce(parameter.grad)
                parameter.grad.div_(self.context.world_size)

    def _clip_gradients(self, max_norm: float) -> None:
        """Scale all gradients so that the norm of backbone + head (all ranks' centres) is <= max_norm."""
        if not self.sharded:
            nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)
            return
        # the backbone's gradient is the same on every rank (DDP); the head's is split by classes, so
        # its squared norm is summed over ranks before it joins the backbone's
        grads = [p.grad for p in self.module.backbone.parameters() if p.grad is not None]
        head_grads = [p.grad for p in self.module.head.parameters() if p.grad is not None]
        head_squared = nn.utils.get_total_norm(head_grads).double().square()
        dist.all_reduce(head_squared, group=self.module.head.process_group)
        total = (nn.utils.get_total_norm(grads).double().square() + head_squared).sqrt()
        dtype = grads[0].dtype if grads else torch.float32
        nn.utils.clip_grads_with_norm_(self.module.parameters(), max_norm, total.to(dtype))

    def _accumulate(self, output: HeadOutput) -> None:
        # a sharded head's values cover the global batch on every rank: summed over ranks, the
        # loss and accuracy ratios stay the global ones
        with torch.no_grad():
            count = output.loss.new_full((), output.samples, dtype=torch.float64)
            correct = output.correct.double()
            self.stats.totals += torch.stack([output.loss.detach().double() * count, correct, count])

    def collect_stats(self) -> dict[str, float]:
        """Mean loss and accuracy since the last call, over all ranks (a synchronization point)."""
        totals = all_reduce_sum(self.stats.totals.clone(), self.context).tolist()
        self.stats = StepStats.zeros(self.context.device)
        samples = max(totals[2], 1.0)
        return {"loss": totals[0] / samples, "accuracy": totals[1] / samples}

    # -- checkpoints --------------------------------------------------------------------------------

    def checkpoint_state(self, extra: dict[str, Any]) -> dict[str, Any]:
        """Everything needed to continue exactly; collective (every rank contributes its RNG state)."""
        rng = all_gather_objects(capture_rng_state(self.context.device), self.context)
        average_buffers(self.model, self.context)  # DDP does not broadcast them (wrap_model)
        return {
            "format": CHECKPOINT_FORMAT,
            "version": CHECKPOINT_VERSION,
            "backbone": self.module.backbone.state_dict(),
            "head": self._head_state(),
            "optimizer": self._optimizer_state(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "step": self.state.step,
            "epoch": self.state.epoch,
            "epoch_samples": self.state.epoch_samples,
            "rng": rng,
            "world_size": self.context.world_size,
            "plan": self.plan.as_dict(),
            **extra,
        }

    def load_checkpoint_state(self, state: dict[str, Any], *, source: str = "checkpoint") -> None:
        """Continue from ``state``, written by this or another number of processes, with either head.

        The checkpoint holds every class centre and its per-class optimizer state in class order, so
        the sharded head takes this rank's rows of them whatever world size wrote it (and the dense
        head takes them all). With another world size the position is re-derived from the samples
        consumed: the sampler restarts at ``epoch_samples`` of the same epoch stream, and the schedule
        at ``epoch * steps_per_epoch + epoch_samples // effective_batch`` with this world's peak rate.
        Ranks the checkpoint had no RNG state for keep their own seeding (nothing in the data path
        draws from these generators: augmentation seeds come from the sampler).
        """
        same_world = state["world_size"] == self.context.world_size
        self.module.backbone.load_state_dict(state["backbone"])
        self.module.head.load_state_dict(self._local_head_state(state["head"]))
        self.optimizer.load_state_dict(self._local_optimizer_state(state["optimizer"]))
        self.scaler.load_state_dict(state["scaler"])
        epoch, epoch_samples = int(state["epoch"]), int(state["epoch_samples"])
        if same_world:
            self.scheduler.load_state_dict(state["scheduler"])
            step = int(state["step"])
        else:
            step = epoch * self.plan.steps_per_epoch + epoch_samples // self.plan.effective_batch
            self._rebase_schedule(step)
            log.warning(
                "resuming %s from %d processes with %d: effective batch %d, lr %.4g, continuing at step %d",
                source,
                state["world_size"],
                self.context.world_size,
                self.plan.effective_batch,
                self.plan.lr,
                step,
            )
        self.state = TrainState(step=step, epoch=epoch, epoch_samples=epoch_samples)
        if self.comm_hook == "powersgd":
            # Its error feedback is keyed by DDP gradient buckets, which DDP rebuilds in gradient
            # order after the first step of every run: it cannot be carried over exactly.
            log.warning("resuming with comm_hook powersgd: PowerSGD's error feedback starts afresh (not bit-exact)")
        rng = state["rng"]
        if self.context.rank < len(rng):
            restore_rng_state(rng[self.context.rank], self.context.device)

    # A checkpoint holds every class centre and every per-class optimizer tensor (momentum, Adam's
    # moments) in class order, gathered from the ranks of a sharded head: the same layout as the dense
    # head's, so either kind at any world size can continue from it.

    def _head_weight_index(self) -> int:
        """Position of the head's centres in the optimizer's state_dict numbering."""
        ids = [id(p) for group in self.optimizer.param_groups for p in group["params"]]
        return ids.index(id(self.module.head.weight))

    def _head_state(self) -> dict[str, Any]:
        state = self.module.head.state_dict()
        if self.sharded:
            state["weight"] = self.module.head.gather_weight()  # collective
        return state

    def _optimizer_state(self) -> dict[str, Any]:
        state = self.optimizer.state_dict()
        if not self.sharded:
            return state
        head, index = self.module.head, self._head_weight_index()
        entry = state["state"].get(index, {})
        gathered = {  # collective: every rank holds the same keys, visited in the same order
            key: head.gather_rows(value) if _per_class(value, head.weight.shape) else value
            for key, value in sorted(entry.items())
        }
        return {**state, "state": {**state["state"], index: gathered}} if entry else state

    def _local_head_state(self, saved: dict[str, Any]) -> dict[str, Any]:
        if not self.sharded:
            return saved
        return {**saved, "weight": self.module.head.local_rows(saved["weight"])}

    def _local_optimizer_state(self, saved: dict[str, Any]) -> dict[str, Any]:
        if not self.sharded:
            return saved
        head, index = self.module.head, self._head_weight_index()
        full_shape = (head.num_classes, *head.weight.shape[1:])
        entry = saved["state"].get(index)
        if not entry:
            return saved
        local = {k: head.local_rows(v) if _per_class(v, full_shape) else v for k, v in entry.items()}
        return {**saved, "state": {**saved["state"], index: local}}

    def _rebase_schedule(self, step: int) -> None:
        """Point the schedule at ``step`` with this world's peak rate (not the one in the checkpoint)."""
        factor = self.scheduler.lr_lambdas[0](step)
        for group in self.optimizer.param_groups:
            group["initial_lr"] = self.plan.lr * group.get("lr_scale", 1.0)
            group["lr"] = group["initial_lr"] * factor
        self.scheduler.base_lrs = [group["initial_lr"] for group in self.optimizer.param_groups]
        self.scheduler.last_epoch = step
        self.scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    # -- the loop -----------------------------------------------------------------------------------

    def fit(
        self,
        loader: DataLoader,
        sampler: ShardOrderSampler,
        *,
        options: LoopOptions,
        metrics: TrainMetrics | None = None,
    ) -> TrainState:
        """Train until ``plan.epochs`` are done (or ``options.max_steps`` optimizer steps in all)."""
        plan, state = self.plan, self.state
        saved_at = state.step
        log_every = options.log_every or auto_log_every(plan.total_steps)
        remaining = max(min(plan.total_steps, options.max_steps or plan.total_steps) - state.step, 0)
        with Progress(remaining, desc="train", unit="step", enabled=self.context.is_main, logger=log) as progress:
            window = _Window(state.step)
            while state.epoch < plan.epochs and not self._stop(options):
                epoch_start, epoch_first_step = time.perf_counter(), state.step
                sampler.set_epoch(state.epoch, start_sample=state.epoch_samples)
                for micro_batches in _steps(loader, plan.accum_steps):
                    self.train_step(micro_batches)
                    progress.update(1)
                    if state.step % log_every == 0:
                        self._log(window, metrics)
                    self._validate(options, metrics)
                    if self._stop(options) or sampler.epoch_finished(state.epoch_samples):
                        break  # the checkpoint below covers this step
                    if options.checkpoint_every and state.step % options.checkpoint_every == 0:
                        saved_at = self._save(options)
                if sampler.epoch_finished(state.epoch_samples):
                    # Count the epoch before saving, so no checkpoint ever points at an epoch's end.
                    state.epoch += 1
                    state.epoch_samples = 0
                    seconds = time.perf_counter() - epoch_start
                    self._log_epoch(metrics, seconds=seconds, steps=state.step - epoch_first_step)
                if saved_at != state.step:
                    saved_at = self._save(options)
            if window.step != state.step:
                self._log(window, metrics)
        return state

    def _log_epoch(self, metrics: TrainMetrics | None, *, seconds: float, steps: int) -> None:
        """Time and memory of the epoch just done (collective: the peak is the largest over ranks)."""
        peak = torch.tensor(peak_memory_mb(self.context.device), dtype=torch.float64, device=self.context.device)
        if self.context.enabled:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        values = {
            "epoch": self.state.epoch,
            "epoch_time_s": seconds,
            "step_time_s": seconds / max(steps, 1),
            "peak_memory_mb": peak.item(),
        }
        if metrics is not None:
            metrics.log(self.state.step, values)
        log.info(
            "epoch %d/%d done in %.1f s (%.3f s/step), peak %s memory %.0f MiB",
            self.state.epoch,
            self.plan.epochs,
            seconds,
            values["step_time_s"],
            "GPU" if self.context.device.type == "cuda" else "RSS",
            values["peak_memory_mb"],
        )

    def _validate(self, options: LoopOptions, metrics: TrainMetrics | None) -> None:
        """At ``every_steps`` and at the last step, before any checkpoint of that step (so a resumed run
        never validates a step twice or skips one)."""
        validator, step = options.validator, self.state.step
        if validator is None or not (validator.due(step) or self._stop(options) or step == self.plan.total_steps):
            return
        values = validator.validate(self.module.backbone, step)
        if metrics is not None:
            metrics.log(step, values, prefix=VAL_PREFIX)

    def _stop(self, options: LoopOptions) -> bool:
        return options.max_steps is not None and self.state.step >= options.max_steps

    def _log(self, window: _Window, metrics: TrainMetrics | None) -> None:
        values = self.collect_stats()
        elapsed, steps = window.advance(self.state.step)
        lr = self.last_lr
        values.update(lr=lr, samples_per_s=steps * self.plan.effective_batch / max(elapsed, 1e-9))
        self.last_metrics = values
        log.info(
            "step %d/%d  epoch %d  loss %.4f  acc %.3f  lr %.4g  %.0f samples/s",
            self.state.step,
            self.plan.total_steps,
            self.state.epoch,
            values["loss"],
            values["accuracy"],
            lr,
            values["samples_per_s"],
        )
        if metrics is not None:
            metrics.log(self.state.step, values)

    def _save(self, options: LoopOptions) -> int:
        """Write a checkpoint of the current step (collective; rank 0 writes)."""
        state = self.checkpoint_state(options.checkpoint_extra)
        if options.out is not None and self.context.is_main:
            path = save_checkpoint(options.out, state, step=self.state.step, keep=options.keep_checkpoints)
            log.info("checkpoint %s", path)
        return self.state.step


def auto_log_every(total_steps: int) -> int:
    """Optimizer steps between metric points for ``log_every: auto``: about 100 points per run, every
    step for short runs (the demo's curves), at most 50 steps apart. Each point synchronizes the
    device with the host and the ranks with each other, so fewer points keep a GPU busier."""
    return min(50, max(1, total_steps // 100))


def _per_class(value: Any, shape: tuple[int, ...]) -> bool:
    """An optimizer state tensor with one row per class of the head (not a step count)."""
    return isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(shape)


class _Window:
    """Wall time and optimizer steps since the previous metric point."""

    def __init__(self, step: int) -> None:
        self.time = time.perf_counter()
        self.step = step

    def advance(self, step: int) -> tuple[float, int]:
        now = time.perf_counter()
        elapsed, steps = now - self.time, step - self.step
        self.time, self.step = now, step
        return elapsed, steps


def _steps(loader: DataLoader, accum_steps: int) -> Iterator[list[Batch]]:
    """Group the loader's batches into the micro-batches of each optimizer step."""
    batches = iter(loader)
    for _ in range(len(loader) // accum_steps):
        yield [next(batches) for _ in range(accum_steps)]
