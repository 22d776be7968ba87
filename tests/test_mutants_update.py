"""shardset/update.py and stages/compact.py function by function, fast and exact (their mutation tests:
every refusal matched whole, every field check at its boundary). Sets are real prepares of a few
112x112 crops with ``detector: none`` (about a second each)."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import pytest
from test_update import PARAMS, V1, face, files_of, run, write

from facepipe.data.scan import ScanItem
from facepipe.config import PrepareParams
from facepipe.errors import FacepipeError
from facepipe.io import ShardSet
from facepipe.io.manifest import SOURCES_KEY, SourcesDigest
from facepipe.io.shards import ShardInfo
from facepipe.shardset import update
from facepipe.shardset.builder import NEW_SHARDS, link_shards, place_new_shards
from facepipe.shardset.update import (
    NotGrowable,
    SourceEntry,
    SourcesError,
    file_stats,
    has_set,
    read_sources,
    source_entries,
)
from facepipe.stages import compact

SHA = "ab" * 32
LINE = {"path": "id0/a.jpg", "sha256": SHA, "reason": None, "sample": 0, "generation": 0, "size": 10, "mtime_ns": 5}


def problem(**changes: object) -> str:
    with pytest.raises(ValueError) as error:
        SourceEntry({**LINE, **changes})
    return str(error.value)


def test_a_source_entry_reads_a_line_as_prepare_writes_it():
    entry = SourceEntry(LINE)
    assert [entry[k] for k in ("path", "sha256", "reason", "sample", "generation", "size", "mtime_ns")] == list(LINE.values())
    reject = SourceEntry({**LINE, "reason": "".join(["low", "_score"]), "sample": None, "sha256": None, "size": None, "mtime_ns": None})
    assert reject.reason is sys.intern("low_score") and reject.sample is None
    assert SourceEntry({**LINE, "sample": 7, "generation": 3}).generation == 3
    with pytest.raises(KeyError):
        SourceEntry({k: v for k, v in LINE.items() if k != "mtime_ns"})


def test_each_field_of_the_wrong_type_is_named():
    assert problem(path=5) == "path is not a file path"
    assert problem(path="") == "'': path is not a file path"
    assert problem(path="a\0b") == "'a\\x00b': path is not a file path"
    assert problem(sha256="ab") == "'id0/a.jpg': sha256 'ab' is not a hex digest"
    assert problem(sha256=5) == "'id0/a.jpg': sha256 5 is not a hex digest"
    assert problem(sha256="a" * 65) == f"'id0/a.jpg': sha256 '{'a' * 65}' is not a hex digest"
    assert problem(reason=5, sample=None) == "'id0/a.jpg': reason 5 is not a reason code"
    accepted_or_reject = "(an accepted file has a sample number, a reject none)"
    assert problem(sample=None) == f"'id0/a.jpg': sample None with reason None {accepted_or_reject}"
    assert problem(reason="duplicate") == f"'id0/a.jpg': sample 0 with reason 'duplicate' {accepted_or_reject}"
    for sample in (-1, True, "x", 1.0):
        assert problem(sample=sample) == f"'id0/a.jpg': sample {sample!r} with reason None {accepted_or_reject}"
    for generation in (-1, True, "0", None):
        assert problem(generation=generation) == f"'id0/a.jpg': generation {generation!r} is not a generation number"
    for field in ("size", "mtime_ns"):
        for value in (-1, "1", False):
            assert problem(**{field: value}) == "'id0/a.jpg': size and mtime_ns must be numbers"
    with pytest.raises(ValueError) as error:
        SourceEntry([LINE])  # type: ignore[arg-type]
    assert str(error.value) == "a line is not a JSON object"
    assert SourceEntry({**LINE, "size": 0, "mtime_ns": 0}).size == 0


def lines_file(path: Path, lines: list[dict], *, blank: bool = False) -> str:
    digest = SourcesDigest()
    texts = []
    for line in lines:
        texts.append(json.dumps(line))
        digest.add(line["path"], line["sha256"], line["reason"], line["sample"], line["generation"])
    path.write_text("\n".join(texts) + ("\n\n" if blank else "\n"))
    return digest.hexdigest()


def test_source_entries_check_the_hash_and_say_what_is_wrong(tmp_path):
    path = tmp_path / "sources.jsonl"
    lines = [LINE, {**LINE, "path": "id0/b.jpg", "sample": 1}, {**LINE, "path": "id1/c.jpg", "sample": None, "reason": "no_face"}]
    expected = lines_file(path, lines, blank=True)
    assert [e.path for e in source_entries(path, expected=expected)] == ["id0/a.jpg", "id0/b.jpg", "id1/c.jpg"]

    def refusal(expected: str | None) -> str:
        with pytest.raises(SourcesError) as error:
            list(source_entries(path, expected=expected))
        return str(error.value)

    assert refusal(None) == f"{path} is inconsistent (the manifest records no {SOURCES_KEY}: written by an earlier facepipe)"
    assert refusal("0" * 64) == f"{path} is inconsistent (its lines do not match the manifest's {SOURCES_KEY})"
    path.write_text(json.dumps({k: v for k, v in LINE.items() if k != "sample"}) + "\n")
    assert refusal(expected) == f"{path} is inconsistent (a line lacks 'sample')"
    path.write_text("{nope\n")
    assert refusal(expected).startswith(f"{path} is inconsistent (not JSON lines: Expecting property name")
    path.write_text(json.dumps({**LINE, "sample": "x"}) + "\n")
    assert refusal(expected) == (
        f"{path} is inconsistent (not lines prepare writes: 'id0/a.jpg': sample 'x' with reason None"
        " (an accepted file has a sample number, a reject none))"
    )
    with pytest.raises(FacepipeError) as error:
        list(source_entries(tmp_path / "missing.jsonl", expected=expected))
    assert str(error.value) == f"cannot read {tmp_path / 'missing.jsonl'}: [Errno 2] No such file or directory: '{tmp_path / 'missing.jsonl'}'"
    assert not isinstance(error.value, SourcesError)


def test_read_sources_refuses_in_one_line_and_leaves_the_collector_as_it_found_it(tmp_path):
    path = tmp_path / "sources.jsonl"
    expected = lines_file(path, [LINE, {**LINE, "sample": 1}])
    with pytest.raises(NotGrowable) as error:
        read_sources(path, expected=expected)
    assert str(error.value) == f"--update: {path} is inconsistent ('id0/a.jpg' appears twice): run a full prepare (without --update)"
    assert gc.isenabled()
    with pytest.raises(NotGrowable) as error:
        read_sources(path, expected=None)
    assert str(error.value) == (
        f"--update: {path} is inconsistent (the manifest records no {SOURCES_KEY}: written by an earlier facepipe):"
        " run a full prepare (without --update)"
    )
    expected = lines_file(path, [LINE, {**LINE, "path": "id0/b.jpg", "sample": 1}])
    gc.disable()
    try:
        sources = read_sources(path, expected=expected)
        assert not gc.isenabled()  # disabled by the caller: left so
    finally:
        gc.enable()
    assert list(sources) == ["id0/a.jpg", "id0/b.jpg"] and sources["id0/b.jpg"].sample == 1
    read_sources(path, expected=expected)
    assert gc.isenabled()


def test_has_set_and_file_stats(tmp_path):
    assert not has_set(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    assert not has_set(tmp_path / "empty")
    (tmp_path / "file").write_text("x")
    assert not has_set(tmp_path / "file")
    (tmp_path / "empty" / "x").write_text("")
    assert has_set(tmp_path / "empty")
    (tmp_path / "set").mkdir()
    (tmp_path / "set" / "manifest.json").write_text("{}")
    assert has_set(tmp_path / "set")
    raw = tmp_path / "raw"
    write(raw, {"a/1.jpg": b"12345", "a/caf\xe9.jpg".encode("latin-1").decode("latin-1"): b"xy"})
    os.utime(raw / "a" / "1.jpg", ns=(7, 9))
    items = [ScanItem("a/gone.jpg", "a"), ScanItem("a/1.jpg", "a"), ScanItem("a/link.jpg", "a", reason="outside_raw_root")]
    assert file_stats(raw, items) == {"a/1.jpg": (5, 9)}


def test_place_and_link_shards(tmp_path):
    (tmp_path / NEW_SHARDS).mkdir()
    for name in ("shard-00000.lmdb", "shard-00001.lmdb"):
        (tmp_path / NEW_SHARDS / name).write_bytes(name.encode())
    (tmp_path / "shards").mkdir()
    infos = [ShardInfo("shard-00000.lmdb", 3, "a" * 64, 10, 16), ShardInfo("shard-00001.lmdb", 1, "b" * 64, 4, 16)]
    placed = place_new_shards(infos, root=tmp_path, first=2)
    assert placed == [ShardInfo("shard-00002.lmdb", 3, "a" * 64, 10, 16), ShardInfo("shard-00003.lmdb", 1, "b" * 64, 4, 16)]
    assert (tmp_path / "shards" / "shard-00002.lmdb").read_bytes() == b"shard-00000.lmdb"
    assert not (tmp_path / NEW_SHARDS).exists()
    (tmp_path / NEW_SHARDS).mkdir()
    (tmp_path / NEW_SHARDS / "shard-00000.lmdb").write_bytes(b"new")
    with pytest.raises(RuntimeError) as error:
        place_new_shards(infos[:1], root=tmp_path, first=3)
    assert str(error.value) == (
        f"shard shard-00003.lmdb already exists in {tmp_path / 'shards'}: the base set's shards are not numbered 0..2"
    )
    assert (tmp_path / NEW_SHARDS / "shard-00000.lmdb").read_bytes() == b"new"
    raw, out = tmp_path / "raw", tmp_path / "out"
    write(raw, V1)
    run(raw, out)
    base = ShardSet(out)
    link_shards(base, tmp_path / "tmp")
    for entry in base.manifest["shards"]:
        linked, source = tmp_path / "tmp" / "shards" / entry["file"], out / "shards" / entry["file"]
        assert os.path.samefile(linked, source)
    assert sorted(p.name for p in (tmp_path / "tmp" / "shards").iterdir()) == sorted(e["file"] for e in base.manifest["shards"])


def test_update_refusals_are_whole_one_line_messages(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "out"
    write(raw, V1)
    run(raw, out)
    manifest = json.loads((out / "manifest.json").read_text())

    def refusal(kind: type = FacepipeError, params=PARAMS) -> str:
        with pytest.raises(kind) as error:
            run(raw, out, update=True, params=params)
        return str(error.value)

    changed = PARAMS.model_copy(update={"image_size": 96})
    assert refusal(NotGrowable, changed) == (
        f"--update: the prepare params differ from those {out} was prepared with (image_size: 112 -> 96); a set must"
        " not mix two alignments or encodings: run a full prepare (without --update)"
    )
    with pytest.raises(NotGrowable) as error:
        update.plan_update(out, [], raw=raw, manifest_params={**manifest["params"], "image_size": 96, "encoding": "png"})
    assert str(error.value).startswith(f"--update: the prepare params differ from those {out} was prepared with (encoding: 'jpeg' -> 'png', image_size: 112 -> 96);")
    (out / "labels.json").write_text(json.dumps(json.loads((out / "labels.json").read_text()) + ["extra"]))
    message = refusal(NotGrowable)
    assert message.startswith(f"--update: {out} is inconsistent (labels.json: sha256 differs from the manifest): see facepipe verify {out}")
    run(raw, out)
    (out / "manifest.json").write_text(json.dumps({**manifest, "source": {"format": "rec"}}))
    assert refusal() == f"--update: {out} was imported from a pack, not prepared from a raw folder"
    (out / "manifest.json").write_text(json.dumps({**manifest, "version": 2}))
    assert refusal(NotGrowable) == f"--update: {out} was written by an older facepipe (set v2, no sources.jsonl): run a full prepare (without --update) once"
    (out / "manifest.json").write_text(json.dumps(manifest))
    (out / "sources.jsonl").unlink()
    assert refusal(NotGrowable) == f"--update: {out} was written by an older facepipe (set v3, no sources.jsonl): run a full prepare (without --update) once"
    (out / "manifest.json").write_text("[]")  # the CLI's output check refuses it first; the plan itself too:
    with pytest.raises(FacepipeError) as error:
        update.plan_update(out, [], raw=raw, manifest_params=manifest["params"])
    assert str(error.value) == f"--update: {out} is not a facepipe shard set to grow (manifest.json of {out} is not a JSON object)"


def test_an_imported_set_is_not_growable_in_auto_mode_either(tmp_path):
    """Imported: a plain FacepipeError (not NotGrowable), so --update auto refuses too instead of re-preparing."""
    raw, out = tmp_path / "raw", tmp_path / "out"
    write(raw, V1)
    run(raw, out)
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "source": {"format": "rec"}}))
    with pytest.raises(FacepipeError) as error:
        run(raw, out, update="auto")
    assert not isinstance(error.value, NotGrowable)


def test_the_plan_reuses_unchanged_files_and_reads_the_rest(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "out"
    write(raw, V1)
    run(raw, out)
    (raw / "id0" / "1.jpg").write_bytes(face(901))  # changed
    os.utime(raw / "id1" / "2.jpg", ns=(1, 1))  # touched, same bytes
    (raw / "id2" / "0.jpg").unlink()  # removed
    write(raw, {"id3/0.jpg": face(300)})  # new
    from facepipe.data.scan import scan_raw

    items = scan_raw(raw)
    manifest = json.loads((out / "manifest.json").read_text())
    plan = update.plan_update(out, items, raw=raw, manifest_params=manifest["params"])
    assert [item.path for item in plan.todo] == ["id0/1.jpg", "id3/0.jpg"]
    assert plan.removed == 1 and plan.base.root == out
    assert plan.stats["id1/2.jpg"] == ((raw / "id1" / "2.jpg").stat().st_size, 1)
    assert set(plan.rejects) == {"id0/empty.jpg", "id2/dup.jpg"}
    stored = {path: entry.sample for path, entry in plan.sources.items() if entry.sample is not None}
    assert [stored[p] for p in ("id0/1.jpg", "id2/0.jpg")] == [1, 6]  # 3 samples a shard: shard 0 key 1, shard 2 key 0
    assert plan.excluded([s for p, s in stored.items() if p not in ("id0/1.jpg", "id2/0.jpg")]) == {
        "shard-00000.lmdb": [1], "shard-00002.lmdb": [0]}
    assert plan.excluded(list(stored.values())) == {}


def test_compact_refusals_and_summary(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "out"
    write(raw, V1)
    run(raw, out)
    write(raw, {"id3/0.jpg": face(300)})
    (raw / "id0" / "0.jpg").unlink()
    run(raw, out, update=True)
    manifest = json.loads((out / "manifest.json").read_text())

    def refusal() -> str:
        before = files_of(out)
        with pytest.raises(FacepipeError) as error:
            compact.run(out, progress=False)
        assert files_of(out) == before
        return str(error.value)

    (out / "manifest.json").write_text(json.dumps({**manifest, "source": {"format": "rec"}}))
    assert refusal() == f"compact: {out} was imported from a pack: it has one generation already"
    (out / "manifest.json").write_text(json.dumps({**manifest, "version": 2}))
    assert refusal() == f"compact: {out} was written by an older facepipe (no sources.jsonl): run a full prepare"
    (out / "manifest.json").write_text(json.dumps({**manifest, "num_identities": 9}))
    assert refusal() == f"compact: {out} is inconsistent (manifest num_identities 9 != 4 names in labels.json): see facepipe verify {out}"
    (out / "manifest.json").write_text(json.dumps({**manifest, SOURCES_KEY: "0" * 64}))
    assert refusal() == f"compact: {out / 'sources.jsonl'} is inconsistent (its lines do not match the manifest's {SOURCES_KEY}): run a full prepare"
    (out / "manifest.json").write_text(json.dumps(manifest))
    sources = (out / "sources.jsonl").read_text()
    (out / "sources.jsonl").unlink()
    assert refusal() == f"compact: {out} was written by an older facepipe (no sources.jsonl): run a full prepare"
    (out / "sources.jsonl").write_text(sources)
    (out / "manifest.json").write_text("[]")
    assert refusal() == f"compact: manifest.json of {out} is not a JSON object"
    (out / "manifest.json").write_text(json.dumps(manifest))
    started = time.perf_counter()
    report = compact.run(out, progress=False)
    assert 0 <= report["timings_s"]["total"] <= time.perf_counter() - started
    assert compact.summary_line(report) == (
        "compact: 2 generation(s) -> 1; 9 samples of 4 identities in 3 shard(s), 2 rejects; 1 excluded record(s)"
        " dropped; labels renumbered (report.json: relabel)"
    )
    assert report["relabel"] == {"0": 0, "1": 1, "2": 2, "3": 3} and report["generation"] == 0
    assert report["rejected_by_reason"] == {"duplicate": 1, "empty_file": 1} and report["num_identities"] == 4
    assert (report["num_shards"], report["compacted_generations"], report["dropped_records"]) == (3, 2, 1)
    assert report["payload_bytes"] == sum(len(ShardSet(out).record(i).payload) for i in range(9))
    assert report["shard_bytes"] == sum(p.stat().st_size for p in (out / "shards").iterdir())
    assert json.loads((out / "report.json").read_text())["counts"] == {"scanned": 11, "accepted": 9, "rejected": 2}


def _hashed(out: Path, lines: list[dict]) -> None:
    """sources.jsonl rewritten with its hash recomputed: consistent with the manifest, not with the shards."""
    manifest = json.loads((out / "manifest.json").read_text())
    expected = lines_file(out / "sources.jsonl", lines)
    (out / "manifest.json").write_text(json.dumps({**manifest, SOURCES_KEY: expected}))


def test_compact_checks_each_line_against_the_records_and_rejects(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "out"
    write(raw, V1)
    run(raw, out)
    lines = [json.loads(line) for line in (out / "sources.jsonl").read_text().splitlines()]
    accepted = [i for i, line in enumerate(lines) if line["sample"] is not None]
    rejected = [i for i, line in enumerate(lines) if line["sample"] is None]
    first, second = accepted[:2]
    swapped = [dict(line) for line in lines]
    swapped[first]["sample"], swapped[second]["sample"] = lines[second]["sample"], lines[first]["sample"]
    _hashed(out, swapped)
    with pytest.raises(FacepipeError) as error:
        compact.run(out, progress=False)
    assert str(error.value) == (
        f"compact: sources.jsonl places {lines[first]['path']!r} where {lines[second]['path']!r} is stored: see facepipe verify"
    )
    past = [dict(line) for line in lines]
    past[first]["sample"] = 9
    _hashed(out, past)
    with pytest.raises(FacepipeError) as error:
        compact.run(out, progress=False)
    assert str(error.value) == f"compact: sources.jsonl places {lines[first]['path']!r} at sample 9, past the set's end: see facepipe verify"
    renamed = [dict(line) for line in lines]
    renamed[rejected[0]]["path"] = "id0/zzz.jpg"
    _hashed(out, renamed)
    with pytest.raises(FacepipeError) as error:
        compact.run(out, progress=False)
    assert str(error.value) == "compact: rejects.jsonl and sources.jsonl disagree at 'id0/zzz.jpg': see facepipe verify"
    extra = [*lines, {**lines[rejected[0]], "path": "id9/extra.jpg"}]
    _hashed(out, extra)
    with pytest.raises(FacepipeError) as error:
        compact.run(out, progress=False)
    assert str(error.value) == "compact: rejects.jsonl and sources.jsonl disagree at 'id9/extra.jpg': see facepipe verify"


def test_walk_feeds_every_file_in_scan_order_and_refuses_extra_outcomes(tmp_path):
    from facepipe.data.scan import scan_raw
    from facepipe.shardset import SetBuilder
    from facepipe.stages import prepare

    raw, out = tmp_path / "raw", tmp_path / "out"
    write(raw, V1)
    run(raw, out)
    (raw / "id0" / "1.jpg").write_bytes(face(901))
    items = scan_raw(raw)
    plan = update.plan_update(out, items, raw=raw, manifest_params=json.loads((out / "manifest.json").read_text())["params"])
    outcomes = prepare.process_chunks([[item.path for item in plan.todo]], str(raw), PARAMS, "cpu")[0]
    (tmp_path / "tmp" / "shards").mkdir(parents=True)  # link_shards into a folder that has its shards/ already
    link_shards(plan.base, tmp_path / "tmp")
    builder = SetBuilder(tmp_path / "tmp", PARAMS, base=update.base_generation(plan))
    try:
        assert list(plan.walk(builder, items, iter(outcomes))) == [1]
        assert builder.accepted == 9 and builder.written == 1 and sorted(builder.kept) == [0, 2, 3, 4, 5, 6, 7, 8]
        with pytest.raises(RuntimeError) as error:
            list(plan.walk(builder, items, iter([*outcomes, outcomes[0]])))
        assert str(error.value) == "the workers returned more outcomes than files to process"
    finally:
        builder.abort()


def test_a_scan_reject_with_the_same_detail_is_reused(tmp_path):
    """A link out of RAW is the scan's own reject: an update with nothing changed reuses it (same reason
    and detail), reads nothing and adds no generation."""
    raw, out, outside = tmp_path / "raw", tmp_path / "out", tmp_path / "outside.jpg"
    write(raw, V1)
    outside.write_bytes(face(77))
    os.symlink(outside, raw / "id1" / "link.jpg")
    run(raw, out)
    assert any(json.loads(line)["reason"] == "outside_raw_root" for line in (out / "rejects.jsonl").read_text().splitlines())
    report = run(raw, out, update=True)
    assert report["files"] == {"reused": len(V1) + 1, "processed": 0, "removed": 0}


# --- shardset/builder.py and shardset/build.py (their mutation tests) ---



def test_build_set_writes_utf8_passes_raw_to_the_report_and_times_it(tmp_path, ascii_locale, monkeypatch):
    from types import SimpleNamespace

    from facepipe.shardset import build
    from facepipe.stages import prepare

    raw, out = tmp_path / "raw", tmp_path / "out"
    write(raw, {"José/0.jpg": face(1), "José/ñ.jpg": face(1), "Zoë/0.jpg": face(2)})  # ñ.jpg: a duplicate, thumbnailed
    paths = ["José/0.jpg", "José/ñ.jpg", "Zoë/0.jpg"]
    outcomes = prepare.process_chunks([paths], str(raw), PARAMS, "cpu")[0]
    clock = iter([100.0, 100.23456])
    monkeypatch.setattr(build, "time", SimpleNamespace(perf_counter=lambda: next(clock)))

    def produce(builder):
        for outcome in outcomes:
            builder.add(outcome)
        return builder.finish(len(outcomes))

    def report(built):
        return {"who": "José", "report_html_s": built.report_html_s, **built.counts()}

    summary, builder = build.build_set(out, PARAMS, produce, report, raw=raw)
    assert summary["report_html_s"] == 0.235 and summary["who"] == "José"
    assert json.loads((out / "report.json").read_text(encoding="utf-8")) == summary
    assert builder.identities == ["José", "Zoë"] and builder.reasons == {"duplicate": 1}
    assert [json.loads(line)["path"] for line in (out / "sources.jsonl").read_text(encoding="utf-8").splitlines()] == paths
    for text in (out / "sources.jsonl").read_text(encoding="utf-8").splitlines():  # sorted keys, UTF-8 as it is
        assert text == json.dumps(json.loads(text), sort_keys=True, ensure_ascii=False) and '"path": "' in text
    assert json.loads((out / "rejects.jsonl").read_text(encoding="utf-8"))["path"] == "José/ñ.jpg"
    assert 'alt="José/ñ.jpg"' in (out / "report.html").read_text(encoding="utf-8")  # a thumbnail: RAW was passed on


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_the_builder_adds_records_labelled_by_the_first_folder_and_lists_resized_crops(tmp_path):
    import numpy as np
    from rawdata import jpeg_bytes

    from facepipe.data.extract import Outcome
    from facepipe.shardset import SetBuilder
    from facepipe.stages import prepare

    raw = tmp_path / "raw"
    big = jpeg_bytes(np.full((120, 120, 3), 90, np.uint8), quality=90)
    write(raw, {"a/0.jpg": face(1), "a/1.jpg": face(1), "b/0.jpg": big})
    outcomes = prepare.process_chunks([["a/0.jpg", "a/1.jpg", "b/0.jpg"]], str(raw), PARAMS, "cpu")[0]
    (tmp_path / "set").mkdir()
    builder = SetBuilder(tmp_path / "set", PARAMS)
    for outcome in outcomes:
        builder.add(outcome)
    nested = outcomes[0].header | {"path": "c/d/e.jpg"}
    builder.add(Outcome("c/d/e.jpg", "cd" * 32, header=nested, payload=outcomes[0].payload))  # identity: the first folder
    builder.add(Outcome("c/x.jpg", None, reason=""))  # a reject without a reason code
    with pytest.raises(AssertionError):
        builder.add(Outcome("c/y.jpg", "ef" * 32, header=nested))  # accepted, but no payload
    closed: list = []
    close = builder.writer.close
    builder.writer.close = lambda: closed.append(close()) or closed[-1]  # the ShardInfos finish() gets
    builder.finish(5)
    assert builder.identities == ["a", "b", "c"] and builder.resized == ["b/0.jpg"]
    assert _lines(tmp_path / "set" / "rejects.jsonl") == [
        {"path": "a/1.jpg", "reason": "duplicate", "detail": "same bytes as a/0.jpg"},
        {"path": "c/x.jpg", "reason": "unknown", "detail": ""},
    ]
    shard_set = ShardSet(tmp_path / "set")
    assert [shard_set.record(i).header.get("label") for i in range(3)] == [0, 1, 2]
    payloads = [outcomes[0].payload, outcomes[2].payload, outcomes[0].payload]
    assert [info.payload_bytes for info in closed[0]] == [sum(map(len, payloads))]
    assert builder.payload_bytes == sum(map(len, payloads))

    aligning = PARAMS.model_copy(update={"detector": "mtcnn"})
    (tmp_path / "set2").mkdir()
    builder = SetBuilder(tmp_path / "set2", aligning)
    builder.add(outcomes[2])  # a detector's crops are made at image_size: never listed as resized
    builder.abort()
    assert builder.resized == []


def test_keep_reuses_records_and_rejects_and_redecides_later_copies(tmp_path):
    from facepipe.shardset import Generation, SetBuilder

    other = "cd" * 32
    base = Generation(number=2, stored=9, shards=(ShardInfo("shard-00000.lmdb", 9, "0" * 64, 0, 100),), identities=("a",))
    builder = SetBuilder(tmp_path, PARAMS, base=base)
    builder.stats = {"a/0.jpg": (10, 5)}
    entry = {"path": "a/0.jpg", "sha256": SHA, "reason": None, "sample": 3, "generation": 0}
    reject = {"path": "a/1.jpg", "sha256": other, "reason": "no_face", "sample": None, "generation": 1}
    assert builder.keep(entry, None) is True
    assert builder.keep(reject, {"path": "a/1.jpg", "reason": "no_face", "detail": "d"}) is True
    with pytest.raises(AssertionError):
        builder.keep({**reject, "path": "a/9.jpg", "sha256": None}, {"path": "a/1.jpg", "reason": "no_face", "detail": "d"})
    copy = {"path": "a/2.jpg", "sha256": SHA, "reason": "duplicate", "sample": None, "generation": 1}
    assert builder.keep(copy, None) is True  # still a copy of a/0.jpg: reused as it was
    assert (builder.redecided, builder.rejected_now) == (0, 0)
    for name in ("a/3.jpg", "a/4.jpg"):  # accepted before, now later copies of a/0.jpg: decided now
        assert builder.keep({**entry, "path": name, "sample": 4}, None) is False
    assert (builder.redecided, builder.rejected_now, builder.accepted, builder.kept) == (2, 2, 1, [3])
    assert builder.reasons == {"no_face": 1, "duplicate": 3}
    builder.abort()
    assert _lines(tmp_path / "rejects.jsonl") == [
        {"path": "a/1.jpg", "reason": "no_face", "detail": "d"},
        {"path": "a/2.jpg", "reason": "duplicate", "detail": "same bytes as a/0.jpg"},
        {"path": "a/3.jpg", "reason": "duplicate", "detail": "same bytes as a/0.jpg"},
        {"path": "a/4.jpg", "reason": "duplicate", "detail": "same bytes as a/0.jpg"},
    ]
    line = {"reason": None, "sample": None, "size": None, "mtime_ns": None}
    assert _lines(tmp_path / "sources.jsonl") == [
        {**line, "path": "a/0.jpg", "sha256": SHA, "sample": 3, "generation": 0, "size": 10, "mtime_ns": 5},
        {**line, "path": "a/1.jpg", "sha256": other, "reason": "no_face", "generation": 1},
        {**line, "path": "a/2.jpg", "sha256": SHA, "reason": "duplicate", "generation": 1},
        {**line, "path": "a/3.jpg", "sha256": SHA, "reason": "duplicate", "generation": 2},
        {**line, "path": "a/4.jpg", "sha256": SHA, "reason": "duplicate", "generation": 2},
    ]


def test_finish_writes_the_manifest_and_says_when_an_update_changed_nothing(tmp_path):
    from facepipe.data.extract import Outcome
    from facepipe.shardset import Generation, SetBuilder
    from facepipe.shardset.builder import manifest_params

    def finished(name: str, params=PARAMS, base=None, rejects=1, **finish) -> SetBuilder:
        (tmp_path / name).mkdir()
        builder = SetBuilder(tmp_path / name, params, base=base)
        for i in range(rejects):
            builder.add(Outcome(f"a/{i}.jpg", None, reason="no_face", detail="x"))
        builder.manifest = builder.finish(rejects, **finish)
        return builder

    scratch = finished("scratch", rejects=2)
    assert scratch.manifest["image"] == {
        "size": 112, "encoding": "jpeg", "quality": 95, "template": "arcface",
        "template_points": [[38.2946, 51.6963], [73.5318, 51.5014], [56.0252, 71.7366], [41.5493, 92.3655], [70.7299, 92.2041]],
    }
    assert scratch.manifest["generations"] == [{
        "generation": 0, "shards": [], "counts": {"scanned": 2, "accepted": 0, "rejected": 2}, "reused": 0, "removed": 0,
        "labels": [0, 0], "excluded": {},
    }]
    assert scratch.unchanged is False
    png = finished("png", PARAMS.model_copy(update={"image_size": 96, "encoding": "png"}))
    assert png.manifest["image"] == {
        "size": 96, "encoding": "png", "quality": None, "template": "arcface",
        "template_points": [[32.8239, 44.3111], [63.0273, 44.1441], [48.0216, 61.4885], [35.6137, 79.1704], [60.6256, 79.0321]],
    }
    grown = {"number": 1, "identities": ("a",), "generations": ({"generation": 0},), "params": manifest_params(PARAMS)}
    nothing = finished("nothing", base=Generation(**grown), rejects=0)
    assert nothing.unchanged is True and nothing.manifest["generations"] == [{"generation": 0}]
    for name, finish, rejects in (("removed", {"removed": 1}, 0), ("decided", {}, 1), ("excluded", {"excluded": {"shard-00000.lmdb": [0]}}, 0)):
        builder = finished(name, base=Generation(**grown), rejects=rejects, **finish)
        assert builder.unchanged is False, name
        assert builder.manifest["generations"][1] == {
            "generation": 1, "shards": [], "counts": {"scanned": rejects, "accepted": 0, "rejected": rejects},
            "reused": 0, "removed": finish.get("removed", 0), "labels": [1, 1], "excluded": finish.get("excluded", {}),
        }, name

    empty = finished("empty", rejects=0)  # a from-scratch set of nothing is a generation all the same
    assert empty.unchanged is False and len(empty.manifest["generations"]) == 1
    (tmp_path / "copies").mkdir()
    builder = SetBuilder(tmp_path / "copies", PARAMS, base=Generation(**grown))
    entry = {"path": "a/0.jpg", "sha256": SHA, "reason": None, "sample": 0, "generation": 0}
    builder.keep(entry, None)
    builder.keep({**entry, "path": "a/1.jpg", "sample": 1}, None)  # now a copy of a/0.jpg: decided, not read
    manifest = builder.finish(2, processed=0, excluded={"shard-00000.lmdb": [1]})
    assert manifest["generations"][1]["counts"] == {"scanned": 1, "accepted": 0, "rejected": 1}
    assert manifest["generations"][1]["reused"] == 1

    (tmp_path / "broken").mkdir()
    builder = SetBuilder(tmp_path / "broken", PARAMS)
    builder.add(Outcome("a/0.jpg", None, reason="no_face", detail="x"))
    with pytest.raises(RuntimeError) as error:
        builder.finish(1, processed=2)
    assert str(error.value) == "accounting broken: 0 + 1 != 1 scanned, or 0 + 1 != 2 decided in this generation"


def test_manifest_params_record_the_crop_only_when_it_is_not_arcface(tmp_path):
    from facepipe.shardset.builder import manifest_params

    assert manifest_params(PARAMS) == {k: v for k, v in PARAMS.model_dump().items() if k not in ("crop", "margin")}
    facenet = PrepareParams(**{**PARAMS.model_dump(), "detector": "mtcnn", "crop": "facenet"})
    assert manifest_params(facenet) == facenet.model_dump() and facenet.model_dump()["crop"] == "facenet"
    weights = tmp_path / "weights.onnx"
    weights.write_bytes(b"not really a model")
    given = PrepareParams(**{**PARAMS.model_dump(), "detector": "retinaface", "detector_weights": str(weights)})
    assert manifest_params(given)["detector_weights"] == {"file": "weights.onnx", "sha256": hashlib.sha256(b"not really a model").hexdigest()}


def test_reasons_text_lists_the_most_frequent_first_then_by_name():
    from collections import Counter
    from types import SimpleNamespace

    from facepipe.shardset.builder import reasons_text

    assert reasons_text(SimpleNamespace(reasons=Counter({"no_face": 2, "duplicate": 2, "empty_file": 3}))) == "empty_file 3, duplicate 2, no_face 2"


def test_warn_resized_names_the_count_the_size_and_the_first(caplog):
    import logging
    from types import SimpleNamespace

    from facepipe.shardset.builder import warn_resized

    with caplog.at_level(logging.WARNING, logger="facepipe.prepare"):
        warn_resized(SimpleNamespace(resized=[]), 96)
        assert caplog.records == []
        warn_resized(SimpleNamespace(resized=["a/1.jpg", "b/2.jpg"]), 96)
    assert [r.getMessage() for r in caplog.records] == ["2 aligned face(s) were not 96x96 and were resized (first: a/1.jpg)"]


def test_link_shards_copies_where_links_are_refused_and_placing_nothing_is_fine(tmp_path, monkeypatch):
    raw, out = tmp_path / "raw", tmp_path / "out"
    write(raw, V1)
    run(raw, out)
    assert place_new_shards([], root=tmp_path, first=3) == []  # a generation with no new shard: no .new-shards folder

    def refuse(*args):
        raise OSError("links not supported")

    monkeypatch.setattr(os, "link", refuse)
    link_shards(ShardSet(out), tmp_path / "tmp")
    for entry in ShardSet(out).manifest["shards"]:
        copied, source = tmp_path / "tmp" / "shards" / entry["file"], out / "shards" / entry["file"]
        assert copied.read_bytes() == source.read_bytes() and not os.path.samefile(copied, source)


def test_reusable_needs_the_same_scan_reject_and_a_recorded_hash_of_a_file_it_can_stat(tmp_path):
    reusable = update._reusable
    link = ScanItem("a/l.jpg", "a", reason="outside_raw_root", detail="d")
    entry = SourceEntry({**LINE, "path": "a/l.jpg", "sha256": None, "reason": "outside_raw_root", "sample": None})
    same = {"a/l.jpg": {"path": "a/l.jpg", "reason": "outside_raw_root", "detail": "d"}}
    assert reusable(link, entry, same, {}, raw=tmp_path, shas=set()) is True
    assert reusable(link, entry, {}, {}, raw=tmp_path, shas=set()) is False  # no reject line to reuse
    other = SourceEntry({**LINE, "path": "a/l.jpg", "sha256": None, "reason": "symlink_loop", "sample": None})
    assert reusable(link, other, same, {}, raw=tmp_path, shas=set()) is False  # another reason, the same detail
    item = ScanItem("id0/a.jpg", "id0")
    unread = SourceEntry({**LINE, "sha256": None, "reason": "io_error", "sample": None})
    assert reusable(item, unread, {}, {"id0/a.jpg": (10, 5)}, raw=tmp_path, shas=set()) is False  # never hashed: read again
    assert reusable(item, SourceEntry(LINE), {}, {}, raw=tmp_path, shas=set()) is False  # no stat: the worker reports it
    assert reusable(item, SourceEntry(LINE), {}, {"id0/a.jpg": (10, 5)}, raw=tmp_path, shas=set()) is True
    copy = SourceEntry({**LINE, "reason": "duplicate", "sample": None})
    assert reusable(item, copy, {}, {"id0/a.jpg": (10, 5)}, raw=tmp_path, shas=set()) is False  # its first copy is not reused
    assert reusable(item, copy, {}, {"id0/a.jpg": (10, 5)}, raw=tmp_path, shas={SHA}) is True
    touched = {"id0/a.jpg": (10, 6)}
    assert reusable(item, SourceEntry(LINE), {}, touched, raw=tmp_path, shas=set()) is False  # gone since its stat
    write(tmp_path, {"id0/a.jpg": b"0123456789"})
    same = SourceEntry({**LINE, "sha256": hashlib.sha256(b"0123456789").hexdigest()})
    assert reusable(item, same, {}, touched, raw=tmp_path, shas=set()) is True  # touched, the same bytes
    assert reusable(item, SourceEntry(LINE), {}, touched, raw=tmp_path, shas=set()) is False


def test_the_rejects_of_an_update_are_read_with_one_line_refusals(tmp_path):
    missing, broken = tmp_path / "missing.jsonl", tmp_path / "rejects.jsonl"
    with pytest.raises(FacepipeError) as error:
        list(update._read_jsonl(missing))
    assert str(error.value) == f"--update: cannot read {missing}: [Errno 2] No such file or directory: '{missing}'"
    assert not isinstance(error.value, NotGrowable)
    broken.write_text('{"path": "a"}\n{nope\n')
    with pytest.raises(NotGrowable) as error:
        list(update._read_jsonl(broken))
    assert str(error.value) == (
        f"--update: {broken} is inconsistent (not JSON lines: Expecting property name enclosed in double quotes:"
        " line 1 column 2 (char 1)): run a full prepare (without --update)"
    )


def test_base_generation_is_the_base_sets_shards_labels_and_history(tmp_path):
    from facepipe.shardset import Generation

    raw, out = tmp_path / "raw", tmp_path / "out"
    write(raw, V1)
    run(raw, out)
    manifest = json.loads((out / "manifest.json").read_text())
    plan = update.plan_update(out, [], raw=raw, manifest_params=manifest["params"])
    shards = tuple(ShardInfo(e["file"], e["num_samples"], e["sha256"], 0, e["bytes"]) for e in manifest["shards"])
    assert update.base_generation(plan) == Generation(
        number=1, stored=9, shards=shards, identities=("id0", "id1", "id2"), generations=tuple(manifest["generations"]),
        params=manifest["params"],
    )
    assert update.base_generation(None) is None


def test_base_payload_is_the_base_reports_or_zero(tmp_path, ascii_locale):
    from types import SimpleNamespace

    plan = SimpleNamespace(base=SimpleNamespace(root=tmp_path))
    assert update.base_payload(plan) == 0  # no report.json
    for text, payload in (('{"payload_bytes": 1234, "by": "José"}', 1234), ("{nope", 0), ("{}", 0), ('{"payload_bytes": null}', 0), ("[]", 0)):
        (tmp_path / "report.json").write_text(text, encoding="utf-8")
        assert update.base_payload(plan) == payload, text


def test_compact_shows_its_progress_over_every_line(tmp_path, monkeypatch):
    raw, out = tmp_path / "raw", tmp_path / "out"
    write(raw, V1)
    run(raw, out)
    bars: list = []

    class Recording(compact.Progress):
        def __init__(self, total, **kwargs):
            super().__init__(total, **kwargs)
            bars.append(self)

    monkeypatch.setattr(compact, "Progress", Recording)
    compact.run(out)  # the CLI's call: progress on by default
    compact.run(out, progress=False)
    assert [(bar.total, bar.desc, bar.enabled, bar.count) for bar in bars] == [(11, "compact", True, 11), (11, "compact", False, 11)]


def test_compact_keeps_the_recorded_params_and_times_itself(tmp_path, monkeypatch):
    from types import SimpleNamespace

    raw, out = tmp_path / "raw", tmp_path / "out"
    write(raw, V1)
    run(raw, out)
    manifest = json.loads((out / "manifest.json").read_text())
    weights = {"file": "retinaface.onnx", "sha256": SHA}  # as a set prepared with detector_weights records them
    recorded = {**manifest["params"], "detector_weights": weights}
    (out / "manifest.json").write_text(json.dumps({**manifest, "params": recorded}))
    before = {name: (out / name).read_bytes() for name in ("sources.jsonl", "rejects.jsonl")}
    assert b'"detail": "0 bytes"' in before["rejects.jsonl"]  # a reject with a detail, not a duplicate
    clock = iter([50.0, 51.23456])
    monkeypatch.setattr(compact, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    report = compact.run(out, progress=False)
    assert report["timings_s"] == {"total": 1.235}
    assert {name: (out / name).read_bytes() for name in before} == before  # one generation: the same lines
    assert json.loads((out / "manifest.json").read_text())["params"] == recorded
