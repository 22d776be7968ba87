"""prepare --update (generations, exclusions, stable labels), compact, and what readers see of a grown set."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest

from facepipe.config import PrepareParams, SplitParams
from facepipe.data.dataset import FaceDataset
from facepipe.errors import FacepipeError
from facepipe.io import ShardSet
from facepipe.stages import compact, export_rec, prepare, split
from facepipe.stages.inspect import summarize, verify
from rawdata import jpeg_bytes

PARAMS = PrepareParams(detector="none", samples_per_shard=3, chunk_size=4, max_pixels=1_000_000)
CANONICAL = ("manifest.json", "labels.json", "rejects.jsonl", "sources.jsonl")


def face(seed: int) -> bytes:
    """A 112x112 JPEG crop (detector none takes it as aligned), distinct per seed."""
    rng = np.random.default_rng(seed)
    base = np.linspace(0, 255, 112 * 112 * 3).reshape(112, 112, 3)
    return jpeg_bytes((base * 0.5 + rng.integers(0, 128, (112, 112, 3))).astype(np.uint8), quality=90)


def write(raw: Path, files: dict[str, bytes]) -> None:
    for path, data in files.items():
        (raw / path).parent.mkdir(parents=True, exist_ok=True)
        (raw / path).write_bytes(data)


def in_process(raw: Path, params: PrepareParams) -> Callable[[list[list[str]]], Future]:
    """A ``submit`` that runs the chunk worker here (no cluster: a fast, real prepare)."""
    def submit(group: list[list[str]]) -> Future:
        future: Future = Future()
        future.set_result(prepare.process_chunks(group, str(raw), params, "cpu"))
        return future

    return submit


def run(raw: Path, out: Path, *, update: bool = False, params: PrepareParams = PARAMS) -> dict:
    return prepare.run(params, raw, out, update=update, submit=in_process(raw, params), workers=1, progress=False)


def files_of(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def check_accounting(out: Path) -> dict:
    """scanned == accepted + rejected, in total and per generation; every reader sees the live samples only."""
    manifest = json.loads((out / "manifest.json").read_text())
    counts = manifest["counts"]
    assert counts["scanned"] == counts["accepted"] + counts["rejected"]
    for generation in manifest["generations"]:
        c = generation["counts"]
        assert c["scanned"] == c["accepted"] + c["rejected"], generation
    sources = [json.loads(line) for line in (out / "sources.jsonl").read_text().splitlines()]
    rejects = (out / "rejects.jsonl").read_text().splitlines()
    assert len(sources) == counts["scanned"] and len(rejects) == counts["rejected"]
    shard_set = ShardSet(out)
    assert len(shard_set) == counts["accepted"] == manifest["num_samples"] == len(shard_set.labels())
    live = sorted(shard_set.record(i).path for i in range(len(shard_set)))
    assert live == sorted(s["path"] for s in sources if s["sample"] is not None)
    dataset = FaceDataset(shard_set, normalize=False)
    assert len(dataset) == len(live) and len(dataset[len(dataset) - 1][0].shape) == 3
    assert verify(out) == []
    return manifest


# 9 faces, an empty file, a copy of id1/1.jpg (a duplicate reject, reused by every update)
V1 = {**{f"id{i}/{j}.jpg": face(10 * i + j) for i in range(3) for j in range(3)}, "id0/empty.jpg": b"", "id2/dup.jpg": face(11)}


@pytest.fixture()
def grown(tmp_path: Path) -> tuple[Path, Path, dict]:
    """v1, then added files, then added + deleted + modified files: RAW, OUT and the reports."""
    raw, out = tmp_path / "raw", tmp_path / "out"
    write(raw, V1)
    reports = {"v1": run(raw, out)}
    check_accounting(out)
    v1_files = files_of(out / "shards")
    v1_labels = json.loads((out / "labels.json").read_text())
    # new files; id9/copy.jpg copies id1/0.jpg (a duplicate); id0/aaa.jpg copies id2/1.jpg and sorts before it,
    # so id2/1.jpg, accepted so far, is now the duplicate (decided without reading it, its record excluded)
    write(raw, {"id1/7.jpg": face(107), "id9/0.jpg": face(900), "id9/1.jpg": face(901), "id9/copy.jpg": face(10),
                "id0/aaa.jpg": face(21)})
    reports["add"] = run(raw, out, update=True)
    manifest = check_accounting(out)
    # existing shards byte-identical; new ones after them; labels stable, new identity appended
    assert {k: v for k, v in files_of(out / "shards").items() if k in v1_files} == v1_files
    assert json.loads((out / "labels.json").read_text()) == [*v1_labels, "id9"]
    assert manifest["generations"][1]["labels"] == [3, 4]
    assert sum(map(len, manifest["generations"][1]["excluded"].values())) == 1  # id2/1.jpg's record
    assert manifest["generations"][1]["counts"] == {"scanned": 6, "accepted": 4, "rejected": 2}
    assert reports["add"]["files"] == {"reused": 10, "processed": 5, "removed": 0}
    assert reports["add"]["counts"] == {"scanned": 16, "accepted": 12, "rejected": 4}  # empty file, 3 duplicates
    # add + delete + modify (+ touch one file without changing it)
    (raw / "id0" / "1.jpg").unlink()
    (raw / "id2" / "2.jpg").write_bytes(face(222))
    os.utime(raw / "id2" / "0.jpg", ns=(1, 1))
    (raw / "id1" / "0.jpg").unlink()  # the first copy of id9/copy.jpg: the copy now counts
    for name in ("0.jpg", "1.jpg", "2.jpg", "aaa.jpg"):
        (raw / "id0" / name).unlink(missing_ok=True)  # every sample of id0 gone: it keeps its label
    # id0/aaa.jpg gone: id2/1.jpg is a first copy again and is read again
    write(raw, {"id3/0.jpg": face(300)})
    reports["mixed"] = run(raw, out, update=True)
    return raw, out, reports


def test_update_generations_stable_labels_and_compact_equals_a_fresh_prepare(grown, tmp_path):
    raw, out, reports = grown
    manifest = check_accounting(out)
    assert len(manifest["generations"]) == 3
    assert json.loads((out / "labels.json").read_text()) == ["id0", "id1", "id2", "id9", "id3"]
    # processed: the changed file, the new one, and the two copies whose first copy went; the touched
    # file and the duplicate of an unchanged file are reused
    assert reports["mixed"]["files"] == {"reused": 8, "processed": 4, "removed": 5}
    excluded = manifest["generations"][2]["excluded"]
    assert sum(len(v) for v in excluded.values()) == 6  # id0/0-2, id0/aaa, id1/0, the old id2/2
    assert np.bincount(ShardSet(out).labels(), minlength=5)[0] == 0  # id0: an empty class, label kept
    # split and export-rec see the live samples only
    summary = split.run(SplitParams(val_identities=2, num_pairs=20, seed=0), out, tmp_path / "split")
    assert summary["prepared"] == {"num_identities": 5, "num_samples": 10}
    assert export_rec.run(out, tmp_path / "rec", progress=False)["num_images"] == 10
    assert {k: summarize(out)[k] for k in ("samples", "generations", "excluded_samples")} == {
        "samples": 10, "generations": 3, "excluded_samples": 7}
    fresh = tmp_path / "fresh"
    run(raw, fresh)
    assert not all((out / n).read_bytes() == (fresh / n).read_bytes() for n in CANONICAL)
    report = compact.run(out, progress=False)
    assert report["dropped_records"] == 7 and report["relabel"]["0"] is None
    for name in CANONICAL:
        assert (out / name).read_bytes() == (fresh / name).read_bytes(), name
    assert files_of(out / "shards") == files_of(fresh / "shards")
    check_accounting(out)


def test_an_unchanged_raw_updates_without_reading_a_file(tmp_path, monkeypatch):
    raw, out = tmp_path / "raw", tmp_path / "out"
    write(raw, V1)
    run(raw, out)
    before = files_of(out)
    def no_warm() -> None:
        raise AssertionError("an update with nothing to read warmed the workers (loaded a detector)")

    # the in-process submit would read; nothing may be submitted, nor any detector loaded
    report = prepare.run(PARAMS, raw, out, update=True, submit=in_process(raw, PARAMS), warm=no_warm, workers=1, progress=False)
    assert report["scheduler"] == "custom"
    # nothing new, changed or removed: no new generation, so the set (and every DVC stage after it) is unchanged
    assert report["files"] == {"reused": 11, "processed": 0, "removed": 0} and report["generation"] == 0
    after = files_of(out)
    assert {n: d for n, d in after.items() if n != "report.json"} == {n: d for n, d in before.items() if n != "report.json"}
    os.utime(raw / "id1/0.jpg", ns=(1, 1))  # touched, same bytes: only sources.jsonl records the new time
    assert run(raw, out, update=True)["generation"] == 0
    touched = files_of(out)
    assert touched["manifest.json"] == before["manifest.json"] and touched["sources.jsonl"] != before["sources.jsonl"]


def test_update_on_a_missing_or_empty_out_is_a_full_prepare(tmp_path):
    raw = tmp_path / "raw"
    write(raw, V1)
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "missing", tmp_path / "empty"):
        assert run(raw, out, update=True)["files"]["processed"] == 11


def test_update_refuses_a_foreign_folder_and_changed_params(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "out"
    write(raw, V1)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(FacepipeError, match="refusing to replace"):
        run(raw, foreign, update=True)
    assert (foreign / "notes.txt").read_text() == "mine"
    run(raw, out)
    before = files_of(out)
    for change in ({"image_size": 96}, {"encoding": "png"}, {"detector": "mtcnn"}):
        with pytest.raises(FacepipeError, match="run a full prepare") as error:
            run(raw, out, update=True, params=PARAMS.model_copy(update=change))
        assert "\n" not in str(error.value) and next(iter(change)) in str(error.value)
    assert files_of(out) == before


def test_a_set_of_the_previous_version_is_read_but_not_updated(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "out"
    write(raw, V1)
    run(raw, out)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["version"] = 2
    del manifest["generations"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    (out / "sources.jsonl").unlink()
    assert len(ShardSet(out)) == 9
    with pytest.raises(FacepipeError, match="older facepipe.*full prepare"):
        run(raw, out, update=True)


def test_a_damaged_sources_file_is_refused_in_one_line_and_auto_prepares_in_full(tmp_path):
    """sources.jsonl is read line by line into compact entries: a line that is not JSON or lacks a field
    is a one-line refusal that changes nothing (no traceback), and ``--update auto`` prepares in full."""
    raw, out = tmp_path / "raw", tmp_path / "out"
    write(raw, V1)
    run(raw, out)
    intact = (out / "sources.jsonl").read_text()
    lines = intact.splitlines()
    lacking = json.loads(lines[1])
    del lacking["sha256"]
    for damaged, expected in (([lines[0], json.dumps(lacking), *lines[2:]], "lacks 'sha256'"), ([lines[0], "{not json", *lines[2:]], "not JSON")):
        (out / "sources.jsonl").write_text("\n".join(damaged) + "\n")
        before = files_of(out)
        with pytest.raises(FacepipeError, match=f"sources.jsonl is inconsistent.*{expected}.*full prepare") as error:
            run(raw, out, update=True)
        assert "\n" not in str(error.value)
        assert files_of(out) == before
    report = run(raw, out, update="auto")
    assert report["files"]["processed"] == len(V1)
    rebuilt = [json.loads(line) for line in (out / "sources.jsonl").read_text().splitlines()]
    assert [entry["path"] for entry in rebuilt] == [json.loads(line)["path"] for line in lines]
    assert all(entry["sha256"] for entry in rebuilt)


KILLED_UPDATE = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from facepipe.stages import prepare
from test_update import PARAMS, in_process
raw, out = Path({raw!r}), Path({out!r})
inner = in_process(raw, PARAMS)
def submit(paths):
    future = inner(paths)
    os.kill(os.getpid(), signal.SIGKILL)  # after the first chunk of the new generation was processed
    return future
prepare.run(PARAMS, raw, out, update=True, submit=submit, workers=1, progress=False)
"""


