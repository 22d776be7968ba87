"""Fast tests that pin the embedding folder (facepipe.gallery.store), how embed finds faces
(facepipe.gallery.faces), which model it runs (facepipe.gallery.runtime.resolve_model), embed's plan of
parts (facepipe.stages.embed), compare's thresholds and the gates of facepipe.data.extract, with exact
values: the mutation tests of these modules (tests/README.md). No model is run here
(tests/test_mutants_embed.py runs one)."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from facepipe.config import PrepareParams
from facepipe.data import extract
from facepipe.data.decode import Reject
from facepipe.data.scan import ScanItem
from facepipe.detection.base import Face
from facepipe.errors import FacepipeError
from facepipe.gallery import store
from facepipe.gallery.faces import NOT_FACES, training_faces
from facepipe.gallery.runtime import EXPORT_REPORT, ModelRef, resolve_model
from facepipe.io.atomic import check_replaceable
from facepipe.io.manifest import dumps, recorded_params, weights_record
from facepipe.io.model_dir import ModelSpec, save_model_dir, write_model_spec
from facepipe.io.shards import sha256_file
from facepipe.models import create_backbone
from facepipe.stages import compare, embed

SPEC = ModelSpec(backbone="mobilefacenet", embedding_size=4, image_size=32)


def rows(n: int, start: int = 0) -> np.ndarray:
    return np.arange(start * 4, (start + n) * 4, dtype=np.float32).reshape(n, 4) / 10


def photo(path: str, faces: int = 1, size: int = 10, mtime: int = 5) -> dict:
    face = {"box": [1.0, 2.0, 3.0, 4.0], "landmarks": [[1.0, 1.0]] * 5, "score": 0.99}
    return {"path": path, "sha256": "s-" + path, "faces": [face] * faces, "size": size, "mtime_ns": mtime}


def reject(path: str, size: int = 10, mtime: int = 5) -> dict:
    return {"path": path, "sha256": "s-" + path, "reason": "no_face", "detail": "none", "size": size, "mtime_ns": mtime}


# --- store: parts --------------------------------------------------------------------------------------


def test_part_names():
    assert store.part_name(3) == "part-00003" and store.part_name(123456) == "part-123456"
    assert store.part_number("part-00012") == 12 and store.part_number("part-123456") == 123456


def test_write_part_then_read_it_back(tmp_path):
    (tmp_path / store.PARTS).mkdir()
    files = [photo("a/1.jpg", 2), reject("a/2.jpg"), photo("3.jpg")]
    store.write_part(tmp_path, "part-00001", "key", files, rows(3).astype(np.float64))
    data = (tmp_path / "parts" / "part-00001.npy").read_bytes()
    buffer = io.BytesIO()
    np.save(buffer, rows(3), allow_pickle=False)
    assert data == buffer.getvalue()  # float32, no pickle
    header = {"part": "part-00001", "settings": "key", "faces": 3, "embeddings_sha256": hashlib.sha256(data).hexdigest()}
    expected = "".join(json.dumps(line, sort_keys=True) + "\n" for line in (header, *files))
    assert (tmp_path / "parts" / "part-00001.jsonl").read_text() == expected
    assert sorted(p.name for p in (tmp_path / "parts").iterdir()) == ["part-00001.jsonl", "part-00001.npy"]
    part = store.read_part(tmp_path, "part-00001")
    assert (part.name, part.header, part.files) == ("part-00001", header, files)
    assert part.embeddings.dtype == np.float32 and np.array_equal(part.embeddings, rows(3))
    assert store.read_part_lines(tmp_path, "part-00001") == (header, files)


def test_write_part_refuses_a_count_mismatch(tmp_path):
    with pytest.raises(RuntimeError, match=r"^part-00000: 2 faces listed, 1 embeddings$"):
        store.write_part(tmp_path, "part-00000", "key", [photo("a/1.jpg", 2), reject("a/2.jpg")], rows(1))
    assert not (tmp_path / "parts").exists()


def test_write_part_with_no_faces(tmp_path):
    (tmp_path / store.PARTS).mkdir()
    store.write_part(tmp_path, "part-00000", "key", [reject("a/2.jpg")], np.zeros((0, 4), np.float32))
    part = store.read_part(tmp_path, "part-00000")
    assert part.header["faces"] == 0 and part.embeddings.shape == (0, 4)


@pytest.mark.parametrize("damage", ["no jsonl", "no npy", "empty", "list", "bad json", "other name", "other sha", "no sha"])
def test_read_part_is_none_for_a_missing_partial_or_corrupt_part(tmp_path, damage):
    (tmp_path / store.PARTS).mkdir()
    store.write_part(tmp_path, "part-00000", "key", [photo("a/1.jpg")], rows(1))
    lines, npy = tmp_path / "parts" / "part-00000.jsonl", tmp_path / "parts" / "part-00000.npy"
    header, *rest = lines.read_text().splitlines(keepends=True)
    content = json.loads(header)
    if damage == "no jsonl":
        lines.unlink()
    elif damage == "no npy":
        npy.unlink()
    elif damage == "empty":
        lines.write_text("")
    elif damage == "list":
        lines.write_text("[1]\n" + "".join(rest))
    elif damage == "bad json":
        lines.write_text("{\n")
    elif damage == "other name":
        lines.write_text(json.dumps({**content, "part": "part-00001"}) + "\n" + "".join(rest))
    elif damage == "other sha":
        npy.write_bytes(npy.read_bytes()[:-1] + b"\x01")
    else:
        del content["embeddings_sha256"]
        lines.write_text(json.dumps(content) + "\n" + "".join(rest))
    assert store.read_part(tmp_path, "part-00000") is None


@pytest.mark.parametrize("content", ["pickled objects", "not npy"])
def test_read_part_is_none_for_npy_bytes_that_hash_right_but_are_no_float_array(tmp_path, content):
    """A crafted part: its .jsonl names the sha256 of a pickled object array (or of no .npy at all).
    It must read as unusable (re-embedded), never unpickled, never a traceback."""
    import hashlib
    import io

    (tmp_path / store.PARTS).mkdir()
    buffer = io.BytesIO()
    if content == "pickled objects":
        np.save(buffer, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    else:
        buffer.write(b"not an npy file")
    data = buffer.getvalue()
    (tmp_path / store.PARTS / "part-00000.npy").write_bytes(data)
    header = {"part": "part-00000", "settings": "key", "faces": 0, "embeddings_sha256": hashlib.sha256(data).hexdigest()}
    (tmp_path / store.PARTS / "part-00000.jsonl").write_text(json.dumps(header) + "\n")
    assert store.read_part(tmp_path, "part-00000") is None


@pytest.mark.parametrize("array", [np.zeros((1, 4), np.float64), np.zeros(4, np.float32), np.zeros((1, 1, 4), np.float32)])
def test_read_part_is_none_for_an_npy_of_another_dtype_or_shape(tmp_path, array):
    """Hashing right, a plain array, but not float32 [faces, E]: either is enough to refuse it."""
    (tmp_path / store.PARTS).mkdir()
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    data = buffer.getvalue()
    (tmp_path / store.PARTS / "part-00000.npy").write_bytes(data)
    header = {"part": "part-00000", "settings": "key", "faces": 1, "embeddings_sha256": hashlib.sha256(data).hexdigest()}
    (tmp_path / store.PARTS / "part-00000.jsonl").write_text(json.dumps(header) + "\n" + json.dumps(photo("a/1.jpg")) + "\n")
    assert store.read_part(tmp_path, "part-00000") is None


_UNPICKLED: list[str] = []


def _record_unpickling(marker: str) -> str:
    _UNPICKLED.append(marker)
    return marker


class _Payload:
    """An object whose unpickling calls ``_record_unpickling``: what a crafted part could run."""

    def __reduce__(self):
        return _record_unpickling, ("ran",)


def test_read_part_never_unpickles_a_crafted_npy(tmp_path):
    (tmp_path / store.PARTS).mkdir()
    buffer = io.BytesIO()
    np.save(buffer, np.array([_Payload()], dtype=object), allow_pickle=True)
    data = buffer.getvalue()
    (tmp_path / store.PARTS / "part-00000.npy").write_bytes(data)
    header = {"part": "part-00000", "settings": "key", "faces": 0, "embeddings_sha256": hashlib.sha256(data).hexdigest()}
    (tmp_path / store.PARTS / "part-00000.jsonl").write_text(json.dumps(header) + "\n")
    _UNPICKLED.clear()
    assert store.read_part(tmp_path, "part-00000") is None
    assert _UNPICKLED == []
    np.load(io.BytesIO(data), allow_pickle=True)  # the payload does run when unpickled: the check above can fail
    assert _UNPICKLED == ["ran"]


def test_index_lines_one_per_face_in_row_order():
    two = {"path": "ann/1.jpg", "sha256": "h1", "faces": [{"box": [1], "landmarks": [[2]], "score": 0.5}, {"box": [3], "landmarks": [[4]], "score": 0.25}]}
    top = {"path": "2.jpg", "sha256": "h2", "faces": [{"box": [5], "landmarks": [[6]], "score": 0.75}]}
    gone = {"path": "ann/3.jpg", "sha256": "h3", "reason": "no_face", "detail": ""}
    assert list(store.index_lines([two, gone, top])) == [
        {"path": "ann/1.jpg", "identity": "ann", "face": 0, "box": [1], "landmarks": [[2]], "score": 0.5, "sha256": "h1"},
        {"path": "ann/1.jpg", "identity": "ann", "face": 1, "box": [3], "landmarks": [[4]], "score": 0.25, "sha256": "h1"},
        {"path": "2.jpg", "identity": None, "face": 0, "box": [5], "landmarks": [[6]], "score": 0.75, "sha256": "h2"},
    ]


def test_identity_of():
    assert store.identity_of("ann/1.jpg") == "ann" and store.identity_of("ann/x/1.jpg") == "ann"
    assert store.identity_of("1.jpg") is None


def test_write_jsonl_returns_the_files_sha256(tmp_path):
    lines = [{"b": 1, "a": "é"}, {"c": None}]
    digest = store.write_jsonl(tmp_path / "x.jsonl", iter(lines))
    data = (tmp_path / "x.jsonl").read_bytes()
    assert data == b'{"a": "\\u00e9", "b": 1}\n{"c": null}\n' and digest == hashlib.sha256(data).hexdigest()
    assert [p.name for p in tmp_path.iterdir()] == ["x.jsonl"]


def test_commit_writes_the_manifest_then_removes_unlisted_parts(tmp_path):
    parts = tmp_path / "parts"
    parts.mkdir()
    for name in ("part-00000", "part-00001", "part-00002"):
        (parts / f"{name}.npy").write_bytes(b"n")
        (parts / f"{name}.jsonl").write_bytes(b"j")
    (parts / "part-0003.npy").write_bytes(b"4 digits")  # not a name embed writes: left alone
    (parts / "part-00004.txt").write_bytes(b"other suffix")
    (parts / "part-00005.npy").mkdir()  # not a file
    os.symlink(parts / "part-00000.npy", parts / "part-00006.npy")  # a link
    manifest = {"parts": [{"name": "part-00000"}, {"name": "part-00002"}], "z": "é"}
    store.commit(tmp_path, manifest)
    assert (tmp_path / "embed.json").read_text(encoding="utf-8") == dumps(manifest)
    assert sorted(p.name for p in parts.iterdir()) == [
        "part-00000.jsonl", "part-00000.npy", "part-00002.jsonl", "part-00002.npy",
        "part-00004.txt", "part-00005.npy", "part-00006.npy", "part-0003.npy",
    ]  # fmt: skip


def write_manifest(folder: Path, content) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "embed.json").write_text(content if isinstance(content, str) else json.dumps(content), encoding="utf-8")
    return folder



def test_read_manifest_reads_utf8_whatever_the_locale(tmp_path, ascii_locale):
    manifest = {"format": "facepipe-embeddings", "version": 1, "parts": [], "raw": "/photos/José"}
    (tmp_path / "embed.json").write_bytes(dumps(manifest).encode("utf-8"))
    assert store.read_manifest(tmp_path) == manifest


def test_read_manifest(tmp_path):
    good = {"format": "facepipe-embeddings", "version": 1, "parts": []}
    assert store.read_manifest(str(write_manifest(tmp_path / "good", good))) == good
    with pytest.raises(FacepipeError, match=rf"^not an embedding folder \(no embed.json; facepipe embed writes it\): {tmp_path}$"):
        store.read_manifest(tmp_path)
    (tmp_path / "dir" / "embed.json").mkdir(parents=True)
    with pytest.raises(FacepipeError, match=r"^not an embedding folder \(no embed.json"):
        store.read_manifest(tmp_path / "dir")
    bad = write_manifest(tmp_path / "bad", "{")
    with pytest.raises(FacepipeError) as error:
        store.read_manifest(bad)
    assert str(error.value) == f"{bad / 'embed.json'}: unreadable (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"
    for content in ([good], {**good, "format": "other"}, {"version": 1}):
        folder = write_manifest(tmp_path / "kind", content)
        with pytest.raises(FacepipeError) as error:
            store.read_manifest(folder)
        assert str(error.value) == f"{folder / 'embed.json'}: not a facepipe embedding manifest"
    for version, shown in ((2, "2"), (None, "None"), ("1", "'1'")):
        folder = write_manifest(tmp_path / "version", {**good, "version": version})
        with pytest.raises(FacepipeError) as error:
            store.read_manifest(folder)
        assert str(error.value) == f"{folder / 'embed.json'}: version {shown}; this facepipe reads version 1"
    folder = write_manifest(tmp_path / "noversion", {"format": "facepipe-embeddings"})
    with pytest.raises(FacepipeError, match=r": version None; this facepipe reads version 1$"):
        store.read_manifest(folder)


def committed(folder: Path, parts: dict[str, tuple[list[dict], np.ndarray]], *, settings: str = "key", size: int = 4) -> dict:
    """A committed embedding folder written by store's own functions, as embed writes it."""
    (folder / store.PARTS).mkdir(parents=True, exist_ok=True)
    entries, files = [], []
    for name, (lines, matrix) in parts.items():
        store.write_part(folder, name, settings, lines, matrix)
        header, _ = store.read_part_lines(folder, name)
        entries.append({"name": name, "photos": len(lines), "faces": header["faces"], "sha256": header["embeddings_sha256"]})
        files += lines
    index = store.write_jsonl(folder / store.INDEX, store.index_lines(files))
    manifest = {"format": store.FORMAT, "version": 1, "model": {"embedding_size": size}, "settings": settings, "parts": entries, "index_sha256": index}
    store.commit(folder, manifest)
    return manifest


