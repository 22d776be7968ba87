"""Where a prepare worker's time goes, per photo: cProfile of ``process_chunk`` in one process, one thread.

    python benchmarks/prepare_profile.py RAW [--detector retinaface] [--photos 48] [--top 12]

Loads the detector as a worker does (``warm_up``: the seconds and whether torch got imported), runs
one chunk untimed, then profiles ``--photos`` photos of RAW in chunks of ``prepare.chunk_size`` and
prints CPU milliseconds per photo by phase (the profiler's own functions grouped: the detector
network, JPEG decoding, resizing, Pillow's encoders (its image-to-NumPy copies and the crops' JPEGs), the
alignment warp, hashing) and the top functions. benchmarks/README.md, "Where the time goes", quotes it.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

from facepipe.config import PrepareParams
from facepipe.data.extract import process_chunk, warm_up
from facepipe.data.scan import scan_raw

#: Phases by the profiled function's name (built-ins and library functions, own time).
PHASES = {
    "detector network": ("onnxruntime_pybind11_state.run", "conv2d", "prelu", "max_pool2d", "linear", "softmax"),
    "JPEG decode": ("'decode' of 'ImagingDecoder'", "decode_jpeg"),
    "resize (detector input, pyramid, crops)": ("{resize}",),
    "Pillow encoders (image -> NumPy copies; the crops' JPEGs)": ("'encode' of 'ImagingEncoder'", "'join' of 'bytes'", "'crop' of 'ImagingCore'", "_imaging.new", "_pixels"),
    "alignment warp": ("warpAffine",),
    "hashing": ("openssl_sha256",),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", type=Path)
    parser.add_argument("--detector", default="retinaface")
    parser.add_argument("--photos", type=int, default=48)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    params = PrepareParams(detector=args.detector)
    started = time.perf_counter()
    warm_up(params, "cpu")
    print(f"warm-up (load the detector): {time.perf_counter() - started:.2f} s; torch imported: {'torch' in sys.modules}")
    paths = [item.path for item in scan_raw(args.raw) if item.reason is None]
    size = params.chunk_size
    process_chunk(paths[:size], str(args.raw), params, "cpu")  # untimed: first-call costs
    chosen = paths[size : size + args.photos]
    profile = cProfile.Profile(time.process_time)
    profile.enable()
    for start in range(0, len(chosen), size):
        process_chunk(chosen[start : start + size], str(args.raw), params, "cpu")
    profile.disable()
    stats = pstats.Stats(profile)
    total = sum(row[2] for row in stats.stats.values())  # own CPU time of every function
    print(f"{args.detector}: {len(chosen)} photos, {1000 * total / len(chosen):.1f} ms CPU per photo\n")
    grouped = dict.fromkeys(PHASES, 0.0)
    for key, row in stats.stats.items():
        label = pstats.func_std_string(key)
        for phase, needles in PHASES.items():
            if any(needle in label for needle in needles):
                grouped[phase] += row[2]
                break
    print("| phase | ms CPU per photo | share |\n|---|---:|---:|")
    for phase, seconds in [*grouped.items(), ("everything else", total - sum(grouped.values()))]:
        print(f"| {phase} | {1000 * seconds / len(chosen):.1f} | {seconds / total:.0%} |")
    print()
    stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