@pytest.mark.multiprocess
def test_an_update_killed_leaves_the_previous_generation_and_a_rerun_completes_it(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "out"
    write(raw, V1)
    run(raw, out)
    write(raw, {f"id{i}/new{j}.jpg": face(500 + 10 * i + j) for i in range(4) for j in range(3)})
    before = files_of(out)
    script = KILLED_UPDATE.format(tests=str(Path(__file__).parent), raw=str(raw), out=str(out))
    result = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parent, capture_output=True, text=True)
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert files_of(out) == before  # the previous generation, intact
    assert any(p.name.startswith(".out.partial-") for p in tmp_path.iterdir())  # the killed run's leftover
    report = run(raw, out, update=True)
    assert report["files"] == {"reused": 11, "processed": 12, "removed": 0}
    check_accounting(out)
    assert not any(p.name.startswith(".out.") for p in tmp_path.iterdir())


def _dvc(repo: Path, *args: str) -> None:
    subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, check=True, capture_output=True)


def _cache_bytes(repo: Path) -> int:
    return sum(p.stat().st_size for p in (repo / ".dvc" / "cache").rglob("*") if p.is_file())


@pytest.mark.multiprocess
@pytest.mark.slow
def test_dvc_cache_grows_by_the_new_shards_only(tmp_path):
    repo = tmp_path / "repo"
    raw, out = tmp_path / "raw", repo / "prepared"
    repo.mkdir()
    _dvc(repo, "init", "--no-scm", "-q")
    write(raw, {f"id{i}/{j}.jpg": face(10 * i + j) for i in range(6) for j in range(5)})  # 10 shards of 3
    run(raw, out)
    _dvc(repo, "add", "-q", "prepared")
    before = _cache_bytes(repo)
    shards_before = files_of(out / "shards")
    write(raw, {"id0/new.jpg": face(1000), "id7/0.jpg": face(1001)})
    run(raw, out, update=True)
    new_shards = {k: v for k, v in files_of(out / "shards").items() if k not in shards_before}
    small = sum((out / n).stat().st_size for n in (*CANONICAL, "report.json", "report.html"))
    _dvc(repo, "add", "-q", "prepared")
    grown = _cache_bytes(repo) - before
    new_bytes = sum(map(len, new_shards.values()))
    assert len(new_shards) == 1 and sum(map(len, shards_before.values())) > 5 * new_bytes
    # the cache grew by the new shard, the small files and DVC's directory listing (.dir), nothing more
    assert new_bytes <= grown <= new_bytes + small + 8192, (grown, new_bytes, small)


