"""Training checkpoints: atomic files of tensors and plain values, loadable with ``weights_only=True``.

``OUT/checkpoints/step-NNNNNNNN.pt`` holds one flat dict (see ``Trainer.checkpoint_state``). A file is
written to a hidden temporary name, synced and renamed into place, so a killed run never leaves a
partial checkpoint under a real name; the newest complete one is the resume point.

Each checkpoint carries ``checksum``: a sha256 over every value in it (tensor bytes, dtypes, shapes,
plain values), verified when it is loaded, so a flipped byte is never trained on. When the newest
checkpoint is corrupt, :func:`latest_good_checkpoint` renames it ``step-N.pt.corrupt`` (kept for a
look, out of the resume order) with a warning and falls back to the previous one.

``class_names`` (one per class, a million at 1M identities) is stored as one uint8 tensor of the names'
UTF-8 JSON (version 3), made once per run by :func:`encode_class_names`: checksumming, saving and
loading it is one buffer, where a list of a million strings cost ~3.6 s of Python hashing, ~3.3 s of
pickling per checkpoint and ~16 s in ``weights_only`` unpickling on resume. :func:`load_checkpoint`
gives it back as the list of names; version 2 files (names as a list) still load and verify.

Every process of a run must continue from the same checkpoint: :func:`agreed_resume_point` has rank 0
pick it, every rank open it on its own view of the folder, and all of them compare what they hold
before training (a node without the shared folder fails at once, with the others, in one line).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from facepipe.errors import FacepipeError
from facepipe.io.atomic import atomic_write
from facepipe.training.distributed import Distributed, all_gather_objects, broadcast_object

log = logging.getLogger("facepipe.training")

CHECKPOINT_FORMAT = "facepipe-train-checkpoint"
# 3: class_names as one JSON tensor; 2: with "checksum"; version 1 files (no checksum) load only when asked
# to (``unverified_ok``: ``facepipe train --trust-unverified-checkpoint``), with a warning
CHECKPOINT_VERSION = 3
_READS = (1, 2, CHECKPOINT_VERSION)
_NAME = re.compile(r"^step-(\d{8,})\.pt$")
#: Everything a run writes in its checkpoint folder: all that ``--fresh`` may remove.
_OURS = re.compile(r"^(step-\d{8,}\.pt(\.corrupt)?|\.step-\d{8,}\.pt\.tmp-\d+)$")


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}.pt"


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save`` to a temporary sibling, fsync, then ``os.replace`` onto ``path``."""
    return atomic_write(path, lambda handle: torch.save(obj, handle))


def encode_class_names(names: list[str]) -> torch.Tensor:
    """``names`` as a 1-D uint8 tensor of their UTF-8 JSON (a list of strings), for a checkpoint."""
    return torch.frombuffer(bytearray(json.dumps(names).encode()), dtype=torch.uint8)


def decode_class_names(blob: torch.Tensor) -> list[str]:
    """Inverse of :func:`encode_class_names`; FacepipeError when the bytes are not a list of names."""
    try:
        names = json.loads(blob.numpy().tobytes())
    except ValueError as error:  # also UnicodeDecodeError
        raise FacepipeError(f"checkpoint class_names unreadable ({error})") from None
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise FacepipeError("checkpoint class_names is not a list of names")
    return names


def state_checksum(state: dict[str, Any]) -> str:
    """sha256 over every value of ``state`` except ``checksum`` (keys in sorted order; tensors by
    dtype, shape and bytes; plain values by type and repr), as torch.load gives them back."""
    digest = hashlib.sha256()
    _feed(digest, {k: v for k, v in state.items() if k != "checksum"})
    return digest.hexdigest()


