"""The dense margin head: every class centre on every rank."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from facepipe.heads.centres import init_centres
from facepipe.heads.margins import Margin, affine_logits, normalized_cosines


class HeadOutput(NamedTuple):
    """What every head returns to the trainer (``head.loss_and_correct``).

    ``loss``: scalar float32 (float64 for float64 input), the mean margin cross-entropy over
    ``samples``; ``correct``: scalar int64, how many of those samples have their own class as the
    top-1 margin logit. The dense head covers this rank's batch; the sharded head the global batch
    (every rank returns the same values).
    """

    loss: torch.Tensor
    correct: torch.Tensor
    samples: int


def initial_rows(margin: Margin, start: int, count: int, *, embedding_size: int, seed: int) -> torch.Tensor:
    """The head's initial rows of classes ``[start, start + count)``: the seeded centres ``[count, E]``,
    and for a non-angular head (softmax) a zero bias as one more column, ``[count, E + 1]``."""
    centres = init_centres(start, count, embedding_size=embedding_size, seed=seed)
    if margin.angular:
        return centres
    return torch.cat([centres, centres.new_zeros(count, 1)], dim=1)


class MarginHead(nn.Module):
    """Class centres ``weight`` ``[C, E]`` plus a margin: embeddings and labels -> scaled logits.

    With the ``softmax`` margin (not angular) ``weight`` is ``[C, E + 1]``, a linear layer's weight with
    its bias as the last column, and the logits are ``embeddings @ W.T + b`` (facenet-pytorch's classifier).

    ``loss = F.cross_entropy(head(embeddings, labels), labels)`` (``loss_and_correct``). Under data
    parallelism it is replicated like the backbone (DDP averages its gradient too).
    """

    def __init__(self, margin: Margin, *, embedding_size: int, num_classes: int, scale: float, seed: int = 0) -> None:
        super().__init__()
        self.margin = margin
        self.scale = float(scale)
        # the same centres as every rank's shard of the sharded head with this seed, together
        self.weight = nn.Parameter(initial_rows(margin, 0, num_classes, embedding_size=embedding_size, seed=seed))

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``[B, E]`` float (any precision) and ``[B]`` int64 in [0, C) -> ``[B, C]`` logits.

        The logits are ``scale`` × margin-adjusted cosines, float32 (float64 for float64 input)
        whatever the autocast state.
        """
        labels = labels.long()
        if not self.margin.angular:
            return affine_logits(embeddings, self.weight)
        cos = normalized_cosines(embeddings, self.weight)
        target_cos = cos.detach().gather(1, labels.unsqueeze(1)).squeeze(1)
        return self.margin(cos, labels, target_cos) * self.scale

    def loss_and_correct(self, embeddings: torch.Tensor, labels: torch.Tensor) -> HeadOutput:
        """``[B, E]`` and ``[B]`` in [0, C) -> mean cross-entropy and top-1 count over this batch."""
        labels = labels.long()
        logits = self(embeddings, labels)
        correct = (logits.detach().argmax(dim=1) == labels).sum()
        return HeadOutput(F.cross_entropy(logits, labels), correct, labels.numel())

    def extra_repr(self) -> str:
        classes, embedding_size = self.weight.shape[0], self.weight.shape[1] - int(not self.margin.angular)
        return f"embedding_size={embedding_size}, num_classes={classes}, scale={self.scale}"
