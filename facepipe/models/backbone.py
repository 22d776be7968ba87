"""What every backbone shares: strict weight loading and activation checkpointing of its stages."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from facepipe.config import NORMALIZATIONS  # noqa: F401 - the families' pixel normalisation (model.json)
from facepipe.errors import FacepipeError

_SHOWN_KEYS = 5



class WeightsError(FacepipeError):
    """A weights file that is missing, unreadable, or does not fit the backbone."""


class Backbone(nn.Module):
    """Base of registered backbones: ``[B, 3, H, W]`` float, normalised as the ``family`` says (arcface:
    [-1, 1]; facenet: (pixel - 127.5) / 128) -> ``[B, E]`` float.

    Subclasses run each residual stage through ``run_stage`` so that ``gradient_checkpointing``
    applies to all of them, and list in ``ignored_weight_prefixes`` the keys of published
    checkpoints that are not part of the backbone (a pretraining classifier).
    """

    ignored_weight_prefixes: tuple[str, ...] = ()
    #: the model family, which fixes the pixel normalisation (``NORMALIZATIONS``) recorded in model.json
    family: str = "arcface"

    def __init__(self, *, embedding_size: int, image_size: int) -> None:
        super().__init__()
        self.embedding_size = embedding_size
        self.image_size = image_size
        self.gradient_checkpointing = False

    def run_stage(self, stage: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``stage(x)``, recomputed in backward instead of stored when checkpointing is on."""
        if not (self.gradient_checkpointing and torch.is_grad_enabled()):
            return stage(x)
        return checkpoint(
            stage,
            x,
            use_reentrant=False,
            context_fn=lambda: (contextlib.nullcontext(), _keep_batchnorm_statistics(stage)),
        )

    @staticmethod
    def in_float32(x: torch.Tensor) -> torch.autocast:
        """Autocast off for the embedding layers, as arcface_torch runs its FC/BN head in float32.

        The projection sums thousands of products per output and the embedding is what every
        later stage compares; use as ``with self.in_float32(x): out = head(x.float())``.
        """
        return torch.autocast(device_type=x.device.type, enabled=False)

    def load_weights(self, path: str | os.PathLike[str]) -> None:
        """Load a state-dict file strictly; a mismatch raises ``WeightsError`` naming the keys."""
        state = {
            key: value
            for key, value in read_state_dict(path).items()
            if not key.startswith(self.ignored_weight_prefixes)
        }
        problems = describe_mismatch(self.state_dict(), state)
        if problems:
            raise WeightsError(f"weights {str(path)!r} do not fit {type(self).__name__}: {problems}")
        self.load_state_dict(state, strict=True)


@contextlib.contextmanager
def _keep_batchnorm_statistics(stage: nn.Module) -> Iterator[None]:
    """Undo the running-statistics update that recomputing ``stage`` in backward does again.

    A checkpointed stage runs its forward twice in training mode; without this, every BatchNorm in
    it would count each batch twice in ``running_mean``/``running_var``/``num_batches_tracked``.
    The restore is in ``finally`` because early-stopped recomputation exits by exception.
    """
    norms = [
        module
        for module in stage.modules()
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats
    ]
    saved = [[buffer.clone() for buffer in _statistics(norm)] for norm in norms]
    try:
        yield
    finally:
        with torch.no_grad():
            for norm, values in zip(norms, saved):
                for buffer, value in zip(_statistics(norm), values):
                    buffer.copy_(value)


def _statistics(norm: nn.modules.batchnorm._BatchNorm) -> list[torch.Tensor]:
    return [
        buffer
        for buffer in (norm.running_mean, norm.running_var, norm.num_batches_tracked)
        if buffer is not None
    ]


def halved_side(size: int, times: int) -> int:
    """Side after ``times`` stride-2 3×3 convolutions with padding 1 (each gives ``ceil(n / 2)``)."""
    for _ in range(times):
        size = (size + 1) // 2
    return size


def read_state_dict(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """A ``{name: tensor}`` file read with ``weights_only=True`` onto the CPU."""
    if not Path(path).is_file():
        raise WeightsError(f"weights file {str(path)!r} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises several types for foreign or pickled files
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise WeightsError(f"weights file {str(path)!r} cannot be read as a state dict: {first_line}") from None
    if not isinstance(state, Mapping):
        raise WeightsError(f"weights file {str(path)!r} holds a {type(state).__name__}, not a state dict")
    for key, value in state.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise WeightsError(
                f"weights file {str(path)!r} is not a state dict: entry {key!r} is a {type(value).__name__}"
            )
    return dict(state)


def describe_mismatch(expected: Mapping[str, torch.Tensor], found: Mapping[str, torch.Tensor]) -> str:
    """One line naming missing keys, unexpected keys and shape mismatches; empty when they fit."""
    missing = [key for key in expected if key not in found]
    unexpected = [key for key in found if key not in expected]
    reshaped = [
        f"{key} {list(found[key].shape)} in file vs {list(expected[key].shape)} in model"
        for key in expected
        if key in found and found[key].shape != expected[key].shape
    ]
    parts = []
    for label, items in (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatch", reshaped)):
        if items:
            shown = ", ".join(items[:_SHOWN_KEYS])
            more = f" and {len(items) - _SHOWN_KEYS} more" if len(items) > _SHOWN_KEYS else ""
            parts.append(f"{label} ({len(items)}): {shown}{more}")
    return "; ".join(parts)