def _feed(digest: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"T{value.dtype}{tuple(value.shape)}".encode())
        if flat.numel():
            digest.update(flat.view(torch.uint8).numpy())  # the tensor's own buffer: no copy
    elif isinstance(value, dict):
        digest.update(f"D{len(value)}".encode())
        for key in sorted(value, key=lambda k: (type(k).__name__, repr(k))):
            digest.update(f"K{type(key).__name__}:{key!r}".encode())
            _feed(digest, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(f"L{len(value)}".encode())  # torch.load may give a list back as a tuple
        for item in value:
            _feed(digest, item)
    else:
        digest.update(f"V{type(value).__name__}:{value!r}".encode())


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
    """Write ``state`` (with its checksum) as the checkpoint of ``step``; delete all but the newest ``keep``.

    A ``class_names`` list is stored encoded (:func:`encode_class_names`); pass it encoded already
    (once per run) to spare the encoding at every checkpoint.
    """
    if isinstance(state.get("class_names"), (list, tuple)):
        state = {**state, "class_names": encode_class_names(list(state["class_names"]))}
    path = atomic_save({**state, "checksum": state_checksum(state)}, Path(directory) / checkpoint_name(step))
    for _, old in list_checkpoints(directory)[:-keep]:
        old.unlink(missing_ok=True)
    return path


class UnverifiedCheckpoint(FacepipeError):
    """A version-1 checkpoint (no checksum) that the caller did not opt in to loading unverified."""


def load_checkpoint(path: str | os.PathLike[str], *, unverified_ok: bool = False) -> dict[str, Any]:
    """Read a checkpoint onto the CPU (tensors and plain values only; ``class_names`` as a list).

    A checksum, when present, is verified whatever the version. A version-1 file without one loads
    (with a warning) only with ``unverified_ok``, else :class:`UnverifiedCheckpoint`: a crafted file
    marked version 1 must not skip the check.
    """
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001  (corrupt zip, pickled objects, I/O: torch raises many kinds)
        raise FacepipeError(
            f"checkpoint unreadable: {path} ({type(error).__name__}: {str(error).splitlines()[0]})"
        ) from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise FacepipeError(f"not a facepipe training checkpoint: {path}")
    if state.get("version") not in _READS:
        raise FacepipeError(
            f"checkpoint version {state.get('version')} is not supported (reads {', '.join(map(str, _READS))}): {path}"
        )
    if state["version"] == 1 and "checksum" not in state:
        if not unverified_ok:
            raise UnverifiedCheckpoint(
                f"checkpoint {path} is version 1, written before checksums: it cannot be verified; resume from it"
                " with --trust-unverified-checkpoint only if you know where it came from, or run with --fresh"
            )
        log.warning("%s predates checkpoint checksums: loading it unverified (--trust-unverified-checkpoint)", path)
    elif state.get("checksum") != state_checksum(state):
        raise FacepipeError(f"checkpoint corrupt: {path} (its content does not match its checksum)")
    if isinstance(state.get("class_names"), torch.Tensor):
        try:
            state["class_names"] = decode_class_names(state["class_names"])
        except FacepipeError as error:
            raise FacepipeError(f"{error}: {path}") from None
    return state


def latest_good_checkpoint(
    directory: str | os.PathLike[str], *, unverified_ok: bool = False
) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads and verifies, and its state; None when there is none.

    A newer one that fails is renamed ``*.corrupt`` with a warning naming it. Raises FacepipeError
    when checkpoints exist but none is usable, and :class:`UnverifiedCheckpoint` (the file left as it
    is) at a version-1 file without ``unverified_ok``.
    """
    found = list_checkpoints(directory)
    for _, path in reversed(found):
        try:
            return path, load_checkpoint(path, unverified_ok=unverified_ok)
        except UnverifiedCheckpoint:
            raise
        except FacepipeError as error:
            aside = path.with_name(path.name + ".corrupt")
            log.warning("%s; set aside as %s, trying the previous checkpoint", error, aside.name)
            os.replace(path, aside)
    if found:
        raise FacepipeError(f"no usable checkpoint in {directory} (all corrupt); run with --fresh")
    return None


#: How the README calls the fix for ranks that do not see the same files.
_SHARED_HINT = (
    "every node must see the same output folder (a shared filesystem, or copies made before the run) "
    "and the same shard set: README.md, 'Several machines'"
)


def agreed_resume_point(
    directory: str | os.PathLike[str],
    context: Distributed,
    *,
    fresh: bool,
    data: dict[str, Any],
    unverified_ok: bool = False,
) -> tuple[Path, dict[str, Any]] | None:
    """Collective: the checkpoint every rank continues from (None: all start afresh), or the same
    one-line FacepipeError on every rank.

    Rank 0 picks the newest good checkpoint in ``directory`` (``fresh``: none) and broadcasts its
    path; the other ranks open that path themselves (the same file on a shared filesystem). Then all
    ranks all-gather what they hold: the checkpoint's name, step and sha256 (or why it did not open),
    the newest checkpoint they see, and ``data`` (e.g. the data fingerprint and dataset length). Any
    difference fails every rank together: otherwise a node without the file fails alone while the
    others wait in a collective until the timeout, and one with an older file of the same name trains
    other weights without a word. ``unverified_ok``: version-1 files may load (:func:`load_checkpoint`).
    """
    found, error = None, None
    if context.is_main and not fresh:
        try:
            found = latest_good_checkpoint(directory, unverified_ok=unverified_ok)
        except FacepipeError as failure:
            error = str(failure)
    path, error = broadcast_object((None if found is None else str(found[0]), error), context)
    if error is not None:
        raise FacepipeError(error)  # rank 0's (no usable checkpoint), raised by every rank at once
    state, held = (found[1], None) if found is not None else (None, None)
    if path is not None and state is None:
        try:
            state = load_checkpoint(path, unverified_ok=unverified_ok)
        except FacepipeError as failure:
            held = f"cannot use it: {failure}"
    newest = None if fresh else latest_checkpoint(directory)
    facts = {
        "resumes from": held or _describe(path, state),
        "newest checkpoint seen": "none" if newest is None else newest.name,
        **{key: str(value) for key, value in data.items()},
    }
    problem = disagreement(all_gather_objects(facts, context))
    if problem:
        raise FacepipeError(f"the {context.world_size} {problem}; {_SHARED_HINT}")
    return None if path is None else (Path(path), state)


def _describe(path: str | None, state: dict[str, Any] | None) -> str:
    if path is None or state is None:
        return "no checkpoint (a new run)"
    checksum = state.get("checksum") or state_checksum(state)  # version 1 files carry none
    return f"{Path(path).name} (step {state['step']}, sha256 {checksum[:16]})"


def disagreement(facts: list[dict[str, str]]) -> str | None:
    """None when every rank's facts are equal; else "processes disagree on how to resume: ..." naming,
    for each group of ranks that agree among themselves, the values that differ."""
    differing = [key for key in facts[0] if any(other.get(key) != facts[0][key] for other in facts)]
    if not differing:
        return None
    groups: dict[str, list[int]] = {}
    for rank, held in enumerate(facts):
        groups.setdefault(", ".join(f"{key} {held.get(key)}" for key in differing), []).append(rank)
    described = "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}: {text}" for text, ranks in groups.items()
    )
    return f"processes disagree on how to resume ({', '.join(differing)}): {described}"


def remove_checkpoints(directory: str | os.PathLike[str]) -> None:
    """Delete the checkpoints (and temporaries) a run wrote in ``directory``; nothing else."""
    directory = Path(directory)
    if directory.is_dir():
        for path in directory.iterdir():
            if _OURS.match(path.name) and path.is_file() and not path.is_symlink():
                path.unlink()


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
