"""The trained model as a function of aligned faces: PyTorch weights of a model folder, or the ONNX
file of an export folder through onnxruntime.

Both take ``[B, S, S, 3]`` uint8 RGB faces cut as the training set's were and return ``[B, E]``
float32 L2-normalised rows. The PyTorch path is evaluate's own (:func:`facepipe.evaluation.embed.embed_images`);
the ONNX path computes the same input in NumPy. Either runs at one intra-op thread while it embeds,
so a face's embedding does not depend on the machine's core count or on how many workers share the
job (``facepipe embed`` is byte-identical for 1 or N workers).
"""

from __future__ import annotations

import functools
import json
from contextlib import contextmanager
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
from pydantic import ValidationError

from facepipe.errors import FacepipeError
from facepipe.io.model_dir import SPEC_FILE, WEIGHTS_FILE, ModelSpec, read_model_spec
from facepipe.io.shards import sha256_file

#: What ``facepipe export`` writes beside the exported files (facepipe.stages.export.REPORT_FILE).
EXPORT_REPORT = "export.json"


@dataclass(frozen=True)
class ModelRef:
    """Which model file to run, by which runtime: picklable, sent to the workers, which load it once."""

    folder: str
    runtime: str
    file: str
    sha256: str
    spec: ModelSpec

    def describe(self) -> dict[str, Any]:
        """What an embedding folder records of the model (embed.json ``model``)."""
        return {
            "runtime": self.runtime,
            "file": Path(self.file).name,
            "sha256": self.sha256,
            "backbone": self.spec.backbone,
            "embedding_size": self.spec.embedding_size,
            "image_size": self.spec.image_size,
            "crop": self.spec.crop,
            "normalization": self.spec.normalization.model_dump(),
        }


def resolve_model(folder: str | Path, runtime: str) -> ModelRef:
    """The model in ``folder``: a model folder (``train``'s, for ``torch``) or an export folder
    (``export``'s, for ``onnx``). Its file's sha256 is checked against the one recorded beside it."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FacepipeError(f"model folder not found: {folder}")
    if (folder / SPEC_FILE).is_file():
        if runtime != "torch":
            raise FacepipeError(
                f"--runtime {runtime} runs an export folder (facepipe export MODEL OUT writes backbone.onnx); {folder} is a model folder"
            )
        spec = read_model_spec(folder)
        return ModelRef(str(folder.resolve()), runtime, str((folder / WEIGHTS_FILE).resolve()), _weights_sha256(folder), spec)
    if (folder / EXPORT_REPORT).is_file():
        if runtime != "onnx":
            raise FacepipeError(f"{folder} is an export folder, which holds no PyTorch weights: use --runtime onnx, or give the model folder")
        return _export_ref(folder)
    raise FacepipeError(f"not a model folder ({SPEC_FILE}) or an export folder ({EXPORT_REPORT}): {folder}")


def _weights_sha256(folder: Path) -> str:
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        raise FacepipeError(f"model folder has no {WEIGHTS_FILE}: {folder}")
    recorded = json.loads((folder / SPEC_FILE).read_text(encoding="utf-8")).get("weights_sha256")
    actual = sha256_file(weights)
    if recorded is not None and recorded != actual:
        raise FacepipeError(f"{weights}: sha256 differs from the one in {SPEC_FILE} (corrupt, or from another run)")
    return actual


def _export_ref(folder: Path) -> ModelRef:
    path = folder / EXPORT_REPORT
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
        spec = ModelSpec.model_validate(report["model"])
        entry = report["files"]["onnx"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        if isinstance(error, ValidationError):
            error = error.errors()[0]["msg"]
        raise FacepipeError(f"{path}: not an export with an ONNX file ({error})") from None
    onnx_file = folder / entry["file"]
    if not onnx_file.is_file():
        raise FacepipeError(f"{path} names {entry['file']}, which is not in {folder}")
    actual = sha256_file(onnx_file)
    if actual != entry.get("sha256"):
        raise FacepipeError(f"{onnx_file}: sha256 differs from the one in {EXPORT_REPORT} (corrupt, or from another export)")
    return ModelRef(str(folder.resolve()), "onnx", str(onnx_file.resolve()), actual, spec)


@contextmanager
def one_thread() -> Iterator[None]:
    """torch at one intra-op thread inside the block (restored after): numerics independent of cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


