"""Memory of ``compact`` per file of the set: its reading of ``sources.jsonl`` and the builder's bookkeeping.

Writes a synthetic ``sources.jsonl`` of ``--files`` lines (the layout of ``update_memory.py``: 8 photos
per identity, one line in 31 a reject) under ``--root``, then, in a fresh process per repeat, reports
the time and the growth of the resident set of:

- ``before``: what compact did until this change: every line as a dict in one list, plus a
  {path: (size, mtime_ns)} dict (skipped above ``--before-max`` files: it would not fit);
- ``now``: compact's loop without the shard files: sources.jsonl streamed through
  ``update.source_entries`` (types and the manifest's hash checked), each entry handed to a real
  ``SetBuilder`` as a reject (its bookkeeping per file: the content index for duplicates, the counters,
  sources.jsonl and rejects.jsonl written). Records are not copied: a shard writer holds one shard at
  a time whatever the set's size, so the per-file cost is the builder's.

    python benchmarks/compact_memory.py [--files 1000000] [--repeats 3] [--root /tmp/facepipe-compact-memory]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from update_memory import write_sources

BEFORE = """
import json, re, sys, time
def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
before = rss()
started = time.perf_counter()
with open(sys.argv[1], encoding="utf-8") as handle:
    sources = [json.loads(line) for line in handle if line.strip()]
stats = {e["path"]: (e["size"], e["mtime_ns"]) for e in sources if e["size"] is not None}
print(json.dumps({"seconds": time.perf_counter() - started, "rss_growth": rss() - before, "entries": len(sources)}))
"""

NOW = """
import json, re, sys, time
from pathlib import Path
from facepipe.config import PrepareParams
from facepipe.data.extract import Outcome
from facepipe.shardset import Generation, SetBuilder
from facepipe.shardset.update import source_entries
def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
params = PrepareParams(detector="none")
out = Path(sys.argv[1]).parent / "built"
out.mkdir()
builder = SetBuilder(out, params, base=Generation(params={}))
before = rss()
started = time.perf_counter()
lines = 0
for entry in source_entries(Path(sys.argv[1]), expected=sys.argv[2]):
    builder.stats = {entry.path: (entry.size, entry.mtime_ns)}
    builder.add(Outcome(entry.path, entry.sha256, reason=entry.reason or "low_score", detail=""))
    lines += 1
grown = rss() - before
builder.abort()
print(json.dumps({"seconds": time.perf_counter() - started, "rss_growth": grown, "entries": lines}))
"""


def measure(probe: str, args: list[str], repeats: int, files: int, what: str, root: Path) -> None:
    runs = []
    for _ in range(repeats):
        shutil.rmtree(root / "built", ignore_errors=True)
        done = subprocess.run([sys.executable, "-c", probe, *args], check=True, capture_output=True, text=True)
        runs.append(json.loads(done.stdout))
    assert all(r["entries"] == files for r in runs), runs
    growth = sorted(r["rss_growth"] for r in runs)[len(runs) // 2]
    seconds = sorted(r["seconds"] for r in runs)[len(runs) // 2]
    print(f"{what}: {seconds:.1f} s, resident +{growth / 2**30:.2f} GiB ({growth / files:.0f} bytes a file); medians of {repeats}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--before-max", type=int, default=2_000_000, help="measure the old reading up to this many files")
    parser.add_argument("--root", type=Path, default=Path("/tmp/facepipe-compact-memory"))
    args = parser.parse_args()
    if args.root.exists():
        raise SystemExit(f"{args.root} exists: choose another --root (this script deletes what it writes)")
    try:
        path = args.root / "sources.jsonl"
        expected = write_sources(path, args.files)
        size = path.stat().st_size / 2**20
        if args.files <= args.before_max:
            measure(BEFORE, [str(path)], args.repeats, args.files, f"{args.files:,} files ({size:.0f} MiB), before: list of dicts", args.root)
        measure(NOW, [str(path), expected], args.repeats, args.files, f"{args.files:,} files ({size:.0f} MiB), now: streamed + builder", args.root)
    finally:
        shutil.rmtree(args.root, ignore_errors=True)


if __name__ == "__main__":
    main()
