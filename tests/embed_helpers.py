"""A real model for the embed / compare / search tests: the sample photos prepared at 56 px, a small
mobilefacenet trained on them, evaluated (thresholds.json) and exported to ONNX, each by its stage."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from facepipe.config import EmbedParams, EvaluateParams, ExportParams, PrepareParams, SampleDataParams, SplitParams
from facepipe.synthetic.photos import make_sample_dataset
from train_helpers import tiny_params

SIZE = 56  # small faces keep the backbone fast on a CPU
FACES = PrepareParams(image_size=SIZE, chunk_size=4)
EMBED = EmbedParams(device="cpu", batch_size=8, files_per_part=5)


@dataclass(frozen=True)
class Pipeline:
    raw: Path  # 6 identities x 4 photos + the bad files
    prepared: Path
    model: Path
    export: Path
    evaluation: Path


def build_pipeline(root: Path) -> Pipeline:
    from facepipe.stages import evaluate, export, prepare, split, train

    raw = root / "raw"
    make_sample_dataset(raw, SampleDataParams(identities=6, images_per_identity=4, seed=0, bad_files=True))
    prepared, model, out = root / "prepared", root / "model", root / "eval"
    prepare.run(FACES, raw, prepared, workers=1, progress=False)
    split.run(SplitParams(val_identities=3, num_pairs=60, seed=0), prepared, root / "split")
    params = tiny_params(embedding_size=32, epochs=12, batch_size=8, reference_batch=8, lr=0.05, scale=16.0)
    train.run(params, prepared, model)
    evaluate.run(
        EvaluateParams(batch_size=16, device="cpu", folds=2, far_targets=(0.1, 1e-4)), model, prepared, out,
        pairs=root / "split" / "pairs.jsonl", progress=False,
    )  # fmt: skip
    export.run(ExportParams(formats=("onnx",)), model, root / "export")
    return Pipeline(raw, prepared, model, root / "export", out)


def photos_of(raw: Path, identity: str) -> list[Path]:
    return sorted(p for p in (raw / identity).iterdir() if p.is_file())


def copy_tree(source: Path, target: Path) -> Path:
    shutil.copytree(source, target, copy_function=shutil.copy2)
    return target


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a.astype(np.float64), b.astype(np.float64)))
