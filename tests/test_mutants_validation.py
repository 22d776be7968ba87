"""Fast tests of ``train.validation`` (``facepipe/training/validation.py``) for the mutation run: what it
measures equals the evaluate stage on the same .bin sets, when it is due, the best step (first on ties)
from the kept history and from its own runs, and ``keep_best``'s writes."""

from __future__ import annotations

import io
import logging
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn


from facepipe.config import EvaluateParams, ValidationParams
from facepipe.io.model_dir import ModelSpec, Normalization, save_model_dir
from facepipe.models import create_backbone
from facepipe.stages import evaluate
from facepipe.io.validation_sets import BinFile
from facepipe.training.validation import Validator

SIZE = 16


def bin_file(path: Path, seed: int) -> Path:
    """20 same and 20 different pairs of 16 px faces: 4 "identities", each a colour plus noise."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (4, SIZE, SIZE, 3))
    images, same = [], []
    for k in range(40):
        a = k % 4
        b = a if k % 2 == 0 else (a + 1 + k // 8) % 4
        for identity in (a, b):
            face = np.clip(base[identity] + rng.normal(0, 60, base[identity].shape), 0, 255).astype(np.uint8)
            buffer = io.BytesIO()
            Image.fromarray(face).save(buffer, format="PNG")
            images.append(buffer.getvalue())
        same.append(a == b)
    path.write_bytes(pickle.dumps((images, same), protocol=2))
    return path


@pytest.fixture(scope="module")
def validation_sets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("validation")
    return bin_file(root / "lfw.bin", 1), bin_file(root / "cfp_fp.bin", 2)


SPEC = ModelSpec(backbone="mobilefacenet", embedding_size=8, image_size=SIZE, normalization=Normalization.of("facenet"))


def tiny_backbone(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return create_backbone("mobilefacenet", embedding_size=8, image_size=SIZE)


def validator(sets: tuple[Path, ...], out: Path, *, keep_best: bool = True, every: int = 3) -> Validator:
    params = ValidationParams(sets=tuple(map(str, sets)), every_steps=every, batch_size=7)
    files = [BinFile(Path(path)) for path in sets]
    return Validator(params, files=files, image_size=SIZE, device=torch.device("cpu"), out=out, keep_best=keep_best, spec=SPEC)


def test_validation_measures_what_evaluate_measures_on_the_same_sets(validation_sets, tmp_path: Path) -> None:
    backbone = tiny_backbone(0)
    backbone.train()
    values = validator(validation_sets, tmp_path).measure(backbone)
    assert backbone.training  # its mode restored
    assert list(values) == [
        "lfw/accuracy", "lfw/insightface_accuracy", "cfp_fp/accuracy", "cfp_fp/insightface_accuracy", "mean_accuracy"
    ]
    save_model_dir(tmp_path / "model", backbone, SPEC)
    measured = evaluate.run_bin_sets(
        EvaluateParams(device="cpu"), tmp_path / "model", list(validation_sets), tmp_path / "eval", progress=False
    )["sets"]
    for name in ("lfw", "cfp_fp"):
        assert values[f"{name}/accuracy"] == pytest.approx(measured[name]["accuracy_mean"], abs=1e-6), name  # metrics.json: 6 digits
        assert values[f"{name}/insightface_accuracy"] == pytest.approx(
            measured[name]["insightface_accuracy_mean"], abs=1e-6
        ), name
    assert values["lfw/accuracy"] != values["cfp_fp/accuracy"]
    assert values["mean_accuracy"] == pytest.approx((values["lfw/accuracy"] + values["cfp_fp/accuracy"]) / 2, abs=1e-15)
    backbone.eval()
    validator(validation_sets, tmp_path).measure(backbone)
    assert not backbone.training


def test_validation_is_due_every_n_steps(validation_sets, tmp_path: Path) -> None:
    check = validator(validation_sets[:1], tmp_path, every=3)
    assert [step for step in range(10) if check.due(step)] == [0, 3, 6, 9]


def test_the_best_step_is_recovered_from_the_kept_history_first_on_ties(validation_sets, tmp_path: Path) -> None:
    check = validator(validation_sets[:1], tmp_path)
    check.recover(tmp_path)  # no history yet
    assert (check.best_step, check.best_accuracy) == (None, -1.0)
    history = tmp_path / "plots" / "metrics" / "val" / "mean_accuracy.tsv"
    history.parent.mkdir(parents=True)
    history.write_text("timestamp\tstep\tmean_accuracy\n1\t3\t0.5\n2\t6\t0.75\n3\t9\t0.75\n4\t12\t0.25\n")
    check.recover(tmp_path)
    assert (check.best_step, check.best_accuracy) == (6, 0.75)


def test_keep_best_writes_only_an_improvement(validation_sets, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    check = validator(validation_sets, tmp_path)
    backbone = tiny_backbone(0)
    with caplog.at_level(logging.INFO, logger="facepipe.training"):
        values = check.validate(backbone, 3)
    best = tmp_path / "best"
    saved = torch.load(best / "backbone.pt", weights_only=True)
    assert saved.keys() == backbone.state_dict().keys()
    assert all(torch.equal(saved[k], v) for k, v in backbone.state_dict().items())
    assert (best / "model.json").is_file() and check.best_step == 3 and values["best_step"] == 3.0
    assert set(values) == {
        "lfw/accuracy", "lfw/insightface_accuracy", "cfp_fp/accuracy", "cfp_fp/insightface_accuracy", "mean_accuracy",
        "best_step", "seconds",
    }
    assert 0 <= values["seconds"] < 60
    shown = ", ".join(f"{k} {values[k]:.4f}" for k in ("lfw/accuracy", "cfp_fp/accuracy"))
    assert [r.getMessage() for r in caplog.records if r.name == "facepipe.training"] == [
        f"validation at step 3: {shown} (best step 3) in {values['seconds']:.1f} s"
    ]
    # the same backbone again: a tie is no improvement, and best/ is not written
    for path in best.iterdir():
        path.unlink()
    best.rmdir()
    assert check.validate(backbone, 6)["best_step"] == 3.0 and not best.exists()
    assert check.best_step == 3


def test_without_keep_best_nothing_is_written(validation_sets, tmp_path: Path) -> None:
    check = validator(validation_sets[:1], tmp_path / "out", keep_best=False)
    assert check.validate(tiny_backbone(0), 3)["best_step"] == 3.0
    assert not (tmp_path / "out").exists()


def test_keep_best_makes_the_output_folder_and_overwrites_a_resumed_runs_best(validation_sets, tmp_path: Path) -> None:
    out = tmp_path / "not" / "yet"
    assert validator(validation_sets[:1], out).validate(tiny_backbone(0), 3)["best_step"] == 3.0
    assert (out / "best" / "backbone.pt").is_file()
    # a resumed run: best/ is there from before, the kept history's best was 0.0 at step 3
    history = out / "plots" / "metrics" / "val" / "mean_accuracy.tsv"
    history.parent.mkdir(parents=True)
    history.write_text("timestamp\tstep\tmean_accuracy\n1\t3\t0.0\n")
    resumed = validator(validation_sets[:1], out)
    resumed.recover(out)
    other = tiny_backbone(1)
    assert resumed.validate(other, 6)["best_step"] == 6.0
    saved = torch.load(out / "best" / "backbone.pt", weights_only=True)
    assert all(torch.equal(saved[k], v) for k, v in other.state_dict().items())
