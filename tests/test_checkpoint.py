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


def test_a_version_1_checkpoint_without_a_checksum_loads_only_when_asked_to(tmp_path, caplog):
    """A file marked version 1 has no checksum to verify: refused in one line (and left where it is,
    not set aside as corrupt) unless the caller opts in; a checksum it does carry is verified."""
    from facepipe.training.checkpoint import UnverifiedCheckpoint, latest_good_checkpoint

    crafted = tiny_state(version=1, class_names=NAMES)
    path = atomic_save(crafted, tmp_path / "step-00000003.pt")
    expected = (
        f"checkpoint {path} is version 1, written before checksums: it cannot be verified; resume from it"
        " with --trust-unverified-checkpoint only if you know where it came from, or run with --fresh"
    )
    with pytest.raises(UnverifiedCheckpoint) as error:
        load_checkpoint(path)
    assert str(error.value) == expected
    with pytest.raises(UnverifiedCheckpoint):
        latest_good_checkpoint(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003.pt"]
    with caplog.at_level("WARNING", logger="facepipe.training"):
        assert load_checkpoint(path, unverified_ok=True)["class_names"] == NAMES
    assert any("loading it unverified" in r.getMessage() for r in caplog.records)
    found = latest_good_checkpoint(tmp_path, unverified_ok=True)
    assert found is not None and found[0] == path and found[1]["step"] == 3
    wrong = {**crafted, "checksum": "0" * 64}  # version 1 with a checksum: verified like any other
    atomic_save(wrong, path)
    with pytest.raises(FacepipeError, match="checkpoint corrupt"):
        load_checkpoint(path, unverified_ok=True)
