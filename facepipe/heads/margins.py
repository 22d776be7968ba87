"""Additive angular / cosine margins on a block of class cosines (pure math, no I/O).

A ``Margin`` sees the cosines between normalized embeddings and a block of normalized class
centres: all classes for the dense head, one rank's shard for the model-parallel head. Labels
are indices into that block, or -1 where the sample's class lives in another block; the cosine of
every sample's own class is passed separately (``target_cos``) because margins that compare
negatives with the positive need it even where it lives elsewhere.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from facepipe.heads.registry import register_head

# Keeps sqrt(1 - cos^2) differentiable at cos = ±1 (an embedding exactly on a class centre):
# the value moves by at most 1e-6, the gradient stays finite instead of inf * 0 = NaN.
_MIN_SIN_SQUARED = 1e-12


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half/bfloat16/float32 inputs, float64 kept (for gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def normalized_cosines(embeddings: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Cosines between rows: ``[B, E]`` x ``[K, E]`` -> ``[B, K]`` in [-1, 1], float32 or float64.

    Runs with autocast disabled: in half precision the margin terms (cos·cos m − sin·sin m,
    differences of nearly equal numbers at s = 64) lose most of their digits.
    """
    dtype = compute_dtype(embeddings.dtype)
    with torch.autocast(device_type=embeddings.device.type, enabled=False):
        cos = F.linear(F.normalize(embeddings.to(dtype), dim=1), F.normalize(weight.to(dtype), dim=1))
    # rounding can leave |cos| slightly above 1, where acos-type formulas are undefined
    return cos.clamp(-1.0, 1.0)