def test_cli_update_summary_refusal_and_compact(tmp_path, capsys):
    from facepipe.cli import main

    raw, out = tmp_path / "raw", tmp_path / "out"
    write(raw, V1)
    params = tmp_path / "params.yaml"
    params.write_text("prepare:\n" + "".join(f"  {k}: {v}\n" for k, v in PARAMS.model_dump().items() if v is not None))
    run(raw, out)
    assert main(["prepare", str(raw), str(out), "--update", "--params", str(params)]) == 0  # nothing to read: no cluster
    assert "unchanged (generation 0): reused 11 file(s)" in capsys.readouterr().out
    (raw / "id1" / "new.jpg").write_bytes(face(99))
    assert main(["prepare", str(raw), str(out), "--update", "auto", "--params", str(params)]) == 0  # grows it too
    assert "generation 1: reused 11, processed 1, removed 0 file(s)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:  # argparse's own exit
        main(["prepare", str(raw), str(out), "--update", "always", "--params", str(params)])
    assert exited.value.code == 2
    assert "invalid choice: 'always'" in capsys.readouterr().err
    params.write_text(params.read_text().replace("image_size: 112", "image_size: 96"))
    assert main(["prepare", str(raw), str(out), "--update", "--params", str(params)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "image_size: 112 -> 96" in err and "run a full prepare" in err
    assert main(["compact", str(out)]) == 0
    assert "compact: 2 generation(s) -> 1; 10 samples" in capsys.readouterr().out
    assert json.loads((out / "manifest.json").read_text())["generations"][0]["generation"] == 0


def test_the_pipeline_flow_metrics_show_the_files_reused_processed_removed(tmp_path):
    from flows.pipeline import prepare_file_counts

    (tmp_path / "dvc.yaml").write_text("stages:\n  prepare:\n    outs:\n      - data/prepared:\n          persist: true\n")
    (tmp_path / "data" / "prepared").mkdir(parents=True)
    (tmp_path / "data" / "prepared" / "report.json").write_text(json.dumps({"files": {"reused": 9, "processed": 1, "removed": 2}}))
    assert prepare_file_counts(tmp_path) == [
        {"file": "data/prepared/report.json", "metric": f"files.{k}", "value": v}
        for k, v in (("processed", 1), ("removed", 2), ("reused", 9))
    ]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_prefect_prepare_flow_updates_and_its_artifact_counts_the_files(tmp_path):
    """The flow's in-process task runner on a temporary Prefect server: --update as the DVC stage runs it."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.testing.utilities import prefect_test_harness

    import flows.prepare as flow_module

    raw, out = tmp_path / "raw", tmp_path / "out"
    write(raw, V1)
    params = tmp_path / "params.yaml"
    params.write_text("prepare:\n" + "".join(f"  {k}: {v}\n" for k, v in PARAMS.model_dump().items() if v is not None))
    run(raw, out)
    write(raw, {"id5/0.jpg": face(5000)})
    with prefect_test_harness(server_startup_timeout=180):
        report = flow_module.prepare_flow(str(raw), str(out), params_file=str(params), workers=1, device="cpu", update=True)
        with get_client(sync_client=True) as client:
            artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["prepare-report"])))
    assert report["files"] == {"reused": 11, "processed": 1, "removed": 0}
    rows = json.loads(artifacts[0].data) if isinstance(artifacts[0].data, str) else artifacts[0].data
    assert {r["measure"]: r["value"] for r in rows if r["measure"].startswith("files")} == {
        "files reused": 11, "files processed": 1, "files removed": 0}
    check_accounting(out)


def test_update_auto_prepares_in_full_where_a_set_cannot_be_grown(tmp_path):
    """What dvc repro runs (--update auto): changed params or an older set give a full prepare, the same
    bytes as one from scratch, instead of the refusal; a foreign folder is still refused and untouched."""
    raw, out, fresh = tmp_path / "raw", tmp_path / "out", tmp_path / "fresh"
    write(raw, V1)
    run(raw, out)
    changed = PARAMS.model_copy(update={"image_size": 96})
    report = run(raw, out, update="auto", params=changed)
    assert report["files"] == {"reused": 0, "processed": len(V1), "removed": 0}
    run(raw, fresh, params=changed)
    assert files_of(out).keys() == files_of(fresh).keys()
    for name, data in files_of(fresh).items():
        if name != "report.json":  # timings
            assert files_of(out)[name] == data, name
    manifest = json.loads((out / "manifest.json").read_text())  # an older set: no generations, no sources
    manifest["version"] = 2
    del manifest["generations"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    (out / "sources.jsonl").unlink()
    assert run(raw, out, update="auto", params=changed)["files"]["processed"] == len(V1)
    assert json.loads((out / "manifest.json").read_text())["version"] == json.loads((fresh / "manifest.json").read_text())["version"]
    grown = run(raw, out, update="auto", params=changed)  # a growable set is grown, not rebuilt
    assert grown["files"] == {"reused": len(V1), "processed": 0, "removed": 0}
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(FacepipeError, match="refusing to replace"):
        run(raw, foreign, update="auto")
    assert (foreign / "notes.txt").read_text() == "mine"


def test_new_shards_never_replace_a_base_shard(tmp_path):
    """place_new_shards refuses a name the base already uses (a hard link of the published set) and moves nothing."""
    from facepipe.io.shards import ShardInfo
    from facepipe.shardset.builder import NEW_SHARDS, place_new_shards

    (tmp_path / "shards").mkdir()
    (tmp_path / NEW_SHARDS).mkdir()
    (tmp_path / "shards" / "shard-00001.lmdb").write_bytes(b"base")
    (tmp_path / NEW_SHARDS / "shard-00000.lmdb").write_bytes(b"new")
    with pytest.raises(RuntimeError, match="shard-00001.lmdb already exists"):
        place_new_shards([ShardInfo("shard-00000.lmdb", 1, "0" * 64, 0, 3)], root=tmp_path, first=1)
    assert (tmp_path / "shards" / "shard-00001.lmdb").read_bytes() == b"base"
    assert (tmp_path / NEW_SHARDS / "shard-00000.lmdb").read_bytes() == b"new"


def _tampered(lines: list[str]) -> dict[str, list[str]]:
    """sources.jsonl as a hostile or unlucky user leaves it: each a file prepare never writes."""
    entries = [json.loads(line) for line in lines]
    a, b = [i for i, e in enumerate(entries) if e["sample"] is not None][:2]

    def edited(changes: dict[int, dict]) -> list[str]:
        return [json.dumps({**e, **changes.get(i, {})}, sort_keys=True) for i, e in enumerate(entries)]

    return {
        "a line removed": [line for i, line in enumerate(lines) if i != b],
        "two samples swapped": edited({a: {"sample": entries[b]["sample"]}, b: {"sample": entries[a]["sample"]}}),
        "a sha256 copied": edited({b: {"sha256": entries[a]["sha256"]}}),
        "sample null": edited({a: {"sample": None}}),
        "sample 'x'": edited({a: {"sample": "x"}}),
    }


def test_a_sources_file_that_prepare_did_not_write_is_refused_and_auto_prepares_in_full(tmp_path):
    """The manifest holds the hash of sources.jsonl's lines (without sizes and times): a removed line,
    swapped samples, a copied sha256, a sample of null or "x" are each refused by the update in one line
    (nothing changed), found by verify, refused by compact; ``--update auto`` prepares in full."""
    raw, out, fresh = tmp_path / "raw", tmp_path / "out", tmp_path / "fresh"
    write(raw, V1)
    run(raw, out)
    run(raw, fresh)
    intact = (out / "sources.jsonl").read_text().splitlines()
    for what, lines in _tampered(intact).items():
        (out / "sources.jsonl").write_text("\n".join(lines) + "\n")
        before = files_of(out)
        with pytest.raises(FacepipeError, match=r"^--update: .*sources.jsonl is inconsistent \(.*\): run a full prepare") as error:
            run(raw, out, update=True)
        assert "\n" not in str(error.value), what
        assert files_of(out) == before, what
        problems = verify(out)
        assert problems and all("\n" not in p for p in problems) and any("sources.jsonl" in p for p in problems), what
        with pytest.raises(FacepipeError, match=r"^compact: .*sources.jsonl") as error:
            compact.run(out, progress=False)
        assert files_of(out) == before, what
        report = run(raw, out, update="auto")
        assert report["files"]["processed"] == len(V1), what
        for name in CANONICAL:
            assert (out / name).read_bytes() == (fresh / name).read_bytes(), (what, name)
        assert verify(out) == []


def test_verify_finds_sources_lines_that_disagree_with_the_shards(tmp_path):
    """A sources.jsonl consistent with its hash but not with the records (the hash recomputed by hand)."""
    from facepipe.io.manifest import SOURCES_KEY, SourcesDigest

    raw, out = tmp_path / "raw", tmp_path / "out"
    write(raw, V1)
    run(raw, out)
    lines = (out / "sources.jsonl").read_text().splitlines()
    swapped = _tampered(lines)["two samples swapped"]
    digest = SourcesDigest()
    for line in swapped:
        e = json.loads(line)
        digest.add(e["path"], e["sha256"], e["reason"], e["sample"], e["generation"])
    (out / "sources.jsonl").write_text("\n".join(swapped) + "\n")
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, SOURCES_KEY: digest.hexdigest()}))
    first, second = (json.loads(line) for line in swapped if json.loads(line)["sample"] in (0, 1))
    assert verify(out) == [
        f"sources.jsonl: {first['path']!r} at sample {first['sample']}, sha256 {first['sha256'][:12]}; the shards:"
        f" sample {second['sample']}, sha256 {first['sha256'][:12]}",
        f"sources.jsonl: {second['path']!r} at sample {second['sample']}, sha256 {second['sha256'][:12]}; the shards:"
        f" sample {first['sample']}, sha256 {second['sha256'][:12]}",
    ]


def test_compact_of_a_set_grown_with_mtcnn_gives_what_the_readme_states(tmp_path):
    """With a real detector a grown set's compact is not byte-identical to a from-scratch prepare: a
    face detected in another batch gets landmarks that differ in the last bits (MTCNN's batched
    arithmetic), and its aligned JPEG differs slightly. What compact does guarantee (README, Growing a
    dataset), checked exactly: labels.json, rejects.jsonl and sources.jsonl byte-identical; the manifest
    identical but for the shards' sha256 and sizes; the same records in the same order with the same
    header (landmarks within 0.01 px, score within 1e-4); decoded pixels within 8 levels, in at most 5 %
    of the pixels."""
    from facepipe.io.records import decode_image
    from rawdata import TEST_PARAMS, astronaut, hopper, make_faces_raw, save, variant

    raw, out, fresh = tmp_path / "raw", tmp_path / "out", tmp_path / "fresh"
    params = PrepareParams(**TEST_PARAMS)
    make_faces_raw(raw)
    run(raw, out, params=params)
    save(variant(astronaut(), angle=4), raw / "astro" / "0004.jpg", quality=91)
    save(variant(hopper(), angle=-4), raw / "hopper" / "0004.jpg", quality=91)
    run(raw, out, update=True, params=params)
    compact.run(out, progress=False)
    run(raw, fresh, params=params)
    for name in ("labels.json", "rejects.jsonl", "sources.jsonl"):
        assert (out / name).read_bytes() == (fresh / name).read_bytes(), name

    def without_shard_bytes(root: Path) -> dict:
        manifest = json.loads((root / "manifest.json").read_text())
        return {**manifest, "shards": [{**s, "sha256": None, "bytes": None} for s in manifest["shards"]]}

    assert without_shard_bytes(out) == without_shard_bytes(fresh)
    compacted, scratch = ShardSet(out), ShardSet(fresh)
    assert len(compacted) == len(scratch) == 9
    differing = 0
    for i in range(len(scratch)):
        ours, theirs = compacted.record(i), scratch.record(i)
        near = {"landmarks": 0.01, "score": 1e-4}
        assert {k: v for k, v in ours.header.items() if k not in near} == {k: v for k, v in theirs.header.items() if k not in near}
        assert np.abs(np.subtract(ours.header["landmarks"], theirs.header["landmarks"])).max() <= near["landmarks"]
        assert abs(ours.header["score"] - theirs.header["score"]) <= near["score"]
        pixels = np.abs(decode_image(ours.payload).astype(int) - decode_image(theirs.payload).astype(int))
        assert pixels.max() <= 8 and (pixels > 0).mean() <= 0.05, (ours.header["path"], pixels.max(), (pixels > 0).mean())
        differing += ours.payload != theirs.payload
    assert differing <= 2  # the two faces the update detected; every other record is copied as it was
    assert verify(out) == []
