"""Prepare throughput: facepipe (1 and 2 workers, CLI and Prefect flow) against a plain MTCNN loop.

    python benchmarks/prepare_bench.py [--identities 40] [--images 8] [--repeats 3] [--out DIR]

The baseline is what facenet-pytorch users write: ``MTCNN(keep_all=True)`` called one image at a
time in a loop (torch's default threads), then the same alignment and JPEG encoding as facepipe.
Each configuration runs ``--repeats`` times, interleaved, and the medians are reported side by side.
Results go to stdout as a Markdown table (and to ``--json`` if given).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import facepipe  # noqa: F401
from facepipe.alignment import align_face
from facepipe.config import PrepareParams, SampleDataParams
from facepipe.data.decode import Reject, load_image
from facepipe.data.sample import make_sample_dataset
from facepipe.data.scan import scan_raw
from facepipe.detection import Face, select_face
from facepipe.io.records import encode_image


def plain_loop(raw: Path, params: PrepareParams) -> tuple[float, int]:
    """Seconds and accepted faces for the one-image-at-a-time facenet-pytorch loop."""
    from facenet_pytorch import MTCNN

    mtcnn = MTCNN(keep_all=True, min_face_size=params.min_face_size, device="cpu")
    accepted = 0
    start = time.perf_counter()
    for item in scan_raw(raw):
        try:
            image = load_image((raw / item.path).read_bytes(), max_pixels=params.max_pixels)
        except (Reject, OSError):
            continue
        try:
            boxes, probs, points = mtcnn.detect(image, landmarks=True)
        except (RuntimeError, ValueError):  # MTCNN raises on images smaller than its smallest face
            continue
        if boxes is None:
            continue
        boxes = np.asarray(boxes, dtype=np.float32)
        probs = np.asarray(probs, dtype=np.float32)
        points = np.asarray(points, dtype=np.float32)
        faces = [Face(b, float(p), l) for b, p, l in zip(boxes, probs, points) if p >= params.score_threshold]
        faces = [f for f in faces if f.size >= params.min_face_size]
        if not faces:
            continue
        face = select_face(faces, params.face_selection, image.shape)
        encode_image(align_face(image, face.landmarks, params.image_size), quality=params.quality)
        accepted += 1
    return time.perf_counter() - start, accepted


def facepipe_cli(raw: Path, out: Path, workers: int, params_file: Path) -> tuple[float, dict]:
    """Wall seconds of the whole ``facepipe prepare`` command, and its report."""
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "facepipe", "prepare", str(raw), str(out), "--params", str(params_file),
         "--workers", str(workers)],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    wall = time.perf_counter() - start
    return wall, json.loads((out / "report.json").read_text())


def facepipe_flow(raw: Path, out: Path, workers: int, params_file: Path, share_api: bool = True) -> tuple[float, dict]:
    """Wall seconds of ``python -m flows.prepare`` (Prefect local mode, DaskTaskRunner)."""
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "flows.prepare", str(raw), str(out), "--params", str(params_file),
         "--workers", str(workers)],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=Path(__file__).resolve().parents[1],
    )
    wall = time.perf_counter() - start
    return wall, json.loads((out / "report.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--identities", type=int, default=40)
    parser.add_argument("--images", type=int, default=8, help="images per identity")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="work folder (default: a temporary one)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--skip-flow", action="store_true")
    args = parser.parse_args()

    work = args.out or Path(tempfile.mkdtemp(prefix="facepipe-bench-"))
    raw = work / "raw"
    if not raw.exists():
        make_sample_dataset(raw, SampleDataParams(identities=args.identities, images_per_identity=args.images))
    params = PrepareParams()
    params_file = work / "params.yaml"
    params_file.write_text("prepare: {}\n")
    n_images = len(scan_raw(raw))

    runs: dict[str, list[float]] = {}
    rates: dict[str, list[float]] = {}
    accepted = {}
    for repeat in range(args.repeats):
        seconds, accepted["loop"] = plain_loop(raw, params)
        runs.setdefault("plain MTCNN loop", []).append(seconds)
        rates.setdefault("plain MTCNN loop", []).append(n_images / seconds)
        for workers in (1, 2):
            wall, report = facepipe_cli(raw, work / f"cli{workers}", workers, params_file)
            name = f"facepipe prepare, {workers} worker(s)"
            runs.setdefault(name, []).append(wall)
            rates.setdefault(name, []).append(report["images_per_s"])
            accepted[name] = report["counts"]["accepted"]
        if not args.skip_flow:
            wall, report = facepipe_flow(raw, work / "flow2", 2, params_file)
            runs.setdefault("Prefect flow, 2 workers", []).append(wall)
            rates.setdefault("Prefect flow, 2 workers", []).append(report["images_per_s"])
        print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr)

    med = {k: statistics.median(v) for k, v in runs.items()}
    med_rate = {k: statistics.median(v) for k, v in rates.items()}
    loop_rate = med_rate["plain MTCNN loop"]
    one = med_rate["facepipe prepare, 1 worker(s)"]
    print(f"\n{n_images} files ({args.identities} identities x {args.images} images + bad files), "
          f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}, Python {platform.python_version()}; "
          f"medians of {args.repeats} interleaved runs\n")
    print("| run | wall s (whole command) | images/s (processing) | vs plain loop | vs 1 worker |")
    print("|---|---:|---:|---:|---:|")
    for name in runs:
        print(f"| {name} | {med[name]:.1f} | {med_rate[name]:.2f} | {med_rate[name] / loop_rate:.2f}x | "
              f"{med_rate[name] / one:.2f}x |")
    if "Prefect flow, 2 workers" in med:
        overhead = med["Prefect flow, 2 workers"] - med["facepipe prepare, 2 worker(s)"]
        print(f"\nPrefect flow overhead over the CLI (2 workers, wall): {overhead:+.1f} s "
              f"({med['Prefect flow, 2 workers'] / med['facepipe prepare, 2 worker(s)']:.2f}x)")
    if args.json:
        args.json.write_text(json.dumps({"runs_s": runs, "images_per_s": rates, "n_images": n_images}, indent=2))
    if args.out is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
