"""Margin heads: embeddings and labels -> margin-adjusted, scaled logits (DESIGN.md, "train").

``create_head(name, ...)`` builds a dense head (``loss = F.cross_entropy(logits, labels)``);
``create_model_parallel_head(name, ...)`` shards the class centres across ranks and returns the loss.
"""

# Importing the margins fills the registry.
from facepipe.heads.dense import MarginHead
from facepipe.heads.factory import create_head, create_model_parallel_head
from facepipe.heads.margins import ArcFaceMargin, CosFaceMargin, CurricularFaceMargin, Margin
from facepipe.heads.model_parallel import ModelParallelMarginHead, class_shard
from facepipe.heads.registry import list_heads, register_head

__all__ = [
    "ArcFaceMargin",
    "CosFaceMargin",
    "CurricularFaceMargin",
    "Margin",
    "MarginHead",
    "ModelParallelMarginHead",
    "class_shard",
    "create_head",
    "create_model_parallel_head",
    "list_heads",
    "register_head",
]
