"""The export stage: ONNX and TorchScript files that reproduce the PyTorch backbone."""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from facepipe import cli
from facepipe import model_export
from facepipe.config import ExportParams
from facepipe.io.model_dir import ModelSpec, Normalization, load_backbone, save_model_dir, write_model_spec
from facepipe.models import create_backbone
from facepipe.stages import export

SIZE = 32


@pytest.fixture(autouse=True)
def _empty_working_directory(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    """Every test runs from an empty working directory that must stay empty: export writes only under its
    output folder (a mutant saving to str(None) left ./None in the mutation runner's directory, which
    later mutants then read as if it were their output)."""
    cwd = tmp_path_factory.mktemp("cwd")
    monkeypatch.chdir(cwd)
    yield
    assert list(cwd.iterdir()) == [], "written to the working directory"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    spec = ModelSpec(backbone="mobilefacenet", embedding_size=16, image_size=SIZE)
    backbone = create_backbone(spec.backbone, embedding_size=spec.embedding_size, image_size=spec.image_size)
    # BatchNorm statistics of the inputs it will see: freshly initialised, the network's outputs are
    # ~1e-5 and barely depend on the input (a check feeding it zeros would pass); calibrated, they
    # are ~3 and two random batches give embeddings that point elsewhere (cosine < 0.5).
    for module in backbone.modules():
        if isinstance(module, torch.nn.BatchNorm2d | torch.nn.BatchNorm1d):
            module.reset_running_stats()
            module.momentum = None  # cumulative average over the calibration batches
    backbone.train()
    with torch.no_grad():
        for seed in range(4):
            backbone(model_export.random_batch(16, SIZE, seed=100 + seed))
    backbone.eval()
    out = tmp_path_factory.mktemp("export") / "model"
    save_model_dir(out, backbone, spec)
    return out


@pytest.fixture(scope="module")
def exported(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("export") / "out"
    # From an empty working directory that must stay empty: the stage writes only under its output folder
    # (a mutant that exported to str(None) once left ./None in the mutation runner's directory).
    cwd = tmp_path_factory.mktemp("cwd")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(cwd)
        report = export.run(ExportParams(), model_dir, out)
    assert list(cwd.iterdir()) == []
    return out, report


def test_export_writes_checked_files(exported: tuple[Path, dict], model_dir: Path) -> None:
    out, report = exported
    assert sorted(p.name for p in out.iterdir()) == ["backbone.onnx", "backbone.torchscript.pt", "export.json"]
    assert json.loads((out / "export.json").read_text()) == report
    assert report["model"] == ModelSpec(backbone="mobilefacenet", embedding_size=16, image_size=SIZE).model_dump()
    arcface = {"family": "arcface", "mean": 127.5, "std": 127.5}
    assert report["input"]["normalization"] == arcface and report["input"]["crop"] == "arcface"
    metadata = {entry.key: entry.value for entry in onnx.load(str(out / "backbone.onnx")).metadata_props}
    assert json.loads(metadata["facepipe.normalization"]) == arcface and metadata["facepipe.crop"] == "arcface"
    assert set(report["files"]) == {"onnx", "torchscript"}
    # What the stage measured, held to the arithmetic (not to the stage's own 1e-4 limit): outputs ~2.5 in
    # float32 through ~50 layers; onnxruntime's kernels differ by ~7e-6 raw, ~2.5e-6 on unit vectors
    # (measured); TorchScript runs PyTorch's own kernels (measured 0).
    limits = {"onnx": (5e-5, 1e-5), "torchscript": (1e-6, 1e-6)}
    for fmt, entry in report["files"].items():
        assert entry["max_abs_diff"] <= limits[fmt][0] and entry["max_embedding_diff"] <= limits[fmt][1], fmt
        assert entry["sha256"] == hashlib.sha256((out / model_export.FILE_NAMES[fmt]).read_bytes()).hexdigest()
    # each file is what its name says: an ONNX graph (not TorchScript under the ONNX name), a TorchScript zip
    onnx.checker.check_model(onnx.load(str(out / "backbone.onnx")))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.load is deprecated
        assert isinstance(torch.jit.load(str(out / "backbone.torchscript.pt")), torch.jit.ScriptModule)


def unit(rows: np.ndarray) -> np.ndarray:
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def test_the_fixture_output_depends_strongly_on_its_input(model_dir: Path) -> None:
    """What makes the checks below mean something: other inputs, other directions."""
    model, _ = load_backbone(model_dir)
    with torch.no_grad():
        a = model(model_export.random_batch(4, SIZE, seed=1)).numpy()
        b = model(model_export.random_batch(4, SIZE, seed=2)).numpy()
        zeros = model(torch.zeros(4, 3, SIZE, SIZE)).numpy()
    assert np.linalg.norm(a, axis=1).min() > 0.5
    assert np.sum(unit(a) * unit(b), axis=1).max() < 0.5
    assert np.sum(unit(a) * unit(zeros), axis=1).max() < 0.9


@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
def test_exported_file_gives_pytorchs_embeddings_and_different_inputs_differ(
    exported: tuple[Path, dict], model_dir: Path, fmt: str
) -> None:
    out, _ = exported
    model, _ = load_backbone(model_dir)
    run = model_export.run_onnx if fmt == "onnx" else model_export.run_torchscript
    path = out / model_export.FILE_NAMES[fmt]
    first, second = model_export.random_batch(4, SIZE, seed=7), model_export.random_batch(4, SIZE, seed=8)
    with torch.no_grad():
        reference = unit(model(torch.cat([first, second])).numpy().astype(np.float64))
    embeddings = unit(np.concatenate([run(path, first), run(path, second)]).astype(np.float64))
    # float32 through a few dozen layers: ONNX's unit vectors differ by 2.4e-6 (measured; it fuses some ops
    # differently), 1e-5 is 4x headroom; TorchScript runs the same kernels (measured 0).
    np.testing.assert_allclose(embeddings, reference, rtol=0, atol=1e-5 if fmt == "onnx" else 1e-6)
    assert np.sum(embeddings[:4] * embeddings[4:], axis=1).max() < 0.5  # the file does not ignore its input


def test_compare_checks_normalised_embeddings_not_only_raw_outputs() -> None:
    """Tiny raw outputs pass any raw tolerance even when they point the other way; the embeddings do not."""
    reference = np.array([[1e-5, 0.0], [0.0, 2e-5]])
    flipped = -reference
    check = model_export.compare(flipped, reference, atol=1e-4, rtol=1e-3)
    assert check.max_abs_diff == pytest.approx(4e-5) and check.max_embedding_diff == pytest.approx(2.0)
    assert not check.passed
    assert model_export.compare(reference * (1 + 1e-7), reference, atol=1e-4, rtol=1e-3).passed
    assert not model_export.compare(reference[:1], reference, atol=1, rtol=1).passed
    assert not model_export.compare(np.full_like(reference, np.nan), reference, atol=1, rtol=1).passed


def test_exported_files_match_pytorch_on_another_batch_size(exported: tuple[Path, dict], model_dir: Path) -> None:
    out, _ = exported
    model, _ = load_backbone(model_dir)
    batch = model_export.random_batch(5, SIZE, seed=123)
    with torch.no_grad():
        reference = model(batch).numpy()
    onnx_out = model_export.run_onnx(out / "backbone.onnx", batch)
    torchscript_out = model_export.run_torchscript(out / "backbone.torchscript.pt", batch)
    # Outputs reach ~3 in float32 (eps 1.2e-7) through ~50 layers: onnxruntime's kernels differ by
    # ~7e-6 (measured), so 5e-5 is 7x headroom; TorchScript runs PyTorch's own kernels (measured 0).
    for outputs, atol in ((onnx_out, 5e-5), (torchscript_out, 1e-6)):
        assert outputs.shape == (5, 16)
        np.testing.assert_allclose(outputs, reference, atol=atol, rtol=0)
    graph = onnx.load(str(out / "backbone.onnx")).graph
    assert graph.input[0].name == "input" and graph.output[0].name == "embedding"
    assert graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"


def test_export_fails_above_tolerance_and_writes_nothing(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = model_export.run_torchscript
    monkeypatch.setattr(model_export, "run_torchscript", lambda path, batch: real(path, batch) + 0.01)
    params = tmp_path / "params.yaml"
    params.write_text("export:\n  formats: [torchscript]\n")
    assert cli.main(["export", str(model_dir), str(tmp_path / "out"), "--params", str(params)]) == 2
    err = capsys.readouterr().err
    assert "torchscript export differs from PyTorch: max |diff| 0.01" in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == [params]  # no output, no temporary folder


def test_a_facenet_model_exports_its_normalisation_from_model_json(model_dir: Path, tmp_path: Path) -> None:
    """The normalisation and crop come from model.json (not from a constant of the export stage)."""
    facenet = tmp_path / "model"
    facenet.mkdir()
    (facenet / "backbone.pt").write_bytes((model_dir / "backbone.pt").read_bytes())
    spec = ModelSpec(
        backbone="mobilefacenet", embedding_size=16, image_size=SIZE, crop="facenet",
        normalization=Normalization.of("facenet"),
    )
    write_model_spec(facenet, spec, weights_sha256=hashlib.sha256((facenet / "backbone.pt").read_bytes()).hexdigest())
    report = export.run(ExportParams(formats=("onnx",)), facenet, tmp_path / "out")
    expected = {"family": "facenet", "mean": 127.5, "std": 128.0}
    assert report["input"]["normalization"] == expected and report["input"]["crop"] == "facenet"
    assert report["input"]["preprocessing"] == "facenet face crop, RGB (pixel - 127.5) / 128 (facenet)"
    metadata = {entry.key: entry.value for entry in onnx.load(str(tmp_path / "out" / "backbone.onnx")).metadata_props}
    assert json.loads(metadata["facepipe.normalization"]) == expected
    assert metadata["facepipe.crop"] == "facenet" and metadata["facepipe.backbone"] == "mobilefacenet"


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