def test_load_embeddings(tmp_path):
    manifest = committed(tmp_path, {"part-00000": ([photo("a/1.jpg", 2), reject("a/2.jpg")], rows(2)), "part-00003": ([photo("3.jpg")], rows(1, 2))})
    result = store.load_embeddings(str(tmp_path))
    assert np.array_equal(result.matrix, rows(3)) and result.matrix.dtype == np.float32
    assert result.rows == list(store.index_lines([photo("a/1.jpg", 2), photo("3.jpg")])) and result.manifest == manifest
    assert result.keys == ["a", "a", "3.jpg"]


def test_load_embeddings_of_no_faces_is_an_empty_matrix(tmp_path):
    committed(tmp_path, {}, size=7)
    result = store.load_embeddings(tmp_path)
    assert result.matrix.shape == (0, 7) and result.matrix.dtype == np.float32 and result.rows == [] and result.keys == []


def test_load_embeddings_refuses_what_embed_json_does_not_record(tmp_path):
    parts = {"part-00000": ([photo("a/1.jpg", 2)], rows(2)), "part-00001": ([photo("b/1.jpg")], rows(1))}
    folder = tmp_path / "index"
    committed(folder, parts)
    (folder / "index.jsonl").write_bytes((folder / "index.jsonl").read_bytes() + b"\n")
    with pytest.raises(FacepipeError) as error:
        store.load_embeddings(folder)
    assert str(error.value) == f"{folder / 'index.jsonl'}: differs from the one embed.json records (an interrupted run: run embed again)"
    (folder / "index.jsonl").unlink()
    with pytest.raises(FacepipeError) as error:
        store.load_embeddings(folder)
    assert str(error.value) == f"{folder / 'index.jsonl'}: unreadable (No such file or directory)"
    for damage in ("missing", "other sha"):
        folder = tmp_path / damage
        manifest = committed(folder, parts)
        if damage == "missing":
            (folder / "parts" / "part-00001.jsonl").unlink()
        else:  # a complete part, but not the one embed.json lists
            store.write_part(folder, "part-00001", "key", [photo("b/1.jpg")], rows(1, 5))
        with pytest.raises(FacepipeError) as error:
            store.load_embeddings(folder)
        assert str(error.value) == f"{folder / 'parts' / 'part-00001'}: missing or corrupt (run embed again)"
    folder = tmp_path / "count"
    manifest = committed(folder, parts)
    lines = (folder / "index.jsonl").read_bytes().splitlines(keepends=True)
    (folder / "index.jsonl").write_bytes(b"".join(lines[:2]))
    store.commit(folder, {**manifest, "index_sha256": hashlib.sha256(b"".join(lines[:2])).hexdigest()})
    with pytest.raises(FacepipeError) as error:
        store.load_embeddings(folder)
    assert str(error.value) == f"{folder / 'index.jsonl'}: 2 lines for 3 embeddings"


