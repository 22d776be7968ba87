"""The model-parallel margin head: class centres sharded across ranks (Partial FC).

Each rank holds the centres of a contiguous class range, sees the embeddings of the global batch
(all-gathered) and computes logits for its classes only; the softmax cross-entropy is assembled
across ranks from an all-reduced max, sum of exponentials and target logit. Memory for the
centres and the logits falls by the number of ranks, which is what makes millions of identities
trainable. At ``sample_rate`` < 1 each forward uses only a sample of each rank's centres (every
positive of the global batch and random others, ``facepipe.heads.partial_fc``): the logits, their
softmax and the centres' gradient shrink by the rate. Unsampled centres get a zero gradient in that
step; the optimizer still applies momentum and weight decay to them (as insightface's Partial FC
v2): with SGD they drift along their momentum and shrink by ``lr * weight_decay``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from facepipe.heads.dense import HeadOutput, initial_rows
from facepipe.heads.margins import Margin, affine_logits, compute_dtype, gather_targets, normalized_cosines
from facepipe.heads.partial_fc import sample_classes


def class_shard(num_classes: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(first class, number of classes)`` held by ``rank``: the first ``C mod W`` ranks hold one more."""
    base, extra = divmod(num_classes, world_size)
    return base * rank + min(rank, extra), base + int(rank < extra)


class _AllGather(torch.autograd.Function):
    """``[B, E]`` on each rank -> ``[W·B, E]`` in rank order, on every rank.

    Backward sums the gradients all ranks computed for this rank's rows and multiplies by ``W``:
    every rank's loss is the same global mean, and DDP then divides the backbone gradient by ``W``;
    with the factor, the backbone gets exactly the gradient of the global-batch loss, the same as
    with the dense head and a per-rank mean loss.
    """

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        parts = [torch.empty_like(tensor) for _ in range(world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        ctx.group, ctx.rank, ctx.world_size, ctx.rows = group, rank, world_size, tensor.shape[0]
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # all_reduce works in place; autograd may still own ``grad``
        grad = grad.contiguous().clone()
        # an all-reduce then a slice (not reduce_scatter) so that gloo works too
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        start = ctx.rank * ctx.rows
        return grad[start : start + ctx.rows] * ctx.world_size, None


class _ShardedCrossEntropy(torch.autograd.Function):
    """Mean softmax cross-entropy over logits split by columns across ranks, and the top-1 count.

    ``logits`` ``[N, K_rank]``; ``labels`` ``[N]`` int64, the column on this rank or -1. Returns the
    same scalar loss and int64 count of rows whose target logit is the global row maximum on every
    rank (a tie with another class counts as correct, where ``argmax`` would pick the lower index).
    """

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, labels: torch.Tensor, group: ProcessGroup | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # subtracting the global row max keeps exp() finite at scale 64 (logits up to ±64)
        row_max = logits.max(dim=1, keepdim=True).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max
        exp = shifted.exp()
        sum_exp = exp.sum(dim=1, keepdim=True)
        dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)
        # each row's target column lives on exactly one rank; the others contribute 0
        target = gather_targets(shifted, labels)
        dist.all_reduce(target, op=dist.ReduceOp.SUM, group=group)
        ctx.save_for_backward(exp / sum_exp, labels)
        correct = (target >= 0).sum()
        ctx.mark_non_differentiable(correct)
        return (sum_exp.squeeze(1).log() - target).mean(), correct

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: torch.Tensor | None) -> tuple[torch.Tensor, None, None]:
        probabilities, labels = ctx.saved_tensors
        has_target = (labels >= 0).to(probabilities.dtype).unsqueeze(1)
        grad_logits = probabilities.scatter_add(1, labels.clamp_min(0).unsqueeze(1), -has_target)
        return grad_logits * (grad / labels.shape[0]), None, None


