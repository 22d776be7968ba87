"""The pause that ``train.validation`` adds: one validation of a ``.bin`` set on rank 0.

Writes a synthetic ``.bin`` set of ``--pairs`` pairs of 112x112 JPEG faces, builds a randomly initialised
``--backbone`` and times ``Validator.validate`` (embedding face + mirror, facepipe's and insightface's
10-fold accuracy) ``--repeats`` times; separately times the two accuracy computations alone on 6,000
pairs (LFW's size), which do not depend on the model. Prints JSON lines and the pause projected to
LFW / AgeDB-30 (12,000 faces) and CFP-FP (14,000 faces) from the per-face embedding time.

    python benchmarks/validation_pause.py [--pairs 300] [--backbone mobilefacenet] [--batch-size 64]
"""

from __future__ import annotations

import argparse
import io
import json
import pickle
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from facepipe.config import ValidationParams
from facepipe.evaluation.insightface_protocol import insightface_verification
from facepipe.evaluation.verification import cosine_scores, kfold_accuracy
from facepipe.io.model_dir import ModelSpec
from facepipe.models import create_backbone
from facepipe.training.validation import Validator


def write_bin(path: Path, pairs: int) -> Path:
    rng = np.random.default_rng(0)
    images = []
    for _ in range(2 * pairs):
        buffer = io.BytesIO()
        face = rng.integers(0, 256, size=(14, 14, 3), dtype=np.uint8)
        Image.fromarray(face).resize((112, 112), Image.BILINEAR).save(buffer, format="JPEG", quality=95)
        images.append(buffer.getvalue())
    path.write_bytes(pickle.dumps((images, [bool(i % 2) for i in range(pairs)]), protocol=4))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=300)
    parser.add_argument("--backbone", default="mobilefacenet")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--torch-threads", type=int, default=None, help="torch intra-op threads (1 on a loaded machine)")
    args = parser.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    torch.manual_seed(0)
    backbone = create_backbone(args.backbone, embedding_size=512, image_size=112).train()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_bin(Path(tmp) / "lfw.bin", args.pairs)
        spec = ModelSpec(backbone=args.backbone, embedding_size=512, image_size=112)
        params = ValidationParams(sets=(str(path),), every_steps=1, batch_size=args.batch_size)
        started = time.perf_counter()
        validator = Validator(params, image_size=112, device=torch.device("cpu"), out=Path(tmp), keep_best=False, spec=spec)
        print(json.dumps({"row": "read + decode the set once", "faces": 2 * args.pairs,
                          "seconds": round(time.perf_counter() - started, 3)}))
        for repeat in range(args.repeats):
            values = validator.validate(backbone, repeat + 1)
            per_face = values["seconds"] / (2 * args.pairs)
            print(json.dumps({"row": f"validate ({args.backbone}, face + mirror)", "faces": 2 * args.pairs,
                              "seconds": round(values["seconds"], 2), "ms_per_face": round(1000 * per_face, 2),
                              "projected_s": {"lfw/agedb_30 (12000 faces)": round(12000 * per_face, 1),
                                              "cfp_fp (14000 faces)": round(14000 * per_face, 1)}}), flush=True)
    rng = np.random.default_rng(0)
    same = np.arange(6000) % 2 == 0
    e = rng.normal(size=(12000, 512))
    e /= np.linalg.norm(e, axis=1, keepdims=True)
    started = time.perf_counter()
    kfold_accuracy(cosine_scores(e[0::2], e[1::2]), same)
    middle = time.perf_counter()
    insightface_verification(e[0::2], e[1::2], same)
    print(json.dumps({"row": "accuracy alone on 6000 pairs", "facepipe_s": round(middle - started, 3),
                      "insightface_s": round(time.perf_counter() - middle, 3)}))


if __name__ == "__main__":
    main()