def test_an_embedding_folder_is_recognised_and_every_file_it_writes_is_ours(tmp_path):
    kind = store.EMBEDDING_FOLDER
    assert kind.name == "embedding folder"
    folder = tmp_path / "out"
    (folder / "parts").mkdir(parents=True)
    assert kind.identify(folder) is True  # a first run killed before its commit
    for name in ("embed.json", "index.jsonl", "rejects.jsonl", "report.json"):
        (folder / name).write_text("{}")
        (folder / f".{name}.tmp-1").write_text("")
    for name in ("parts/part-00000.npy", "parts/part-00000.jsonl", "parts/.part-00000.npy.tmp-1"):
        (folder / name).write_text("")
    assert kind.identify(folder) is False  # embed.json of something else
    write_manifest(folder, {"format": "facepipe-embeddings"})
    assert kind.identify(folder) is True
    check_replaceable(folder, kind)
    assert kind.identify(tmp_path / "none") is False
    for other in ("notes.txt", "parts/other.npy", "parts/x/part-00000.npy"):
        (folder / other).parent.mkdir(exist_ok=True)
        (folder / other).write_text("")
        with pytest.raises(FacepipeError, match="refusing to replace"):
            check_replaceable(folder, kind)
        (folder / other).unlink()


# --- faces: the training set's prepare params -----------------------------------------------------------


