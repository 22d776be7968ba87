"""Prepare throughput: facepipe (MTCNN and RetinaFace, 1 and 2 workers, CLI and Prefect flow) against a plain MTCNN loop.

    python benchmarks/prepare_bench.py [--identities 40] [--images 8] [--repeats 3] [--out DIR]
        [--detectors mtcnn,retinaface] [--large 48]

``--large N`` adds a second set: N group photos of 2.5 MP with 3-10 faces each, composed from the
sample photos (``benchmarks/large_set.py``); every detector runs on both sets.

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
from facepipe.synthetic.photos import make_sample_dataset
from facepipe.data.scan import scan_raw
from facepipe.detection import Face, select_face
from facepipe.io.records import encode_image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from large_set import make_large_set  # noqa: E402 - a sibling script, not a package


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


def _sets(work: Path, args: argparse.Namespace) -> dict[str, Path]:
    """The raw folders to run on, by name: the sample set, and the large multi-face set if asked."""
    raw = work / "raw"
    if not raw.exists():
        make_sample_dataset(raw, SampleDataParams(identities=args.identities, images_per_identity=args.images))
    sets = {"sample": raw}
    if args.large:
        large = work / "large"
        if not large.exists():
            make_large_set(raw, large, images=args.large)
        sets["large"] = large
    return sets


def cuda_rows(sets: dict[str, Path], params: PrepareParams, repeats: int) -> None:
    """Detector-only images/s of batched RetinaFace in PyTorch on CUDA (prepare's CUDA path), chunks of
    ``params.chunk_size`` decoded photos; a line saying so when there is no CUDA device."""
    import torch

    from facepipe.detection import create_detector

    if not torch.cuda.is_available():
        print("\nno CUDA device: the CUDA row (batched PyTorch RetinaFace, prepare's path on a GPU) was not run")
        return
    detector = create_detector("retinaface", min_face_size=params.min_face_size, detect_size=params.detect_size, device="cuda")
    print(f"\nCUDA ({torch.cuda.get_device_name()}), runtime {detector.runtime}, detector only, batches of {params.chunk_size}:")
    for set_name, raw in sets.items():
        images = []
        for item in scan_raw(raw):
            try:
                images.append(load_image((raw / item.path).read_bytes(), max_pixels=params.max_pixels))
            except (Reject, OSError):
                continue
        chunks = [images[i : i + params.chunk_size] for i in range(0, len(images), params.chunk_size)]
        detector.detect(chunks[0])  # warm-up: cuDNN picks its kernels
        rates = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for chunk in chunks:
                detector.detect(chunk)  # returns numpy results: synchronised per chunk
            rates.append(len(images) / (time.perf_counter() - start))
        print(f"| {set_name}: retinaface on CUDA, batched | {statistics.median(rates):.1f} images/s |")


def _table(runs: dict[str, list[float]], rates: dict[str, list[float]]) -> None:
    """Markdown rows of medians; ratios against the set's plain loop (if run) and its MTCNN 2-worker row."""
    print("| run | wall s (whole command) | images/s (processing) | vs plain loop | vs MTCNN, same workers |")
    print("|---|---:|---:|---:|---:|")
    med = {k: statistics.median(v) for k, v in runs.items()}
    rate = {k: statistics.median(v) for k, v in rates.items()}
    for name in runs:
        set_name = name.split(":")[0]
        loop = rate.get(f"{set_name}: plain MTCNN loop")
        same = rate.get(name.replace("retinaface", "mtcnn"))
        vs_loop = f"{rate[name] / loop:.2f}x" if loop else "-"
        vs_mtcnn = f"{rate[name] / same:.2f}x" if same and "retinaface" in name else "-"
        print(f"| {name} | {med[name]:.1f} | {rate[name]:.2f} | {vs_loop} | {vs_mtcnn} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--identities", type=int, default=40)
    parser.add_argument("--images", type=int, default=8, help="images per identity")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="work folder (default: a temporary one)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--skip-flow", action="store_true")
    parser.add_argument("--skip-loop", action="store_true")
    parser.add_argument("--detectors", default="mtcnn,retinaface", help="comma-separated prepare.detector values")
    parser.add_argument("--large", type=int, default=0, help="also run on N large multi-face photos")
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts of the CLI rows (the flow row: 2)")
    args = parser.parse_args()

    work = args.out or Path(tempfile.mkdtemp(prefix="facepipe-bench-"))
    sets = _sets(work, args)
    params = PrepareParams()
    detectors = args.detectors.split(",")
    params_files = {}
    for detector in detectors:
        params_files[detector] = work / f"params-{detector}.yaml"
        params_files[detector].write_text(f"prepare: {{detector: {detector}}}\n")
    counts = {name: len(scan_raw(raw)) for name, raw in sets.items()}

    runs: dict[str, list[float]] = {}
    rates: dict[str, list[float]] = {}

    def record(name: str, wall: float, rate: float) -> None:
        runs.setdefault(name, []).append(wall)
        rates.setdefault(name, []).append(rate)

    for repeat in range(args.repeats):  # interleaved: every configuration once per repeat
        for set_name, raw in sets.items():
            if not args.skip_loop:
                seconds, _ = plain_loop(raw, params)
                record(f"{set_name}: plain MTCNN loop", seconds, counts[set_name] / seconds)
            for workers in map(int, args.workers.split(",")):
                for detector in detectors:
                    wall, report = facepipe_cli(raw, work / "cli", workers, params_files[detector])
                    record(f"{set_name}: facepipe prepare {detector}, {workers} worker(s)", wall, report["images_per_s"])
            if not args.skip_flow and set_name == "sample":
                wall, report = facepipe_flow(raw, work / "flow2", 2, params_files[detectors[0]])
                record(f"{set_name}: Prefect flow {detectors[0]}, 2 workers", wall, report["images_per_s"])
        print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr)

    sizes = ", ".join(f"{name}: {n} files" for name, n in counts.items())
    print(f"\n{sizes}; {os.cpu_count()} cores, {platform.processor() or platform.machine()}, "
          f"Python {platform.python_version()}; medians of {args.repeats} interleaved runs\n")
    _table(runs, rates)
    flow = rates.get(f"sample: Prefect flow {detectors[0]}, 2 workers")
    cli = rates.get(f"sample: facepipe prepare {detectors[0]}, 2 worker(s)")
    if flow and cli:
        print(f"\nPrefect flow / CLI, 2 workers, images/s: {statistics.median(flow) / statistics.median(cli):.2f}x")
    if "retinaface" in detectors:
        cuda_rows(sets, params, args.repeats)
    if args.json:
        args.json.write_text(json.dumps({"runs_s": runs, "images_per_s": rates, "n_images": counts}, indent=2))
    if args.out is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
