"""IJB faces/s: ``facepipe ijb``'s batched, threaded path against a plain per-face loop.

Writes a synthetic IJB-C folder of ``--faces`` loose crops (``--crop`` px JPEGs of noise, one template
and media per face, 5 points placed on the ArcFace template) under ``--root``, builds a randomly
initialised ``--backbone`` at 112 px, and times, on the same faces:

- ``decode+align``: the thread pool alone (``ijb.aligned_faces``), 1 thread and ``--workers`` threads;
- ``plain loop``: per face, read, decode, align, then the model on the face and on its mirror (batch 1);
- ``facepipe ijb``: ``ijb.face_features`` (threads decode and align while the model embeds batches).

It prints one JSON line per row and the projected time of a full IJB-C (469,375 faces) at each rate.

    python benchmarks/ijb_bench.py [--faces 512] [--backbone mobilefacenet] [--batch-size 64] [--workers 2]
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from facepipe.alignment import align_face, template
from facepipe.config import IjbParams
from facepipe.data.decode import load_image
from facepipe.evaluation.embed import to_model_input
from facepipe.io.ijb import read_ijb
from facepipe.models import create_backbone
from facepipe.stages import ijb

IJBC_FACES = 469_375


def write_folder(root: Path, faces: int, crop: int) -> Path:
    rng = np.random.default_rng(0)
    shutil.rmtree(root, ignore_errors=True)
    (root / "meta").mkdir(parents=True)
    (root / "loose_crop").mkdir()
    tids, points = [], []
    for index in range(1, faces + 1):
        buffer = io.BytesIO()
        pixels = rng.integers(0, 256, size=(crop // 8, crop // 8, 3), dtype=np.uint8)
        Image.fromarray(pixels).resize((crop, crop), Image.BILINEAR).save(buffer, format="JPEG", quality=90)
        (root / "loose_crop" / f"{index}.jpg").write_bytes(buffer.getvalue())
        landmarks = template(112) * crop / 160 + crop * 0.15 + rng.normal(0, 1, (5, 2))
        tids.append(f"{index}.jpg {index} {index}")
        points.append(" ".join([f"{index}.jpg", *(f"{v:.2f}" for v in landmarks.ravel()), "0.99"]))
    (root / "meta" / "ijbc_face_tid_mid.txt").write_text("\n".join(tids) + "\n")
    (root / "meta" / "ijbc_name_5pts_score.txt").write_text("\n".join(points) + "\n")
    (root / "meta" / "ijbc_template_pair_label.txt").write_text("1 2 1\n1 3 0\n")
    return root


def row(name: str, faces: int, seconds: float) -> dict:
    rate = faces / seconds
    result = {"row": name, "faces": faces, "seconds": round(seconds, 2), "faces_per_s": round(rate, 1),
              "full_ijbc_hours": round(IJBC_FACES / rate / 3600, 2)}
    print(json.dumps(result), flush=True)
    return result


@torch.inference_mode()
def plain_loop(model: torch.nn.Module, protocol) -> None:
    for index in range(len(protocol.images)):
        image = load_image(protocol.image_path(index).read_bytes(), max_pixels=40_000_000)
        x = to_model_input(align_face(image, protocol.landmarks[index], 112)[None])
        feature = model(x) + model(x.flip(3))
        torch.nn.functional.normalize(feature, dim=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faces", type=int, default=512)
    parser.add_argument("--crop", type=int, default=250, help="side of the loose crops (px)")
    parser.add_argument("--backbone", default="mobilefacenet")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--root", type=Path, default=Path("/tmp/facepipe-ijb-bench"))
    parser.add_argument(
        "--torch-threads", type=int, default=None,
        help="torch intra-op threads (default: torch's); 1 on a shared loaded machine, where 2 OpenMP threads "
        "spin against other jobs (measured 2.7 s vs 0.19 s a batch-1 forward)",
    )
    args = parser.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    protocol = read_ijb(write_folder(args.root / "IJBC", args.faces, args.crop))
    torch.manual_seed(0)
    model = create_backbone(args.backbone, embedding_size=512, image_size=112).eval()
    print(json.dumps({"backbone": args.backbone, "torch_threads": torch.get_num_threads(), **vars(args)}, default=str))
    for workers in sorted({1, args.workers}):
        started = time.perf_counter()
        for _ in ijb.aligned_faces(protocol, size=112, workers=workers, window=2 * args.batch_size + 4 * workers):
            pass
        row(f"decode+align, {workers} thread(s)", args.faces, time.perf_counter() - started)
    started = time.perf_counter()
    plain_loop(model, protocol)
    row("plain loop (batch 1, face then mirror)", args.faces, time.perf_counter() - started)
    params = IjbParams(batch_size=args.batch_size, workers=args.workers, device="cpu")
    started = time.perf_counter()
    ijb.face_features(
        params, model, protocol, image_size=112, normalization=(127.5, 127.5), device="cpu", progress=False
    )
    row(f"facepipe ijb (batch {args.batch_size}, {args.workers} threads)", args.faces, time.perf_counter() - started)


if __name__ == "__main__":
    main()