FACES = PrepareParams(image_size=32, min_face_size=20, chunk_size=2)


def test_training_faces_are_the_recorded_ones():
    spec = SPEC.model_copy(update={"faces": recorded_params(FACES)})
    assert training_faces(spec) == FACES
    assert NOT_FACES == {"samples_per_shard", "follow_symlinks"}
    given = FACES.model_copy(update={"samples_per_shard": 3, "follow_symlinks": True})
    assert training_faces(spec, given) == FACES.model_copy(update={"follow_symlinks": True})  # not samples_per_shard
    facenet = FACES.model_copy(update={"crop": "facenet", "margin": 4})
    assert training_faces(SPEC.model_copy(update={"faces": recorded_params(facenet)}), facenet) == facenet


@pytest.mark.parametrize(
    ("field", "value", "shown", "recorded"),
    [("min_face_size", 60, "60", "20"), ("detector", "mtcnn", "'mtcnn'", "'retinaface'"), ("image_size", 48, "48", "32"), ("crop", "facenet", "'facenet'", "'arcface'")],
)
def test_training_faces_refuse_other_params(field, value, shown, recorded):
    spec = SPEC.model_copy(update={"faces": recorded_params(FACES)})
    with pytest.raises(FacepipeError) as error:
        training_faces(spec, FACES.model_copy(update={field: value}))
    assert str(error.value) == (
        f"prepare.{field} is {shown} in the params given, the model's training set used {recorded} (model.json faces): embeddings would not match the model"
    )


def test_a_model_without_recorded_faces_takes_the_params_given(caplog):
    caplog.set_level(logging.WARNING, logger="facepipe.embed")
    assert training_faces(SPEC, FACES) is FACES
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("facepipe.embed", logging.WARNING, "embed: the model does not record how its training set was prepared: using the prepare section of the params given (or the defaults)")
    ]
    assert training_faces(SPEC.model_copy(update={"image_size": 112})) == PrepareParams()
    with pytest.raises(FacepipeError) as error:
        training_faces(SPEC)
    assert str(error.value) == "prepare.image_size is 112, the model takes 32 faces (model.json)"
    with pytest.raises(FacepipeError) as error:
        training_faces(SPEC, FACES.model_copy(update={"crop": "facenet"}))
    assert str(error.value) == "prepare.crop is 'facenet', the model takes 'arcface' faces (model.json)"
    with pytest.raises(FacepipeError) as error:
        training_faces(SPEC.model_copy(update={"crop": "facenet"}), FACES)
    assert str(error.value) == "prepare.crop is 'arcface', the model takes 'facenet' faces (model.json)"


