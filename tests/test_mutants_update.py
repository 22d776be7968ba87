"""shardset/update.py and stages/compact.py function by function, fast and exact (their mutation tests:
every refusal matched whole, every field check at its boundary). Sets are real prepares of a few
112x112 crops with ``detector: none`` (about a second each)."""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path

import pytest
from test_update import PARAMS, V1, face, files_of, run, write

from facepipe.data.scan import ScanItem
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
    items = [ScanItem("a/1.jpg", "a"), ScanItem("a/gone.jpg", "a"), ScanItem("a/link.jpg", "a", reason="outside_raw_root")]
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
        update.plan_update(out, PARAMS, [], raw=raw, manifest_params=manifest["params"])
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
    plan = update.plan_update(out, PARAMS, items, raw=raw, manifest_params=manifest["params"])
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
    plan = update.plan_update(out, PARAMS, items, raw=raw, manifest_params=json.loads((out / "manifest.json").read_text())["params"])
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
