"""stages/prepare.py and stages/import_data.py function by function, fast and exact (their mutation
tests, tests/README.md): every refusal and log line matched whole, every report field checked against
what the run wrote. Sets are real prepares of a few 112x112 crops with ``detector: none``, run in this
process (about a second each); where a function only decides where work runs, the runner it builds
is recorded instead of started."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from rawdata import jpeg_bytes
from test_update import PARAMS, face, in_process, write

from facepipe.config import PrepareParams
from facepipe.data.scan import ScanItem
from facepipe.errors import FacepipeError
from facepipe.io import ShardSet
from facepipe.shardset import build
from facepipe.stages import import_data, import_rec, prepare

#: 4 faces of 2 identities, an empty file and a copy of a/0.jpg: two rejects
#: one chunk for these few files: a run without ``submit`` reads it in this process, no cluster
ONE_CHUNK = PARAMS.model_copy(update={"chunk_size": 16})
RAW = {"a/0.jpg": face(1), "a/1.jpg": face(2), "a/dup.jpg": face(1), "b/0.jpg": face(3), "b/1.jpg": face(4), "b/empty.jpg": b""}


def payload_bytes(out: Path) -> int:
    return sum(len(record.payload) for reader in ShardSet(out).readers for record in reader)


def shard_bytes(out: Path) -> int:
    return sum(path.stat().st_size for path in (out / "shards").iterdir())


class Recorder:
    """A stand-in that records its calls and returns ``result`` (or what ``result(*args, **kw)`` gives)."""

    def __init__(self, result=None):
        self.calls: list[tuple[tuple, dict]] = []
        self.result = result

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.result(*args, **kwargs) if callable(self.result) else self.result


# --- process_chunks, task_groups ---


def test_process_chunks_reads_every_chunk_on_auto_by_default_and_names_a_broken_one(tmp_path, monkeypatch):
    seen = Recorder(lambda paths, raw, params, device: [f"{device}:{path}" for path in paths])
    monkeypatch.setattr(prepare, "process_chunk", seen)
    assert prepare.process_chunks([["a/0.jpg"], [], ["b/0.jpg", "b/1.jpg"]], "/raw", PARAMS) == [
        ["auto:a/0.jpg"], [], ["auto:b/0.jpg", "auto:b/1.jpg"]]
    assert seen.calls[0] == ((["a/0.jpg"], "/raw", PARAMS, "auto"), {})
    assert prepare.process_chunks([["x"]], "/raw", PARAMS, "cpu") == [["cpu:x"]]

    def broken(paths, *args):
        if "b/1.jpg" in paths:
            raise OSError("lost")
        return []

    monkeypatch.setattr(prepare, "process_chunk", broken)
    with pytest.raises(prepare.ChunkFailed) as error:
        prepare.process_chunks([["a/0.jpg"], ["b/0.jpg", "b/1.jpg", "b/2.jpg"]], "/raw", PARAMS)
    assert str(error.value) == "chunk b/0.jpg .. b/2.jpg (3 files) failed: OSError: lost"
    assert isinstance(error.value.__cause__, OSError)


def test_task_groups_take_at_most_a_share_of_what_is_left():
    chunks = [[i] for i in range(20)]
    # left // (2 x workers), between 1 and most: 20//2=10 -> 4, 16//2 -> 4, 12//2 -> 4, 8//2=4, 4//2=2, 2//2=1, 1//2=0 -> 1
    assert [len(g) for g in prepare.task_groups(chunks, workers=1, most=4)] == [4, 4, 4, 4, 2, 1, 1]
    assert [len(g) for g in prepare.task_groups(chunks, workers=2, most=4)] == [4, 4, 3, 2, 1, 1, 1, 1, 1, 1, 1]
    assert [c for g in prepare.task_groups(chunks, workers=2, most=4) for c in g] == chunks
    assert prepare.task_groups(chunks, workers=1) == [[c] for c in chunks]  # most: 1 by default


# --- check_paths, check_inputs ---


def test_check_inputs_refuse_a_missing_raw_an_output_inside_it_and_a_raw_without_images(tmp_path):
    raw = tmp_path / "raw"
    with pytest.raises(FacepipeError) as error:
        prepare.check_paths(raw, tmp_path / "out")
    assert str(error.value) == f"raw folder not found: {raw}"
    write(raw, {"a/notes.txt": b"hello"})
    with pytest.raises(FacepipeError) as error:
        prepare.check_paths(raw, raw / "out")
    assert str(error.value) == f"the output {raw / 'out'} lies inside the raw folder {raw}"
    with pytest.raises(FacepipeError) as error:
        prepare.check_inputs(raw, tmp_path / "out")
    assert str(error.value) == f"no images found under {raw}"
    write(raw, {"a/0.jpg": face(1)})
    out = tmp_path / "out"
    prepare.run(ONE_CHUNK, raw, out, progress=False)
    prepare.check_paths(raw, out)  # a shard set may be replaced
    (out / "mine.txt").write_text("x")
    with pytest.raises(FacepipeError, match="^refusing to replace"):
        prepare.check_paths(raw, out)


def test_check_inputs_follow_links_out_of_raw_only_when_asked(tmp_path):
    raw, outside = tmp_path / "raw", tmp_path / "outside.jpg"
    write(raw, {"a/0.jpg": face(1)})
    outside.write_bytes(face(2))
    os.symlink(outside, raw / "a" / "link.jpg")
    by_default = {item.path: item.reason for item in prepare.check_inputs(raw, tmp_path / "out")}
    assert by_default == {"a/0.jpg": None, "a/link.jpg": "outside_raw_root"}
    followed = prepare.check_inputs(raw, tmp_path / "out", follow_symlinks=True)
    assert {item.path: item.reason for item in followed} == {"a/0.jpg": None, "a/link.jpg": None}
    following = ONE_CHUNK.model_copy(update={"follow_symlinks": True})  # prepare follows as its params say
    assert prepare.run(following, raw, tmp_path / "out", progress=False)["counts"] == {"scanned": 2, "accepted": 2, "rejected": 0}
    assert prepare.run(ONE_CHUNK, raw, tmp_path / "out", progress=False)["rejected_by_reason"] == {"outside_raw_root": 1}


# --- run and _Job: a real prepare, timed on a stubbed clock ---


@pytest.fixture()
def clocked(monkeypatch):
    """prepare's and build_set's clocks stubbed: the phases take 1.23456 s (scan), 0.5 s (startup),
    3 s (process), 10.0004 s in all, report.html 0.25 s; the first file is done 0.98765 s after launch."""
    ticks = iter([100.0, 101.23456, 102.0, 102.5, 105.5, 110.0004])
    monkeypatch.setattr(prepare, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    html = iter([50.0, 50.25])
    monkeypatch.setattr(build, "time", SimpleNamespace(perf_counter=lambda: next(html)))
    launch = iter([0.98765, *range(2, 100)])  # one call a file: the first is kept
    monkeypatch.setattr(prepare, "_since_launch", lambda: next(launch))


def test_a_prepare_reports_what_it_wrote_and_how_long_each_phase_took(tmp_path, clocked, caplog):
    raw, out = tmp_path / "raw", tmp_path / "out"
    write(raw, {**RAW, "c/big.jpg": jpeg_bytes(np.full((120, 120, 3), 90, np.uint8), quality=90)})
    with caplog.at_level(logging.INFO, logger="facepipe"):
        report = prepare.run(PARAMS, raw, out, submit=in_process(raw, PARAMS), workers=3, progress=False)
    assert report == {
        "counts": {"scanned": 7, "accepted": 5, "rejected": 2},
        "rejected_by_reason": {"duplicate": 1, "empty_file": 1},
        "num_identities": 3,
        "num_shards": 2,
        "generation": 0,
        "files": {"reused": 0, "processed": 7, "removed": 0},
        "payload_bytes": payload_bytes(out),
        "resized": 1,
        "shard_bytes": shard_bytes(out),
        "workers": 3,
        "scheduler": "custom",
        "timings_s": {"scan": 1.235, "startup": 0.5, "process": 3.0, "first_photo_since_launch": 0.988, "report_html": 0.25, "total": 10.0},
        "images_per_s": 2.33,
    }
    assert json.loads((out / "report.json").read_text()) == report
    assert 'alt="a/dup.jpg"' in (out / "report.html").read_text(encoding="utf-8")  # a duplicate's thumbnail: RAW passed on
    messages = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
    assert ("facepipe.prepare", "INFO", f"prepare: 7 files (7 to process) in 2 chunks from {raw}") in messages
    assert ("facepipe.prepare", "WARNING", "1 aligned face(s) were not 112x112 and were resized (first: c/big.jpg)") in messages
    sources = [json.loads(line) for line in (out / "sources.jsonl").read_text().splitlines()]
    assert {s["path"]: (s["size"], s["mtime_ns"]) for s in sources if s["size"] is not None} == {
        s["path"]: ((raw / s["path"]).stat().st_size, (raw / s["path"]).stat().st_mtime_ns) for s in sources if s["size"] is not None}
    assert len(sources) == 7 and sum(s["size"] is not None for s in sources) == 7  # every file's stat recorded


def test_an_update_reports_the_files_reused_processed_and_removed(tmp_path, monkeypatch):
    raw, out = tmp_path / "raw", tmp_path / "out"
    params = ONE_CHUNK
    write(raw, RAW)
    first = prepare.run(params, raw, out, progress=False)
    assert first["scheduler"] == "in-process" and first["workers"] == 1 and first["generation"] == 0
    assert first["payload_bytes"] == payload_bytes(out)
    (raw / "b" / "1.jpg").unlink()
    write(raw, {"c/0.jpg": face(5), "c/1.jpg": face(6)})
    submitted: list = []
    submit = in_process(raw, params)
    stats = Recorder(prepare.file_stats)
    monkeypatch.setattr(prepare, "file_stats", stats)
    report = prepare.run(params, raw, out, update=True, submit=lambda group: submitted.append(group) or submit(group), workers=1, progress=False)
    assert stats.calls == []  # the plan's stat of every file is the one recorded: no second stat of RAW
    assert submitted == [[["c/0.jpg", "c/1.jpg"]]]  # the new files only, one chunk a submission
    assert report["generation"] == 1 and report["files"] == {"reused": 5, "processed": 2, "removed": 1}
    assert report["counts"] == {"scanned": 7, "accepted": 5, "rejected": 2} and "unchanged" not in report
    new = sum(len(record.payload) for reader in ShardSet(out).readers for record in reader if record.path.startswith("c/"))
    assert report["payload_bytes"] == first["payload_bytes"] + new  # the base's bytes, the removed file's included
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["generations"][1]["counts"] == {"scanned": 2, "accepted": 2, "rejected": 0}
    assert sum(map(len, manifest["generations"][1]["excluded"].values())) == 1  # b/1.jpg's record
    again = prepare.run(params, raw, out, update=True, progress=False)
    assert again["unchanged"] is True and again["generation"] == 1 and again["files"] == {"reused": 7, "processed": 0, "removed": 0}
    assert again["scheduler"] == "in-process" and again["payload_bytes"] == report["payload_bytes"]
    full = prepare.run(params, raw, out, progress=False)  # update is off by default: a full prepare
    assert full["generation"] == 0 and full["files"] == {"reused": 0, "processed": 7, "removed": 0}


def test_a_report_of_detected_faces_counts_no_resized_crops_and_times_to_the_millisecond(monkeypatch):
    """A detector's crops are aligned onto the output size, never resized: no "resized", whatever the
    builder lists; the total keeps its milliseconds; a process phase under a second still gives the rate
    of its own length."""
    counts = {"counts": {"scanned": 3, "accepted": 2, "rejected": 1}, "rejected_by_reason": {"no_face": 1}, "num_identities": 2, "num_shards": 1}
    built = SimpleNamespace(
        manifest={"generations": [{"generation": 0, "reused": 0, "removed": 0}]}, counts=lambda: counts, shard_bytes=5000,
        builder=SimpleNamespace(unchanged=False, payload_bytes=4000, resized=["a/0.jpg"]), report_html_s=0.125,
    )
    items = [ScanItem("a/0.jpg", "a"), ScanItem("a/1.jpg", "a"), ScanItem("b/0.jpg", "b")]
    timings = {"scan": 0.25, "startup": 1.0, "process": 0.5}
    job = prepare._Job(Path("raw"), PrepareParams(detector="retinaface"), items, None, {}, 100.0, timings, workers=2)
    monkeypatch.setattr(prepare, "time", SimpleNamespace(perf_counter=lambda: 112.34567))
    assert job.report(built, scheduler="local") == {
        **counts, "generation": 0, "files": {"reused": 0, "processed": 3, "removed": 0}, "payload_bytes": 4000,
        "shard_bytes": 5000, "workers": 2, "scheduler": "local",
        "timings_s": {"scan": 0.25, "startup": 1.0, "process": 0.5, "report_html": 0.125, "total": 12.346}, "images_per_s": 6.0,
    }


def test_an_update_that_cannot_grow_the_set_is_refused_or_with_auto_prepared_in_full(tmp_path, caplog):
    from facepipe.shardset.update import NotGrowable

    raw, out = tmp_path / "raw", tmp_path / "out"
    write(raw, RAW)
    assert prepare._plan(out, ONE_CHUNK, [], raw=raw, update=True) is None  # nothing to grow
    prepare.run(ONE_CHUNK, raw, out, progress=False)
    items = prepare.check_inputs(raw, out)
    assert prepare._plan(out, ONE_CHUNK, items, raw=raw, update=False) is None
    assert prepare._plan(out, ONE_CHUNK, items, raw=raw, update=True).todo == []
    other = ONE_CHUNK.model_copy(update={"quality": 80})
    with pytest.raises(NotGrowable) as error:
        prepare._plan(out, other, items, raw=raw, update=True)
    assert str(error.value).startswith("--update: ")
    caplog.clear()  # the earlier prepare's INFO lines, kept when another test left the logger at INFO
    with caplog.at_level(logging.WARNING, logger="facepipe.prepare"):
        assert prepare._plan(out, other, items, raw=raw, update="auto") is None
    why = str(error.value).removeprefix("--update: ")
    assert [r.getMessage() for r in caplog.records if r.name == "facepipe.prepare"] == [f"prepare: {out} cannot be grown ({why}): preparing it in full"]


def test_prepare_shows_its_progress_and_keeps_the_workers_window(tmp_path, monkeypatch):
    raw, out = tmp_path / "raw", tmp_path / "out"
    write(raw, {f"a/{i}.jpg": face(i) for i in range(5)})
    os.symlink(tmp_path / "gone.jpg", raw / "a" / "2x.jpg")  # a dangling link: the scan's own reject, never sent
    events: list = []

    class Recording(prepare.Progress):
        def __init__(self, total, **kwargs):
            super().__init__(total, **kwargs)
            events.append(("bar", total, kwargs))

        def update(self, n=1):
            events.append(("done", n))
            super().update(n)

    monkeypatch.setattr(prepare, "Progress", Recording)
    params = PARAMS.model_copy(update={"chunk_size": 1})
    submit = in_process(raw, params)

    def recorded(group):
        events.append(("submit", group))
        return submit(group)

    warmed: list = []
    prepare.run(params, raw, out, submit=recorded, warm=lambda: warmed.append(len(events)), workers=1)
    chunk = [["a/0.jpg"], ["a/1.jpg"], ["a/2.jpg"], [], ["a/3.jpg"], ["a/4.jpg"]]
    # one worker: three submissions in flight (2 x workers + 1), then one more for each file done
    assert events == [
        ("bar", 6, {"desc": "prepare", "enabled": True}),
        ("submit", [chunk[0]]), ("submit", [chunk[1]]), ("submit", [chunk[2]]), ("done", 1),
        ("submit", [chunk[3]]), ("done", 1), ("submit", [chunk[4]]), ("done", 1), ("submit", [chunk[5]]),
        ("done", 1), ("done", 1), ("done", 1),
    ]
    assert warmed == [0]  # before the bar and the first submission
    events.clear()
    prepare.run(params, raw, out, submit=recorded, workers=1, progress=False, chunks_per_task=2)
    assert events[0] == ("bar", 6, {"desc": "prepare", "enabled": False})
    assert [len(event[1]) for event in events if event[0] == "submit"] == [2, 2, 1, 1]  # 6 chunks: left // 2, at most 2
    events.clear()
    prepare.run(params, raw, out, submit=recorded, workers=2, progress=False)
    assert [event[0] for event in events[1:7]] == ["submit"] * 5 + ["done"]  # two workers: 2 x 2 + 1 in flight


def test_prepare_refuses_a_set_of_nothing_only_when_asked(tmp_path):
    raw = tmp_path / "raw"
    write(raw, {"a/empty.jpg": b"", "a/cut.jpg": face(1)[:200], "b/cut.jpg": face(2)[:250]})
    report = prepare.run(ONE_CHUNK, raw, tmp_path / "empty", progress=False)
    assert report["counts"] == {"scanned": 3, "accepted": 0, "rejected": 3}
    with pytest.raises(FacepipeError) as error:
        prepare.run(ONE_CHUNK, raw, tmp_path / "refused", progress=False, refuse_empty=True)
    assert str(error.value) == f"nothing imported from {raw}: all 3 files were rejected (unreadable 2, empty_file 1)"
    assert not (tmp_path / "refused").exists()


def test_a_prepare_on_its_own_reads_on_auto_in_this_process(tmp_path, monkeypatch):
    devices = Recorder(lambda paths, raw, params, device: original(paths, raw, params, "cpu"))
    original = prepare.process_chunk
    monkeypatch.setattr(prepare, "process_chunk", devices)
    warmed = Recorder()
    monkeypatch.setattr(prepare, "warm_up", warmed)
    raw, params = tmp_path / "raw", ONE_CHUNK
    write(raw, RAW)
    report = prepare.run(params, raw, tmp_path / "out")  # one chunk: one worker, in this process
    assert [call[0][3] for call in devices.calls] == ["auto"] and warmed.calls == [((params, "auto"), {})]
    assert (report["scheduler"], report["workers"], report["generation"]) == ("in-process", 1, 0)


def test_a_prepare_on_a_given_cluster_names_it(tmp_path, monkeypatch):
    from contextlib import contextmanager

    calls: list = []
    real = prepare.chunk_runner

    @contextmanager
    def here(*args, **options):  # the cluster's runner, recorded and run in this process
        calls.append(options)
        with real(*args, here=True) as runner:
            yield runner

    monkeypatch.setattr(prepare, "chunk_runner", here)
    raw = tmp_path / "raw"
    write(raw, RAW)
    report = prepare.run(ONE_CHUNK, raw, tmp_path / "out", scheduler_address="tcp://127.0.0.1:8786", device="cpu", progress=False)
    assert report["scheduler"] == "tcp://127.0.0.1:8786" and report["counts"]["accepted"] == 4
    assert [{k: v for k, v in call.items() if k != "warm"} for call in calls] == [{"workers": None, "scheduler_address": "tcp://127.0.0.1:8786", "device": "cpu"}]


# --- _runner: where the chunks run (recorded, nothing started) ---


def test_the_runner_is_the_given_submit_a_cluster_or_this_process(tmp_path, monkeypatch):
    runners = Recorder(lambda *args, **kwargs: ("runner", args, kwargs))
    monkeypatch.setattr(prepare, "chunk_runner", runners)
    wanted = Recorder(lambda workers, *, chunks, device: min(workers or 4, chunks))
    monkeypatch.setattr(prepare, "local_workers", wanted)
    monkeypatch.setattr(prepare, "default_workers", lambda: 6)
    raw, params = tmp_path / "raw", PARAMS

    def runner(todo: int, chunks: int = 1, **options):
        job = SimpleNamespace(todo=[None] * todo, chunks=[[]] * chunks)
        given = {"workers": None, "scheduler_address": None, "device": "cuda:1", "submit": None, "warm": None, **options}
        return prepare._runner(job, params, raw, **given)

    def warm_of(kwargs):
        warm = kwargs.pop("warm")
        assert isinstance(warm, partial) and (warm.func, warm.args, warm.keywords) == (prepare.warm_up, (params, "cuda:1"), {})
        return kwargs

    head = (prepare.process_chunks, str(raw), params, "cuda:1")
    submit = object()
    assert runner(0) == (("runner", head, {"here": True}), "in-process")
    assert runner(0, submit=submit) == (("runner", head, {"here": True}), "custom")
    assert wanted.calls == []
    (kind, args, kwargs), name = runner(3, chunks=1)
    assert (args, warm_of(kwargs), name) == (head, {"here": True}, "in-process")
    assert wanted.calls == [((None,), {"chunks": 1, "device": "cuda:1"})]
    (kind, args, kwargs), name = runner(3, chunks=5, workers=2)
    assert (args, warm_of(kwargs), name) == (head, {"workers": 2, "scheduler_address": None, "device": "cuda:1"}, "local")
    assert wanted.calls[-1] == ((2,), {"chunks": 5, "device": "cuda:1"})
    (kind, args, kwargs), name = runner(3, chunks=5, workers=1, scheduler_address="tcp://host:8786")
    assert (args, warm_of(kwargs), name) == (head, {"workers": 1, "scheduler_address": "tcp://host:8786", "device": "cuda:1"}, "tcp://host:8786")
    assert len(wanted.calls) == 2  # a given cluster: its own workers, none counted here
    assert len(runners.calls) == 5
    warmed: list = []
    given, name = runner(3, submit=submit, warm=lambda: warmed.append(1))
    assert name == "custom" and warmed == []
    with given as (got, n_workers):
        assert (got, n_workers, warmed) == (submit, 6, [1])
    with runner(3, submit=submit, workers=2)[0] as (got, n_workers):
        assert (got, n_workers) == (submit, 2)


# --- _since_launch, _add_all, summary_line ---


def test_since_launch_is_the_processs_age_from_the_kernel_else_psutil(monkeypatch):
    import psutil

    age = time.time() - psutil.Process().create_time()
    monkeypatch.setitem(sys.modules, "psutil", None)  # the /proc path must not need it
    assert abs(prepare._since_launch() - age) < 1.5
    monkeypatch.setitem(sys.modules, "psutil", psutil)
    monkeypatch.delattr(time, "CLOCK_BOOTTIME")  # elsewhere: psutil
    age = time.time() - psutil.Process().create_time()
    assert abs(prepare._since_launch() - age) < 0.5


def test_add_all_feeds_the_builder_and_counts_one_a_file():
    added: list = []
    builder = SimpleNamespace(add=added.append)
    assert list(prepare._add_all(builder, iter(["x", "y"]))) == [1, 1] and added == ["x", "y"]


def test_summary_line_says_counts_reasons_generations_and_rate():
    report = {
        "counts": {"scanned": 12, "accepted": 9, "rejected": 3}, "rejected_by_reason": {"duplicate": 1, "empty_file": 2},
        "num_identities": 3, "num_shards": 4, "generation": 0, "files": {"reused": 0, "processed": 12, "removed": 0},
        "timings_s": {"total": 12.345}, "images_per_s": 7.26, "workers": 2,
    }
    tail = "3 identities in 4 shard(s); 12.3 s, 7.3 images/s on 2 worker(s)"
    assert prepare.summary_line(report) == f"prepare: scanned 12, accepted 9, rejected 3 (empty_file 2, duplicate 1); {tail}"
    clean = {**report, "counts": {"scanned": 9, "accepted": 9, "rejected": 0}, "rejected_by_reason": {}}
    assert prepare.summary_line(clean, stage="import") == f"import: scanned 9, accepted 9, rejected 0; {tail}"
    grown = {**clean, "generation": 2, "files": {"reused": 10, "processed": 5, "removed": 1}}
    assert prepare.summary_line(grown) == (
        "prepare: scanned 9, accepted 9, rejected 0; 3 identities in 4 shard(s); generation 2: reused 10, processed 5,"
        " removed 1 file(s); 12.3 s, 7.3 images/s on 2 worker(s)")
    unchanged = {**grown, "generation": 1, "unchanged": True, "files": {"reused": 9, "processed": 0, "removed": 0}}
    assert prepare.summary_line(unchanged) == (
        "prepare: scanned 9, accepted 9, rejected 0; 3 identities in 4 shard(s); unchanged (generation 1): reused 9 file(s);"
        " 12.3 s, 7.3 images/s on 2 worker(s)")
    imported = {k: v for k, v in clean.items() if k not in ("files", "generation")}
    assert prepare.summary_line({**imported, "generation": 2}) == f"prepare: scanned 9, accepted 9, rejected 0; {tail}"


# --- import_data ---


def test_import_sends_a_pack_to_import_rec_and_a_folder_to_prepare_with_aligned_crops(tmp_path, monkeypatch):
    packs, folders = Recorder("pack report"), Recorder("folder report")
    monkeypatch.setattr(import_rec, "run", packs)
    monkeypatch.setattr(prepare, "run", folders)
    params = PrepareParams(detector="retinaface", detector_weights="w.onnx", quality=80)
    (tmp_path / "pack").mkdir()
    (tmp_path / "pack" / "train.rec").write_bytes(b"")
    assert import_data.run(params, tmp_path / "pack", tmp_path / "out") == "pack report"
    assert packs.calls == [((params, tmp_path / "pack", tmp_path / "out"), {"workers": None, "progress": True})]
    assert import_data.run(params, tmp_path / "pack", "o", workers=2, progress=False, update=True) == "pack report"
    assert packs.calls[-1] == ((params, tmp_path / "pack", "o"), {"workers": 2, "progress": False})
    (tmp_path / "aligned").mkdir()
    assert import_data.run(params, tmp_path / "aligned", "o") == "folder report"
    ((aligned, source, out), options), = folders.calls
    assert (aligned.detector, aligned.detector_weights, aligned.quality) == ("none", None, 80) and params.detector == "retinaface"
    assert (source, out, options) == (tmp_path / "aligned", "o", {"workers": None, "progress": True, "refuse_empty": True})
    import_data.run(params, tmp_path / "aligned", "o", workers=3, progress=False, chunks_per_task=2)
    assert folders.calls[-1][1] == {"workers": 3, "progress": False, "refuse_empty": True, "chunks_per_task": 2}
    for source in (tmp_path / "missing", tmp_path / "pack" / "train.rec.txt"):
        with pytest.raises(FacepipeError) as error:
            import_data.run(params, source, "o")
        assert str(error.value) == f"nothing to import at {source}: expected a .rec file, a folder with train.rec, or a folder of aligned faces"


def test_an_aligned_folder_imports_through_prepare(tmp_path):
    raw = tmp_path / "aligned"
    write(raw, RAW)
    report = import_data.run(PrepareParams(detector="retinaface", samples_per_shard=3), raw, tmp_path / "out", progress=False)
    assert report["counts"] == {"scanned": 6, "accepted": 4, "rejected": 2} and report["resized"] == 0
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["params"]["detector"] == "none"


def test_import_summary_line_adds_the_validation_sets():
    report = {
        "counts": {"scanned": 2, "accepted": 2, "rejected": 0}, "rejected_by_reason": {}, "num_identities": 1, "num_shards": 1,
        "timings_s": {"total": 1.0}, "images_per_s": 2.0, "workers": 1,
    }
    line = "import: scanned 2, accepted 2, rejected 0; 1 identities in 1 shard(s); 1.0 s, 2.0 images/s on 1 worker(s)"
    assert import_data.summary_line(report) == line
    assert import_data.summary_line({**report, "validation_sets": {}}) == line
    sets = {"lfw": 6000, "cfp_fp": 7000}
    assert import_data.summary_line({**report, "validation_sets": sets}) == f"{line}; validation sets: lfw (6000 pairs), cfp_fp (7000 pairs)"


def test_since_launch_reads_the_kernels_start_time_whatever_the_process_is_called(monkeypatch):
    """``/proc/self/stat`` names the process in brackets before the fields, and a name may hold ``)``,
    spaces and any bytes: the fields start after the last ``)``, read as UTF-8 whatever the locale."""
    import locale

    import psutil

    comm = Path("/proc/self/comm")  # this thread's name; the main thread's is the process's
    before = comm.read_bytes().rstrip(b"\n")
    locale_before = locale.setlocale(locale.LC_CTYPE)
    try:
        comm.write_bytes("é) 1 2) 3".encode())
        locale.setlocale(locale.LC_CTYPE, "C")
        age = time.time() - psutil.Process().create_time()
        monkeypatch.setitem(sys.modules, "psutil", None)
        assert abs(prepare._since_launch() - age) < 1.5
    finally:
        comm.write_bytes(before)
        locale.setlocale(locale.LC_CTYPE, locale_before)