def test_recorded_detector_weights_must_be_given_by_a_file_with_their_sha256(tmp_path):
    weights, other = tmp_path / "w.onnx", tmp_path / "o.onnx"
    weights.write_bytes(b"weights")
    other.write_bytes(b"other")
    params = FACES.model_copy(update={"detector_weights": str(weights)})
    spec = SPEC.model_copy(update={"faces": recorded_params(params)})
    assert training_faces(spec, params) == params
    copy = tmp_path / "copy" / "w.onnx"
    copy.parent.mkdir()
    copy.write_bytes(b"weights")
    assert training_faces(spec, params.model_copy(update={"detector_weights": str(copy)})).detector_weights == str(copy)
    message = f"the model's training set was detected with w.onnx (sha256 {weights_record(weights)['sha256']}): give that file as prepare.detector_weights in --params"
    for given in (None, FACES, params.model_copy(update={"detector_weights": str(other)})):
        with pytest.raises(FacepipeError) as error:
            training_faces(spec, given)
        assert str(error.value) == message
    assert training_faces(SPEC.model_copy(update={"faces": {**recorded_params(FACES), "detector_weights": None}})) == FACES
    unnamed = {key: value for key, value in recorded_params(FACES).items() if key != "detector_weights"}
    assert training_faces(SPEC.model_copy(update={"faces": unnamed})) == FACES  # recorded without the key at all


def test_recorded_faces_this_facepipe_does_not_read():
    spec = SPEC.model_copy(update={"faces": {**recorded_params(FACES), "min_face_size": "big"}})
    with pytest.raises(FacepipeError) as error:
        training_faces(spec)
    assert str(error.value) == "model.json faces: not prepare params this facepipe reads (1 validation error for PrepareParams)"


# --- runtime: which model file --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    backbone = create_backbone(SPEC.backbone, embedding_size=SPEC.embedding_size, image_size=SPEC.image_size)
    out = tmp_path_factory.mktemp("gallery") / "model"
    save_model_dir(out, backbone, SPEC)
    return out


def test_resolve_a_model_folder(model_dir):
    ref = resolve_model(str(model_dir), "torch")
    weights = model_dir / "backbone.pt"
    assert ref == ModelRef(str(model_dir.resolve()), "torch", str(weights.resolve()), sha256_file(weights), SPEC)
    assert ref.describe() == {
        "runtime": "torch", "file": "backbone.pt", "sha256": sha256_file(weights), "backbone": "mobilefacenet",
        "embedding_size": 4, "image_size": 32, "crop": "arcface", "normalization": {"family": "arcface", "mean": 127.5, "std": 127.5},
    }  # fmt: skip


def test_resolve_model_errors(model_dir, tmp_path):
    def error(folder, runtime="torch") -> str:
        with pytest.raises(FacepipeError) as caught:
            resolve_model(folder, runtime)
        return str(caught.value)

    assert error(tmp_path / "none") == f"model folder not found: {tmp_path / 'none'}"
    (tmp_path / "file").write_text("")
    assert error(tmp_path / "file") == f"model folder not found: {tmp_path / 'file'}"
    assert error(model_dir, "onnx") == (
        f"--runtime onnx runs an export folder (facepipe export MODEL OUT writes backbone.onnx); {model_dir} is a model folder"
    )
    assert error(tmp_path) == f"not a model folder (model.json) or an export folder (export.json): {tmp_path}"
    bare = tmp_path / "bare"
    bare.mkdir()
    write_model_spec(bare, SPEC)
    assert error(bare) == f"model folder has no backbone.pt: {bare}"
    (bare / "backbone.pt").mkdir()
    assert error(bare) == f"model folder has no backbone.pt: {bare}"
    (bare / "backbone.pt").rmdir()
    (bare / "backbone.pt").write_bytes((model_dir / "backbone.pt").read_bytes())
    assert resolve_model(bare, "torch").sha256 == sha256_file(model_dir / "backbone.pt")  # no sha256 recorded: taken
    write_model_spec(bare, SPEC, weights_sha256="0" * 64)
    assert error(bare) == f"{bare / 'backbone.pt'}: sha256 differs from the one in model.json (corrupt, or from another run)"
    (tmp_path / "export.json").write_text("{}")
    (tmp_path / "model.json").mkdir()  # not a file: the folder is an export folder
    assert error(tmp_path) == f"{tmp_path} is an export folder, which holds no PyTorch weights: use --runtime onnx, or give the model folder"


def export_folder(folder: Path, report) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / EXPORT_REPORT).write_text(report if isinstance(report, str) else json.dumps(report), encoding="utf-8")
    return folder


def test_resolve_an_export_folder(tmp_path):
    (tmp_path / "backbone.onnx").write_bytes(b"onnx")
    digest = hashlib.sha256(b"onnx").hexdigest()
    folder = export_folder(tmp_path, {"model": SPEC.model_dump(mode="json"), "files": {"onnx": {"file": "backbone.onnx", "sha256": digest}}})
    assert resolve_model(str(folder), "onnx") == ModelRef(str(tmp_path.resolve()), "onnx", str((tmp_path / "backbone.onnx").resolve()), digest, SPEC)


def test_model_and_export_folders_resolve_whatever_the_locale(model_dir, tmp_path, ascii_locale):
    """model.json and export.json are UTF-8 (manifest.dumps keeps non-ASCII): read as such under LANG=C too."""
    spec = SPEC.model_copy(update={"faces": {"detector_weights": "/models/José/retinaface.onnx"}})
    weights = (model_dir / "backbone.pt").read_bytes()
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "backbone.pt").write_bytes(weights)
    write_model_spec(folder, spec, weights_sha256=hashlib.sha256(weights).hexdigest())
    assert "José".encode() in (folder / "model.json").read_bytes()
    assert resolve_model(folder, "torch").spec == spec
    (tmp_path / "export" / "backbone.onnx").parent.mkdir()
    (tmp_path / "export" / "backbone.onnx").write_bytes(b"onnx")
    report = {"model": spec.model_dump(mode="json"), "files": {"onnx": {"file": "backbone.onnx", "sha256": hashlib.sha256(b"onnx").hexdigest()}}}
    (tmp_path / "export" / EXPORT_REPORT).write_bytes(dumps(report).encode("utf-8"))
    assert resolve_model(tmp_path / "export", "onnx").spec == spec


