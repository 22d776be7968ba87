"""Export a backbone to ONNX and TorchScript, and check each file against the PyTorch model.

Both formats take ``input`` [batch, 3, S, S] float32 RGB normalised as the model's ``model.json``
says (arcface: pixel / 127.5 - 1; facenet: (pixel - 127.5) / 128) and give ``embedding`` [batch, E]
float32, not normalized; the batch axis is dynamic. The ONNX file carries the normalisation and the
crop in its metadata (``metadata_props``), so a runtime needs nothing else to feed it.

A check compares the raw outputs and, more strictly, their L2-normalised rows: what a face matcher
compares is the direction, and a raw tolerance alone says nothing when the outputs are small.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from facepipe.config import ExportFormat

FILE_NAMES: dict[str, str] = {"onnx": "backbone.onnx", "torchscript": "backbone.torchscript.pt"}
INPUT_NAME = "input"
OUTPUT_NAME = "embedding"
_TRACE_BATCH = 2  # the example batch; checks use another size, so a fixed batch axis would fail them


@dataclass(frozen=True)
class Check:
    """How far an exported model's outputs are from PyTorch's on the same random batch.

    ``max_abs_diff``: of the raw outputs; ``max_embedding_diff``: of their L2-normalised rows (each
    element in [-1, 1], so an absolute tolerance means the same whatever the output scale).
    """

    max_abs_diff: float
    max_embedding_diff: float
    passed: bool


def random_batch(batch_size: int, image_size: int, *, seed: int) -> torch.Tensor:
    """[batch_size, 3, image_size, image_size] float32 uniform in [-1, 1], reproducible from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(batch_size, 3, image_size, image_size, generator=generator) * 2 - 1


@contextmanager
def _legacy_torch_apis() -> Iterator[None]:
    # The TorchScript-based ONNX exporter and torch.jit warn that they are deprecated. They are
    # chosen on purpose: the torch.export-based exporter needs onnxscript, which is not a dependency.
    # Some of the warnings are attributed to the caller, so filter by category, only in this scope.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        yield


def export_onnx(
    model: nn.Module, path: str | Path, *, image_size: int, opset: int, metadata: dict[str, str] | None = None
) -> None:
    """Write ``model`` (eval mode, CPU) as an ONNX file with a dynamic batch axis and ``metadata``
    (string keys and values) in its ``metadata_props``."""
    example = random_batch(_TRACE_BATCH, image_size, seed=0)
    with _legacy_torch_apis():
        torch.onnx.export(
            model,
            (example,),
            str(path),
            dynamo=False,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
            opset_version=opset,
        )
    if metadata:
        import onnx

        proto = onnx.load(str(path))
        for key, value in sorted(metadata.items()):
            entry = proto.metadata_props.add()
            entry.key, entry.value = key, value
        onnx.save(proto, str(path))


def export_torchscript(model: nn.Module, path: str | Path, *, image_size: int) -> None:
    """Write ``model`` (eval mode, CPU) traced to TorchScript."""
    example = random_batch(_TRACE_BATCH, image_size, seed=0)
    with _legacy_torch_apis(), torch.no_grad():
        torch.jit.save(torch.jit.trace(model, example), str(path))


def run_onnx(path: str | Path, batch: torch.Tensor) -> np.ndarray:
    """Embeddings [B, E] float32 of ``batch`` ([B, 3, S, S]) by onnxruntime on the CPU."""
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run([OUTPUT_NAME], {INPUT_NAME: batch.numpy()})[0]


def run_torchscript(path: str | Path, batch: torch.Tensor) -> np.ndarray:
    """Embeddings [B, E] float32 of ``batch`` ([B, 3, S, S]) by the saved TorchScript module."""
    with _legacy_torch_apis(), torch.no_grad():
        return torch.jit.load(str(path), map_location="cpu")(batch).numpy()


def unit_rows(embeddings: np.ndarray) -> np.ndarray:
    """[B, E] -> [B, E] float64 rows scaled to unit L2 norm (an all-zero row stays zero)."""
    rows = np.asarray(embeddings, dtype=np.float64)
    return rows / np.maximum(np.linalg.norm(rows, axis=-1, keepdims=True), 1e-12)


def compare(exported: np.ndarray, reference: np.ndarray, *, atol: float, rtol: float) -> Check:
    """Passes where shapes match, every ``|exported - reference| <= atol + rtol * |reference|``, and
    the L2-normalised rows agree within ``atol`` element by element."""
    if exported.shape != reference.shape or not np.all(np.isfinite(exported)):
        return Check(max_abs_diff=float("inf"), max_embedding_diff=float("inf"), passed=False)
    diff = np.abs(exported.astype(np.float64) - reference)
    embedding_diff = np.abs(unit_rows(exported) - unit_rows(reference))
    passed = bool(np.all(diff <= atol + rtol * np.abs(reference)) and np.all(embedding_diff <= atol))
    return Check(max_abs_diff=float(diff.max()), max_embedding_diff=float(embedding_diff.max()), passed=passed)


def export_and_check(
    model: nn.Module,
    fmt: ExportFormat,
    path: str | Path,
    *,
    image_size: int,
    check_batch: torch.Tensor,
    reference: np.ndarray,
    atol: float,
    rtol: float,
    opset: int = 17,
    metadata: dict[str, str] | None = None,
) -> Check:
    """Export ``model`` in ``fmt`` to ``path``, run the file on ``check_batch`` and compare with ``reference``.

    ``metadata``: written into an ONNX file's ``metadata_props`` (TorchScript files have no place for it).
    """
    if fmt == "onnx":
        export_onnx(model, path, image_size=image_size, opset=opset, metadata=metadata)
        exported = run_onnx(path, check_batch)
    else:
        export_torchscript(model, path, image_size=image_size)
        exported = run_torchscript(path, check_batch)
    return compare(exported, reference, atol=atol, rtol=rtol)
