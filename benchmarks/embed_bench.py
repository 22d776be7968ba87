"""Embed speed per core and per command: ``facepipe embed`` (PyTorch on 1 and 2 workers, ONNX on 1)
against the one-photo facenet-pytorch loop it replaces, with each command's CPU time and peak memory.

    python benchmarks/embed_bench.py [--model data/model] [--export DIR] [--params params.yaml]
        [--raw SAMPLE_RAW | --identities 40] [--images 96] [--sample 32] [--repeats 3] [--workers 1,2]
        [--batch-sizes 8] [--out DIR] [--json FILE]

Sets: ``--images N`` group photos of 2.5 MP with 3-10 faces each (``benchmarks/large_set.py``, composed
from the sample identities of ``--raw``, or of a ``facepipe sample-data`` set of ``--identities``
generated here), and the first ``--sample N`` single-face photos of those identities. Every row is a
whole command run as a subprocess, launch to exit (``wall``), with its processing phase from its own
report: ``report.json``'s ``timings_s.process`` (first chunk submitted to last part written) for
``facepipe embed RAW MODEL OUT --all-faces --workers N --params FILE``; the loop's JSON line
(``benchmarks/embed_loop.py``: MTCNN on the photo scaled to 640 px, every face past the gates aligned
and embedded with its mirror, one photo per forward pass, torch at 1 thread). "per core" divides a
processing rate by the worker processes (the loop: 1); facepipe's main process runs beside them,
uncounted. ``cpu s`` is the command's user + system time with every child it waited for (Dask's
workers included); peak RSS and PSS are the largest sums over the command's process tree, polled
every 0.2 s (RSS counts pages that forked workers share once per process, PSS splits them). Rows
run in alternating order (forward, then backward) ``--repeats`` times; medians, and ratios of the
medians of rows run side by side. The ONNX row runs ``--export`` (default: one ``facepipe export``
writes into the work folder). ``--batch-sizes`` adds 1-worker PyTorch rows with ``embed.batch_size``
changed (a copy of the params file).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import psutil
import yaml

from facepipe.config import SampleDataParams
from facepipe.gallery.store import EMBEDDING_FOLDER
from facepipe.io.atomic import check_replaceable
from facepipe.synthetic.photos import make_sample_dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from large_set import make_large_set  # noqa: E402 - a sibling script, not a package

LOOP = "facenet-pytorch loop"
POLL_S = 0.2


@dataclass
class Run:
    """One whole command: wall and CPU seconds, peak memory of its process tree (bytes), its own
    report's processing seconds and start-up seconds, the photos it processed and the faces it embedded."""

    wall: float
    cpu: float
    rss: int
    pss: int
    process: float
    startup: float
    photos: int
    faces: int


def _tree_memory(process: psutil.Process) -> tuple[int, int]:
    """(RSS, PSS) summed over ``process`` and its descendants; processes that end meanwhile are skipped."""
    rss = pss = 0
    for member in [process, *process.children(recursive=True)]:
        try:
            info = member.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        rss, pss = rss + info.rss, pss + getattr(info, "pss", info.rss)
    return rss, pss


def measure(command: list[str]) -> tuple[float, float, int, int, str]:
    """Run ``command`` to its end: wall seconds, CPU seconds (it and the children it waited for),
    peak RSS and PSS of its process tree, and its stdout. Raises CalledProcessError on failure."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    peak = [0, 0]
    start = time.perf_counter()
    child = psutil.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(POLL_S):
            rss, pss = _tree_memory(child)
            peak[0], peak[1] = max(peak[0], rss), max(peak[1], pss)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    stdout, stderr = child.communicate()
    wall = time.perf_counter() - start
    stop.set()
    poller.join()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if child.returncode:
        sys.stderr.write(stderr[-4000:])
        raise subprocess.CalledProcessError(child.returncode, command, stdout, stderr)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, peak[0], peak[1], stdout


def embed_loop(raw: Path, model: Path, out: Path) -> tuple[Run, int]:
    """``benchmarks/embed_loop.py RAW MODEL``, and its worker count (1)."""
    command = [sys.executable, str(Path(__file__).with_name("embed_loop.py")), str(raw), str(model), "--out", str(out / "loop.npy")]
    wall, cpu, rss, pss, stdout = measure(command)
    line = json.loads(stdout.strip().splitlines()[-1])
    return Run(wall, cpu, rss, pss, line["process_s"], line["startup_s"], line["images"], line["faces"]), 1


def facepipe_embed(raw: Path, model: Path, *, out: Path, workers: int, params_file: Path, runtime: str) -> tuple[Run, int]:
    """The whole ``facepipe embed --all-faces`` command into a fresh ``out``, and its report's worker count."""
    check_replaceable(out, EMBEDDING_FOLDER)  # removed only when it is an embedding folder (an earlier run's)
    shutil.rmtree(out, ignore_errors=True)
    command = [
        sys.executable, "-m", "facepipe", "embed", str(raw), str(model), str(out), "--all-faces",
        "--workers", str(workers), "--params", str(params_file), "--runtime", runtime,
    ]  # fmt: skip
    wall, cpu, rss, pss, _ = measure(command)
    report = json.loads((out / "report.json").read_text())
    timings = report["timings_s"]
    run = Run(wall, cpu, rss, pss, timings["process"], timings["startup"], report["files"]["embedded"], report["counts"]["faces"])
    return run, report["workers"]