@pytest.mark.parametrize(
    ("report", "why"),
    [
        ("{", "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
        ({"files": {}}, "'model'"),
        ({"model": {"backbone": "x", "embedding_size": 4}, "files": {}}, "Field required"),  # one error: the first one's message
        ({"model": {"backbone": "x", "embedding_size": "a", "image_size": "b"}, "files": {}}, "Input should be a valid integer, unable to parse string as an integer"),
        ({"model": SPEC.model_dump(mode="json"), "files": {}}, "'onnx'"),
        ({"model": SPEC.model_dump(mode="json"), "files": []}, "list indices must be integers or slices, not str"),
        ([], "list indices must be integers or slices, not str"),
    ],
)
def test_an_export_without_an_onnx_file_is_refused(tmp_path, report, why):
    folder = export_folder(tmp_path, report)
    with pytest.raises(FacepipeError) as error:
        resolve_model(folder, "onnx")
    assert str(error.value) == f"{folder / 'export.json'}: not an export with an ONNX file ({why})"


def test_an_export_whose_onnx_file_is_missing_or_changed(tmp_path):
    report = {"model": SPEC.model_dump(mode="json"), "files": {"onnx": {"file": "b.onnx", "sha256": hashlib.sha256(b"onnx").hexdigest()}}}
    folder = export_folder(tmp_path, report)
    with pytest.raises(FacepipeError) as error:
        resolve_model(folder, "onnx")
    assert str(error.value) == f"{folder / 'export.json'} names b.onnx, which is not in {folder}"
    (tmp_path / "b.onnx").write_bytes(b"onnx!")
    with pytest.raises(FacepipeError) as error:
        resolve_model(folder, "onnx")
    assert str(error.value) == f"{folder / 'b.onnx'}: sha256 differs from the one in export.json (corrupt, or from another export)"
    del report["files"]["onnx"]["sha256"]
    export_folder(tmp_path, report)
    with pytest.raises(FacepipeError, match="sha256 differs"):
        resolve_model(folder, "onnx")


# --- embed: settings and the plan of parts ---------------------------------------------------------------


def work(**changes) -> embed.Work:
    ref = ModelRef("/m", "torch", "/m/backbone.pt", "abc", SPEC)
    return embed.replace(embed.Work("/raw", FACES, ref, "cpu", True, 8, False), **changes)


def test_settings_key_is_the_sha256_of_what_makes_rows_interchangeable():
    content = {"model_sha256": "abc", "runtime": "torch", "faces": FACES.model_dump(mode="json"), "flip": True, "all_faces": False, "batch_size": 8, "device": "cpu"}
    assert embed.settings_key(work(), 8) == hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()
    assert embed.settings_key(work(raw="/other", batch_size=3), 8) == embed.settings_key(work(), 8)
    ref = work().model
    changed = [
        embed.settings_key(work(), 9), embed.settings_key(work(flip=False), 8), embed.settings_key(work(all_faces=True), 8),
        embed.settings_key(work(model=embed.replace(ref, sha256="abd")), 8), embed.settings_key(work(model=embed.replace(ref, runtime="onnx")), 8),
        embed.settings_key(work(faces=FACES.model_copy(update={"quality": 90})), 8),
    ]  # fmt: skip
    assert len(set(changed) | {embed.settings_key(work(), 8)}) == 7


def items(*paths: str) -> list[ScanItem]:
    return [ScanItem(p, p.partition("/")[0] if "/" in p else None) for p in paths]


def test_plan_of_a_new_folder_cuts_the_scan_into_parts(tmp_path):
    scan = [*items("a/1", "a/2"), ScanItem("a/3", "a", "empty_file"), *items("b/1", "b/2", "c/1")]
    plan = embed.plan_parts(tmp_path / "out", scan, {}, settings="key", files_per_part=2)
    assert plan.parts == [("part-00000", items("a/1", "a/2")), ("part-00001", items("b/1", "b/2")), ("part-00002", items("c/1"))]
    assert (plan.reused, plan.removed, plan.old_parts) == (0, 0, {})
    assert embed.plan_parts(tmp_path, [], {}, settings="key", files_per_part=2).parts == []


def test_plan_of_an_update(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="facepipe.embed")
    committed(tmp_path, {
        "part-00000": ([photo("a/1"), reject("a/2")], rows(1)),  # unchanged: kept
        "part-00004": ([photo("b/1", 2), photo("b/2"), photo("b/3")], rows(4)),  # b/2 changed, b/3 gone: rewritten
        "part-00002": ([photo("c/1"), photo("c/2")], rows(2)),  # both changed: embedded again
    })  # fmt: skip
    stats = {"a/1": (10, 5), "a/2": (10, 5), "b/1": (10, 5), "b/2": (11, 5), "c/1": (10, 6), "c/2": (9, 5), "d/1": (1, 1)}
    scan = items("a/1", "a/2", "b/1", "b/2", "c/1", "c/2", "d/1")
    plan = embed.plan_parts(tmp_path, scan, stats, settings="key", files_per_part=2)
    assert plan.parts == [
        ("part-00000", "keep"),
        ("part-00005", embed.Rewrite("part-00004", [photo("b/1", 2)])),
        ("part-00006", items("b/2", "c/1")),
        ("part-00007", items("c/2", "d/1")),
    ]
    assert (plan.reused, plan.removed) == (3, 1)
    assert sorted(plan.old_parts) == ["part-00000", "part-00002", "part-00004"]
    old = plan.old_parts["part-00004"]
    assert (old.name, old.files, old.header["faces"]) == ("part-00004", [photo("b/1", 2), photo("b/2"), photo("b/3")], 4)
    assert np.array_equal(old.embeddings, rows(4))
    assert caplog.records == []


def test_plan_with_other_settings_or_a_corrupt_part_embeds_again(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="facepipe.embed")
    committed(tmp_path, {"part-00000": ([photo("a/1")], rows(1)), "part-00001": ([photo("a/2")], rows(1))})
    stats = {"a/1": (10, 5), "a/2": (10, 5)}
    plan = embed.plan_parts(tmp_path, items("a/1", "a/2"), stats, settings="other", files_per_part=5)
    assert plan.parts == [("part-00002", items("a/1", "a/2"))] and (plan.reused, plan.removed, plan.old_parts) == (0, 0, {})
    assert [r.getMessage() for r in caplog.records] == [f"embed: {tmp_path} was embedded with another model or settings: every photo is embedded again"]
    assert caplog.records[0].levelno == logging.WARNING
    caplog.clear()
    (tmp_path / "parts" / "part-00000.npy").write_bytes(b"x")
    plan = embed.plan_parts(tmp_path, items("a/1", "a/2"), stats, settings="key", files_per_part=5)
    assert plan.parts == [("part-00001", "keep"), ("part-00002", items("a/1"))] and plan.reused == 1
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.WARNING, "embed: part-00000 is missing or corrupt: its photos are embedded again")]
    caplog.clear()
    store.write_part(tmp_path, "part-00000", "key", [photo("a/1")], rows(1, 3))  # complete, but not the committed one
    plan = embed.plan_parts(tmp_path, items("a/1", "a/2"), stats, settings="key", files_per_part=5)
    assert plan.parts == [("part-00001", "keep"), ("part-00002", items("a/1"))] and list(plan.old_parts) == ["part-00001"]
    assert [r.getMessage() for r in caplog.records] == ["embed: part-00000 is missing or corrupt: its photos are embedded again"]


