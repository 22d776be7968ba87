"""Where a prepare worker's time goes, per photo: cProfile of ``process_chunk`` in one process, one thread.

    python benchmarks/prepare_profile.py RAW [--detector retinaface] [--photos 48] [--top 12] [--timers]

Loads the detector as a worker does (``warm_up``: the seconds and whether torch got imported), runs
one chunk untimed, then profiles ``--photos`` photos of RAW in chunks of ``prepare.chunk_size`` and
prints CPU milliseconds per photo by phase (the profiler's own functions grouped: the detector
network, JPEG decoding, resizing, Pillow's encoders (its image-to-NumPy copies and the crops' JPEGs), the
alignment warp, hashing) and the top functions. benchmarks/README.md, "Where the time goes", quotes it.

``--timers``: no profiler; the phases' functions are wrapped in CPU-time counters instead (the
RetinaFace path: the network, JPEG decoding, the network input, resizing, alignment, reading and
hashing, NMS, encoding, box decoding, header parsing, gates), so the total is the true CPU time per
photo and "the rest" is everything no counter holds.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import pstats
import sys
import time
from pathlib import Path

from facepipe.config import PrepareParams
from facepipe.data.extract import process_chunk, warm_up
from facepipe.data.scan import scan_raw
from facepipe.errors import FacepipeError

#: Phases by the profiled function's name (built-ins and library functions, own time).
PHASES = {
    "detector network": ("onnxruntime_pybind11_state.run", "conv2d", "prelu", "max_pool2d", "linear", "softmax"),
    "JPEG decode": ("'decode' of 'ImagingDecoder'", "decode_jpeg"),
    "resize (detector input, pyramid, crops)": ("{resize}",),
    "Pillow encoders (image -> NumPy copies; the crops' JPEGs)": ("'encode' of 'ImagingEncoder'", "'join' of 'bytes'", "'crop' of 'ImagingCore'", "_imaging.new", "_pixels"),
    "alignment warp": ("warpAffine",),
    "hashing": ("openssl_sha256",),
}


#: (module, attribute, phase) wrapped in CPU-time counters by --timers.
TIMED = (
    ("facepipe.detection.retinaface", "OnnxRetinaFace.__call__", "detector network (onnxruntime)"),
    ("simplejpeg", "decode_jpeg", "JPEG decode (libjpeg-turbo)"),
    ("facepipe.detection.retinaface", "RetinaFaceDetector._input", "network input (BGR minus the mean)"),
    ("facepipe.detection.retinaface", "downscale", "resize to the network's input"),
    ("facepipe.data.extract", "align_face", "alignment (similarity fit and warp)"),
    ("facepipe.data.extract", "_read", "reading and hashing the file"),
    ("facepipe.detection.retinaface", "nms", "non-maximum suppression"),
    ("facepipe.data.extract", "encode_image", "the crop's JPEG"),
    ("facepipe.detection.retinaface", "decode", "box and landmark decoding"),
    ("facepipe.data.extract", "open_image", "header parsing"),
    ("facepipe.data.extract", "_passing", "score and size gates"),
)


def install_timers() -> dict[str, float]:
    """Wrap every :data:`TIMED` function in a CPU-time counter; the counters, by phase (seconds)."""
    spent: dict[str, float] = {}
    for module_name, attribute, phase in TIMED:
        owner: object = importlib.import_module(module_name)
        *path, name = attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        original = getattr(owner, name)

        def timed(*args, _original=original, _phase=phase, **kwargs):  # type: ignore[no-untyped-def]
            started = time.process_time()
            try:
                return _original(*args, **kwargs)
            finally:
                spent[_phase] = spent.get(_phase, 0.0) + time.process_time() - started

        setattr(owner, name, timed)
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", type=Path)
    parser.add_argument("--detector", default="retinaface")
    parser.add_argument("--photos", type=int, default=48)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--timers", action="store_true", help="CPU-time counters around the phases instead of cProfile")
    args = parser.parse_args()
    spent = install_timers() if args.timers else {}
    params = PrepareParams(detector=args.detector)
    try:
        paths = [item.path for item in scan_raw(args.raw) if item.reason is None]
    except FacepipeError as error:
        parser.exit(2, f"prepare_profile.py: {error}\n")
    size = params.chunk_size
    if len(paths) <= size:  # the first chunk is not timed
        parser.exit(2, f"prepare_profile.py: no photo to profile: {args.raw} has {len(paths)} photos, the first {size} are not timed\n")
    started = time.perf_counter()
    warm_up(params, "cpu")
    print(f"warm-up (load the detector): {time.perf_counter() - started:.2f} s; torch imported: {'torch' in sys.modules}")
    process_chunk(paths[:size], str(args.raw), params, "cpu")  # untimed: first-call costs
    chosen = paths[size : size + args.photos]
    if args.timers:
        spent.clear()
        started = time.process_time()
        for start in range(0, len(chosen), size):
            process_chunk(chosen[start : start + size], str(args.raw), params, "cpu")
        total = time.process_time() - started
        print(f"{args.detector}: {len(chosen)} photos, {1000 * total / len(chosen):.1f} ms CPU per photo (no profiler)\n")
        print("| phase | ms CPU per photo | share |\n|---|---:|---:|")
        for phase, seconds in [*sorted(spent.items(), key=lambda kv: -kv[1]), ("the rest", total - sum(spent.values()))]:
            print(f"| {phase} | {1000 * seconds / len(chosen):.2f} | {seconds / total:.0%} |")
        return
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