class ModelParallelMarginHead(nn.Module):
    """Class centres sharded across the ranks of ``process_group``; returns the loss, not logits.

    Rank ``r`` holds ``weight`` ``[n_r, E]`` for classes ``[class_start, class_start + n_r)``
    (``class_shard``). ``forward`` is a collective: every rank calls it with the same batch size.
    The head is not wrapped in DDP (its parameters differ per rank); the backbone is.
    """

    def __init__(
        self,
        margin: Margin,
        *,
        embedding_size: int,
        num_classes: int,
        scale: float,
        process_group: ProcessGroup | None = None,
        seed: int = 0,
        sample_rate: float = 1.0,
    ) -> None:
        super().__init__()
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("the model-parallel head needs an initialized process group")
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        if num_classes < self.world_size:
            raise ValueError(f"num_classes ({num_classes}) must be at least the number of ranks ({self.world_size})")
        self.num_classes = num_classes
        self.class_start, self.num_local = class_shard(num_classes, self.rank, self.world_size)
        self.scale = float(scale)
        self.seed, self.sample_rate = seed, float(sample_rate)
        #: (step, micro-batch) of the next forward, set by the trainer: keys Partial FC's draw
        self.sample_key: tuple[int, int] = (0, 0)
        #: this rank's classes used by the last forward ([K] int64), None at sample_rate 1
        self.last_index: torch.Tensor | None = None
        # target_cos below already covers the global batch: no second reduction of statistics
        margin.sync_statistics = False
        self.margin = margin
        # drawn per block of classes: the gathered centres are the dense head's for this seed, any W
        self.weight = nn.Parameter(
            initial_rows(margin, self.class_start, self.num_local, embedding_size=embedding_size, seed=seed)
        )

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``[B, E]`` float and ``[B]`` int64 in [0, C) -> scalar float32 loss, equal on all ranks.

        The loss is the mean margin cross-entropy over the global batch (all ranks' samples).
        """
        return self.loss_and_correct(embeddings, labels).loss

    def loss_and_correct(self, embeddings: torch.Tensor, labels: torch.Tensor) -> HeadOutput:
        """As ``forward``, with the top-1 count; both over the global batch of ``W·B`` samples."""
        group = self.process_group
        embeddings = embeddings.to(compute_dtype(embeddings.dtype))
        all_embeddings = _AllGather.apply(embeddings, group)
        label_parts = [torch.empty_like(labels, dtype=torch.long) for _ in range(self.world_size)]
        dist.all_gather(label_parts, labels.long().contiguous(), group=group)
        local = torch.cat(label_parts) - self.class_start
        local = torch.where((local >= 0) & (local < self.num_local), local, torch.full_like(local, -1))

        weight = self.weight
        if self.sample_rate < 1.0:
            key = (self.seed, *self.sample_key, self.class_start)
            self.last_index, local = sample_classes(local, num_local=self.num_local, sample_rate=self.sample_rate, key=key)
            weight = self.weight[self.last_index]  # the gradient reaches the sampled rows only
        if self.margin.angular:
            cos = normalized_cosines(all_embeddings, weight)
            target_cos = gather_targets(cos.detach(), local)
            dist.all_reduce(target_cos, op=dist.ReduceOp.SUM, group=group)
            logits = self.margin(cos, local, target_cos) * self.scale
        else:  # softmax: a linear layer with bias on the raw embeddings, no margin, no scale
            logits = affine_logits(all_embeddings, weight)
        loss, correct = _ShardedCrossEntropy.apply(logits, local, group)
        return HeadOutput(loss, correct, local.numel())

    @torch.no_grad()
    def gather_weight(self) -> torch.Tensor:
        """All class centres ``[C, E]`` on every rank (a collective): for rank-count-free checkpoints."""
        return self.gather_rows(self.weight)

    @torch.no_grad()
    def gather_rows(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's per-class rows ``[n_r, ...]`` (centres, their optimizer state) -> ``[C, ...]``
        in class order on every rank (a collective)."""
        rows = class_shard(self.num_classes, 0, self.world_size)[1]
        padded = local.new_zeros(rows, *local.shape[1:])
        padded[: self.num_local] = local
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded, group=self.process_group)
        counts = [class_shard(self.num_classes, rank, self.world_size)[1] for rank in range(self.world_size)]
        return torch.cat([part[:count] for part, count in zip(parts, counts)])

    def local_rows(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a per-class tensor ``[C, ...]`` (the inverse of ``gather_rows``)."""
        return full[self.class_start : self.class_start + self.num_local]

    @torch.no_grad()
    def load_full_weight(self, weight: torch.Tensor) -> None:
        """Take this rank's rows of all class centres ``[C, E]`` (as from ``gather_weight``)."""
        if weight.shape != (self.num_classes, self.weight.shape[1]):
            raise ValueError(f"expected class centres {[self.num_classes, self.weight.shape[1]]}, got {list(weight.shape)}")
        self.weight.copy_(self.local_rows(weight))

    def extra_repr(self) -> str:
        return (
            f"embedding_size={self.weight.shape[1] - int(not self.margin.angular)}, num_classes={self.num_classes}, scale={self.scale}, "
            f"sample_rate={self.sample_rate}, "
            f"classes=[{self.class_start}, {self.class_start + self.num_local}) of rank {self.rank}/{self.world_size}"
        )
