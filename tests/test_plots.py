"""PNG curves a person can open offline: train's training curves and evaluate's ROC."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from train_helpers import synthetic_set, tiny_params

from facepipe.config import EvaluateParams, SplitParams
from facepipe.io.model_dir import ModelSpec, save_model_dir
from facepipe.models import create_backbone
from facepipe.plots import ROC_SIZE, TRAINING_SIZE, read_series, roc_png, training_curves_png
from facepipe.stages import evaluate, split, train

LINE = (0x2B, 0x6C, 0xB0)  # the training curves' colour
ROC = (0xC0, 0x56, 0x21)


def decoded(path) -> np.ndarray:
    """[H, W, 3] uint8 pixels of a PNG that fully decodes."""
    with Image.open(path) as pil:
        assert pil.format == "PNG"
        pil.load()
        return np.asarray(pil.convert("RGB"))


def share_of(pixels: np.ndarray, colour: tuple[int, int, int], tolerance: int = 40) -> float:
    return float((np.abs(pixels.astype(int) - colour).max(axis=2) < tolerance).mean())


def test_train_stage_writes_the_training_curves(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # dvclive writes nothing outside OUT, but keep the cwd clean anyway
    shard_set = synthetic_set(tmp_path / "set")
    train.run(tiny_params(epochs=2), shard_set, tmp_path / "model")
    png = tmp_path / "model" / "plots" / "training.png"
    pixels = decoded(png)
    assert pixels.shape == (TRAINING_SIZE[1], TRAINING_SIZE[0], 3)
    assert share_of(pixels, LINE) > 0.001  # the curves are drawn
    # the loss panel shows the logged loss: drawn again from the TSV, the same bytes
    again = training_curves_png(tmp_path / "model" / "plots" / "metrics" / "train", tmp_path / "again.png")
    assert again.read_bytes() == png.read_bytes()
    steps, loss = read_series(tmp_path / "model" / "plots" / "metrics" / "train" / "loss.tsv")
    assert len(steps) == len(loss) > 1


def test_evaluate_stage_writes_the_roc(tmp_path):
    torch.manual_seed(0)
    spec = ModelSpec(backbone="mobilefacenet", embedding_size=16, image_size=32)
    save_model_dir(tmp_path / "model", create_backbone("mobilefacenet", embedding_size=16, image_size=32), spec)
    prepared = synthetic_set(tmp_path / "set", identities=8, per_identity=5, size=32)
    split.run(SplitParams(val_identities=4, num_pairs=20, seed=0), prepared, tmp_path / "split")
    out = tmp_path / "eval"
    metrics = evaluate.run(
        EvaluateParams(batch_size=16, device="cpu"), tmp_path / "model", prepared, out,
        pairs=tmp_path / "split" / "pairs.jsonl", progress=False,
    )
    pixels = decoded(out / "roc.png")
    assert pixels.shape == (ROC_SIZE[1], ROC_SIZE[0], 3)
    assert share_of(pixels, ROC) > 0.001
    assert metrics["auc"] is not None
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json", "roc.csv", "roc.png", "thresholds.json"]
    evaluate.run(  # an evaluation folder with its PNG is replaced, and the same data draw the same bytes
        EvaluateParams(batch_size=16, device="cpu"), tmp_path / "model", prepared, tmp_path / "eval2",
        pairs=tmp_path / "split" / "pairs.jsonl", progress=False,
    )
    assert (tmp_path / "eval2" / "roc.png").read_bytes() == (out / "roc.png").read_bytes()


def test_a_known_curve_lands_where_it_should(tmp_path):
    """The diagonal ROC of a chance classifier overlays the dashed chance line; a perfect one hugs
    the top-left corner."""
    perfect = decoded(roc_png([0, 0, 1], [0, 1, 1], tmp_path / "perfect.png", title="perfect"))
    # the top edge of the plot area (tpr = 1 over fpr in (0, 1)) is the model's colour in its middle
    rows = np.flatnonzero([share_of(perfect[y : y + 1, 250:400], ROC) > 0.9 for y in range(ROC_SIZE[1])])
    assert len(rows) and rows.min() < ROC_SIZE[1] * 0.25


@pytest.mark.parametrize("content", ["step\tloss\n", ""])
def test_no_series_writes_no_png(tmp_path, content):
    (tmp_path / "loss.tsv").write_text(content)
    assert training_curves_png(tmp_path, tmp_path / "out.png") is None
    assert not (tmp_path / "out.png").exists()


def test_pipeline_flow_links_what_opens_offline(tmp_path):
    """flows.pipeline's artifact lists the project's image plots and data-quality page that exist."""
    import shutil
    from pathlib import Path

    from flows.pipeline import offline_views

    shutil.copy(Path(__file__).resolve().parents[1] / "dvc.yaml", tmp_path / "dvc.yaml")
    assert offline_views(tmp_path) == []
    for path in ("data/eval/roc.png", "data/model/plots/training.png", "data/prepared/report.html"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_bytes(b"x")
    assert offline_views(tmp_path) == ["data/prepared/report.html", "data/model/plots/training.png", "data/eval/roc.png"]
