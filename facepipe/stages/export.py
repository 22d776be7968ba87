"""The export stage: a model folder -> ONNX and TorchScript files, each checked against PyTorch.

Outputs::

    OUT/backbone.onnx             (format "onnx")
    OUT/backbone.torchscript.pt   (format "torchscript")
    OUT/export.json               input/output contract, files, sha256 and the check of each file

A file whose outputs, raw or as L2-normalised embeddings, differ from PyTorch's by more than the
tolerance fails the stage, and then nothing is written.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from facepipe.config import ExportParams
from facepipe.errors import FacepipeError
from facepipe.model_export import FILE_NAMES, INPUT_NAME, OUTPUT_NAME, export_and_check, random_batch
from facepipe.io.atomic import OutputKind, atomic_output_dir, check_output, json_key_file
from facepipe.io.manifest import dumps
from facepipe.io.model_dir import ModelSpec, load_backbone
from facepipe.io.shards import sha256_file

log = logging.getLogger("facepipe.export")

REPORT_FILE = "export.json"

#: An existing OUT is replaced only when it holds these files and nothing else.
EXPORT_OUTPUT = OutputKind(
    "export folder",
    patterns=(*FILE_NAMES.values(), REPORT_FILE),
    identify=json_key_file(REPORT_FILE, "model", "input", "output", "files"),
)


def run(params: ExportParams, model_dir: str | Path, out: str | Path) -> dict[str, Any]:
    """Export the backbone in ``model_dir`` into ``out``; returns the report (also ``export.json``)."""
    check_output(out, kind=EXPORT_OUTPUT, sources={"model folder": model_dir})
    model, spec = load_backbone(model_dir, device="cpu")
    check_batch = random_batch(params.check_batch_size, spec.image_size, seed=params.seed)
    with torch.no_grad():
        reference = model(check_batch).numpy()
    files: dict[str, Any] = {}
    with atomic_output_dir(out, kind=EXPORT_OUTPUT) as tmp:
        for fmt in dict.fromkeys(params.formats):
            path = tmp / FILE_NAMES[fmt]
            check = export_and_check(
                model,
                fmt,
                path,
                image_size=spec.image_size,
                check_batch=check_batch,
                reference=reference,
                atol=params.atol,
                rtol=params.rtol,
                opset=params.opset,
                metadata=onnx_metadata(spec),
            )
            log.info(
                "export: %s max |diff| %.3g, of normalised embeddings %.3g vs PyTorch",
                fmt,
                check.max_abs_diff,
                check.max_embedding_diff,
            )
            if not check.passed:
                raise FacepipeError(
                    f"{fmt} export differs from PyTorch: max |diff| {check.max_abs_diff:.3g} "
                    f"(of L2-normalised embeddings {check.max_embedding_diff:.3g}) exceeds "
                    f"atol {params.atol} + rtol {params.rtol} * |output| (embeddings: atol)"
                )
            files[fmt] = {
                "file": path.name,
                "sha256": sha256_file(path),
                "max_abs_diff": float(f"{check.max_abs_diff:.3g}"),
                "max_embedding_diff": float(f"{check.max_embedding_diff:.3g}"),
                **({"opset": params.opset} if fmt == "onnx" else {"method": "trace"}),
            }
        report = _report(params, spec, files)
        (tmp / REPORT_FILE).write_text(dumps(report), encoding="utf-8")
    return report


def _report(params: ExportParams, spec: ModelSpec, files: dict[str, Any]) -> dict[str, Any]:
    """export.json: the model, its input and output, how it was checked, and the files written."""
    return {
        "model": spec.model_dump(),
        "input": {
            "name": INPUT_NAME,
            "shape": ["batch", 3, spec.image_size, spec.image_size],
            "dtype": "float32",
            "preprocessing": f"{spec.crop} face crop, {spec.normalization.describe()}",
            "crop": spec.crop,
            "normalization": spec.normalization.model_dump(),
        },
        "output": {
            "name": OUTPUT_NAME,
            "shape": ["batch", spec.embedding_size],
            "dtype": "float32",
            "normalized": False,
        },
        "check": {
            "batch_size": params.check_batch_size,
            "seed": params.seed,
            "atol": params.atol,
            "rtol": params.rtol,
        },
        "files": files,
    }


def onnx_metadata(spec: ModelSpec) -> dict[str, str]:
    """What a runtime needs besides the graph: the crop and the pixel normalisation of ``model.json``."""
    return {
        "facepipe.backbone": spec.backbone,
        "facepipe.crop": spec.crop,
        "facepipe.normalization": json.dumps(spec.normalization.model_dump(), sort_keys=True),
        "facepipe.preprocessing": f"{spec.crop} face crop, {spec.normalization.describe()}",
    }


def summary_line(report: dict[str, Any]) -> str:
    parts = ", ".join(
        f"{fmt} {entry['file']} (max |diff| {entry['max_abs_diff']:.3g})" for fmt, entry in report["files"].items()
    )
    return f"export: {report['model']['backbone']} -> {parts}"
