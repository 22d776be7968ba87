"""The export check's arithmetic against hand-computed cases (tests/README.md)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from google.protobuf.message import DecodeError

from facepipe.model_export import (
    FILE_NAMES,
    INPUT_NAME,
    OUTPUT_NAME,
    compare,
    export_and_check,
    export_onnx,
    export_torchscript,
    random_batch,
    run_onnx,
    run_torchscript,
    unit_rows,
)


def test_unit_rows_by_hand() -> None:
    rows = unit_rows(np.array([[3.0, 4.0], [0.0, 0.0], [0.0, -2.0], [0.0, 0.25]], dtype=np.float32))
    assert rows.dtype == np.float64
    np.testing.assert_array_equal(rows, [[0.6, 0.8], [0.0, 0.0], [0.0, -1.0], [0.0, 1.0]])  # short rows too
    # only a norm below 1e-12 is held at 1e-12 (no division by zero); 0.3, 0.4 up to float64 rounding
    np.testing.assert_allclose(unit_rows(np.array([[3e-13, 4e-13]])), [[0.3, 0.4]], rtol=1e-15, atol=0)


def test_compare_bounds_by_hand() -> None:
    reference = np.array([[3.0, 4.0], [1.0, 0.0]])
    # |diff| = 0.5 on an element of size 4: passes with atol 0.1 + rtol 0.1 (0.1 + 0.4), fails at rtol 0.09
    exported = reference + np.array([[0.0, 0.5], [0.0, 0.0]])
    unit_gap = np.abs(unit_rows(exported) - unit_rows(reference)).max()  # direction moves by ~0.047
    check = compare(exported, reference, atol=0.1, rtol=0.1)
    assert check.passed and check.max_abs_diff == 0.5 and check.max_embedding_diff == unit_gap
    assert not compare(exported, reference, atol=0.1, rtol=0.09).passed
    # the absolute bound alone is not enough when the direction differs by more than atol
    assert not compare(exported, reference, atol=0.04, rtol=1.0).passed
    # the exact bound passes (<=), in each term: dyadic numbers, so every difference below is exact
    raw = compare(np.array([[1.5, 0.0]]), np.array([[1.0, 0.0]]), atol=0.25, rtol=0.25)  # |diff| 0.5 = 0.25 + 0.25 * 1
    assert raw.passed and raw.max_abs_diff == 0.5 and raw.max_embedding_diff == 0.0
    turned = compare(np.array([[0.0, 1.0]]), np.array([[1.0, 0.0]]), atol=1.0, rtol=0.0)  # unit rows 1 apart
    assert turned.passed and turned.max_abs_diff == 1.0 and turned.max_embedding_diff == 1.0


def test_compare_refuses_other_shapes_and_non_finite_outputs() -> None:
    reference = np.ones((2, 3))
    for exported in (np.ones((3, 2)), np.ones((2, 3, 1)), np.array([[1.0, np.nan, 1.0], [1.0, 1.0, 1.0]])):
        check = compare(exported, reference, atol=1.0, rtol=1.0)
        assert check.passed is False and check.max_abs_diff == np.inf and check.max_embedding_diff == np.inf


def test_random_batch_is_seeded_uniform_in_range() -> None:
    batch = random_batch(4, 8, seed=3)
    assert batch.shape == (4, 3, 8, 8) and batch.dtype == torch.float32
    assert torch.equal(batch, random_batch(4, 8, seed=3)) and not torch.equal(batch, random_batch(4, 8, seed=4))
    assert batch.min() >= -1 and batch.max() <= 1 and batch.min() < -0.9 and batch.max() > 0.9
    assert abs(batch.mean().item()) < 0.1  # uniform on [-1, 1]: mean 0 (768 draws, std of the mean 0.02)


# --- export_and_check on a tiny model: each format written as itself, where it was asked -------------------

SIZE = 8


def tiny_model() -> torch.nn.Module:
    """[B, 3, 8, 8] -> [B, 6]; outputs of order 0.1-1 that depend on every pixel (a check that fed the file
    zeros, or another batch, would see it). Exports in well under a second."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Tanh(), torch.nn.Flatten(), torch.nn.Linear(4 * SIZE * SIZE, 6)
    ).eval()


@pytest.fixture
def empty_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working directory: an export that wrote anywhere but its path would leave a file here
    (a mutant writing to str(None) once left ./None behind, which later runs then read)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


def opset_of(path: Path) -> int:
    return next(entry.version for entry in onnx.load(str(path)).opset_import if entry.domain in ("", "ai.onnx"))