def test_resume_skips_the_parts_a_killed_run_finished(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="facepipe.embed")
    (tmp_path / "parts").mkdir()
    stats = {"a/1": (10, 5), "a/2": (10, 5), "b/1": (10, 5), "c/1": (10, 5)}
    store.write_part(tmp_path, "part-00001", "key", [photo("a/1"), reject("a/2")], rows(1))  # done
    store.write_part(tmp_path, "part-00002", "old", [photo("b/1")], rows(1))  # other settings
    store.write_part(tmp_path, "part-00003", "key", [photo("c/1", size=11)], rows(1))  # another file
    rewrite = embed.Rewrite("part-00009", [photo("x/1")])
    plan = embed.Plan(parts=[("part-00000", "keep"), ("part-00001", items("a/1", "a/2")), ("part-00002", items("b/1")), ("part-00003", items("c/1")), ("part-00004", items("d/1")), ("part-00005", rewrite)])
    todo = embed._resume(tmp_path, plan, stats, settings="key")
    assert todo == [("part-00002", items("b/1")), ("part-00003", items("c/1")), ("part-00004", items("d/1"))]
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.INFO, "embed: part-00001 is complete from an interrupted run: reused")]
    assert embed._part_files(items("a/1", "d/1"), stats) == [("a/1", 10, 5), ("d/1", None, None)]


def test_rewrite_copies_the_rows_of_the_photos_still_there(tmp_path):
    (tmp_path / "parts").mkdir()
    lines = [photo("a/1", 2), reject("a/2"), photo("a/3"), photo("a/4", 2)]
    store.write_part(tmp_path, "part-00000", "key", lines, rows(5))
    old = store.read_part(tmp_path, "part-00000")
    embed._rewrite(tmp_path, "part-00001", old, [lines[1], lines[3]], "new")
    part = store.read_part(tmp_path, "part-00001")
    assert part.header["settings"] == "new" and part.files == [lines[1], lines[3]]
    assert np.array_equal(part.embeddings, rows(5)[[3, 4]])
    embed._rewrite(tmp_path, "part-00002", old, [lines[0], lines[2]], "new")
    assert np.array_equal(store.read_part(tmp_path, "part-00002").embeddings, rows(5)[[0, 1, 2]])
    embed._rewrite(tmp_path, "part-00003", old, [lines[1]], "new")
    assert store.read_part(tmp_path, "part-00003").embeddings.shape == (0, 4)


def test_embed_summary_line():
    report = {"counts": {"scanned": 9, "faces": 7, "photos": 6, "rejected": 3}, "files": {"embedded": 5, "reused": 1, "removed": 2}, "timings_s": {"total": 12.345}, "faces_per_s": 3.5}
    assert embed.summary_line(report) == (
        "embed: scanned 9, 7 face(s) from 6 photo(s), rejected 3; embedded 5 photo(s), reused 1, removed 2 in 12.3 s (3.5 faces/s)"
    )


# --- compare: thresholds ---------------------------------------------------------------------------------


def thresholds_file(tmp_path: Path, content) -> Path:
    path = tmp_path / "thresholds.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content), encoding="utf-8")
    return path