@dataclass
class Row:
    """One configuration's runs, and the worker processes it used."""

    workers: int = 1
    runs: list[Run] = field(default_factory=list)

    def median(self, what: Callable[[Run], float]) -> float:
        return statistics.median(what(run) for run in self.runs) if self.runs else float("nan")


def faces_per_s(run: Run) -> float:
    return run.faces / run.process


def photos_per_s(run: Run) -> float:
    return run.photos / run.process


def summary(rows: dict[str, Row]) -> list[dict[str, float | str]]:
    """Per row, medians over its runs; per core (the processing rates / the row's workers) and the
    ratios of its medians to the same set's loop (the set is the row name's part before ":")."""
    table = []
    for name, row in rows.items():
        loop = rows.get(f"{name.split(':')[0]}: {LOOP}")
        per_core = row.median(faces_per_s) / row.workers
        entry: dict[str, float | str] = {
            "run": name,
            "workers": row.workers,
            "faces": row.median(lambda r: r.faces),
            "wall_s": row.median(lambda r: r.wall),
            "faces_per_s": row.median(faces_per_s),
            "photos_per_s": row.median(photos_per_s),
            "faces_per_s_per_core": per_core,
            "startup_s": row.median(lambda r: r.startup),
            "cpu_ms_per_face": row.median(lambda r: 1000 * r.cpu / max(r.faces, 1)),
            "peak_rss_mib": row.median(lambda r: r.rss) / 2**20,
            "peak_pss_mib": row.median(lambda r: r.pss) / 2**20,
        }
        if loop is not None and loop.runs:
            entry["vs_loop_per_core"] = per_core / loop.median(faces_per_s)
            # the whole command as a user sees it: photos through per second of wall, launch to exit
            entry["vs_loop_whole"] = row.median(lambda r: r.photos / r.wall) / loop.median(lambda r: r.photos / r.wall)
        table.append(entry)
    return table


