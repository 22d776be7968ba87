"""Batched embedding of aligned faces, optionally fused with the embedding of the mirrored face."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import islice

import numpy as np
import torch
from torch import nn

from facepipe.progress import Progress


def to_model_input(images: np.ndarray, *, mean: float = 127.5, std: float = 127.5) -> torch.Tensor:
    """[B, H, W, 3] uint8 RGB -> [B, 3, H, W] float32 ``(pixel - mean) / std``: the model's
    normalisation (model.json); the default, arcface's, is [-1, 1] computed as pixel / 127.5 - 1."""
    batch = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float()
    if (mean, std) == (127.5, 127.5):
        return batch / 127.5 - 1.0
    return (batch - mean) / std


def _batches(images: Iterable[np.ndarray], size: int) -> Iterator[np.ndarray]:
    iterator = iter(images)
    while batch := list(islice(iterator, size)):
        yield np.stack(batch)


@torch.inference_mode()
def embed_images(
    model: nn.Module,
    images: Iterable[np.ndarray],
    *,
    count: int,
    batch_size: int = 64,
    flip: bool = True,
    device: torch.device | str = "cpu",
    progress: bool = True,
    normalization: tuple[float, float] = (127.5, 127.5),
) -> np.ndarray:
    """Embed ``count`` faces ([H, W, 3] uint8 RGB each) -> [count, E] float32, L2-normalized rows.

    With ``flip``, each face and its horizontal mirror go through the model in the same forward
    pass and their raw embeddings are summed before normalizing (the insightface convention).
    ``model`` must already be in eval mode on ``device``; ``normalization`` is its (mean, std).
    """
    device = torch.device(device)
    chunks = []
    with Progress(count, desc="embed", unit="img", enabled=progress) as bar:
        for batch in _batches(images, batch_size):
            x = to_model_input(batch, mean=normalization[0], std=normalization[1]).to(device)
            if flip:
                out = model(torch.cat([x, x.flip(3)]))
                out = out[: len(x)] + out[len(x) :]
            else:
                out = model(x)
            chunks.append(nn.functional.normalize(out.float(), dim=1).cpu().numpy())
            bar.update(len(batch))
    embeddings = np.concatenate(chunks) if chunks else np.zeros((0, 0), np.float32)
    if len(embeddings) != count:
        raise ValueError(f"expected {count} images, got {len(embeddings)}")
    return embeddings