def test_read_thresholds(tmp_path):
    path = thresholds_file(tmp_path, {"thresholds": {"1e-3": 0.5, "1e-1": 0.25, "1e-4": None, "1e-2": 1}, "measured_on": {"num_different": 40}})
    assert compare.read_thresholds(str(path), None) == (0.5, 1e-3, None)  # the lowest rate measured
    assert compare.read_thresholds(path, 0.1) == (0.25, 0.1, None)
    value, rate, why = compare.read_thresholds(path, 0.01)
    assert (value, rate, why) == (1.0, 0.01, None) and type(value) is float
    assert compare.read_thresholds(path, 1e-4) == (None, None, f"{path} has no threshold at FAR 0.0001: 40 different pairs are too few to measure it")
    with pytest.raises(FacepipeError) as error:
        compare.read_thresholds(path, 0.05)
    assert str(error.value) == f"{path} has no threshold at FAR 0.05 (it has: 0.0001, 0.001, 0.01, 0.1)"


def test_read_thresholds_where_none_is_measured(tmp_path):
    path = thresholds_file(tmp_path, '{"thresholds": {"1e-1": NaN, "1e-2": Infinity, "1e-3": null, "1e-4": "0.5"}}')
    assert compare.read_thresholds(path, None) == (None, None, f"{path} has no threshold at any of its false accept rates: ? different pairs are too few to measure it")
    assert compare.read_thresholds(path, 0.1)[2] == f"{path} has no threshold at FAR 0.1: ? different pairs are too few to measure it"


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ("{", "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
        ({"other": {}}, "'thresholds'"),
        ({"thresholds": {"low": 0.5}}, "could not convert string to float: 'low'"),
        ({"thresholds": [0.5]}, "'list' object has no attribute 'items'"),
        ([], "list indices must be integers or slices, not str"),
    ],
)
def test_read_thresholds_refuses_another_file(tmp_path, content, why):
    path = thresholds_file(tmp_path, content)
    with pytest.raises(FacepipeError) as error:
        compare.read_thresholds(path, None)
    assert str(error.value) == f"{path}: not a thresholds.json of facepipe evaluate ({why})"


def test_read_thresholds_of_a_missing_file(tmp_path):
    with pytest.raises(FacepipeError) as error:
        compare.read_thresholds(tmp_path / "none.json", None)
    assert str(error.value) == f"{tmp_path / 'none.json'}: not a thresholds.json of facepipe evaluate ([Errno 2] No such file or directory: '{tmp_path / 'none.json'}')"



def test_read_thresholds_reads_utf8_under_the_ascii_locale(tmp_path, ascii_locale):
    path = thresholds_file(tmp_path, '{"thresholds": {"1e-3": null}, "measured_on": {"num_different": "zwölf"}}')
    assert compare.read_thresholds(path, None)[2] == f"{path} has no threshold at any of its false accept rates: zwölf different pairs are too few to measure it"


def test_compare_summary_line():
    result = {"score": 0.71234, "threshold": 0.31416, "far": 1e-3, "same": True, "why": None}
    assert compare.summary_line(result) == "compare: score 0.7123 >= 0.3142 (threshold at FAR 0.001): same person"
    assert compare.summary_line({**result, "same": False}) == "compare: score 0.7123 < 0.3142 (threshold at FAR 0.001): different people"
    assert compare.summary_line({**result, "same": None, "why": "no file"}) == "compare: score 0.7123 (no same/different answer: no file)"


# --- extract: the faces that pass the gates ----------------------------------------------------------


def face(x: float, y: float, side: float, score: float) -> Face:
    return Face(box=np.array([x, y, x + side, y + side], np.float32), score=score, landmarks=np.zeros((5, 2), np.float32))


GATES = PrepareParams(min_face_size=20, score_threshold=0.9)


def test_passing_faces_the_selected_one_first_then_by_score():
    small, low, big, mid, top = face(0, 0, 19, 0.99), face(0, 0, 90, 0.89), face(50, 50, 60, 0.91), face(10, 10, 20, 0.95), face(5, 5, 30, 0.97)
    kept = extract._passing([small, low, mid, big, top], GATES, (200, 200))
    assert [f is g for f, g in zip(kept, [big, top, mid])] == [True] * 3 and len(kept) == 3
    assert extract._gate([small, low, mid, big, top], GATES, (200, 200)) is big
    centre = GATES.model_copy(update={"face_selection": "center"})
    kept = extract._passing([mid, big, face(90, 90, 20, 0.9)], centre, (200, 200))
    assert [f.score for f in kept] == [0.9, 0.95, 0.91]
    assert extract._gate([mid, big, face(90, 90, 20, 0.9)], centre, (200, 200)).score == 0.9
    same = [face(0, 0, 30, 0.95), face(40, 0, 30, 0.95)]
    assert extract._passing(same, GATES.model_copy(update={"face_selection": "highest_score"}), (100, 100)) == same  # ties keep their order
    edge = [face(0, 0, 20, 0.9)]
    assert extract._passing(edge, GATES, (100, 100)) == edge  # both gates inclusive


@pytest.mark.parametrize(
    ("faces", "reason", "detail"),
    [
        ([], "no_face", "detector found no face"),
        ([face(0, 0, 50, 0.5), face(0, 0, 50, 0.89994)], "low_score", "best score 0.8999 < 0.9"),
        ([face(0, 0, 19.4, 0.95), face(0, 0, 10, 0.96), face(0, 0, 50, 0.8)], "face_too_small", "largest face 19px < min_face_size=20"),
    ],
)
def test_passing_rejects(faces, reason, detail):
    with pytest.raises(Reject) as error:
        extract._passing(faces, GATES, (100, 100))
    assert (error.value.reason, error.value.detail) == (reason, detail)
