"""Prepare speed per core and per command: facepipe (RetinaFace, the default, and MTCNN; 1 and 2
workers) against the one-photo facenet-pytorch loop it replaces, and start-up.

    python benchmarks/prepare_bench.py [--identities 40] [--images 8] [--large 240] [--repeats 3]
        [--detectors retinaface,mtcnn] [--workers 1,2] [--skip-loop] [--flow] [--out DIR] [--json FILE]

Sets: the generated sample set (``--identities`` x ``--images`` photos of 250-700 px, plus planted bad
files), ``--large N`` group photos of 2.5 MP with 3-10 faces each (``benchmarks/large_set.py``), and a
folder of 16 sample photos for start-up. Every row is a whole command run as a subprocess, launch to
exit (``wall``), with its processing phase from its own report: facepipe's ``report.json``
(``images_per_s``, ``timings_s.startup`` and ``first_photo_since_launch``), the loop's JSON line
(``benchmarks/facenet_loop.py``: MTCNN on the photo scaled to 640 px, torch at 1 thread, the same
face choice, alignment and JPEG encoding). "per core" divides a processing rate by the worker
processes (the loop: 1); facepipe's main process (scan, writer) runs beside them, uncounted. Rows
run interleaved, ``--repeats`` times; medians, and ratios of the medians of rows run side by side.
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
from dataclasses import dataclass, field
from pathlib import Path

from facepipe.config import PrepareParams, SampleDataParams
from facepipe.data.decode import Reject, load_image
from facepipe.data.scan import scan_raw
from facepipe.synthetic.photos import make_sample_dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from large_set import make_large_set  # noqa: E402 - a sibling script, not a package


def facenet_loop(raw: Path) -> tuple[float, dict]:
    """Wall seconds of ``benchmarks/facenet_loop.py RAW`` and its JSON line."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("facenet_loop.py")), str(raw)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return time.perf_counter() - start, json.loads(done.stdout.strip().splitlines()[-1])


def facepipe_cli(raw: Path, out: Path, workers: int | None, params_file: Path) -> tuple[float, dict]:
    """Wall seconds of the whole ``facepipe prepare`` command, and its report (``workers`` None: the
    default, one per core and at most one per chunk)."""
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "facepipe", "prepare", str(raw), str(out), "--params", str(params_file),
         *(["--workers", str(workers)] if workers else [])],
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
    """The raw folders to run on, by name: the sample set, the large multi-face set if asked, and a
    folder of 16 sample photos (start-up)."""
    raw = work / "raw"
    if not raw.exists():
        make_sample_dataset(raw, SampleDataParams(identities=args.identities, images_per_identity=args.images))
    sets = {"sample": raw}
    if args.large:
        large = work / f"large{args.large}"
        if not large.exists():
            make_large_set(raw, large, images=args.large)
        sets["large"] = large
    small = work / "small"
    if not small.exists():
        for path in sorted(raw.glob("*/*.jpg"))[:16]:
            (small / path.parent.name).mkdir(parents=True, exist_ok=True)
            shutil.copy(path, small / path.parent.name / path.name)
    sets["small"] = small
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


@dataclass
class Row:
    """One configuration's runs: whole-command seconds, processing images/s, start-up seconds."""

    workers: int
    wall: list[float] = field(default_factory=list)
    rate: list[float] = field(default_factory=list)
    startup: list[float] = field(default_factory=list)
    first: list[float] = field(default_factory=list)

    def median(self, name: str) -> float:
        values = getattr(self, name)
        return statistics.median(values) if values else float("nan")


