"""The export stage: ONNX and TorchScript files that reproduce the PyTorch backbone."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from facepipe import cli, exporting
from facepipe.config import ExportParams
from facepipe.io.model_dir import ModelSpec, load_backbone, save_model_dir
from facepipe.models import create_backbone
from facepipe.stages import export

SIZE = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    spec = ModelSpec(backbone="mobilefacenet", embedding_size=16, image_size=SIZE)
    backbone = create_backbone(spec.backbone, embedding_size=spec.embedding_size, image_size=spec.image_size)
    # Random BatchNorm statistics, so that eval mode is not the identity and the check means something.
    for module in backbone.modules():
        if isinstance(module, torch.nn.BatchNorm2d | torch.nn.BatchNorm1d):
            module.running_mean.uniform_(-0.1, 0.1)
            module.running_var.uniform_(0.5, 1.5)
    out = tmp_path_factory.mktemp("export") / "model"
    save_model_dir(out, backbone, spec)
    return out


@pytest.fixture(scope="module")
def exported(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("export") / "out"
    return out, export.run(ExportParams(), model_dir, out)


def test_export_writes_checked_files(exported: tuple[Path, dict], model_dir: Path) -> None:
    out, report = exported
    assert sorted(p.name for p in out.iterdir()) == ["backbone.onnx", "backbone.torchscript.pt", "export.json"]
    assert json.loads((out / "export.json").read_text()) == report
    assert report["model"] == {"backbone": "mobilefacenet", "embedding_size": 16, "image_size": SIZE}
    assert set(report["files"]) == {"onnx", "torchscript"}
    for entry in report["files"].values():
        assert entry["max_abs_diff"] <= 1e-4 and len(entry["sha256"]) == 64


def test_exported_files_match_pytorch_on_another_batch_size(exported: tuple[Path, dict], model_dir: Path) -> None:
    out, _ = exported
    model, _ = load_backbone(model_dir)
    batch = exporting.random_batch(5, SIZE, seed=123)
    with torch.no_grad():
        reference = model(batch).numpy()
    onnx_out = exporting.run_onnx(out / "backbone.onnx", batch)
    torchscript_out = exporting.run_torchscript(out / "backbone.torchscript.pt", batch)
    for outputs in (onnx_out, torchscript_out):
        assert outputs.shape == (5, 16)
        np.testing.assert_allclose(outputs, reference, atol=1e-4, rtol=1e-3)
    graph = onnx.load(str(out / "backbone.onnx")).graph
    assert graph.input[0].name == "input" and graph.output[0].name == "embedding"
    assert graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"


def test_export_fails_above_tolerance_and_writes_nothing(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = exporting.run_torchscript
    monkeypatch.setattr(exporting, "run_torchscript", lambda path, batch: real(path, batch) + 0.01)
    params = tmp_path / "params.yaml"
    params.write_text("export:\n  formats: [torchscript]\n")
    assert cli.main(["export", str(model_dir), str(tmp_path / "out"), "--params", str(params)]) == 2
    err = capsys.readouterr().err
    assert "torchscript export differs from PyTorch: max |diff| 0.01" in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == [params]  # no output, no temporary folder


def test_export_cli_one_format(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    params = tmp_path / "params.yaml"
    params.write_text("export:\n  formats: [torchscript]\n  check_batch_size: 2\n")
    assert cli.main(["export", str(model_dir), str(tmp_path / "out"), "--params", str(params)]) == 0
    assert "export: mobilefacenet -> torchscript backbone.torchscript.pt" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["backbone.torchscript.pt", "export.json"]


@pytest.mark.parametrize(
    ("params_text", "model_name", "message"),
    [
        ("", "missing", "model folder not found"),
        ("", "empty", "no model.json"),
        ("export:\n  formats: [tflite]\n", None, "export.formats.0: Input should be 'onnx' or 'torchscript'"),
        ("export:\n  tolerance: 1\n", None, "unknown key 'export.tolerance'"),
    ],
)
def test_export_cli_errors(
    model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    params_text: str,
    model_name: str | None,
    message: str,
) -> None:
    params = tmp_path / "params.yaml"
    params.write_text(params_text)
    model = model_dir
    if model_name is not None:
        model = tmp_path / model_name
        if model_name == "empty":
            model.mkdir()
    assert cli.main(["export", str(model), str(tmp_path / "out"), "--params", str(params)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("facepipe export: error:") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()