@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
def test_export_and_check_writes_the_format_asked_for_at_its_path_only(
    fmt: str, tmp_path: Path, empty_cwd: Path
) -> None:
    model = tiny_model()
    batch = random_batch(3, SIZE, seed=1)  # not the trace's batch size (2): the batch axis must be dynamic
    with torch.no_grad():
        reference = model(batch).numpy()
    path = tmp_path / "out" / FILE_NAMES[fmt]
    path.parent.mkdir()
    check = export_and_check(model, fmt, path, image_size=SIZE, check_batch=batch, reference=reference, atol=1e-6, rtol=0)
    # float32, one conv and one linear layer, outputs up to 0.35 (ulp 3e-8): onnxruntime differs by 7.5e-8 raw
    # and 2e-7 on unit rows (measured), TorchScript by 0; 1e-6 leaves 5x headroom
    assert check.passed and check.max_abs_diff <= 1e-6 and check.max_embedding_diff <= 1e-6, check
    assert [p.name for p in path.parent.iterdir()] == [path.name] and list(empty_cwd.iterdir()) == []
    if fmt == "onnx":  # a real ONNX graph (not TorchScript under the ONNX name), as documented
        onnx.checker.check_model(onnx.load(str(path)))
        assert opset_of(path) == 17  # the default opset
        graph = onnx.load(str(path)).graph
        assert [i.name for i in graph.input] == [INPUT_NAME] and [o.name for o in graph.output] == [OUTPUT_NAME]
        shapes = [[d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in (*graph.input, *graph.output)]
        assert shapes == [["batch", 3, SIZE, SIZE], ["batch", 6]]  # only the batch axes are dynamic
        np.testing.assert_array_equal(run_onnx(str(path), batch), run_onnx(path, batch))
    else:
        with pytest.raises(DecodeError):
            onnx.load(str(path))  # a TorchScript zip, not an ONNX protobuf
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch.jit.load is deprecated
            assert isinstance(torch.jit.load(str(path)), torch.jit.ScriptModule)
    # the file, run on its own, gives the model's outputs on the check batch, and follows its input
    run = run_onnx if fmt == "onnx" else run_torchscript
    np.testing.assert_allclose(run(path, batch), reference, rtol=0, atol=1e-6)
    other = random_batch(3, SIZE, seed=2)
    assert np.abs(run(path, other) - reference).max() > 0.1


@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
def test_export_and_check_fails_against_another_batchs_reference(fmt: str, tmp_path: Path, empty_cwd: Path) -> None:
    """The check runs the file on ``check_batch`` itself: a reference of another batch fails it."""
    model = tiny_model()
    with torch.no_grad():
        reference = model(random_batch(3, SIZE, seed=2)).numpy()
    check = export_and_check(
        model, fmt, tmp_path / FILE_NAMES[fmt], image_size=SIZE, check_batch=random_batch(3, SIZE, seed=1),
        reference=reference, atol=1e-3, rtol=1e-3,
    )
    assert not check.passed and check.max_abs_diff > 0.1


def test_export_and_check_passes_the_opset_and_both_tolerances_on(tmp_path: Path, empty_cwd: Path) -> None:
    model = tiny_model()
    batch = random_batch(3, SIZE, seed=1)
    with torch.no_grad():
        reference = model(batch).numpy()

    def check(fmt: str, expected: np.ndarray, **kwargs: float):
        path = tmp_path / FILE_NAMES[fmt]
        return export_and_check(model, fmt, path, image_size=SIZE, check_batch=batch, reference=expected, **kwargs)

    # raw outputs (~0.2) shifted by 0.001: their directions move by 0.0044; passes with atol 0.01, not 0.0005
    assert check("onnx", reference + 0.001, atol=0.01, rtol=0.0, opset=13).passed
    assert opset_of(tmp_path / FILE_NAMES["onnx"]) == 13
    assert not check("onnx", reference + 0.001, atol=0.0005, rtol=0.0).passed
    # scaled by 1.05: the same directions, raw |diff| = 0.05/1.05 |reference|: rtol 0.06 passes, 0.04 does not
    assert check("torchscript", reference * 1.05, atol=1e-6, rtol=0.06).passed
    assert not check("torchscript", reference * 1.05, atol=1e-6, rtol=0.04).passed


def test_exporters_silence_only_their_deprecation_warnings_and_only_inside(
    tmp_path: Path, empty_cwd: Path
) -> None:
    """The legacy exporters' DeprecationWarning/FutureWarning are hidden; a model's own warning is not,
    nor are the caller's filters changed; onnxruntime runs on the provider asked for, without falling back."""

    class Warns(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = tiny_model()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            warnings.warn("the model's own warning", UserWarning, stacklevel=1)
            return self.inner(x)

    before = list(warnings.filters)
    for export in (
        lambda: export_onnx(Warns().eval(), tmp_path / "m.onnx", image_size=SIZE, opset=17),
        lambda: export_torchscript(Warns().eval(), tmp_path / "m.pt", image_size=SIZE),
    ):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            export()
        kinds = {type(w.message) for w in caught if not isinstance(w.message, torch.jit.TracerWarning)}
        assert kinds == {UserWarning}, [str(w.message) for w in caught]
    assert warnings.filters == before
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # onnxruntime warns when it falls back from an unknown provider
        run_onnx(tmp_path / "m.onnx", random_batch(1, SIZE, seed=0))
