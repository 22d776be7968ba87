"""facepipe embed and compare on a real (small) trained model: the same embeddings as evaluate's path,
resume after a kill, updates, all faces, the CLI's one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from facepipe.cli import main
from facepipe.errors import FacepipeError
from facepipe.evaluation.embed import embed_images
from facepipe.gallery import store
from facepipe.gallery.runtime import resolve_model
from facepipe.io.model_dir import load_backbone, read_model_spec
from facepipe.io.shards import ShardSet
from facepipe.stages import compare, embed
from embed_helpers import EMBED, FACES, Pipeline, copy_tree, cosine, photos_of

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pipeline(trained_pipeline: Pipeline) -> Pipeline:
    return trained_pipeline


@pytest.fixture(scope="module")
def embedded(pipeline: Pipeline, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("embedded") / "out"
    embed.run(EMBED, pipeline.raw, pipeline.model, out, workers=1, progress=False)
    return out


def files_of(folder: Path) -> dict[str, bytes]:
    """Every file of an embedding folder but report.json (timings), by relative path."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file() and p.name != store.REPORT}


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out.strip(), captured.err.strip()


# --- the model records how its faces were cut ---------------------------------------------------------


def test_train_records_the_training_sets_face_params(pipeline):
    faces = read_model_spec(pipeline.model).faces
    assert faces == ShardSet(pipeline.prepared).manifest["params"]
    assert faces["image_size"] == FACES.image_size and faces["detector"] == FACES.detector


# --- embed equals evaluate's path on the shard set's faces -------------------------------------------


@pytest.mark.parametrize("runtime", ["torch", "onnx"])
def test_embed_equals_evaluate_on_the_training_sets_faces(pipeline, embedded, runtime, tmp_path):
    if runtime == "torch":
        result = store.load_embeddings(embedded)
    else:
        out = tmp_path / "onnx"
        embed.run(EMBED.model_copy(update={"runtime": "onnx"}), pipeline.raw, pipeline.export, out, workers=1, progress=False)
        result = store.load_embeddings(out)
    shard_set = ShardSet(pipeline.prepared)
    model, _ = load_backbone(pipeline.model)
    records = [shard_set.record(i) for i in range(len(shard_set))]
    reference = embed_images(model, (r.image() for r in records), count=len(records), batch_size=5, progress=False)
    row = {r["path"]: i for i, r in enumerate(result.rows)}
    assert set(row) >= {r.header["path"] for r in records}  # prepare also drops duplicates; embed keeps them
    ours = result.matrix[[row[r.header["path"]] for r in records]]
    assert np.abs(ours - reference).max() <= 1e-5
    for record in records:  # and the same face: box, landmarks, score as the shard set's header
        line = result.rows[row[record.header["path"]]]
        assert (line["box"], line["landmarks"], line["score"]) == (record.header["box"], record.header["landmarks"], record.header["score"])
    assert result.manifest["model"]["runtime"] == runtime
    assert result.manifest["model"]["sha256"] == resolve_model(pipeline.model if runtime == "torch" else pipeline.export, runtime).sha256


def test_embedding_folder_accounts_for_every_file(pipeline, embedded):
    result = store.load_embeddings(embedded)
    manifest = result.manifest
    rejects = list(store.read_jsonl(embedded / store.REJECTS))
    scanned = sum(1 for p in pipeline.raw.rglob("*") if p.is_file())
    assert manifest["counts"]["scanned"] == scanned == manifest["counts"]["photos"] + len(rejects)
    assert manifest["counts"]["faces"] == len(result.rows) == len(result.matrix)
    assert {r["path"] for r in result.rows}.isdisjoint(r["path"] for r in rejects)
    assert all(r["reason"] for r in rejects) and [r["path"] for r in rejects] == sorted(r["path"] for r in rejects)
    assert result.matrix.dtype == np.float32 and np.allclose(np.linalg.norm(result.matrix, axis=1), 1, atol=1e-5)
    assert all(r["identity"] == r["path"].split("/")[0] and r["face"] == 0 for r in result.rows)
    read = [p["photos"] for p in manifest["parts"]]  # the files the workers read: the scan's own rejects never go there
    assert all(n == EMBED.files_per_part for n in read[:-1]) and 0 < read[-1] <= EMBED.files_per_part
    assert [p["name"] for p in manifest["parts"]] == [store.part_name(i) for i in range(len(manifest["parts"]))]


def test_embed_is_byte_identical_for_one_or_two_workers(pipeline, embedded, tmp_path):
    two = tmp_path / "two"
    report = embed.run(EMBED, pipeline.raw, pipeline.model, two, workers=2, progress=False)
    assert report["workers"] == 2 and report["scheduler"] == "local"
    assert files_of(two) == files_of(embedded)


