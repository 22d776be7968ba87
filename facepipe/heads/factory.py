"""``create_head`` / ``create_model_parallel_head``: a registered margin inside a dense or sharded head."""

from __future__ import annotations

from torch.distributed import ProcessGroup

from facepipe.heads.dense import MarginHead
from facepipe.heads.model_parallel import ModelParallelMarginHead
from facepipe.heads.registry import HEADS


def _check(embedding_size: int, num_classes: int, scale: float) -> None:
    if embedding_size < 1:
        raise ValueError(f"embedding_size must be positive, got {embedding_size}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be positive, got {num_classes}")
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")


def create_head(
    name: str,
    *,
    embedding_size: int,
    num_classes: int,
    scale: float = 64.0,
    margin: float | None = None,
    seed: int = 0,
) -> MarginHead:
    """A dense margin head: ``head(embeddings [B, E], labels [B]) -> [B, C]`` scaled logits.

    ``margin=None`` takes the head's default (arcface 0.5, cosface 0.35, curricularface 0.5). The
    centres come from ``seed`` alone (``heads.centres``), the same as the sharded head's gathered.
    Unknown names raise ``ValueError`` naming the known ones.
    """
    margin_class = HEADS.get(name)
    _check(embedding_size, num_classes, scale)
    return MarginHead(
        margin_class(margin), embedding_size=embedding_size, num_classes=num_classes, scale=scale, seed=seed
    )


def create_model_parallel_head(
    name: str,
    *,
    embedding_size: int,
    num_classes: int,
    scale: float = 64.0,
    margin: float | None = None,
    process_group: ProcessGroup | None = None,
    seed: int = 0,
    sample_rate: float = 1.0,
) -> ModelParallelMarginHead:
    """A sharded margin head: ``head(embeddings [B, E], labels [B]) -> scalar loss`` (a collective).

    Needs an initialized process group; each rank holds ``num_classes / world_size`` centres, drawn
    so that together they equal ``create_head(..., seed=seed)``'s whatever the world size.
    """
    margin_class = HEADS.get(name)
    _check(embedding_size, num_classes, scale)
    return ModelParallelMarginHead(
        margin_class(margin),
        embedding_size=embedding_size,
        num_classes=num_classes,
        scale=scale,
        process_group=process_group,
        seed=seed,
        sample_rate=sample_rate,
    )
