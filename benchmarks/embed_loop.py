"""The one-photo loop that facepipe embed replaces: what a facenet-pytorch user writes.

    python benchmarks/embed_loop.py RAW MODEL [--min-face-size 40] [--threads 1] [--no-flip] [--out FILE.npy]

Every image file of RAW (``facepipe embed``'s scan, same order) is decoded in full; every face that
``facenet_pytorch.MTCNN(keep_all=True)`` finds on the photo scaled to 640 px and that passes facepipe's
gates (``benchmarks/facenet_loop.py``'s ``detect_faces``: score >= 0.95, size >= ``--min-face-size``
original pixels) is aligned with the 5-point template at the model's size and embedded by MODEL's
backbone (a model folder: ``load_backbone``, model.json's normalization), the photo's faces in one
forward pass, each with its mirror as ``facepipe embed`` does by default (``--no-flip``: without).
One process, torch at ``--threads`` intra-op threads. Prints one JSON line: ``startup_s`` (imports,
MTCNN and the model), ``process_s`` and ``cpu_s`` (the photo loop, wall and this process's CPU),
``images``, ``photos_with_faces``, ``faces``. ``benchmarks/embed_bench.py`` runs it as a whole command.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

STARTED = time.perf_counter()

from pathlib import Path  # noqa: E402 - the imports are part of the loop's start-up

import numpy as np  # noqa: E402
import torch  # noqa: E402
from facenet_pytorch import MTCNN  # noqa: E402

from facepipe.alignment import align_face  # noqa: E402
from facepipe.data.decode import Reject, load_image  # noqa: E402
from facepipe.data.scan import scan_raw  # noqa: E402
from facepipe.evaluation.embed import embed_images  # noqa: E402
from facepipe.io.model_dir import ModelSpec, load_backbone  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from facenet_loop import detect_faces  # noqa: E402 - a sibling script, not a package


def one_photo(mtcnn: MTCNN, model: torch.nn.Module, spec: ModelSpec, data: bytes, *, min_face_size: int, flip: bool) -> np.ndarray:
    """``[F, E]`` float32 unit rows: the embeddings of the photo's faces (``F`` = 0 when it has none or
    does not decode)."""
    try:
        image = load_image(data, max_pixels=100_000_000)
    except Reject:
        return np.zeros((0, spec.embedding_size), np.float32)
    faces = [align_face(image, face.landmarks, spec.image_size) for face in detect_faces(mtcnn, image, min_face_size)]
    if not faces:
        return np.zeros((0, spec.embedding_size), np.float32)
    norm = (spec.normalization.mean, spec.normalization.std)
    return embed_images(model, faces, count=len(faces), batch_size=len(faces), flip=flip, progress=False, normalization=norm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", type=Path)
    parser.add_argument("model", type=Path, help="model folder (model.json + backbone.pt)")
    parser.add_argument("--min-face-size", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-flip", dest="flip", action="store_false", help="no mirrored face (facepipe embed: embed.flip false)")
    parser.add_argument("--out", type=Path, default=None, help="write the embeddings here (.npy), as a user keeps them")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    mtcnn = MTCNN(keep_all=True, min_face_size=args.min_face_size, device="cpu")
    model, spec = load_backbone(args.model)
    if spec.crop != "arcface":
        parser.error(f"the loop aligns with the 5-point template; {args.model} takes {spec.crop!r} crops")
    items = [item for item in scan_raw(args.raw) if item.reason is None]
    started, cpu = time.perf_counter(), time.process_time()
    rows = [one_photo(mtcnn, model, spec, (args.raw / item.path).read_bytes(), min_face_size=args.min_face_size, flip=args.flip) for item in items]
    embeddings = np.concatenate(rows) if rows else np.zeros((0, spec.embedding_size), np.float32)
    if args.out is not None:
        np.save(args.out, embeddings)
    done, cpu = time.perf_counter(), time.process_time() - cpu
    print(json.dumps({
        "startup_s": round(started - STARTED, 3), "process_s": round(done - started, 3), "cpu_s": round(cpu, 3),
        "images": len(items), "photos_with_faces": sum(1 for r in rows if len(r)), "faces": len(embeddings),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
