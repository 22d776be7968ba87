"""prepare --update against a full prepare: a set grows by 1% new photos.

    python benchmarks/update_bench.py [--identities 50] [--images 8] [--percent 1] [--repeats 3] [--workers 2]

Each repeat, on a fresh copy of the same sample set: a full ``facepipe prepare`` (the CLI, as a user
runs it), then ``facepipe prepare --update`` with nothing changed (the fixed start-up: process start,
imports, scan, the comparison with sources.jsonl, report.html; no cluster, nothing decoded), then
``--update`` after adding ``--percent`` % new photos (new identities' folders from another seed).
Wall times of the whole commands; medians over the repeats, which are interleaved. The target:
update <= 5% of the full run + fixed start-up, where fixed start-up = the no-change update plus the
Dask cluster start and detector load the update's report.json records (``timings_s.startup``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import facepipe  # noqa: F401
from facepipe.config import SampleDataParams
from facepipe.synthetic.photos import make_sample_dataset


def timed(*args: str) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "facepipe", *args], check=True, capture_output=True)
    return time.perf_counter() - started


def new_photos(pool: Path, raw: Path, count: int) -> int:
    """Copy ``count`` photos of ``pool`` (identity folders) into ``raw`` under new identity names."""
    photos = sorted(p for p in pool.glob("*/*.jpg") if p.stat().st_size > 0)[:count]
    for photo in photos:
        target = raw / f"new_{photo.parent.name}" / photo.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(photo, target)
    return len(photos)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--identities", type=int, default=50)
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--percent", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base, pool = tmp / "base", tmp / "pool"
        make_sample_dataset(base, SampleDataParams(identities=args.identities, images_per_identity=args.images, seed=0))
        make_sample_dataset(pool, SampleDataParams(identities=args.identities, images_per_identity=args.images, seed=1, bad_files=False))
        files = sum(1 for p in base.rglob("*") if p.is_file())
        rows: dict[str, list[float]] = {"full": [], "noop": [], "update": [], "cluster": [], "full_process": [],
                                        "update_process": []}
        added = 0
        for repeat in range(args.repeats):
            raw, out = tmp / f"raw{repeat}", tmp / f"out{repeat}"
            shutil.copytree(base, raw, symlinks=True)
            workers = ("--workers", str(args.workers))
            rows["full"].append(timed("prepare", str(raw), str(out), *workers))
            rows["full_process"].append(json.loads((out / "report.json").read_text())["timings_s"]["process"])
            rows["noop"].append(timed("prepare", str(raw), str(out), "--update", *workers))
            added = new_photos(pool, raw, max(1, round(files * args.percent / 100)))
            rows["update"].append(timed("prepare", str(raw), str(out), "--update", *workers))
            report = json.loads((out / "report.json").read_text())
            rows["cluster"].append(report["timings_s"]["startup"])
            rows["update_process"].append(report["timings_s"]["process"])
            print(f"repeat {repeat}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in rows.items()), file=sys.stderr)
            print(f"  update report: files {report['files']}, counts {report['counts']}", file=sys.stderr)
        med = {k: statistics.median(v) for k, v in rows.items()}
        fixed = med["noop"] + med["cluster"]
        bound = 0.05 * med["full"] + fixed
        print(f"| set | files | added | full prepare | update, nothing new | update +{args.percent:g}% | fixed start-up | bound (5% of full + fixed) |")
        print("|---|---|---|---|---|---|---|---|")
        print(f"| sample {args.identities}x{args.images} | {files} | {added} | {med['full']:.2f} s | {med['noop']:.2f} s |"
              f" {med['update']:.2f} s | {fixed:.2f} s | {bound:.2f} s ({'met' if med['update'] <= bound else 'NOT met'}) |")
        print(f"processing phase alone (first chunk submitted to last record written): full {med['full_process']:.2f} s,"
              f" update {med['update_process']:.2f} s ({100 * med['update_process'] / med['full_process']:.1f}%)")
        print(f"load average {os.getloadavg()[0]:.2f}; medians of {args.repeats} interleaved repeats; {args.workers} workers")


if __name__ == "__main__":
    main()