# --- resume after a kill; updates ----------------------------------------------------------------------


def test_sigkill_during_embed_then_rerun_gives_the_same_bytes(pipeline, embedded, tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"embed": EMBED.model_dump(mode="json"), "prepare": FACES.model_dump(mode="json")}))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "facepipe", "embed", str(pipeline.raw), str(pipeline.model), str(out), "--workers", "1"]
    process = subprocess.Popen([*command, "--params", str(params)], start_new_session=True)
    deadline = time.monotonic() + 300
    while not list((out / store.PARTS).glob("part-00001.jsonl")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert (out / store.PARTS / "part-00001.jsonl").is_file() and not (out / store.MANIFEST).exists()
    with pytest.raises(FacepipeError, match="not an embedding folder"):
        store.load_embeddings(out)
    parts_before = {p.name: p.stat().st_mtime_ns for p in (out / store.PARTS).glob("part-*.jsonl")}
    code = subprocess.run([*command, "--params", str(params)]).returncode
    assert code == 0
    assert files_of(out) == files_of(embedded)
    kept = {p.name: p.stat().st_mtime_ns for p in (out / store.PARTS).glob("part-*.jsonl") if p.name in parts_before}
    assert kept == parts_before  # the parts the killed run finished were reused, not written again


def test_update_embeds_only_new_and_changed_photos(pipeline, embedded, tmp_path):
    raw = copy_tree(pipeline.raw, tmp_path / "raw")
    out = copy_tree(embedded, tmp_path / "out")
    before = store.load_embeddings(out)
    identities = sorted(p.name for p in raw.iterdir() if p.is_dir())
    removed = photos_of(raw, identities[0])[0]
    removed.unlink()
    changed = photos_of(raw, identities[1])[0]
    shutil.copyfile(photos_of(raw, identities[2])[1], changed)
    new = raw / "newcomer" / "new.jpg"
    new.parent.mkdir()
    shutil.copyfile(photos_of(raw, identities[3])[2], new)
    report = embed.run(EMBED, raw, pipeline.model, out, workers=1, progress=False)
    read_before = sum(p["photos"] for p in before.manifest["parts"])
    assert report["files"] == {"embedded": 2, "removed": 1, "reused": read_before - 2}
    after = store.load_embeddings(out)
    paths = {r["path"]: i for i, r in enumerate(after.rows)}
    old = {r["path"]: i for i, r in enumerate(before.rows)}
    rel = lambda p: p.relative_to(raw).as_posix()  # noqa: E731
    assert rel(removed) not in paths and rel(new) in paths
    for path, i in old.items():
        if path not in (rel(removed), rel(changed)):
            assert np.array_equal(after.matrix[paths[path]], before.matrix[i])  # kept rows, not recomputed
    fresh = tmp_path / "fresh"
    embed.run(EMBED, raw, pipeline.model, fresh, workers=1, progress=False)
    scratch = store.load_embeddings(fresh)
    by_path = {r["path"]: i for i, r in enumerate(scratch.rows)}
    assert set(by_path) == set(paths)
    for path, i in paths.items():  # equal up to float rounding: a chunk's batch holds other faces in an update
        assert np.abs(after.matrix[i] - scratch.matrix[by_path[path]]).max() <= 1e-6, path
    again = embed.run(EMBED, raw, pipeline.model, out, workers=1, progress=False)
    assert again["files"]["embedded"] == 0 and again["files"]["removed"] == 0


# --- all faces; photos outside identity folders ----------------------------------------------------------


def side_by_side(left: Path, right: Path, out: Path) -> Path:
    a, b = Image.open(left).convert("RGB"), Image.open(right).convert("RGB")
    canvas = Image.new("RGB", (a.width + b.width, max(a.height, b.height)), (128, 128, 128))
    canvas.paste(a, (0, 0))
    canvas.paste(b, (a.width, 0))
    canvas.save(out, quality=95)
    return out


def test_all_faces_keeps_every_face_the_selected_one_first(pipeline, tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    identities = sorted(p.name for p in pipeline.raw.iterdir() if p.is_dir())
    group = side_by_side(photos_of(pipeline.raw, identities[0])[0], photos_of(pipeline.raw, identities[3])[1], raw / "group.jpg")
    one, every = tmp_path / "one", tmp_path / "every"
    embed.run(EMBED, raw, pipeline.model, one, workers=1, progress=False)
    embed.run(EMBED.model_copy(update={"all_faces": True}), raw, pipeline.model, every, workers=1, progress=False)
    single, both = store.load_embeddings(one), store.load_embeddings(every)
    assert len(single.rows) == 1 and len(both.rows) == 2
    assert [r["face"] for r in both.rows] == [0, 1] and {r["path"] for r in both.rows} == {"group.jpg"}
    assert both.rows[0]["identity"] is None and both.keys == ["group.jpg", "group.jpg"]  # a photo at RAW's top
    assert both.rows[0]["box"] == single.rows[0]["box"]
    assert np.abs(both.matrix[0] - single.matrix[0]).max() <= 1e-6  # float rounding: the batch holds 2 faces here
    area = lambda box: (box[2] - box[0]) * (box[3] - box[1])  # noqa: E731
    assert area(both.rows[0]["box"]) >= area(both.rows[1]["box"])  # face_selection: largest
    assert both.rows[1]["box"][0] != both.rows[0]["box"][0]  # the other face, not the same one twice
    assert both.manifest["settings"] != single.manifest["settings"]


# --- refusals: one line, nothing written -------------------------------------------------------------------


def test_embed_refuses_params_that_differ_from_the_training_set(pipeline, tmp_path, capsys):
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"prepare": FACES.model_copy(update={"min_face_size": 60}).model_dump(mode="json")}))
    code, _, err = cli(capsys, "embed", str(pipeline.raw), str(pipeline.model), str(tmp_path / "out"), "--params", str(params))
    assert code == 2 and len(err.splitlines()) == 1
    assert "prepare.min_face_size is 60" in err and "training set used 40" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("runtime", "which", "message"),
    [("onnx", "model", "is a model folder"), ("torch", "export", "holds no PyTorch weights")],
)
def test_runtime_and_model_kind_must_agree(pipeline, tmp_path, capsys, runtime, which, message):
    model = pipeline.model if which == "model" else pipeline.export
    code, _, err = cli(capsys, "embed", str(pipeline.raw), str(model), str(tmp_path / "out"), "--runtime", runtime)
    assert code == 2 and message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_embed_never_writes_into_a_foreign_folder(pipeline, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    code, _, err = cli(capsys, "embed", str(pipeline.raw), str(pipeline.model), str(out))
    assert code == 2 and "refusing to replace" in err and "notes.txt" in err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_a_corrupt_part_or_index_is_named_when_read(embedded, tmp_path):
    out = copy_tree(embedded, tmp_path / "out")
    index = out / store.INDEX
    index.write_bytes(index.read_bytes().replace(b'"face": 0', b'"face": 1', 1))
    with pytest.raises(FacepipeError, match="index.jsonl: differs"):
        store.load_embeddings(out)
    out = copy_tree(embedded, tmp_path / "out2")
    npy = out / store.PARTS / "part-00001.npy"
    data = bytearray(npy.read_bytes())
    data[-1] ^= 1
    npy.write_bytes(bytes(data))
    with pytest.raises(FacepipeError, match="part-00001: missing or corrupt"):
        store.load_embeddings(out)


def test_a_run_over_a_corrupt_part_embeds_its_photos_again(pipeline, embedded, tmp_path):
    out = copy_tree(embedded, tmp_path / "out")
    npy = out / store.PARTS / "part-00001.npy"
    npy.write_bytes(npy.read_bytes()[:-4])
    report = embed.run(EMBED, pipeline.raw, pipeline.model, out, workers=1, progress=False)
    assert report["files"]["embedded"] == EMBED.files_per_part
    reloaded = store.load_embeddings(out)
    original = store.load_embeddings(embedded)
    by_path = {r["path"]: i for i, r in enumerate(original.rows)}
    assert all(np.array_equal(reloaded.matrix[i], original.matrix[by_path[r["path"]]]) for i, r in enumerate(reloaded.rows))


# --- compare ----------------------------------------------------------------------------------------------


def test_compare_same_and_different_at_evaluates_threshold(pipeline, capsys):
    thresholds = pipeline.evaluation / "thresholds.json"
    threshold = json.loads(thresholds.read_text())["thresholds"]["1e-1"]
    identities = sorted(p.name for p in pipeline.raw.iterdir() if p.is_dir())
    same = photos_of(pipeline.raw, identities[0])[:2]
    other = next(i for i in identities if i.split("_")[0] != identities[0].split("_")[0])  # the other base face
    different = [same[0], photos_of(pipeline.raw, other)[0]]
    code, out, _ = cli(capsys, "compare", *map(str, same), "--model", str(pipeline.model), "--thresholds", str(thresholds), "--json")
    result = json.loads(out)
    assert code == 0 and result["same"] is True and result["score"] >= threshold == result["threshold"] and result["far"] == 0.1
    code, out, _ = cli(capsys, "compare", *map(str, different), "--model", str(pipeline.model), "--thresholds", str(thresholds))
    assert code == 0 and out.endswith("different people") and "(threshold at FAR 0.1)" in out
    embedded = embed.embed_files(same, embed.Work("", FACES, resolve_model(pipeline.model, "torch"), "cpu", True, 8, False))
    assert result["score"] == round(cosine(embedded[0][1][0], embedded[1][1][0]), 6)


def test_compare_without_a_measured_threshold_gives_the_score_and_why(pipeline, capsys):
    thresholds = pipeline.evaluation / "thresholds.json"
    photos = photos_of(pipeline.raw, sorted(p.name for p in pipeline.raw.iterdir() if p.is_dir())[0])[:2]
    code, out, _ = cli(capsys, "compare", *map(str, photos), "--model", str(pipeline.model), "--thresholds", str(thresholds), "--far", "1e-4")
    assert code == 0 and "no same/different answer" in out and "18 different pairs are too few" in out
    code, out, _ = cli(capsys, "compare", *map(str, photos), "--model", str(pipeline.model))
    assert code == 0 and "no thresholds.json given" in out
    code, _, err = cli(capsys, "compare", *map(str, photos), "--model", str(pipeline.model), "--thresholds", str(thresholds), "--far", "0.01")
    assert code == 2 and "no threshold at FAR 0.01 (it has: 0.0001, 0.1)" in err


def test_compare_a_photo_without_a_face_is_a_one_line_error(pipeline, tmp_path, capsys):
    blank = tmp_path / "wall.jpg"
    Image.new("RGB", (320, 240), (200, 190, 180)).save(blank)
    face = photos_of(pipeline.raw, sorted(p.name for p in pipeline.raw.iterdir() if p.is_dir())[0])[0]
    code, _, err = cli(capsys, "compare", str(face), str(blank), "--model", str(pipeline.model))
    assert code == 2 and len(err.splitlines()) == 1 and f"{blank}: no usable face (no_face" in err
    code, _, err = cli(capsys, "compare", str(face), str(tmp_path / "missing.jpg"), "--model", str(pipeline.model))
    assert code == 2 and "photo not found" in err


# --- the library call and the Prefect flow ------------------------------------------------------------


def test_library_embed_writes_what_the_stage_writes_and_returns_it(pipeline, embedded, tmp_path):
    import facepipe

    out = tmp_path / "out"
    overrides = {key: getattr(EMBED, key) for key in ("device", "batch_size", "files_per_part")}
    result = facepipe.embed(pipeline.raw, pipeline.model, out, workers=1, progress=False, **overrides)
    assert isinstance(result, facepipe.Embeddings) and files_of(out) == files_of(embedded)
    assert np.array_equal(result.matrix, store.load_embeddings(embedded).matrix)
    photos = photos_of(pipeline.raw, result.rows[0]["identity"])[:2]
    assert facepipe.compare(*photos, pipeline.model, device="cpu")["score"] > 0
    with pytest.raises(ValueError, match="files_per_part"):
        facepipe.embed(pipeline.raw, pipeline.model, tmp_path / "bad", files_per_part=0)


def test_a_run_with_other_settings_leaves_the_committed_folder_whole_until_its_commit(pipeline, embedded, tmp_path, monkeypatch):
    out = copy_tree(embedded, tmp_path / "out")
    before = store.load_embeddings(out)

    def killed(folder, manifest):
        raise KeyboardInterrupt  # the process dies just before writing embed.json

    monkeypatch.setattr(store, "commit", killed)
    with pytest.raises(KeyboardInterrupt):
        embed.run(EMBED.model_copy(update={"flip": False}), pipeline.raw, pipeline.model, out, workers=1, progress=False)
    after = store.load_embeddings(out)  # every part embed.json lists is still the one it lists
    assert np.array_equal(after.matrix, before.matrix) and after.rows == before.rows
    names = sorted(p.stem for p in (out / store.PARTS).glob("part-*.jsonl"))
    assert names[len(before.manifest["parts"])] == store.part_name(len(before.manifest["parts"]))  # new ones after


def test_a_folder_holding_only_files_named_like_ours_is_not_ours(pipeline, tmp_path, capsys):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "index.jsonl").write_text('{"my": "notes"}\n')
    code, _, err = cli(capsys, "embed", str(pipeline.raw), str(pipeline.model), str(out))
    assert code == 2 and "refusing to replace" in err
    assert [p.name for p in out.iterdir()] == ["index.jsonl"]
