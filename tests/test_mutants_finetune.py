"""Fast tests of ``train.init_from``'s file handling (``facepipe/models/pretrained.py``) for the mutation run:
which file a path names, the kind of file told by its keys, what is dropped and logged, the one-line
refusals matched whole. Tiny modules stand in for the backbones: the loader only reads keys and shapes."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from facepipe.models.backbone import WeightsError
from facepipe.io.shards import sha256_file as file_sha256
from facepipe.models.pretrained import InitRecord, load_init_weights, weights_file


class FacenetLike(nn.Module):
    """Keys of facenet-pytorch's layout (``conv2d_1a.conv.weight``), tiny."""

    def __init__(self) -> None:
        super().__init__()
        self.conv2d_1a = nn.Sequential()
        self.conv2d_1a.add_module("conv", nn.Conv2d(1, 2, 1, bias=False))
        self.last_bn = nn.BatchNorm1d(2)


class ArcfaceLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 3)


def random_state(module: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {key: torch.rand(value.shape, generator=generator).to(value.dtype) for key, value in module.state_dict().items()}


def model_folder(root: Path, state: dict[str, torch.Tensor]) -> Path:
    root.mkdir()
    torch.save(state, root / "backbone.pt")
    (root / "model.json").write_text("{}")
    return root


def test_weights_file_tells_a_model_folder_and_its_backbone_from_other_files(tmp_path: Path) -> None:
    folder = model_folder(tmp_path / "model", {})
    assert weights_file(folder) == (folder / "backbone.pt", True)
    assert weights_file(str(folder / "backbone.pt")) == (folder / "backbone.pt", True)
    (folder / "other.pt").write_bytes(b"x")
    assert weights_file(folder / "other.pt") == (folder / "other.pt", False)  # model.json beside, another name
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "backbone.pt").write_bytes(b"x")
    assert weights_file(alone / "backbone.pt") == (alone / "backbone.pt", False)  # no model.json beside
    (alone / "model.json").mkdir()  # a folder of that name is not the spec
    assert weights_file(alone / "backbone.pt") == (alone / "backbone.pt", False)


@pytest.mark.parametrize("present", ["model.json", "backbone.pt", None])
def test_a_folder_without_both_files_is_refused_whole(tmp_path: Path, present: str | None) -> None:
    folder = tmp_path / "half"
    folder.mkdir()
    if present:
        (folder / present).write_text("{}")
    message = f"init_from {str(folder)!r} is a folder but not a facepipe model folder (backbone.pt and model.json)"
    with pytest.raises(WeightsError) as error:
        weights_file(folder)
    assert str(error.value) == message


def test_a_missing_path_is_refused_whole(tmp_path: Path) -> None:
    with pytest.raises(WeightsError) as error:
        weights_file(tmp_path / "absent.pth")
    assert str(error.value) == f"init_from {str(tmp_path / 'absent.pth')!r} does not exist"


def test_file_sha256_reads_past_the_first_block(tmp_path: Path) -> None:
    data = bytes(range(256)) * (3 * 4096 + 7)  # 3 MiB and a bit: several 1 MiB blocks
    (tmp_path / "f").write_bytes(data)
    assert file_sha256(tmp_path / "f") == hashlib.sha256(data).hexdigest()
    (tmp_path / "empty").write_bytes(b"")
    assert file_sha256(tmp_path / "empty") == hashlib.sha256(b"").hexdigest()


def test_init_record_leaves_out_what_was_not_dropped() -> None:
    assert InitRecord(kind="k", file="f", sha256="s").as_dict() == {"kind": "k", "file": "f", "sha256": "s"}
    assert InitRecord("k", "f", "s", "d").as_dict() == {"kind": "k", "file": "f", "sha256": "s", "dropped": "d"}


def check_loaded(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    loaded = module.state_dict()
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[key], state[key]) for key in state)