Embedder = Callable[[np.ndarray], np.ndarray]


@functools.lru_cache(maxsize=2)
def _torch_model(file: str, sha256: str, device: str, spec_json: str) -> Any:
    from facepipe.io.model_dir import load_backbone

    model, _ = load_backbone(Path(file).parent, device=device)
    return model


@functools.lru_cache(maxsize=2)
def _onnx_session(file: str, sha256: str, device: str) -> Any:
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    providers = ["CPUExecutionProvider"]
    if device.startswith("cuda"):
        if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
            raise FacepipeError("--device cuda with --runtime onnx needs onnxruntime-gpu (this onnxruntime runs on the CPU only)")
        providers = [("CUDAExecutionProvider", {"device_id": int(device.partition(":")[2] or 0)}), "CPUExecutionProvider"]
    return onnxruntime.InferenceSession(file, sess_options=options, providers=providers)


def embedder(ref: ModelRef, *, device: str = "cpu", flip: bool = True, batch_size: int = 64) -> Embedder:
    """A function ``[B, S, S, 3]`` uint8 faces -> ``[B, E]`` float32 unit rows, the model loaded once
    per process. ``flip``: each face's embedding is summed with its mirror's before normalizing."""
    mean, std = ref.spec.normalization.mean, ref.spec.normalization.std
    if ref.runtime == "onnx":
        session = _onnx_session(ref.file, ref.sha256, device)
        return functools.partial(_embed_onnx, session, mean=mean, std=std, flip=flip, batch_size=batch_size)
    model = _torch_model(ref.file, ref.sha256, device, ref.spec.model_dump_json())
    return functools.partial(_embed_torch, model, mean=mean, std=std, flip=flip, batch_size=batch_size, device=device)


def _embed_torch(model: Any, faces: np.ndarray, *, mean: float, std: float, flip: bool, batch_size: int, device: str) -> np.ndarray:
    from facepipe.evaluation.embed import embed_images

    if not len(faces):
        return np.zeros((0, 0), np.float32)
    with one_thread():
        return embed_images(
            model, list(faces), count=len(faces), batch_size=batch_size, flip=flip, device=device,
            progress=False, normalization=(mean, std),
        )  # fmt: skip


def model_input(faces: np.ndarray, *, mean: float, std: float) -> np.ndarray:
    """``[B, S, S, 3]`` uint8 -> ``[B, 3, S, S]`` float32 ``(pixel - mean) / std``, computed as
    :func:`facepipe.evaluation.embed.to_model_input` does (arcface's as pixel / 127.5 - 1)."""
    batch = np.ascontiguousarray(faces.transpose(0, 3, 1, 2), dtype=np.float32)
    if (mean, std) == (127.5, 127.5):
        return batch / np.float32(127.5) - np.float32(1.0)
    return (batch - np.float32(mean)) / np.float32(std)


def _embed_onnx(session: Any, faces: np.ndarray, *, mean: float, std: float, flip: bool, batch_size: int) -> np.ndarray:
    name = session.get_inputs()[0].name
    rows = []
    for start in range(0, len(faces), batch_size):
        x = model_input(faces[start : start + batch_size], mean=mean, std=std)
        if flip:
            out = session.run(None, {name: np.concatenate([x, x[..., ::-1]])})[0]
            out = out[: len(x)] + out[len(x) :]
        else:
            out = session.run(None, {name: x})[0]
        norms = np.maximum(np.linalg.norm(out, axis=1, keepdims=True), np.float32(1e-12))
        rows.append((out / norms).astype(np.float32))
    return np.concatenate(rows) if rows else np.zeros((0, 0), np.float32)