def print_table(table: list[dict[str, float | str]]) -> None:
    print("| run | faces | wall s (whole command) | faces/s (processing) | photos/s (processing) | faces/s per core "
          "| vs loop, per core | vs loop, whole command | start-up s | CPU ms per face (whole command) | peak RSS MiB | peak PSS MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for e in table:
        ratios = [f"{e[k]:.2f}x" if k in e else "-" for k in ("vs_loop_per_core", "vs_loop_whole")]
        print(f"| {e['run']} | {e['faces']:.0f} | {e['wall_s']:.1f} | {e['faces_per_s']:.2f} | {e['photos_per_s']:.2f} "
              f"| {e['faces_per_s_per_core']:.2f} | {ratios[0]} | {ratios[1]} | {e['startup_s']:.2f} "
              f"| {e['cpu_ms_per_face']:.0f} | {e['peak_rss_mib']:.0f} | {e['peak_pss_mib']:.0f} |")


def _sets(work: Path, args: argparse.Namespace) -> dict[str, Path]:
    """The raw folders by name: ``--images`` group photos and the first ``--sample`` sample photos."""
    raw = args.raw
    if raw is None:
        raw = work / "raw"
        if not raw.exists():
            make_sample_dataset(raw, SampleDataParams(identities=args.identities))
    sets = {}
    large = work / f"large{args.images}"
    if not large.exists():
        make_large_set(raw, large, images=args.images)
    sets[f"large ({args.images} group photos)"] = large
    if args.sample:
        sample = work / f"sample{args.sample}"
        if not sample.exists():
            for path in sorted(raw.glob("*/*.jpg"))[: args.sample]:
                (sample / path.parent.name).mkdir(parents=True, exist_ok=True)
                shutil.copy(path, sample / path.parent.name / path.name)
        sets[f"sample ({args.sample} single-face photos)"] = sample
    return sets


def _export(work: Path, args: argparse.Namespace) -> Path:
    if args.export is not None:
        return args.export
    export = work / "export"
    if not (export / "export.json").is_file():
        subprocess.run([sys.executable, "-m", "facepipe", "export", str(args.model), str(export), "--params", str(args.params)], check=True)
    return export


def _with_batch_size(params: Path, size: int, work: Path) -> Path:
    """A copy of the params file ``params`` with ``embed.batch_size`` set to ``size``."""
    content = yaml.safe_load(params.read_text(encoding="utf-8")) or {}
    content["embed"] = {**(content.get("embed") or {}), "batch_size": size}
    path = work / f"params-batch{size}.yaml"
    path.write_text(yaml.safe_dump(content), encoding="utf-8")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("data/model"), help="model folder (train's)")
    parser.add_argument("--export", type=Path, default=None, help="export folder of that model (default: exported here)")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"), help="its prepare section: the model's training set's")
    parser.add_argument("--raw", type=Path, default=None, help="sample identities (default: facepipe sample-data, --identities)")
    parser.add_argument("--identities", type=int, default=40)
    parser.add_argument("--images", type=int, default=96, help="N large multi-face photos")
    parser.add_argument("--sample", type=int, default=32, help="N single-face sample photos (0: none)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts of the PyTorch rows (large set)")
    parser.add_argument("--batch-sizes", default="", help="comma-separated embed.batch_size values: more PyTorch 1-worker rows (large set)")
    parser.add_argument("--out", type=Path, default=None, help="work folder, kept (default: a temporary one)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    args.model, args.params = args.model.resolve(), args.params.resolve()

    work = args.out or Path(tempfile.mkdtemp(prefix="facepipe-embed-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    sets = _sets(work, args)
    export = _export(work, args)
    jobs: list[tuple[str, Callable[[], tuple[Run, int]]]] = []
    for index, (set_name, raw) in enumerate(sets.items()):
        jobs.append((f"{set_name}: {LOOP}", partial(embed_loop, raw, args.model, work)))
        embed = partial(facepipe_embed, raw, out=work / "out", params_file=args.params)
        for workers in map(int, args.workers.split(",")) if index == 0 else [1]:  # the sample set: one worker only
            jobs.append((f"{set_name}: facepipe embed torch, {workers} worker(s)", partial(embed, args.model, workers=workers, runtime="torch")))
        if index == 0:
            jobs.append((f"{set_name}: facepipe embed onnx, 1 worker(s)", partial(embed, export, workers=1, runtime="onnx")))
            for size in map(int, filter(None, args.batch_sizes.split(","))):
                params_file = _with_batch_size(args.params, size, work)
                run = partial(facepipe_embed, raw, args.model, out=work / "out", params_file=params_file, workers=1, runtime="torch")
                jobs.append((f"{set_name}: facepipe embed torch, 1 worker(s), batch_size {size}", run))

    rows = {name: Row() for name, _ in jobs}
    for repeat in range(args.repeats):  # every configuration once per repeat, the order reversed every other
        for name, job in jobs if repeat % 2 == 0 else jobs[::-1]:
            run, rows[name].workers = job()
            rows[name].runs.append(run)
            print(f"repeat {repeat + 1}: {name}: {run}", file=sys.stderr, flush=True)
        if args.json:  # after every repeat: a run cut short still leaves its figures
            runs = {name: {"workers": row.workers, "runs": [vars(run) for run in row.runs]} for name, row in rows.items()}
            args.json.write_text(json.dumps({"summary": summary(rows), "rows": runs}, indent=2), encoding="utf-8")

    counts = ", ".join(f"{name}: {next(iter(rows[f'{name}: {LOOP}'].runs)).photos} photos" for name in sets)
    print(f"\n{counts}; {os.cpu_count()} cores, {platform.processor() or platform.machine()}, Python {platform.python_version()}, "
          f"load average {os.getloadavg()[0]:.1f} at the end; medians of {args.repeats} runs in alternating order\n")
    print_table(summary(rows))
    if args.out is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
