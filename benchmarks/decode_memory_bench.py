"""Peak memory of one prepare worker on one chunk of large photos: the decode budget against none.

A chunk of ``--images`` photos of ``--megapixels`` each (default 16 x 40 MP, just under the default
``max_pixels``) goes through ``process_chunk`` exactly as a Dask worker runs it: read, decode, detect
(MTCNN, CPU), align, encode. Each measurement runs in a fresh process that first loads the detector,
so the figures are the chunk's own cost on top of a warm worker:

- ``after``: facepipe as it is (``DECODE_BUDGET_PIXELS``, row-band decoding);
- ``after, no budget``: the same code with the budget lifted (the whole chunk decoded at once);
- ``before REV`` (with ``--before REV``): facepipe as of git revision REV, taken with ``git archive``.

Peak RSS is the kernel's high-water mark (``ru_maxrss``); "chunk" is that minus the RSS of the warm
worker before the chunk. The outcomes (landmarks, payload hashes) must be equal in every run.

Run: ``.venv/bin/python benchmarks/decode_memory_bench.py --before 650a2e5``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rss_mb() -> float:
    with open("/proc/self/status") as handle:
        line = next(line for line in handle if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def child(raw: str, budget: int | None) -> None:
    """Measure one chunk in this process; prints one JSON line."""
    import facepipe.data.extract as extract
    from facepipe.config import PrepareParams

    if budget is not None:
        extract.DECODE_BUDGET_PIXELS = budget
    params = PrepareParams()
    extract.warm_up(params, "cpu")
    paths = sorted(f"a/{name}" for name in os.listdir(Path(raw) / "a"))
    warm = rss_mb()
    started = time.perf_counter()
    outcomes = extract.process_chunk(paths, raw, params, "cpu")
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    digest = hashlib.sha256(
        json.dumps([[o.reason, o.header and o.header["landmarks"], o.payload and hashlib.sha256(o.payload).hexdigest()] for o in outcomes]).encode()
    ).hexdigest()[:12]
    print(json.dumps({"warm_mb": warm, "peak_mb": peak, "seconds": seconds, "accepted": sum(o.reason is None for o in outcomes), "outcomes": digest}))


def make_chunk(raw: Path, *, images: int, megapixels: float) -> None:
    """One large face photo (Grace Hopper, upscaled, with sensor-like noise), copied ``images`` times."""
    import matplotlib.cbook
    import numpy as np
    from PIL import Image

    with Image.open(matplotlib.cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)) as pil:
        face = pil.convert("RGB")
    scale = (megapixels * 1e6 / (face.width * face.height)) ** 0.5
    big = np.asarray(face.resize((int(face.width * scale), int(face.height * scale)), Image.BICUBIC)).astype(np.int16)
    noise = np.random.default_rng(0).integers(-6, 7, size=big.shape[:2], dtype=np.int16)[..., None]
    big = np.clip(big + noise, 0, 255).astype(np.uint8)
    (raw / "a").mkdir(parents=True)
    first = raw / "a" / "00.jpg"
    Image.fromarray(big).save(first, quality=90)
    for index in range(1, images):
        shutil.copy(first, raw / "a" / f"{index:02d}.jpg")
    print(f"chunk: {images} x {big.shape[1]}x{big.shape[0]} ({big.shape[0] * big.shape[1] / 1e6:.1f} MP), "
          f"{first.stat().st_size / 1e6:.1f} MB each", flush=True)


def measure(label: str, raw: Path, *, source: Path, budget: int | None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(source)}
    cmd = [sys.executable, __file__, "--child", str(raw)] + (["--budget", str(budget)] if budget is not None else [])
    out = subprocess.run(cmd, env=env, cwd=source, capture_output=True, text=True, check=True).stdout
    result = {"run": label, **json.loads(out.strip().splitlines()[-1])}
    print(f"{label:<24} peak RSS {result['peak_mb']:7.0f} MB, chunk {result['peak_mb'] - result['warm_mb']:7.0f} MB, "
          f"{result['seconds']:5.1f} s, accepted {result['accepted']}, outcomes {result['outcomes']}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--megapixels", type=float, default=39.9)
    parser.add_argument("--before", metavar="REV", help="also measure facepipe as of this git revision")
    parser.add_argument("--child", metavar="RAW", help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.budget)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "raw"
        make_chunk(raw, images=args.images, megapixels=args.megapixels)
        results = []
        if args.before:
            old = Path(tmp) / "before"
            old.mkdir()
            archive = subprocess.run(["git", "archive", args.before, "facepipe"], cwd=ROOT, capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
            results.append(measure(f"before {args.before}", raw, source=old, budget=None))
        results.append(measure("after, no budget", raw, source=ROOT, budget=10**12))
        results.append(measure("after", raw, source=ROOT, budget=None))
        if len({r["outcomes"] for r in results}) != 1:
            print("outcomes differ between runs", file=sys.stderr)
            sys.exit(1)


if __name__ == "__main__":
    main()
