"""What a shard-set sequence writes, as hashes: the guard that a refactor changes no output (issue 20).

``snapshot(work)`` runs prepare -> ``--update`` (files added) -> ``--update`` (files added, removed,
rewritten, touched) -> compact on a raw folder of 112x112 JPEG crops (``detector: none``: no detector,
no resize, so the bytes do not depend on the CPU), then imports the same folder as aligned crops and
the compacted set, exported as a RecordIO pack, back through ``facepipe import``. After every step it
records the sha256 of every file of the output: shards, manifest.json, labels.json, sources.jsonl,
rejects.jsonl, report.html, and report.json less what may differ run to run (timings, throughput,
workers). ``tests/set_snapshot.json`` holds the hashes written by the code before issue 20's move
(commit 092ec68; main at eb5c6a8 after issue 19 added ``validation_sets`` to an import's report.json);
``tests/test_set_snapshot.py`` checks the code against it.

``python tests/set_snapshot.py OUT.json`` writes the hashes of the code on PYTHONPATH;
``--mtcnn`` adds the same sequence on the generated sample set with MTCNN (the default detector before issue 21:
compare two runs on one machine only, its last bits depend on the CPU).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

#: What report.json may hold that differs run to run (or by the machine's cores).
VOLATILE = ("timings_s", "images_per_s", "workers", "scheduler")


def face(seed: int) -> bytes:
    """A 112x112 JPEG crop, distinct per seed (as tests/test_update.py makes them)."""
    import io

    from PIL import Image

    rng = np.random.default_rng(seed)
    base = np.linspace(0, 255, 112 * 112 * 3).reshape(112, 112, 3)
    buffer = io.BytesIO()
    Image.fromarray((base * 0.5 + rng.integers(0, 128, (112, 112, 3))).astype(np.uint8)).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def _write(raw: Path, files: dict[str, bytes]) -> None:
    for path, data in files.items():
        (raw / path).parent.mkdir(parents=True, exist_ok=True)
        (raw / path).write_bytes(data)
        os.utime(raw / path, ns=(10**18, 10**18))  # sources.jsonl records mtimes: the same every run


def hashes(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under ``root``; report.json without :data:`VOLATILE`."""
    out = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if path.name == "report.json":
            report = json.loads(data)
            data = json.dumps({k: v for k, v in report.items() if k not in VOLATILE}, sort_keys=True).encode()
        out[path.relative_to(root).as_posix()] = hashlib.sha256(data).hexdigest()
    return out


def _in_process(raw: Path, params: Any) -> Callable[[list[list[str]]], Future]:
    from facepipe.stages import prepare

    def submit(group: list[list[str]]) -> Future:
        future: Future = Future()
        future.set_result(prepare.process_chunks(group, str(raw), params, "cpu"))
        return future

    return submit


def _sequence(raw: Path, out: Path, params: Any, changes: list[Callable[[], None]]) -> dict[str, dict[str, str]]:
    """prepare, one ``--update`` after each of ``changes``, compact: the hashes after each step."""
    from facepipe.stages import compact, prepare

    steps = {}

    def run(update: bool) -> None:
        prepare.run(params, raw, out, update=update, submit=_in_process(raw, params), workers=1, progress=False)

    run(False)
    steps["prepare"] = hashes(out)
    for number, change in enumerate(changes, 1):
        change()
        run(True)
        steps[f"update{number}"] = hashes(out)
    compact.run(out, progress=False)
    steps["compact"] = hashes(out)
    return steps


def _export(prepared: Path, pack: Path) -> None:
    from facepipe.stages import export_rec

    export_rec.run(prepared, pack, progress=False)


def snapshot(work: Path) -> dict[str, dict[str, str]]:
    """The ``detector: none`` sequence in ``work`` (an empty folder): {step: {file: sha256}}."""
    from facepipe.config import PrepareParams
    from facepipe.stages import import_data

    params = PrepareParams(detector="none", samples_per_shard=3, chunk_size=4, max_pixels=1_000_000)
    raw, out = work / "raw", work / "out"
    _write(raw, {f"id{i}/{j}.jpg": face(10 * i + j) for i in range(3) for j in range(3)})
    _write(raw, {"id0/empty.jpg": b"", "id2/dup.jpg": face(11), "id1/notes.jpg": b"not an image\n"})

    def add() -> None:
        _write(raw, {"id1/7.jpg": face(107), "id9/0.jpg": face(900), "id9/copy.jpg": face(10), "id0/aaa.jpg": face(21)})

    def mixed() -> None:
        (raw / "id0" / "1.jpg").unlink()
        (raw / "id1" / "0.jpg").unlink()
        _write(raw, {"id2/2.jpg": face(222), "id3/0.jpg": face(300)})
        os.utime(raw / "id2" / "0.jpg", ns=(1, 1))  # touched, same bytes: reused, its new time recorded

    steps = _sequence(raw, out, params, [add, mixed])
    aligned = work / "aligned"
    import_data.run(params, raw, aligned, workers=1, progress=False, submit=_in_process(raw, params.model_copy(update={"detector": "none"})))
    steps["import_aligned"] = hashes(aligned)
    _export(out, work / "pack")
    imported = work / "imported"
    import_data.run(params, work / "pack", imported, workers=1, progress=False)
    steps["import_rec"] = hashes(imported)
    return steps


def snapshot_mtcnn(work: Path) -> dict[str, dict[str, str]]:
    """The sample set (6 identities x 4, bad files, seed 0) with MTCNN: prepare, an
    update that adds an identity and removes two photos, compact."""
    from facepipe.config import PrepareParams, SampleDataParams

    try:
        from facepipe.data.sample import make_sample_dataset
    except ImportError:
        from facepipe.synthetic.photos import make_sample_dataset  # type: ignore[no-redef]
    raw, out = work / "raw", work / "out"
    make_sample_dataset(raw, SampleDataParams(identities=7, images_per_identity=4, seed=0, bad_files=True))
    for path in sorted(p for p in raw.rglob("*") if p.is_file()):
        os.utime(path, ns=(10**18, 10**18))  # sources.jsonl records mtimes: the same every run
    held_back = sorted(p for p in raw.iterdir() if p.is_dir())[-1]
    held_back.rename(work / held_back.name)
    params = PrepareParams(detector="mtcnn", chunk_size=4, samples_per_shard=5)  # the default until issue 21

    def grow() -> None:
        (work / held_back.name).rename(held_back)
        firsts = [sorted(d.iterdir())[0] for d in sorted(p for p in raw.iterdir() if p.is_dir())[:2]]
        for path in firsts:
            path.unlink()

    return _sequence(raw, out, params, [grow])


def main(argv: list[str]) -> int:
    import tempfile

    target = Path(argv[0])
    with tempfile.TemporaryDirectory() as tmp:
        result: dict[str, Any] = {"none": snapshot(Path(tmp) / "none")}
        if "--mtcnn" in argv:
            (Path(tmp) / "mtcnn").mkdir()
            result["mtcnn"] = snapshot_mtcnn(Path(tmp) / "mtcnn")
    target.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
