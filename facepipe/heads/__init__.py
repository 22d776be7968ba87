"""Margin heads: embeddings and labels -> margin-adjusted, scaled logits (docs/architecture.md, "Rooms").

``softmax`` (facenet-pytorch's classifier: linear with bias, no margin) is registered beside the margins.
``create_head(name, ...)`` builds a dense head (``loss = F.cross_entropy(logits, labels)``);
``create_model_parallel_head(name, ...)`` shards the class centres across ranks and returns the loss.
The trainer's contract is ``head.loss_and_correct(embeddings, labels) -> HeadOutput`` (loss and top-1
count), the same for both.
"""

# Importing the margins fills the registry.
from facepipe.heads.dense import HeadOutput, MarginHead
from facepipe.heads.factory import create_head, create_model_parallel_head
from facepipe.heads.margins import ArcFaceMargin, CosFaceMargin, CurricularFaceMargin, Margin, SoftmaxLogits
from facepipe.heads.model_parallel import ModelParallelMarginHead, class_shard
from facepipe.heads.registry import list_heads, register_head

__all__ = [
    "ArcFaceMargin",
    "CosFaceMargin",
    "CurricularFaceMargin",
    "HeadOutput",
    "Margin",
    "MarginHead",
    "ModelParallelMarginHead",
    "SoftmaxLogits",
    "class_shard",
    "create_head",
    "create_model_parallel_head",
    "list_heads",
    "register_head",
]