def affine_logits(embeddings: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``embeddings @ W.T + b``: ``[B, E]`` x ``[K, E + 1]`` (each class's row, its bias last) -> ``[B, K]``.

    The bias rides as the last column of the class rows, so a sharded head's slicing, Partial FC's
    sampling and the class-ordered checkpoints treat it as part of each class. float32 (float64
    kept) with autocast disabled, as the margin heads compute.
    """
    dtype = compute_dtype(embeddings.dtype)
    with torch.autocast(device_type=embeddings.device.type, enabled=False):
        weight = weight.to(dtype)
        return F.linear(embeddings.to(dtype), weight[:, :-1], weight[:, -1])


def put_targets(logits: torch.Tensor, labels: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``logits`` with ``targets[i]`` at ``[i, labels[i]]`` for rows with ``labels[i] >= 0``.

    ``logits`` ``[B, K]``, ``labels`` ``[B]`` int64 in [-1, K), ``targets`` ``[B]``. Out of place and
    without data-dependent shapes: rows labelled -1 write their own column-0 value back, so no
    host synchronisation is needed to find the rows that have a target.
    """
    has_target = labels >= 0
    index = labels.clamp_min(0).unsqueeze(1)
    current = logits.gather(1, index).squeeze(1)
    values = torch.where(has_target, targets, current)
    return logits.scatter(1, index, values.unsqueeze(1))


def gather_targets(values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``values[i, labels[i]]``, 0 where ``labels[i] == -1``: ``[B, K]``, ``[B]`` -> ``[B]``."""
    gathered = values.gather(1, labels.clamp_min(0).unsqueeze(1)).squeeze(1)
    return torch.where(labels >= 0, gathered, torch.zeros_like(gathered))


class Margin(nn.Module):
    """Turns class cosines into margin-adjusted cosines (the head multiplies by the scale)."""

    default_margin: ClassVar[float]
    #: True: the head feeds cosines of normalized embeddings and centres and scales the result; False
    #: (softmax): the head's logits are an affine map of the raw embedding, passed through unscaled.
    angular: ClassVar[bool] = True

    def __init__(self, margin: float | None = None) -> None:
        super().__init__()
        self.margin = self.default_margin if margin is None else float(margin)
        # Margins with batch statistics all-reduce them across ranks when True; a head whose
        # ``target_cos`` already covers the global batch turns it off.
        self.sync_statistics = True
        # True under gradient accumulation (the trainer sets it): statistics are collected over the
        # micro-batches and applied once per optimizer step by ``end_step``.
        self.deferred = False

    def forward(self, cos: torch.Tensor, labels: torch.Tensor, target_cos: torch.Tensor) -> torch.Tensor:
        """``[B, K]`` cosines -> ``[B, K]`` adjusted cosines, same dtype.

        ``labels`` ``[B]`` int64 in [-1, K) (-1: the class is in another block); ``target_cos``
        ``[B]`` is cos θ_y of every row, detached, wherever its class lives.
        """
        return put_targets(cos, labels, self.target_logit(gather_targets(cos, labels)))

    def target_logit(self, cos: torch.Tensor) -> torch.Tensor:
        """The positive logit (before scaling) as a function of its cosine, elementwise."""
        raise NotImplementedError

    def end_step(self) -> None:
        """Called on every rank once after each optimizer step; applies deferred statistics."""

    def extra_repr(self) -> str:
        return f"margin={self.margin}"


def cos_plus_margin(cos: torch.Tensor, margin: float) -> torch.Tensor:
    """cos(θ + m) from cos θ, θ in [0, π]: cos θ·cos m − sin θ·sin m, elementwise."""
    sin = torch.sqrt((1.0 - cos * cos).clamp_min(_MIN_SIN_SQUARED))
    return cos * math.cos(margin) - sin * math.sin(margin)


def angular_target(cos: torch.Tensor, margin: float) -> torch.Tensor:
    """cos(θ + m) for θ + m < π, else cos θ − m·sin m: monotone decreasing in θ on [0, π].

    cos(θ + m) turns back up once θ + m passes π, which would reward pushing an embedding away
    from its class; the linear branch (ArcFace paper, insightface) keeps the logit decreasing.
    sin(π − m) = sin m.
    """
    linear = cos - margin * math.sin(margin)
    return torch.where(cos > math.cos(math.pi - margin), cos_plus_margin(cos, margin), linear)


@register_head("arcface")
class ArcFaceMargin(Margin):
    """ArcFace (Deng et al., CVPR 2019): positive logit cos(θ_y + m); default m = 0.5."""

    default_margin = 0.5

    def target_logit(self, cos: torch.Tensor) -> torch.Tensor:
        return angular_target(cos, self.margin)


@register_head("cosface")
class CosFaceMargin(Margin):
    """CosFace (Wang et al., CVPR 2018): positive logit cos θ_y − m; default m = 0.35."""

    default_margin = 0.35

    def target_logit(self, cos: torch.Tensor) -> torch.Tensor:
        return cos - self.margin


@register_head("curricularface")
class CurricularFaceMargin(ArcFaceMargin):
    """CurricularFace (Huang et al., CVPR 2020); default m = 0.5.

    Positive: the ArcFace logit. Negatives harder than the positive, cos θ_j > cos(θ_y + m), become
    cos θ_j · (t + cos θ_j), where ``t`` is an exponential moving average of the batch mean of
    cos θ_y: ``t ← α·mean + (1 − α)·t`` with α = 0.01, from t = 0, in training mode only, once per
    optimizer step, the mean taken over all samples of that step (every rank, every micro-batch),
    so ``t``'s trajectory does not depend on how a step's samples are split across processes or
    accumulation steps:

    - without accumulation (``deferred`` False) ``t`` is updated from the current batch before use,
      as in the authors' code;
    - with accumulation (``deferred`` True, set by the trainer) the micro-batches use the ``t`` of
      the previous step and collect their sum and count of cos θ_y; ``end_step`` applies the
      step's mean after the optimizer step, so the new ``t`` is used from the next step on. (Using
      it within the step would need the whole step's mean before its first micro-batch.)

    The dense head all-reduces the statistic when a process group exists, so ``t`` is identical on
    every rank; a head whose ``target_cos`` already covers the global batch sets
    ``sync_statistics = False``. Every rank must therefore run the same number of training-mode
    forwards (and of ``end_step`` calls).
    """

    default_margin = 0.5
    momentum: ClassVar[float] = 0.01

    t: torch.Tensor

    def __init__(self, margin: float | None = None) -> None:
        super().__init__(margin)
        self.register_buffer("t", torch.zeros(()))
        # sum and count of cos θ_y over the micro-batches of the current step (deferred mode); empty
        # between optimizer steps, hence not saved
        self.register_buffer("pending", torch.zeros(2, dtype=torch.float64), persistent=False)

    def forward(self, cos: torch.Tensor, labels: torch.Tensor, target_cos: torch.Tensor) -> torch.Tensor:
        """See ``Margin.forward``; also updates ``t`` in training mode (a collective when syncing)."""
        # the paper's T(cos θ_y) = cos(θ_y + m), without the θ + m > π branch, as in the reference code
        hard = cos > cos_plus_margin(target_cos, self.margin).unsqueeze(1)
        if self.training and self.deferred:
            self.pending += self._statistics(target_cos)
        elif self.training:
            self._apply_statistics(self._statistics(target_cos))
        t = self.t.to(cos.dtype)
        modulated = torch.where(hard, cos * (t + cos), cos)
        return put_targets(modulated, labels, self.target_logit(gather_targets(cos, labels)))

    def end_step(self) -> None:
        """Apply the step's collected statistic (deferred mode; a collective when syncing)."""
        if self.deferred:
            self._apply_statistics(self.pending.clone())
            self.pending.zero_()

    @torch.no_grad()
    def _statistics(self, target_cos: torch.Tensor) -> torch.Tensor:
        total = target_cos.sum().to(torch.float64)
        return torch.stack([total, total.new_tensor(float(target_cos.numel()))]).to(self.pending)

    @torch.no_grad()
    def _apply_statistics(self, stats: torch.Tensor) -> None:
        """``t ← α·mean + (1 − α)·t`` from ``stats`` = [sum, count] of cos θ_y (unchanged when empty)."""
        if self.sync_statistics and dist.is_available() and dist.is_initialized():
            # sum and count rather than an average of means: exact for unequal batches, and gloo
            # has no AVG reduction
            dist.all_reduce(stats, op=dist.ReduceOp.SUM)
        # no host synchronisation to test for an empty step: a count of 0 leaves t as it is
        mean = (stats[0] / stats[1].clamp_min(1.0)).to(self.t.dtype)
        updated = self.t * (1.0 - self.momentum) + self.momentum * mean
        self.t.copy_(torch.where(stats[1] > 0, updated, self.t))


@register_head("softmax")
class SoftmaxLogits(Margin):
    """No margin: facenet-pytorch's classifier (``InceptionResnetV1(classify=True)``'s ``logits``).

    A linear layer with bias on the unnormalized embedding and plain cross-entropy; the head's
    ``scale`` and ``margin`` do not apply (``margin`` is recorded as 0).
    """

    default_margin = 0.0
    angular = False

    def __init__(self, margin: float | None = None) -> None:
        super().__init__(None)

    def forward(self, cos: torch.Tensor, labels: torch.Tensor, target_cos: torch.Tensor) -> torch.Tensor:
        """The head's logits unchanged (the argument named ``cos`` holds them)."""
        return cos

    def target_logit(self, cos: torch.Tensor) -> torch.Tensor:
        return cos