@pytest.mark.parametrize(
    ("classes", "named"), [(8631, "8631 classes, VGGFace2"), (10575, "10575 classes, CASIA-WebFace"), (5, "5 classes")]
)
def test_a_facenet_file_loses_its_classifier_and_says_which(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, classes: int, named: str
) -> None:
    state = random_state(FacenetLike(), 1)
    path = tmp_path / "20180402-114759-vggface2.pt"
    torch.save({**state, "logits.weight": torch.zeros(classes, 1), "logits.bias": torch.zeros(classes)}, path)
    module = FacenetLike()
    with caplog.at_level(logging.INFO, logger="facepipe.models"):
        record = load_init_weights(module, path)
    check_loaded(module, state)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    dropped = f"logits.bias, logits.weight ({named})"
    assert record == InitRecord(kind="facenet-pytorch", file=path.name, sha256=digest, dropped=dropped)
    assert [r.getMessage() for r in caplog.records if r.name == "facepipe.models"] == [
        f"init_from: dropped the file's pretraining classifier {dropped}; the head is this run's own",
        f"init_from: backbone weights from {path} (facenet-pytorch, sha256 {digest[:16]})",
    ]


def test_a_facenet_file_with_only_a_classifier_bias_or_none(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state = random_state(FacenetLike(), 2)
    torch.save({**state, "logits.bias": torch.zeros(3)}, tmp_path / "bias.pt")
    record = load_init_weights(FacenetLike(), tmp_path / "bias.pt")
    assert record.dropped == "logits.bias (None classes)"
    torch.save(state, tmp_path / "plain.pt")
    caplog.clear()  # the first load may be captured too, when an earlier test left facepipe's loggers at INFO
    with caplog.at_level(logging.INFO, logger="facepipe.models"):
        record = load_init_weights(FacenetLike(), tmp_path / "plain.pt")
    assert (record.kind, record.dropped, record.file) == ("facenet-pytorch", None, "plain.pt")
    assert "pretraining classifier" not in caplog.text


def test_facepipe_and_arcface_torch_files(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state = random_state(ArcfaceLike(), 3)
    folder = model_folder(tmp_path / "model", state)
    for path in (folder, folder / "backbone.pt"):
        module = ArcfaceLike()
        record = load_init_weights(module, path)
        check_loaded(module, state)
        assert record.as_dict() == {"kind": "facepipe", "file": "backbone.pt", "sha256": file_sha256(folder / "backbone.pt")}
    torch.save(state, tmp_path / "backbone.pth")
    module = ArcfaceLike()
    caplog.clear()  # the loads above may be captured too, when an earlier test left facepipe's loggers at INFO
    with caplog.at_level(logging.INFO, logger="facepipe.models"):
        record = load_init_weights(module, tmp_path / "backbone.pth")
    check_loaded(module, state)
    assert record.as_dict() == {"kind": "arcface_torch", "file": "backbone.pth", "sha256": file_sha256(tmp_path / "backbone.pth")}
    assert [r.getMessage() for r in caplog.records] == [
        f"init_from: backbone weights from {tmp_path / 'backbone.pth'} (arcface_torch, sha256 {record.sha256[:16]})"
    ]


@pytest.mark.parametrize("kind", ["facepipe", "facenet-pytorch", "arcface_torch"])
def test_a_file_that_does_not_fit_is_refused_whole_and_the_module_kept(tmp_path: Path, kind: str) -> None:
    module = FacenetLike() if kind == "facenet-pytorch" else ArcfaceLike()
    state = random_state(module, 4)
    state["extra.weight"] = torch.zeros(1)
    if kind == "facenet-pytorch":
        state["logits.weight"] = torch.zeros(8631, 1)  # dropped before the check: not named
    if kind == "facepipe":
        path = model_folder(tmp_path / "model", state)
    else:
        path = tmp_path / "w.pth"
        torch.save(state, path)
    before = {key: value.clone() for key, value in module.state_dict().items()}
    with pytest.raises(WeightsError) as error:
        load_init_weights(module, path)
    name = type(module).__name__
    assert str(error.value) == f"init_from {str(path)!r} ({kind}) does not fit {name}: unexpected keys (1): extra.weight"
    check_loaded(module, before)
