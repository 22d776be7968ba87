"""Memory of an update per file of the set: its reading of ``sources.jsonl``, and (``--scan``) the scan.

Writes a synthetic ``sources.jsonl`` of ``--files`` lines (8 photos per identity, one line per file as
prepare writes them) under ``--root``, then in a fresh process per repeat reads it as the update does
(``facepipe.shardset.update.read_sources``) and reports the time and the growth of the resident set. With
``--scan`` it also creates ``--files`` empty files in that layout and times the scan that every prepare
and update starts with (``scan_raw``) plus the update's per-file stats (``file_stats``) the same way.

    python benchmarks/update_memory.py [--files 1000000] [--scan] [--root /tmp/facepipe-update-memory]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from facepipe.io.manifest import SourcesDigest

PROBE = """
import json, re, sys, time
from pathlib import Path
from facepipe.shardset.update import read_sources
def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
before = rss()
started = time.perf_counter()
entries = read_sources(Path(sys.argv[1]), expected=sys.argv[2])
print(json.dumps({"seconds": time.perf_counter() - started, "rss_growth": rss() - before, "entries": len(entries)}))
"""

SCAN_PROBE = """
import json, re, sys, time
from pathlib import Path
from facepipe.data.scan import scan_raw
from facepipe.shardset.update import file_stats
def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
before = rss()
started = time.perf_counter()
items = scan_raw(sys.argv[1])
stats = file_stats(Path(sys.argv[1]), items)
print(json.dumps({"seconds": time.perf_counter() - started, "rss_growth": rss() - before, "entries": len(items)}))
"""


def write_files(raw: Path, files: int) -> None:
    for i in range(files):
        identity = raw / f"id{i // 8:07d}"
        if i % 8 == 0:
            identity.mkdir(parents=True)
        (identity / f"id{i // 8:07d}_{i % 8:04d}.jpg").touch()


def measure(probe: str, target: Path, repeats: int, files: int, what: str, *args: str) -> None:
    runs = [json.loads(subprocess.run([sys.executable, "-c", probe, str(target), *args], check=True, capture_output=True, text=True).stdout)
            for _ in range(repeats)]
    assert all(r["entries"] >= files for r in runs), runs
    growth = sorted(r["rss_growth"] for r in runs)[len(runs) // 2]
    seconds = sorted(r["seconds"] for r in runs)[len(runs) // 2]
    print(f"{what}: {seconds:.1f} s, resident +{growth / 2**30:.2f} GiB ({growth / files:.0f} bytes a file); medians of {repeats}")


def write_sources(path: Path, files: int) -> str:
    """Writes the file; returns the hash the manifest would record of it (``SOURCES_KEY``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    digest = SourcesDigest()
    with open(path, "w", encoding="utf-8") as handle:
        for i in range(files):
            identity = f"id{i // 8:07d}"
            line = {"generation": 0, "mtime_ns": 1_796_087_397_780_087_059 + i, "path": f"{identity}/{identity}_{i % 8:04d}.jpg",
                    "reason": "low_score" if i % 31 == 0 else None, "sample": None if i % 31 == 0 else i,
                    "sha256": hashlib.sha256(str(i).encode()).hexdigest(), "size": 98_401 + i}
            handle.write(json.dumps(line, sort_keys=True) + "\n")
            digest.add(line["path"], line["sha256"], line["reason"], line["sample"], line["generation"])
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scan", action="store_true", help="also create --files empty files and time the scan")
    parser.add_argument("--root", type=Path, default=Path("/tmp/facepipe-update-memory"))
    args = parser.parse_args()
    if args.root.exists():
        raise SystemExit(f"{args.root} exists: choose another --root (this script deletes what it writes)")
    try:
        path = args.root / "sources.jsonl"
        expected = write_sources(path, args.files)
        size = path.stat().st_size / 2**20
        measure(PROBE, path, args.repeats, args.files, f"{args.files:,} files, reading sources.jsonl ({size:.0f} MiB)", expected)
        if args.scan:
            write_files(args.root / "raw", args.files)
            measure(SCAN_PROBE, args.root / "raw", args.repeats, args.files, f"{args.files:,} files, scan_raw + file_stats")
    finally:
        shutil.rmtree(args.root, ignore_errors=True)


if __name__ == "__main__":
    main()
