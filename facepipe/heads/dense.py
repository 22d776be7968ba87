"""The dense margin head: every class centre on every rank."""

from __future__ import annotations

import torch
from torch import nn

from facepipe.heads.centres import init_centres
from facepipe.heads.margins import Margin, normalized_cosines


class MarginHead(nn.Module):
    """Class centres ``weight`` ``[C, E]`` plus a margin: embeddings and labels -> scaled logits.

    ``loss = F.cross_entropy(head(embeddings, labels), labels)``. Under data parallelism it is
    replicated like the backbone (DDP averages its gradient too).
    """

    def __init__(self, margin: Margin, *, embedding_size: int, num_classes: int, scale: float, seed: int = 0) -> None:
        super().__init__()
        self.margin = margin
        self.scale = float(scale)
        # the same centres as every rank's shard of the sharded head with this seed, together
        self.weight = nn.Parameter(init_centres(0, num_classes, embedding_size=embedding_size, seed=seed))

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``[B, E]`` float (any precision) and ``[B]`` int64 in [0, C) -> ``[B, C]`` logits.

        The logits are ``scale`` × margin-adjusted cosines, float32 (float64 for float64 input)
        whatever the autocast state.
        """
        labels = labels.long()
        cos = normalized_cosines(embeddings, self.weight)
        target_cos = cos.detach().gather(1, labels.unsqueeze(1)).squeeze(1)
        return self.margin(cos, labels, target_cos) * self.scale

    def extra_repr(self) -> str:
        classes, embedding_size = self.weight.shape
        return f"embedding_size={embedding_size}, num_classes={classes}, scale={self.scale}"
