"""Files facepipe loads never run code: a pickle that would execute something on load is refused
before it does (weights, checkpoints, records)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from facepipe.errors import FacepipeError
from facepipe.io.records import RecordError, decode_record
from facepipe.models import create_backbone
from facepipe.training.checkpoint import load_checkpoint


class _Payload:
    """Unpickling this object creates the folder ``marker``: the test's evidence that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "code-ran"


def test_the_payload_runs_code_when_loaded_without_weights_only(tmp_path: Path, marker: Path):
    """The control: the same file does run code through a plain unpickler."""
    torch.save({"fc.weight": _Payload(marker)}, tmp_path / "evil.pt")
    torch.load(tmp_path / "evil.pt", weights_only=False)
    assert marker.is_dir()


def test_backbone_weights_that_would_run_code_are_refused(tmp_path: Path, marker: Path):
    torch.save({"fc.weight": _Payload(marker)}, tmp_path / "evil.pth")
    with pytest.raises(FacepipeError):
        create_backbone("mobilefacenet", weights=tmp_path / "evil.pth")
    assert not marker.exists()


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path: Path, marker: Path):
    torch.save({"format": "facepipe-train-checkpoint", "version": 2, "state": _Payload(marker)}, tmp_path / "step-1.pt")
    with pytest.raises(FacepipeError):
        load_checkpoint(tmp_path / "step-1.pt")
    assert not marker.exists()


def test_a_record_holding_a_pickle_is_refused(marker: Path):
    with pytest.raises(RecordError):
        decode_record(pickle.dumps(_Payload(marker)))
    assert not marker.exists()


def test_detector_weights_that_would_run_code_are_refused(tmp_path: Path, marker: Path):
    from facepipe.detection.retinaface_net import load_checkpoint as load_retinaface

    torch.save({"body.stage1.0.0.weight": _Payload(marker)}, tmp_path / "mobilenet0.25_Final.pth")
    with pytest.raises(FacepipeError):
        load_retinaface(tmp_path / "mobilenet0.25_Final.pth")
    assert not marker.exists()
