"""Training checkpoints: atomic files of tensors and plain values, loadable with ``weights_only=True``.

``OUT/checkpoints/step-NNNNNNNN.pt`` holds one flat dict (see ``Trainer.checkpoint_state``). A file is
written to a hidden temporary name, synced and renamed into place, so a killed run never leaves a
partial checkpoint under a real name; the newest complete one is the resume point.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from facepipe.errors import FacepipeError

CHECKPOINT_FORMAT = "facepipe-train-checkpoint"
CHECKPOINT_VERSION = 1
_NAME = re.compile(r"^step-(\d{8,})\.pt$")


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}.pt"


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save`` to a temporary sibling, fsync, then ``os.replace`` onto ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def list_checkpoints(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``directory`` as (step, path), oldest first; temporary files are ignored."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def save_checkpoint(directory: str | os.PathLike[str], state: dict[str, Any], *, step: int, keep: int) -> Path:
    """Write ``state`` as the checkpoint of ``step`` and delete all but the newest ``keep``."""
    path = atomic_save(state, Path(directory) / checkpoint_name(step))
    for _, old in list_checkpoints(directory)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint onto the CPU (tensors and plain values only)."""
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001  (corrupt zip, pickled objects, I/O: torch raises many kinds)
        raise FacepipeError(
            f"checkpoint unreadable: {path} ({type(error).__name__}: {str(error).splitlines()[0]})"
        ) from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise FacepipeError(f"not a facepipe training checkpoint: {path}")
    if state.get("version") != CHECKPOINT_VERSION:
        raise FacepipeError(
            f"checkpoint version {state.get('version')} is not supported (reads {CHECKPOINT_VERSION}): {path}"
        )
    return state


def capture_rng_state(device: torch.device) -> dict[str, Any]:
    """This process's torch / CUDA / NumPy / Python generator states as tensors and plain values."""
    _, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.zeros(0, dtype=torch.uint8),
        "numpy": {
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": {"version": int(version), "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
    }


def restore_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Inverse of :func:`capture_rng_state`."""
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state["cuda"].numel():
        torch.cuda.set_rng_state(state["cuda"], device)
    numpy = state["numpy"]
    keys = numpy["keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, numpy["pos"], numpy["has_gauss"], numpy["cached_gaussian"]))
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"].tolist()), python["gauss"]))
