"""Checkpoint class names at scale (issue 9): one encoded buffer, checksummed, decoded on load; older
version-2 files (names as a list) still load and verify."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import facepipe.training.checkpoint as checkpoint
from facepipe.errors import FacepipeError
from facepipe.training.checkpoint import (
    atomic_save,
    encode_class_names,
    load_checkpoint,
    save_checkpoint,
    state_checksum,
)

NAMES = [f"id{i:05d}" for i in range(2000)] + ["Zoë Ünïcode"]


def tiny_state(**extra: Any) -> dict[str, Any]:
    return {
        "format": checkpoint.CHECKPOINT_FORMAT,
        "version": checkpoint.CHECKPOINT_VERSION,
        "step": 3,
        "head": {"weight": torch.arange(12, dtype=torch.float32).reshape(3, 4)},
        **extra,
    }


def test_class_names_are_one_buffer_in_the_file_and_a_list_when_loaded(tmp_path):
    path = save_checkpoint(tmp_path, tiny_state(class_names=encode_class_names(NAMES)), step=3, keep=2)
    raw = torch.load(path, weights_only=True)
    assert isinstance(raw["class_names"], torch.Tensor) and raw["class_names"].dtype == torch.uint8
    assert load_checkpoint(path)["class_names"] == NAMES
    # a list handed to save_checkpoint is encoded the same way
    again = save_checkpoint(tmp_path, tiny_state(class_names=NAMES), step=4, keep=2)
    assert torch.equal(torch.load(again, weights_only=True)["class_names"], raw["class_names"])


def test_the_checksum_does_no_per_name_python_work(tmp_path, monkeypatch):
    """The checksum's walk visits a handful of values, not one per class (30 s at 1M names under load)."""
    calls = []
    feed = checkpoint._feed
    monkeypatch.setattr(checkpoint, "_feed", lambda digest, value: (calls.append(1), feed(digest, value)))
    save_checkpoint(tmp_path, tiny_state(class_names=NAMES), step=3, keep=1)
    assert len(calls) < 20


def test_a_changed_class_list_fails_verification(tmp_path):
    path = save_checkpoint(tmp_path, tiny_state(class_names=NAMES), step=3, keep=1)
    data = bytearray(path.read_bytes())
    at = data.find(b'"id01234"')
    assert at >= 0
    data[at + 7] ^= 0x01  # "id01234" -> "id01235": still valid JSON, another class list
    path.write_bytes(bytes(data))
    assert torch.load(path, weights_only=True)["class_names"].numel()  # torch notices nothing
    with pytest.raises(FacepipeError, match="checkpoint corrupt"):
        load_checkpoint(path)


def test_a_version_2_checkpoint_with_a_list_of_names_still_loads_and_verifies(tmp_path):
    old = tiny_state(class_names=NAMES, version=2)
    path = atomic_save({**old, "checksum": state_checksum(old)}, tmp_path / "step-00000003.pt")
    assert load_checkpoint(path)["class_names"] == NAMES
    changed = {**old, "class_names": [*NAMES[:-1], "someone else"]}
    atomic_save({**changed, "checksum": state_checksum(old)}, path)
    with pytest.raises(FacepipeError, match="checkpoint corrupt"):
        load_checkpoint(path)


def test_undecodable_class_names_are_a_one_line_error(tmp_path):
    state = tiny_state(class_names=torch.tensor(list(b'{"not": "a list"}'), dtype=torch.uint8))
    path = save_checkpoint(tmp_path, state, step=3, keep=1)
    with pytest.raises(FacepipeError, match=r"class_names is not a list of names: .*step-00000003\.pt"):
        load_checkpoint(Path(path))