def _table(rows: dict[str, Row]) -> None:
    """Markdown rows of medians; per-core and whole-command ratios against the same set's loop."""
    print("| run | wall s (whole command) | images/s (processing) | per core | vs loop, per core | vs loop, whole command | start-up s | first photo s (from launch) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, row in rows.items():
        loop = rows.get(name.split(":")[0] + ": facenet-pytorch loop")
        per_core = row.median("rate") / row.workers
        vs_core = f"{per_core / loop.median('rate'):.2f}x" if loop else "-"
        vs_whole = f"{loop.median('wall') / row.median('wall'):.2f}x" if loop else "-"
        first = f"{row.median('first'):.2f}" if row.first else "-"
        print(f"| {name} | {row.median('wall'):.1f} | {row.median('rate'):.2f} | {per_core:.2f} | {vs_core} | {vs_whole} | {row.median('startup'):.2f} | {first} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--identities", type=int, default=40)
    parser.add_argument("--images", type=int, default=8, help="images per identity")
    parser.add_argument("--large", type=int, default=240, help="N large multi-face photos (0: none)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="work folder, kept (default: a temporary one)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--skip-loop", action="store_true")
    parser.add_argument("--flow", action="store_true", help="also the Prefect flow, 2 workers, on the sample set")
    parser.add_argument("--detectors", default="retinaface,mtcnn", help="comma-separated prepare.detector values")
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts of the CLI rows")
    args = parser.parse_args()

    work = args.out or Path(tempfile.mkdtemp(prefix="facepipe-bench-"))
    sets = _sets(work, args)
    params = PrepareParams()
    detectors = args.detectors.split(",")
    params_files = {}
    for detector in detectors:
        params_files[detector] = work / f"params-{detector}.yaml"
        params_files[detector].write_text(f"prepare: {{detector: {detector}}}\n", encoding="utf-8")
    counts = {name: len(scan_raw(raw)) for name, raw in sets.items()}
    rows: dict[str, Row] = {}

    def facepipe_row(name: str, raw: Path, workers: int | None, detector: str) -> None:
        wall, report = facepipe_cli(raw, work / "cli", workers, params_files[detector])
        row = rows.setdefault(name, Row(report["workers"]))
        row.wall.append(wall)
        row.rate.append(report["images_per_s"])
        row.startup.append(report["timings_s"]["startup"])
        row.first.append(report["timings_s"].get("first_photo_since_launch", float("nan")))

    for repeat in range(args.repeats):  # interleaved: every configuration once per repeat
        for set_name, raw in sets.items():
            if set_name == "small":  # start-up: the default command on a folder of 16 photos
                facepipe_row(f"small (16 photos): facepipe prepare {detectors[0]}, default workers", raw, None, detectors[0])
                continue
            if not args.skip_loop:
                wall, line = facenet_loop(raw)
                row = rows.setdefault(f"{set_name}: facenet-pytorch loop", Row(1))
                row.wall.append(wall)
                row.rate.append(line["images"] / line["process_s"])
                row.startup.append(line["startup_s"])
            for workers in map(int, args.workers.split(",")):
                for detector in detectors:
                    facepipe_row(f"{set_name}: facepipe prepare {detector}, {workers} worker(s)", raw, workers, detector)
            if args.flow and set_name == "sample":
                wall, report = facepipe_flow(raw, work / "flow2", 2, params_files[detectors[0]])
                row = rows.setdefault(f"{set_name}: Prefect flow {detectors[0]}, 2 workers", Row(2))
                row.wall.append(wall)
                row.rate.append(report["images_per_s"])
                row.startup.append(report["timings_s"]["startup"])
        print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr)

    sizes = ", ".join(f"{name}: {n} files" for name, n in counts.items())
    print(f"\n{sizes}; {os.cpu_count()} cores, {platform.processor() or platform.machine()}, "
          f"Python {platform.python_version()}; medians of {args.repeats} interleaved runs\n")
    _table(rows)
    if "retinaface" in detectors:
        cuda_rows({k: v for k, v in sets.items() if k != "small"}, params, args.repeats)
    if args.json:
        args.json.write_text(json.dumps({name: vars(row) for name, row in rows.items()} | {"n_images": counts}, indent=2), encoding="utf-8")
    if args.out is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
