"""Fast tests that run embed and compare on a random-initialised small model and a stand-in detector
(faces placed by the test, so every box, score and reject is known): the mutation tests of
facepipe.stages.embed, facepipe.stages.compare, facepipe.gallery.runtime's embedders and the
all-faces path of facepipe.data.extract (tests/README.md). tests/test_embed.py runs a trained model
and the real detector."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from facepipe.alignment import template
from facepipe.config import EmbedParams, ExportParams, PrepareParams
from facepipe.data import extract
from facepipe.data.scan import ScanItem, file_stats, scan_raw
from facepipe.detection.base import Face
from facepipe.errors import FacepipeError
from facepipe.evaluation.embed import embed_images
from facepipe.gallery import runtime, store
from facepipe.gallery.runtime import resolve_model
from facepipe.io.manifest import dumps, recorded_params
from facepipe.io.model_dir import ModelSpec, load_backbone, save_model_dir
from facepipe.io.records import decode_image
from facepipe.models import create_backbone
from facepipe.stages import compare, embed, search

FACES = PrepareParams(image_size=32, min_face_size=20, chunk_size=2, score_threshold=0.9)
SPEC = ModelSpec(backbone="mobilefacenet", embedding_size=8, image_size=32, faces=recorded_params(FACES))
EMBED = EmbedParams(device="cpu", batch_size=2, files_per_part=2)


def face(x: float, y: float, side: float, score: float, *, degenerate: bool = False) -> Face:
    points = np.full((5, 2), 5.0) if degenerate else template(112) / 112 * side + [x, y]
    return Face(box=np.array([x, y, x + side, y + side], np.float64), score=score, landmarks=points.astype(np.float64))


#: The stand-in detector's faces by the (height, width) of the image it is given.
FOUND = {
    (90, 80): [face(10, 10, 60, 0.99)],  # ann/1.png
    (100, 120): [face(80, 20, 30, 0.98), face(5, 5, 70, 0.96), face(60, 60, 25, 0.97, degenerate=True), face(0, 0, 90, 0.5)],  # ann/2.png
    (70, 70): [],  # bob/1.png
    (64, 96): [face(30, 4, 50, 0.95)],  # top.png
    (66, 66): [face(0, 0, 10, 0.99)],  # bob/3.png: too small
}


class Detector:
    def __init__(self, found: dict, fail: tuple = ()):
        self.found, self.fail, self.calls = found, fail, []

    def detect(self, images, *, reductions=None):
        shapes = [image.shape[:2] for image in images]
        self.calls.append((shapes, reductions))
        if any(shape in self.fail for shape in shapes):
            raise RuntimeError("boom")
        return [list(self.found.get(shape, [])) for shape in shapes]


@pytest.fixture
def detector(monkeypatch: pytest.MonkeyPatch) -> Detector:
    found = Detector(FOUND)
    asked = []
    monkeypatch.setattr(extract, "get_detector", lambda *args: asked.append(args) or found)
    found.asked = asked
    return found


def noise(height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def save(path: Path, image: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(path)


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("embed") / "raw"
    save(root / "ann" / "1.png", noise(90, 80, 1))
    save(root / "ann" / "2.png", noise(100, 120, 2))
    save(root / "bob" / "1.png", noise(70, 70, 3))
    (root / "bob" / "2.jpg").write_bytes(b"")
    save(root / "bob" / "3.png", noise(66, 66, 4))
    save(root / "top.png", noise(64, 96, 5))
    save(root.parent / "outside.png", noise(64, 96, 6))
    os.symlink(root.parent / "outside.png", root / "bob" / "4.png")  # the scan's own reject
    return root


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    backbone = create_backbone(SPEC.backbone, embedding_size=SPEC.embedding_size, image_size=SPEC.image_size)
    out = tmp_path_factory.mktemp("embed") / "model"
    save_model_dir(out, backbone, SPEC)
    return out


def crops_of(outcome: extract.Outcome) -> list[np.ndarray]:
    return [decode_image(o.payload) for o in (outcome, *outcome.others)]


def reference(model: Path, faces: list[np.ndarray], *, flip: bool = True) -> np.ndarray:
    """Evaluate's embedding of faces: the model and its input computed here, not by runtime."""
    backbone, _ = load_backbone(model)
    x = torch.from_numpy(np.stack(faces)).permute(0, 3, 1, 2).float() / 127.5 - 1
    with torch.no_grad():
        out = backbone(x) + (backbone(x.flip(3)) if flip else 0)
    return torch.nn.functional.normalize(out, dim=1).numpy()


# --- extract: all faces, photos outside identity folders -------------------------------------------


def test_process_chunk_keeps_every_passing_face_when_asked(raw, detector):
    paths = ["ann/1.png", "ann/2.png", "bob/1.png", "top.png", "bob/3.png"]
    outcomes = extract.process_chunk(paths, str(raw), FACES, "cpu", all_faces=True, identity_folders=False)
    assert [o.path for o in outcomes] == paths
    assert [(o.reason, o.detail) for o in outcomes] == [
        (None, ""), (None, ""), ("no_face", "detector found no face"), (None, ""),
        ("face_too_small", "largest face 10px < min_face_size=20"),
    ]  # fmt: skip
    assert [len(o.others) for o in outcomes] == [0, 1, 0, 0, 0]
    group = outcomes[1]
    assert (group.header["box"], group.header["score"]) == ([5.0, 5.0, 75.0, 75.0], 0.96)  # the largest first
    other = group.others[0]
    assert (other.header["box"], other.header["score"], other.path, other.sha256) == ([80.0, 20.0, 110.0, 50.0], 0.98, "ann/2.png", group.sha256)
    assert other.header["source_size"] == [120, 100] and other.others == ()
    assert group.sha256 == hashlib.sha256((raw / "ann" / "2.png").read_bytes()).hexdigest()
    one = extract.process_chunk(paths, str(raw), FACES, "cpu", identity_folders=False)
    assert [o.others for o in one] == [()] * 5 and [o.header for o in one[:2]] == [o.header for o in outcomes[:2]]
    assert [o.payload for o in one[:2]] == [o.payload for o in outcomes[:2]]
    assert detector.asked[0] == ("retinaface", None, 20, 640, "cpu")


def test_process_chunk_reads_only_identity_folders_by_default(raw, detector):
    stray, after = extract.process_chunk(["top.png", "ann/1.png"], str(raw), FACES)
    assert (stray.reason, stray.detail, stray.sha256) == ("outside_identity_folder", "file is not inside an identity folder", None)
    assert after.accepted and detector.asked == [("retinaface", None, 20, 640, "auto")]
    empty, later = extract.process_chunk(["bob/2.jpg", "ann/1.png"], str(raw), FACES, "cpu")  # a reject of the decode
    assert later.accepted
    assert (empty.path, empty.sha256, empty.reason, empty.detail) == ("bob/2.jpg", hashlib.sha256(b"").hexdigest(), "empty_file", "0 bytes")
    detector.calls.clear()
    [kept] = extract.process_chunk(["top.png"], str(raw), FACES, "cpu", all_faces=True, identity_folders=False)
    assert kept.accepted and detector.calls == [([(64, 96)], None)]
    assert extract.process_chunk(["ann/2.png"], str(raw), FACES, "cpu", all_faces=True)[0].others[0].header["score"] == 0.98


def test_the_decode_budget_counts_every_pixel_held(raw, detector, monkeypatch):
    monkeypatch.setattr(extract, "DECODE_BUDGET_PIXELS", 90 * 80 + 100 * 120)
    extract.process_chunk(["ann/1.png", "ann/2.png", "top.png"], str(raw), FACES, "cpu", identity_folders=False)
    assert [shapes for shapes, _ in detector.calls] == [[(90, 80), (100, 120)], [(64, 96)]]
    monkeypatch.setattr(extract, "DECODE_BUDGET_PIXELS", 90 * 80 + 100 * 120 - 1)
    extract.process_chunk(["ann/1.png", "ann/2.png"], str(raw), FACES, "cpu")
    assert [shapes for shapes, _ in detector.calls[2:]] == [[(90, 80)], [(100, 120)]]
    assert detector.asked == [("retinaface", None, 20, 640, "cpu")] * 4  # every batch on the device asked for
    monkeypatch.setattr(extract, "DECODE_BUDGET_PIXELS", 100 * 120 + 64 * 96)  # held counts from 0 after a flush
    extract.process_chunk(["ann/1.png", "ann/2.png", "top.png"], str(raw), FACES, "cpu", identity_folders=False)
    assert [shapes for shapes, _ in detector.calls[4:]] == [[(90, 80)], [(100, 120), (64, 96)]]


def test_each_photo_is_opened_once_for_its_size_and_its_decode(raw, detector, monkeypatch):
    """The header parsed for the decode budget is the one decoded: Pillow opens each file once."""
    from facepipe.data import decode

    opened, real_open = [], decode.Image.open
    monkeypatch.setattr(decode.Image, "open", lambda fp, *args, **kwargs: opened.append(fp) or real_open(fp, *args, **kwargs))
    outcomes = extract.process_chunk(["ann/1.png", "ann/2.png", "bob/1.png", "bob/2.jpg"], str(raw), FACES, "cpu")
    assert [o.reason for o in outcomes] == [None, None, "no_face", "empty_file"] and len(opened) == 3


def test_a_reject_of_the_decode_keeps_the_files_hash_and_the_size_limit_is_inclusive(tmp_path, detector):
    save(tmp_path / "ann" / "small.png", noise(19, 30, 7))  # below min_face_size=20: image_too_small
    save(tmp_path / "ann" / "edge.png", noise(20, 30, 8))  # exactly min_face_size: decoded, no face found
    small, edge = extract.process_chunk(["ann/small.png", "ann/edge.png"], str(tmp_path), FACES, "cpu")
    sha = hashlib.sha256((tmp_path / "ann" / "small.png").read_bytes()).hexdigest()
    assert (small.reason, small.detail, small.sha256) == ("image_too_small", "30x19 cannot hold a 20px face", sha)
    assert (edge.reason, edge.detail) == ("no_face", "detector found no face")
    assert edge.sha256 == hashlib.sha256((tmp_path / "ann" / "edge.png").read_bytes()).hexdigest()  # a gate reject keeps it
    extract.process_chunk(["ann/edge.png"], str(tmp_path), FACES.model_copy(update={"detector_weights": "w.onnx"}), "cpu")
    assert detector.asked[-1] == ("retinaface", "w.onnx", 20, 640, "cpu")  # the weights reach the detector


def test_only_photos_that_are_aligned_are_decoded_reduced(tmp_path, detector, monkeypatch):
    """The detector sees at most detect_size px, so a photo to align is decoded from that size up; a
    photo used as it is (detector none) is decoded at full resolution."""
    asked, opened = [], extract.decode_opened
    monkeypatch.setattr(extract, "decode_opened", lambda data, pil, *, max_pixels, longest: asked.append(longest) or opened(data, pil, max_pixels=max_pixels, longest=longest))
    save(tmp_path / "ann" / "1.png", noise(112, 112, 9))
    extract.process_chunk(["ann/1.png"], str(tmp_path), FACES, "cpu")
    extract.process_chunk(["ann/1.png"], str(tmp_path), PrepareParams(detector="none", image_size=112), "cpu")
    assert asked == [640, None]


def test_all_faces_in_every_detector_batch(raw, detector, monkeypatch):
    monkeypatch.setattr(extract, "DECODE_BUDGET_PIXELS", 1)  # one detector batch a photo
    outcomes = extract.process_chunk(["ann/2.png", "ann/1.png"], str(raw), FACES, "cpu", all_faces=True)
    assert [len(o.others) for o in outcomes] == [1, 0] and len(detector.calls) == 2


def test_read_rejects(tmp_path):
    (tmp_path / "a").mkdir()
    os.symlink(tmp_path / "none", tmp_path / "a" / "gone.png")
    with open(tmp_path / "a" / "big.png", "wb") as handle:
        handle.truncate((16 << 20) + 9)
    tiny = PrepareParams(max_pixels=1)
    gone = extract._read("a/gone.png", str(tmp_path), tiny)
    assert (gone.path, gone.sha256, gone.reason, gone.detail) == ("a/gone.png", None, "io_error", "FileNotFoundError: No such file or directory")
    big = extract._read("a/big.png", str(tmp_path), tiny, identity_folders=False)
    assert (big.path, big.sha256, big.reason, big.detail) == ("a/big.png", None, "file_too_large", f"{(16 << 20) + 9} bytes; an image of max_pixels=1 takes at most {(16 << 20) + 8}")
    (tmp_path / "top.png").write_bytes(b"data")
    assert extract._read("top.png", str(tmp_path), PrepareParams(), identity_folders=False) == (hashlib.sha256(b"data").hexdigest(), b"data")
    stray = extract.Outcome("top.png", None, reason="outside_identity_folder", detail="file is not inside an identity folder")
    assert extract._read("top.png", str(tmp_path), PrepareParams()) == stray
    with open(tmp_path / "a" / "edge.png", "wb") as handle:
        handle.truncate((16 << 20) + 8)
    assert extract._read("a/edge.png", str(tmp_path), tiny)[1] == bytes((16 << 20) + 8)


def test_a_detector_error_stays_with_its_photo(raw, detector):
    detector.fail = ((70, 70),)
    outcomes = extract.process_chunk(["ann/1.png", "bob/1.png", "ann/2.png"], str(raw), FACES, "cpu", all_faces=True)
    assert [(o.reason, o.detail) for o in outcomes] == [(None, ""), ("detector_error", "RuntimeError: boom"), (None, "")]
    assert (outcomes[1].path, outcomes[1].sha256) == ("bob/1.png", hashlib.sha256((raw / "bob" / "1.png").read_bytes()).hexdigest())
    assert len(outcomes[2].others) == 1
    assert [shapes for shapes, _ in detector.calls] == [[(90, 80), (70, 70), (100, 120)], [(90, 80)], [(70, 70)], [(100, 120)]]


def test_faces_of_a_reduced_decode_in_full_resolution_pixels(tmp_path, monkeypatch):
    big = tmp_path / "a" / "big.jpg"
    big.parent.mkdir()
    Image.fromarray(noise(200, 260, 7)).save(big, quality=90)  # decoded at 1/2 for a 64 px detector
    found = Detector({(100, 130): [face(10, 10, 40, 0.99), face(60, 20, 30, 0.98)]})
    monkeypatch.setattr(extract, "get_detector", lambda *args: found)
    params = FACES.model_copy(update={"detect_size": 100})
    [outcome] = extract.process_chunk(["a/big.jpg"], str(tmp_path), params, "cpu", all_faces=True)
    assert found.calls == [([(100, 130)], [2])]
    assert outcome.header["box"] == [20.0, 20.0, 100.0, 100.0] and outcome.header["source_size"] == [260, 200]
    assert [o.header["box"] for o in outcome.others] == [[120.0, 40.0, 180.0, 100.0]]
    [plain] = extract.process_chunk(["a/big.jpg"], str(tmp_path), FACES, "cpu", all_faces=True)
    assert found.calls[1] == ([(200, 260)], None) and plain.reason == "no_face"


# --- runtime: the model as a function of faces --------------------------------------------------------


def test_torch_embedder_is_evaluates_embedding(model, raw, detector):
    ref = resolve_model(model, "torch")
    outcomes = extract.process_chunk(["ann/1.png", "ann/2.png", "top.png"], str(raw), FACES, "cpu", all_faces=True, identity_folders=False)
    faces = np.stack([crop for o in outcomes for crop in crops_of(o)])
    embedded = runtime.embedder(ref, device="cpu", batch_size=3)(faces)
    assert embedded.shape == (4, 8) and embedded.dtype == np.float32
    assert np.abs(embedded - reference(model, list(faces))).max() <= 1e-5
    plain = runtime.embedder(ref, device="cpu", flip=False, batch_size=1)(faces)
    assert np.abs(plain - reference(model, list(faces), flip=False)).max() <= 1e-5
    assert np.abs(plain - embedded).max() > 1e-3
    assert runtime.embedder(ref, device="cpu")(faces[:0]).shape == (0, 0)


def test_embedder_defaults_and_the_model_it_loads(monkeypatch):
    """Without a device, batch size or flip: the CPU, batches of 64, flipped; the model (or session)
    is asked for by file, sha256 and device (its cache key). Stubs: no model is loaded."""
    loaded = []
    monkeypatch.setattr(runtime, "_torch_model", lambda *args: loaded.append(("torch", *args)) or "model")
    monkeypatch.setattr(runtime, "_onnx_session", lambda *args: loaded.append(("onnx", *args)) or "session")
    ref = runtime.ModelRef("/m", "torch", "/m/weights.pt", "abc", SPEC)
    made = runtime.embedder(ref)
    assert made.func is runtime._embed_torch and made.args == ("model",)
    mean, std = SPEC.normalization.mean, SPEC.normalization.std
    assert made.keywords == {"mean": mean, "std": std, "flip": True, "batch_size": 64, "device": "cpu"}
    made = runtime.embedder(runtime.ModelRef("/e", "onnx", "/e/backbone.onnx", "def", SPEC))
    assert made.func is runtime._embed_onnx and made.args == ("session",)
    assert made.keywords == {"mean": mean, "std": std, "flip": True, "batch_size": 64}
    assert loaded == [("torch", "/m/weights.pt", "abc", "cpu", SPEC.model_dump_json()), ("onnx", "/e/backbone.onnx", "def", "cpu")]


class Recording(torch.nn.Module):
    """A stand-in model: each face's per-channel mean, the shape of every batch it is given recorded."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def forward(self, x):
        self.shapes.append(tuple(x.shape))
        return x.mean(dim=(2, 3))


def test_torch_embedder_runs_batches_of_batch_size_and_gives_float32_even_for_no_faces():
    model = Recording()
    faces = np.stack([noise(4, 4, seed) for seed in range(5)])
    embedded = runtime._embed_torch(model, faces, mean=127.5, std=127.5, flip=False, batch_size=2, device="cpu")
    assert model.shapes == [(2, 3, 4, 4), (2, 3, 4, 4), (1, 3, 4, 4)]
    expected = torch.nn.functional.normalize(torch.from_numpy(faces).permute(0, 3, 1, 2).float().div(127.5).sub(1).mean(dim=(2, 3)), dim=1)
    assert embedded.dtype == np.float32 and np.abs(embedded - expected.numpy()).max() <= 1e-6
    empty = runtime._embed_torch(model, faces[:0], mean=127.5, std=127.5, flip=True, batch_size=2, device="cpu")
    assert empty.shape == (0, 0) and empty.dtype == np.float32 and len(model.shapes) == 3


def test_torch_embedder_hands_evaluate_its_arguments_and_shows_no_progress(monkeypatch):
    from facepipe.evaluation import embed as evaluation_embed

    calls = []
    monkeypatch.setattr(evaluation_embed, "embed_images", lambda model, images, **kwargs: calls.append((model, images, kwargs)) or "rows")
    faces = np.stack([noise(4, 4, seed) for seed in range(3)])
    assert runtime._embed_torch("model", faces, mean=100.0, std=50.0, flip=False, batch_size=2, device="cuda:1") == "rows"
    [(model, images, kwargs)] = calls
    assert model == "model" and len(images) == 3 and all(np.array_equal(a, b) for a, b in zip(images, faces))
    assert not kwargs.pop("progress", True)  # embed_images' own progress is off: embed shows the run's
    assert kwargs == {"count": 3, "batch_size": 2, "flip": False, "device": "cuda:1", "normalization": (100.0, 50.0)}


def test_one_thread_inside_the_block_restored_after():
    torch.set_num_threads(2)
    try:
        with runtime.one_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(KeyError), runtime.one_thread():
            raise KeyError
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)


def test_model_input():
    faces = np.array([[[[0, 127, 255], [1, 2, 3]]]], np.uint8)  # [1, 1, 2, 3]
    arcface = runtime.model_input(faces, mean=127.5, std=127.5)
    assert arcface.dtype == np.float32 and arcface.shape == (1, 3, 1, 2) and arcface.flags.c_contiguous
    assert np.array_equal(arcface, faces.transpose(0, 3, 1, 2).astype(np.float32) / np.float32(127.5) - np.float32(1))
    other = runtime.model_input(faces, mean=100.0, std=50.0)
    assert other.dtype == np.float32 and np.array_equal(other[0, :, 0, 0], np.array([-2.0, 0.54, 3.1], np.float32))


@pytest.fixture(scope="module")
def exported(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from facepipe.stages import export

    out = tmp_path_factory.mktemp("embed") / "export"
    export.run(ExportParams(formats=("onnx",)), model, out)
    return out


def test_onnx_embedder_equals_the_torch_one(model, exported):
    ref = resolve_model(exported, "onnx")
    assert ref.runtime == "onnx" and ref.describe()["file"] == "backbone.onnx"
    faces = np.stack([noise(32, 32, seed) for seed in range(5)])
    embedded = runtime.embedder(ref, device="cpu", batch_size=2)(faces)
    assert embedded.shape == (5, 8) and embedded.dtype == np.float32
    assert np.abs(embedded - reference(model, list(faces))).max() <= 1e-5
    plain = runtime.embedder(ref, device="cpu", flip=False, batch_size=5)(faces)
    assert np.abs(plain - reference(model, list(faces), flip=False)).max() <= 1e-5
    assert runtime.embedder(ref, device="cpu")(faces[:0]).shape == (0, 0)
    session = runtime._onnx_session(ref.file, ref.sha256, "cpu")
    assert session.get_providers() == ["CPUExecutionProvider"]
    options = session.get_session_options()
    assert (options.intra_op_num_threads, options.inter_op_num_threads) == (1, 1)


def test_onnx_embedder_of_no_faces_is_an_empty_float32_matrix():
    session = types.SimpleNamespace(get_inputs=lambda: [types.SimpleNamespace(name="input")])  # never run
    empty = runtime._embed_onnx(session, np.zeros((0, 32, 32, 3), np.uint8), mean=127.5, std=127.5, flip=True, batch_size=2)
    assert empty.shape == (0, 0) and empty.dtype == np.float32


def test_onnx_on_cuda_needs_onnxruntime_gpu(exported):
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime has CUDA")
    ref = resolve_model(exported, "onnx")
    with pytest.raises(FacepipeError) as error:
        runtime._onnx_session(ref.file, ref.sha256, "cuda:0")
    assert str(error.value) == "--device cuda with --runtime onnx needs onnxruntime-gpu (this onnxruntime runs on the CPU only)"


# --- embed ------------------------------------------------------------------------------------------


class Clock:
    """perf_counter for embed: 0.125 s a call (exact in binary), so the timings of a run are known."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 0.125
        return self.now


def embedded_rows(model: Path, raw: Path, paths: list[str], *, all_faces: bool = False) -> np.ndarray:
    outcomes = extract.process_chunk(paths, str(raw), FACES, "cpu", all_faces=all_faces, identity_folders=False)
    return reference(model, [crop for o in outcomes if o.accepted for crop in crops_of(o)])


def test_embed_writes_the_embedding_folder(raw, model, detector, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(embed, "time", types.SimpleNamespace(perf_counter=Clock().perf_counter))
    caplog.set_level(logging.INFO, logger="facepipe.embed")
    out = tmp_path / "new" / "folder" / "out"
    report = embed.run(EMBED, raw, model, out, workers=1, progress=False)
    assert [r.getMessage() for r in caplog.records if r.name == "facepipe.embed"] == ["embed: 6 photos, 6 to embed in 3 part(s) (0 reused, 0 removed)"]
    ref = resolve_model(model, "torch")
    work = embed.Work(str(raw), FACES, ref, "cpu", True, 2, False)
    manifest = json.loads((out / "embed.json").read_text())
    parts = manifest.pop("parts")
    index = (out / "index.jsonl").read_bytes()
    assert manifest == {
        "format": "facepipe-embeddings", "version": 1, "model": ref.describe(), "faces": recorded_params(FACES),
        "embed": {"flip": True, "all_faces": False, "batch_size": 2}, "settings": embed.settings_key(work, 2),
        "counts": {"scanned": 7, "photos": 3, "faces": 3, "rejected": 4}, "index_sha256": hashlib.sha256(index).hexdigest(),
    }  # fmt: skip
    assert [(p["name"], p["photos"], p["faces"]) for p in parts] == [("part-00000", 2, 2), ("part-00001", 2, 0), ("part-00002", 2, 1)]
    assert [p["sha256"] for p in parts] == [store.read_part(out, p["name"]).header["embeddings_sha256"] for p in parts]
    scanned = {item.path: item for item in scan_raw(raw)}
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert rejects == [
        {"path": "bob/1.png", "reason": "no_face", "detail": "detector found no face"},
        {"path": "bob/2.jpg", "reason": "empty_file", "detail": "0 bytes"},
        {"path": "bob/3.png", "reason": "face_too_small", "detail": "largest face 10px < min_face_size=20"},
        {"path": "bob/4.png", "reason": scanned["bob/4.png"].reason, "detail": scanned["bob/4.png"].detail},
    ]
    assert scanned["bob/4.png"].reason == "outside_raw_root"
    result = store.load_embeddings(out)
    assert [(r["path"], r["identity"], r["face"]) for r in result.rows] == [("ann/1.png", "ann", 0), ("ann/2.png", "ann", 0), ("top.png", None, 0)]
    assert result.rows[1]["box"] == [5.0, 5.0, 75.0, 75.0] and result.rows[2]["sha256"] == hashlib.sha256((raw / "top.png").read_bytes()).hexdigest()
    assert np.abs(result.matrix - embedded_rows(model, raw, ["ann/1.png", "ann/2.png", "top.png"])).max() <= 1e-5
    lines = store.read_part(out, "part-00002").files
    stat = (raw / "bob" / "3.png").stat()
    assert lines[0] == {"path": "bob/3.png", "sha256": hashlib.sha256((raw / "bob" / "3.png").read_bytes()).hexdigest(), "reason": "face_too_small",
                        "detail": "largest face 10px < min_face_size=20", "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}  # fmt: skip
    stat = (raw / "ann" / "1.png").stat()
    assert (store.read_part(out, "part-00000").files[0]["size"], store.read_part(out, "part-00000").files[0]["mtime_ns"]) == (stat.st_size, stat.st_mtime_ns)
    assert set(store.read_part(out, "part-00000").files[0]) == {"path", "sha256", "faces", "size", "mtime_ns"}
    assert set(store.read_part(out, "part-00000").files[0]["faces"][0]) == {"box", "landmarks", "score"}
    assert report == {
        "raw": str(raw.resolve()), "model": str(model.resolve()), "counts": {"scanned": 7, "photos": 3, "faces": 3, "rejected": 4},
        "files": {"reused": 0, "embedded": 6, "removed": 0}, "workers": 1, "scheduler": "in-process",
        "timings_s": {"scan": 0.125, "startup": 0.125, "process": 0.125, "total": 0.75}, "faces_per_s": 24.0,
    }  # fmt: skip
    assert json.loads((out / "report.json").read_text()) == report and (out / "report.json").read_text() == dumps(report)
    assert sorted(p.name for p in out.iterdir()) == ["embed.json", "index.jsonl", "parts", "rejects.jsonl", "report.json"]
    assert embed.summary_line(report) == "embed: scanned 7, 3 face(s) from 3 photo(s), rejected 4; embedded 6 photo(s), reused 0, removed 0 in 0.8 s (24.0 faces/s)"


class Bar:
    made: list = []

    def __init__(self, total, *, desc, enabled):
        self.counts = [total, desc, enabled]
        Bar.made.append(self.counts)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def update(self, n):
        self.counts.append(n)


def test_embed_shows_its_progress_by_default(raw, model, detector, tmp_path, monkeypatch):
    monkeypatch.setattr(embed, "Progress", Bar)
    Bar.made.clear()
    embed.run(EMBED, raw, model, tmp_path / "on", workers=1)
    embed.run(EMBED.model_copy(update={"files_per_part": 3}), raw, model, tmp_path / "off", workers=1, progress=False)
    assert Bar.made == [[6, "embed", True, 2, 2, 2], [6, "embed", False, 2, 1, 2, 1]]


def test_embed_at_a_scheduler_address_keeps_two_chunks_a_worker_plus_one_in_flight(raw, model, detector, tmp_path, monkeypatch):
    from contextlib import contextmanager

    from facepipe import cluster

    started, windows, asked = [], [], []

    @contextmanager
    def runner(work, *args, **kwargs):
        started.append((work, args, {k: v for k, v in kwargs.items() if k != "warm"}))
        kwargs["warm"]()
        yield (lambda chunk: cluster.done(work(chunk, *args))), 3

    def ordered(submit, items, *, window):
        windows.append(window)
        return cluster.ordered_results(submit, items, window=window)

    monkeypatch.setattr(embed, "chunk_runner", runner)
    monkeypatch.setattr(embed, "ordered_results", ordered)
    report = embed.run(EMBED, raw, model, tmp_path / "out", scheduler_address="tcp://s:1", progress=False)
    assert (report["scheduler"], report["workers"], windows) == ("tcp://s:1", 3, [7])
    ref = resolve_model(model, "torch")
    assert started == [(embed.embed_chunks, (embed.Work(str(raw), FACES, ref, "cpu", True, 2, False),), {"workers": None, "scheduler_address": "tcp://s:1", "device": "cpu"})]
    assert report["counts"] == {"scanned": 7, "photos": 3, "faces": 3, "rejected": 4}
    monkeypatch.setattr(embed, "local_workers", lambda workers, **kwargs: asked.append((workers, kwargs)) or 2)
    assert embed.run(EMBED, raw, model, tmp_path / "local", workers=4, progress=False)["scheduler"] == "local"
    assert asked == [(4, {"chunks": 3, "device": "cpu"})] and started[1][2] == {"workers": 2, "scheduler_address": None, "device": "cpu"}


def test_a_part_of_several_chunks_is_written_once_when_its_last_chunk_is_back(raw, model, detector, tmp_path, monkeypatch):
    written, write = [], embed._write_new_part
    monkeypatch.setattr(embed, "_write_new_part", lambda out, name, lines, *args: written.append((name, len(lines))) or write(out, name, lines, *args))
    out = tmp_path / "out"
    embed.run(EMBED.model_copy(update={"files_per_part": 4}), raw, model, out, workers=1, progress=False)  # chunks of 2 photos
    assert written == [("part-00000", 4), ("part-00001", 2)]
    manifest = json.loads((out / "embed.json").read_text())
    assert [(p["name"], p["photos"], p["faces"]) for p in manifest["parts"]] == [("part-00000", 4, 2), ("part-00001", 2, 1)]
    assert [store.read_part(out, p["name"]).header["settings"] for p in manifest["parts"]] == [manifest["settings"]] * 2
    assert np.abs(store.load_embeddings(out).matrix - embedded_rows(model, raw, ["ann/1.png", "ann/2.png", "top.png"])).max() <= 1e-5


def test_a_run_after_a_killed_one_reuses_the_parts_it_wrote(raw, model, detector, tmp_path, caplog):
    out = tmp_path / "out"
    embed.run(EMBED, raw, model, out, workers=1, progress=False)
    parts = {p.name: p.read_bytes() for p in (out / "parts").iterdir()}
    for name in ("embed.json", "index.jsonl", "rejects.jsonl", "report.json"):  # killed before its commit
        (out / name).unlink()
    detector.calls.clear()
    caplog.set_level(logging.INFO, logger="facepipe.embed")
    report = embed.run(EMBED, raw, model, out, workers=1, progress=False)
    assert report["files"] == {"reused": 0, "embedded": 0, "removed": 0} and detector.calls == []
    assert [r.getMessage() for r in caplog.records if "interrupted" in r.getMessage()] == [
        f"embed: part-0000{i} is complete from an interrupted run: reused" for i in range(3)
    ]
    assert {p.name: p.read_bytes() for p in (out / "parts").iterdir()} == parts and report["counts"]["faces"] == 3


def test_the_report_times_each_phase_to_the_millisecond(raw, model, detector, tmp_path, monkeypatch):
    ticks = iter([10.0, 10.00012, 10.5, 10.50034, 11.0, 11.7, 12.00091])
    monkeypatch.setattr(embed, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    report = embed.run(EMBED, raw, model, tmp_path / "out", workers=1, progress=False)
    assert report["timings_s"] == {"scan": 0.0, "startup": 0.0, "process": 0.7, "total": 2.001}
    assert report["faces_per_s"] == 4.29  # 3 faces in 0.7 s


def test_embed_again_reuses_and_updates(raw, model, detector, tmp_path, monkeypatch):
    import shutil

    raw = Path(shutil.copytree(raw, tmp_path / "raw", symlinks=True, copy_function=shutil.copy2))
    out = tmp_path / "out"
    embed.run(EMBED, raw, model, out, workers=1, progress=False)
    before = store.load_embeddings(out)
    files = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != "report.json"}
    detector.calls.clear()
    monkeypatch.setattr(embed, "time", types.SimpleNamespace(perf_counter=Clock().perf_counter))
    again = embed.run(EMBED, raw, model, out, workers=1, progress=False)
    assert again["files"] == {"reused": 6, "embedded": 0, "removed": 0} and (again["workers"], again["scheduler"]) == (0, "none")
    assert again["faces_per_s"] == 0 and again["timings_s"] == {"scan": 0.125, "total": 0.25} and detector.calls == []
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != "report.json"} == files
    (raw / "ann" / "1.png").unlink()  # part-00000 keeps ann/2.png: rewritten
    os.utime(raw / "top.png", ns=(1, 1))  # changed: embedded again; part-00002 keeps bob/3.png
    report = embed.run(EMBED, raw, model, out, workers=1, progress=False)
    assert report["files"] == {"reused": 4, "embedded": 1, "removed": 1}
    after = store.load_embeddings(out)
    assert [(p["name"], p["photos"]) for p in after.manifest["parts"]] == [("part-00003", 1), ("part-00001", 2), ("part-00004", 1), ("part-00005", 1)]
    assert {store.read_part(out, p["name"]).header["settings"] for p in after.manifest["parts"]} == {after.manifest["settings"]}  # rewritten ones too
    assert [r["path"] for r in after.rows] == ["ann/2.png", "top.png"]
    assert np.array_equal(after.matrix[0], before.matrix[1])  # the kept row, not embedded again
    assert np.abs(after.matrix[1] - before.matrix[2]).max() <= 1e-6
    assert sorted(p.name for p in (out / "parts").iterdir()) == [f"part-0000{i}.{s}" for i in (1, 3, 4, 5) for s in ("jsonl", "npy")]


def test_all_faces_embeds_every_passing_face(raw, model, detector, tmp_path):
    out = tmp_path / "out"
    embed.run(EMBED.model_copy(update={"all_faces": True, "flip": False, "batch_size": 1}), raw, model, out, workers=1, progress=False)
    result = store.load_embeddings(out)
    assert [(r["path"], r["face"], r["box"]) for r in result.rows] == [
        ("ann/1.png", 0, [10.0, 10.0, 70.0, 70.0]), ("ann/2.png", 0, [5.0, 5.0, 75.0, 75.0]),
        ("ann/2.png", 1, [80.0, 20.0, 110.0, 50.0]), ("top.png", 0, [30.0, 4.0, 80.0, 54.0]),
    ]  # fmt: skip
    assert result.manifest["embed"] == {"flip": False, "all_faces": True, "batch_size": 1}
    assert result.manifest["counts"] == {"scanned": 7, "photos": 3, "faces": 4, "rejected": 4}
    outcomes = extract.process_chunk(["ann/1.png", "ann/2.png", "top.png"], str(raw), FACES, "cpu", all_faces=True, identity_folders=False)
    expected = reference(model, [crop for o in outcomes for crop in crops_of(o)], flip=False)
    assert np.abs(result.matrix - expected).max() <= 1e-5


def test_embed_chunks_runs_the_model_once_on_the_resolved_device(raw, model, detector, monkeypatch):
    seen = []

    def embedder(ref, **kwargs):
        seen.append((ref, kwargs))
        return lambda faces: np.full((len(faces), 8), len(faces), np.float32)

    monkeypatch.setattr(embed, "embedder", embedder)
    work = embed.Work(str(raw), FACES, resolve_model(model, "torch"), "cpu", False, 3, True)
    [(lines, rows), (none, empty), (top, one)] = embed.embed_chunks([["ann/1.png", "ann/2.png"], ["bob/1.png"], ["top.png"]], work)
    assert seen == [(work.model, {"device": "cpu", "flip": False, "batch_size": 3})]
    assert detector.asked == [("retinaface", None, 20, 640, "cpu")] * 3
    assert [len(line["faces"]) for line in lines] == [1, 2] and np.array_equal(rows, np.full((3, 8), 3, np.float32))
    assert none == [{"path": "bob/1.png", "sha256": hashlib.sha256((raw / "bob" / "1.png").read_bytes()).hexdigest(), "reason": "no_face", "detail": "detector found no face"}]
    assert empty.shape == (0, 8) and empty.dtype == np.float32 and top[0]["path"] == "top.png" and one.shape == (1, 8)


def test_embed_with_the_onnx_runtime(raw, model, exported, detector, tmp_path):
    out = tmp_path / "out"
    embed.run(EMBED.model_copy(update={"runtime": "onnx"}), raw, exported, out, workers=1, progress=False)
    result = store.load_embeddings(out)
    assert result.manifest["model"] == resolve_model(exported, "onnx").describe() and result.manifest["model"]["runtime"] == "onnx"
    assert np.abs(result.matrix - embedded_rows(model, raw, ["ann/1.png", "ann/2.png", "top.png"])).max() <= 1e-5


def test_embed_refuses_before_any_work(raw, model, detector, tmp_path):
    with pytest.raises(FacepipeError) as error:
        embed.run(EMBED, tmp_path / "none", model, tmp_path / "out")
    assert str(error.value) == f"raw folder not found: {tmp_path / 'none'}"
    (tmp_path / "text" / "a").mkdir(parents=True)
    (tmp_path / "text" / "a" / "notes.txt").write_text("")
    with pytest.raises(FacepipeError) as error:
        embed.run(EMBED, tmp_path / "text", model, tmp_path / "out")
    assert str(error.value) == f"no images found under {tmp_path / 'text'}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text"]
    for out, what in ((raw / "out", "raw folder"), (model / "out", "model folder")):
        with pytest.raises(FacepipeError) as error:
            embed.run(EMBED, raw, model, out)
        assert str(error.value) == f"the output {out} lies inside the {what} {model if what == 'model folder' else raw}"
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("")
    with pytest.raises(FacepipeError, match="refusing to replace"):
        embed.run(EMBED, raw, model, foreign)
    with pytest.raises(FacepipeError, match=r"^prepare.min_face_size is 30 in the params given"):
        embed.run(EMBED, raw, model, tmp_path / "out", faces_params=FACES.model_copy(update={"min_face_size": 30}))
    with pytest.raises(FacepipeError, match="is a model folder"):
        embed.run(EMBED.model_copy(update={"runtime": "onnx"}), raw, model, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["foreign", "text"]


def test_embed_removes_stale_temporaries(raw, model, detector, tmp_path):
    out = tmp_path / "out"
    (out / "parts").mkdir(parents=True)
    (out / ".index.jsonl.tmp-99999998").write_text("")
    (out / "parts" / ".part-00000.npy.tmp-99999999").write_text("")
    embed.run(EMBED.model_copy(update={"files_per_part": 9}), raw, model, out, workers=1, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["embed.json", "index.jsonl", "parts", "rejects.jsonl", "report.json"]
    assert sorted(p.name for p in (out / "parts").iterdir()) == ["part-00000.jsonl", "part-00000.npy"]


def test_embed_follows_symlinks_as_the_training_set_did(raw, model, detector, tmp_path):
    photos = tmp_path / "photos"
    (photos / "ann").mkdir(parents=True)
    os.symlink(raw / "ann" / "1.png", photos / "ann" / "1.png")
    faces = FACES.model_copy(update={"follow_symlinks": True})
    embed.run(EMBED, photos, model, tmp_path / "on", faces_params=faces, workers=1, progress=False)
    assert store.load_embeddings(tmp_path / "on").manifest["counts"] == {"scanned": 1, "photos": 1, "faces": 1, "rejected": 0}
    embed.run(EMBED, photos, model, tmp_path / "off", workers=1, progress=False)
    assert store.load_embeddings(tmp_path / "off").manifest["counts"]["rejected"] == 1


def test_write_new_part_of_a_file_gone_since_the_scan(model, tmp_path):
    (tmp_path / "parts").mkdir()
    work = embed.Work(str(tmp_path), FACES, resolve_model(model, "torch"), "cpu", True, 2, False)
    embed._write_new_part(tmp_path, "part-00000", [{"path": "a/1.png", "sha256": "x", "reason": "io_error", "detail": ""}], [], work, "key", {})
    part = store.read_part(tmp_path, "part-00000")
    assert part.files[0]["size"] is None and part.files[0]["mtime_ns"] is None and part.embeddings.shape == (0, 8)
    assert part.header["settings"] == "key"  # what the next run's resume compares


def test_rewrite_copies_the_rows_of_the_photos_kept(tmp_path):
    (tmp_path / "parts").mkdir()
    box = {"box": [0, 0, 1, 1], "landmarks": [], "score": 1.0}
    lines = [{"path": f"a/{i}.png", "sha256": "x", "faces": [box] * n, "size": 1, "mtime_ns": 1} for i, n in enumerate((2, 1, 0, 2))]
    store.write_part(tmp_path, "part-00000", "key", lines, np.arange(40, dtype=np.float32).reshape(5, 8))
    old = store.read_part(tmp_path, "part-00000")
    embed._rewrite(tmp_path, "part-00001", old, [lines[2], lines[3]], "key")
    part = store.read_part(tmp_path, "part-00001")
    assert (part.header["settings"], part.files) == ("key", [lines[2], lines[3]])
    assert np.array_equal(part.embeddings, old.embeddings[3:])  # rows 3 and 4: after the 2 + 1 faces dropped


def test_a_part_records_the_stats_the_scan_saw_not_those_after_the_read(model, tmp_path):
    """A photo rewritten while the run read it keeps the scan's size and mtime: the next run sees it
    changed and embeds it again (a stat taken after the read would hide the change)."""
    (tmp_path / "parts").mkdir()
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "1.png").write_bytes(b"rewritten since the scan")
    work = embed.Work(str(tmp_path), FACES, resolve_model(model, "torch"), "cpu", True, 2, False)
    line = {"path": "a/1.png", "sha256": "x", "reason": "no_face", "detail": ""}
    embed._write_new_part(tmp_path, "part-00000", [line], [], work, "key", {"a/1.png": (7, 123)})
    part = store.read_part(tmp_path, "part-00000")
    assert (part.files[0]["size"], part.files[0]["mtime_ns"]) == (7, 123)


def test_runner_and_warm_up(model, detector, monkeypatch):
    work = embed.Work("/raw", FACES, resolve_model(model, "torch"), "cpu", False, 3, False)
    calls = []
    monkeypatch.setattr(embed, "chunk_runner", lambda *args, **kwargs: calls.append((args, kwargs)) or "runner")
    assert embed._runner(work, 1, workers=4, scheduler_address=None) == ("runner", "in-process")
    assert embed._runner(work, 3, workers=2, scheduler_address=None) == ("runner", "local")
    assert embed._runner(work, 1, workers=None, scheduler_address="tcp://s:1") == ("runner", "tcp://s:1")
    assert [(args, {k: v for k, v in kwargs.items() if k != "warm"}) for args, kwargs in calls] == [
        ((embed.embed_chunks, work), {"here": True}),
        ((embed.embed_chunks, work), {"workers": 2, "scheduler_address": None, "device": "cpu"}),
        ((embed.embed_chunks, work), {"workers": None, "scheduler_address": "tcp://s:1", "device": "cpu"}),
    ]
    warmed = []
    monkeypatch.setattr(embed, "embedder", lambda *args, **kwargs: warmed.append((args, kwargs)))
    for _, kwargs in calls:
        kwargs["warm"]()
    assert warmed == [((work.model,), {"device": "cpu", "flip": False, "batch_size": 3})] * 3
    assert detector.asked == [("retinaface", None, 20, 640, "cpu")] * 3


def test_settings_key_is_the_sha256_of_every_setting_that_makes_rows(model, monkeypatch):
    ref = resolve_model(model, "torch")
    work = embed.Work("/raw", FACES, ref, "cpu", True, 2, False)
    content = {
        "model_sha256": ref.sha256, "runtime": "torch", "faces": FACES.model_dump(mode="json"), "flip": True,
        "all_faces": False, "batch_size": 5, "device": "cpu",
    }  # fmt: skip
    assert embed.settings_key(work, 5) == hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()
    from facepipe import devices

    monkeypatch.setattr(devices, "cuda_device_count", lambda: 2)  # cuda:1 and cuda:0 give the same rows
    gpu = hashlib.sha256(json.dumps(content | {"device": "cuda"}, sort_keys=True).encode()).hexdigest()
    assert embed.settings_key(embed.Work("/raw", FACES, ref, "cuda:1", True, 2, False), 5) == gpu


def test_plan_parts_rewrites_reembeds_and_numbers_after_the_committed_parts(raw, model, detector, tmp_path, caplog):
    out = tmp_path / "out"
    embed.run(EMBED, raw, model, out, workers=1, progress=False)  # [ann/1, ann/2], [bob/1, bob/2.jpg], [bob/3, top]
    items, settings = scan_raw(raw), json.loads((out / "embed.json").read_text())["settings"]
    stats = file_stats(raw, items)
    caplog.set_level(logging.WARNING, logger="facepipe.embed")
    caplog.clear()  # what the run above logged (INFO when an earlier test set up the CLI's logging)
    other = embed.plan_parts(out, items, stats, settings="other", files_per_part=4)
    assert [(name, [i.path for i in source]) for name, source in other.parts] == [
        ("part-00003", ["ann/1.png", "ann/2.png", "bob/1.png", "bob/2.jpg"]), ("part-00004", ["bob/3.png", "top.png"]),
    ]  # fmt: skip
    assert (other.reused, other.removed, other.old_parts) == (0, 0, {})
    assert [r.getMessage() for r in caplog.records] == [f"embed: {out} was embedded with another model or settings: every photo is embedded again"]
    caplog.clear()
    (out / "parts" / "part-00001.npy").write_bytes(b"corrupt")
    stats.pop("ann/2.png")  # removed
    stats["bob/3.png"] = (stats["bob/3.png"][0] + 1, stats["bob/3.png"][1])  # changed
    plan = embed.plan_parts(out, [i for i in items if i.path != "ann/2.png"], stats, settings=settings, files_per_part=2)
    [(first, rewrite), (second, rewrite2), *new] = plan.parts
    assert (first, rewrite.old, [line["path"] for line in rewrite.lines]) == ("part-00003", "part-00000", ["ann/1.png"])
    assert (second, rewrite2.old, [line["path"] for line in rewrite2.lines]) == ("part-00004", "part-00002", ["top.png"])
    assert [(name, [i.path for i in source]) for name, source in new] == [("part-00005", ["bob/1.png", "bob/2.jpg"]), ("part-00006", ["bob/3.png"])]
    assert (plan.reused, plan.removed, sorted(plan.old_parts)) == (2, 1, ["part-00000", "part-00002"])
    assert plan.old_parts["part-00002"].files == store.read_part(out, "part-00002").files
    assert [r.getMessage() for r in caplog.records] == ["embed: part-00001 is missing or corrupt: its photos are embedded again"]


def test_new_parts_start_at_0_after_a_folder_without_parts(raw, model, detector, tmp_path):
    (tmp_path / "raw" / "a").mkdir(parents=True)
    os.symlink(raw / "ann" / "1.png", tmp_path / "raw" / "a" / "1.png")  # the scan's reject: no part
    embed.run(EMBED, tmp_path / "raw", model, tmp_path / "out", workers=1, progress=False)
    manifest = json.loads((tmp_path / "out" / "embed.json").read_text())
    assert manifest["parts"] == []
    item = ScanItem("a/2.png", "a")
    plan = embed.plan_parts(tmp_path / "out", [item], {"a/2.png": (1, 1)}, settings=manifest["settings"], files_per_part=2)
    assert plan.parts == [("part-00000", [item])]


def test_the_model_device_is_the_one_asked_for_and_a_bad_one_is_named_as_embed_device(monkeypatch):
    from facepipe import devices

    monkeypatch.setattr(devices, "cuda_device_count", lambda: 2)
    assert (embed._model_device("cuda:1"), embed._model_device("cpu"), embed._model_device("auto")) == ("cuda:1", "cpu", "cuda:0")
    with pytest.raises(FacepipeError) as error:
        embed._model_device("gpu")
    assert str(error.value) == "embed.device: 'gpu' is not a device (auto, cpu, cuda or cuda:N)"


def part_lines(*files: tuple[str, int | None, int | None]) -> list[dict]:
    return [{"path": path, "sha256": "x", "reason": "no_face", "detail": "", "size": size, "mtime_ns": mtime} for path, size, mtime in files]


def test_resume_skips_the_parts_an_interrupted_run_of_the_same_plan_wrote(tmp_path, caplog):
    (tmp_path / "parts").mkdir()
    empty = np.zeros((0, 8), np.float32)
    stats = {"a/1.png": (1, 10), "a/2.png": (2, 20), "b/1.png": (3, 30), "c/1.png": (4, 40), "d/1.png": (5, 50)}
    item = {path: ScanItem(path, path.split("/")[0]) for path in [*stats, "e/1.png"]}
    store.write_part(tmp_path, "part-00001", "key", part_lines(("a/1.png", 1, 10), ("a/2.png", 2, 20)), empty)  # complete
    store.write_part(tmp_path, "part-00003", "other", part_lines(("b/1.png", 3, 30)), empty)  # other settings
    store.write_part(tmp_path, "part-00004", "key", part_lines(("c/1.png", 4, 41)), empty)  # the photo changed since
    store.write_part(tmp_path, "part-00006", "key", part_lines(("e/1.png", None, None)), empty)  # a photo gone before its stat
    store.write_part(tmp_path, "part-00007", "key", part_lines(("e/1.png", None, None)), empty)  # written for a photo since seen
    plan = embed.Plan(parts=[
        ("part-00000", "keep"), ("part-00001", [item["a/1.png"], item["a/2.png"]]), ("part-00002", embed.Rewrite("part-00000", [])),
        ("part-00003", [item["b/1.png"]]), ("part-00004", [item["c/1.png"]]), ("part-00005", [item["d/1.png"]]),
        ("part-00006", [item["e/1.png"]]), ("part-00007", [item["a/1.png"]]),
    ])  # fmt: skip
    caplog.set_level(logging.INFO, logger="facepipe.embed")
    todo = embed._resume(tmp_path, plan, stats, settings="key")
    assert todo == [("part-00003", [item["b/1.png"]]), ("part-00004", [item["c/1.png"]]), ("part-00005", [item["d/1.png"]]), ("part-00007", [item["a/1.png"]])]
    assert [r.getMessage() for r in caplog.records if r.name == "facepipe.embed"] == [
        "embed: part-00001 is complete from an interrupted run: reused", "embed: part-00006 is complete from an interrupted run: reused",
    ]  # fmt: skip
    assert embed._part_files([item["e/1.png"], item["a/2.png"]], stats) == [("e/1.png", None, None), ("a/2.png", 2, 20)]


def test_embed_files_embeds_photos_anywhere(raw, model, detector, tmp_path):
    import shutil

    odd = tmp_path / "a\\b é.png"
    shutil.copyfile(raw / "ann" / "2.png", odd)
    work = embed.Work("", FACES, resolve_model(model, "torch"), "cpu", True, 2, True)
    [(line, rows), (top, one)] = embed.embed_files([odd, raw / "top.png"], work)
    assert line["path"] == str(odd) and [f["box"] for f in line["faces"]] == [[5.0, 5.0, 75.0, 75.0], [80.0, 20.0, 110.0, 50.0]]
    assert (top["path"], rows.shape, one.shape) == (str(raw / "top.png"), (2, 8), (1, 8))
    assert np.abs(np.concatenate([rows, one]) - embedded_rows(model, raw, ["ann/2.png", "top.png"], all_faces=True)).max() <= 1e-5


# --- compare --------------------------------------------------------------------------------------------


def test_compare(raw, model, detector, tmp_path):
    a, b = raw / "ann" / "1.png", raw / "top.png"
    ref = resolve_model(model, "torch")
    [(_, ea), (_, eb)] = embed.embed_files([a, b], embed.Work("", FACES, ref, "cpu", True, 2, False))
    score = float(np.dot(ea[0].astype(np.float64), eb[0].astype(np.float64)))
    thresholds = tmp_path / "thresholds.json"
    thresholds.write_text(json.dumps({"thresholds": {"1e-2": score, "1e-3": np.nextafter(score, 2)}}))
    result = compare.run(EMBED, str(a), str(b), str(model), thresholds=str(thresholds))
    line_a = {"box": [10.0, 10.0, 70.0, 70.0], "landmarks": result["a"]["landmarks"], "score": 0.99}
    assert result == {
        "a": {"path": str(a), **line_a}, "b": {"path": str(b), "box": [30.0, 4.0, 80.0, 54.0], "landmarks": result["b"]["landmarks"], "score": 0.95},
        "score": round(score, 6), "threshold": np.nextafter(score, 2), "far": 1e-3, "same": False, "why": None,
    }  # fmt: skip
    assert len(result["a"]["landmarks"]) == 5
    assert compare.run(EMBED, a, b, model, thresholds=thresholds, far=0.01)["same"] is True
    assert abs(score - float(np.dot(reference(model, [crops_of(o)[0] for o in extract.process_chunk(["ann/1.png", "top.png"], str(raw), FACES, "cpu", identity_folders=False)])[0], reference(model, [crops_of(o)[0] for o in extract.process_chunk(["top.png"], str(raw), FACES, "cpu", identity_folders=False)])[0]))) <= 1e-5
    plain = compare.run(EMBED.model_copy(update={"flip": False}), a, b, model)
    [(_, fa), (_, fb)] = embed.embed_files([a, b], embed.Work("", FACES, ref, "cpu", False, 2, False))
    assert plain["score"] == round(float(np.dot(fa[0].astype(np.float64), fb[0].astype(np.float64))), 6) != result["score"]
    assert (plain["threshold"], plain["far"], plain["same"], plain["why"]) == (None, None, None, "no thresholds.json given (evaluate writes one: --thresholds)")


def test_compare_refusals(raw, model, detector, tmp_path):
    a, empty = raw / "ann" / "1.png", raw / "bob" / "1.png"
    for pair, missing in (((tmp_path / "x.png", a), tmp_path / "x.png"), ((a, tmp_path), tmp_path)):
        with pytest.raises(FacepipeError) as error:
            compare.run(EMBED, *pair, model)
        assert str(error.value) == f"photo not found: {missing}"
    with pytest.raises(FacepipeError) as error:
        compare.run(EMBED, a, empty, model)
    assert str(error.value) == f"{empty}: no usable face (no_face: detector found no face)"
    with pytest.raises(FacepipeError, match=r"^prepare.min_face_size is 30 in the params given"):
        compare.run(EMBED, a, a, model, faces_params=FACES.model_copy(update={"min_face_size": 30}))
    with pytest.raises(FacepipeError, match="is a model folder"):
        compare.run(EMBED.model_copy(update={"runtime": "onnx"}), a, a, model)
    with pytest.raises(FacepipeError, match="not a thresholds.json"):
        compare.run(EMBED, a, a, model, thresholds=tmp_path / "none.json")



def test_compare_embeds_one_face_a_photo_with_the_params(raw, model, detector, monkeypatch):
    calls = []
    real = compare.embed_files
    monkeypatch.setattr(compare, "embed_files", lambda files, work: calls.append((files, work)) or real(files, work))
    a, b = raw / "ann" / "2.png", raw / "top.png"
    result = compare.run(EMBED.model_copy(update={"batch_size": 3, "flip": False}), a, b, model)
    assert calls == [([a, b], embed.Work("", FACES, resolve_model(model, "torch"), "cpu", False, 3, False))]
    assert result["a"]["box"] == [5.0, 5.0, 75.0, 75.0]  # the photo's best face of two

# --- search with photos as probes -----------------------------------------------------------------------


def _spies(monkeypatch: pytest.MonkeyPatch) -> list:
    """search's embedders and resolve_model recorded (and run)."""
    calls = []
    for name in ("embed_chunks", "embed_files", "resolve_model"):
        real = getattr(search, name)
        monkeypatch.setattr(search, name, lambda *args, _real=real, _name=name: calls.append((_name, *args)) or _real(*args))
    return calls


def test_search_embeds_photo_probes_with_the_gallerys_model_and_settings(raw, model, detector, tmp_path, monkeypatch, caplog):
    gallery = tmp_path / "gallery"
    embed.run(EMBED, raw, model, gallery, workers=1, progress=False)
    calls = _spies(monkeypatch)
    caplog.set_level(logging.WARNING, logger="facepipe.search")
    caplog.clear()  # the gallery's embed above
    params = EMBED.model_copy(update={"flip": False, "batch_size": 5, "top_k": 2, "search_method": "exact"})
    summary = search.run(params, gallery, raw, model=str(model))
    ref = resolve_model(model, "torch")
    work = embed.Work(str(raw), FACES, ref, "cpu", True, 2, False)  # the gallery's flip and batch size, not the params'
    assert calls == [("resolve_model", str(model), "torch"), ("embed_chunks", [["ann/1.png", "ann/2.png"], ["bob/1.png", "bob/2.jpg"], ["bob/3.png", "top.png"]], work)]
    assert [r.getMessage() for r in caplog.records] == [
        "search: probe bob/1.png has no usable face (no_face: detector found no face)",
        "search: probe bob/2.jpg has no usable face (empty_file: 0 bytes)",
        "search: probe bob/3.png has no usable face (face_too_small: largest face 10px < min_face_size=20)",
    ]
    assert [(r["probe"], r["face"], r["identity"], r["box"], [m["path"] for m in r["matches"]]) for r in summary["results"]] == [
        ("ann/1.png", 0, "ann", [10.0, 10.0, 70.0, 70.0], ["ann/1.png", "top.png"]),
        ("ann/2.png", 0, "ann", [5.0, 5.0, 75.0, 75.0], ["ann/2.png", "top.png"]),
        ("top.png", 0, None, [30.0, 4.0, 80.0, 54.0], ["top.png", "ann/1.png"]),
    ]  # fmt: skip
    assert all(r["matches"][0]["score"] == 1.0 for r in summary["results"])  # each photo finds itself
    assert (summary["probes"], summary["top1_correct"], summary["top1_checked"]) == (3, 2, 2)
    # all faces from the params; another model file refused whole
    calls.clear()
    every = search.run(params.model_copy(update={"all_faces": True}), gallery, raw, model=model)
    assert calls[1][2] == embed.Work(str(raw), FACES, ref, "cpu", True, 2, True)
    assert [(r["probe"], r["face"]) for r in every["results"]] == [("ann/1.png", 0), ("ann/2.png", 0), ("ann/2.png", 1), ("top.png", 0)]
    other = types.SimpleNamespace(sha256="f" * 64)
    monkeypatch.setattr(search, "resolve_model", lambda *args: other)
    with pytest.raises(FacepipeError) as error:
        search.run(params, gallery, raw, model=model)
    assert str(error.value) == f"{model} is not the model the gallery was embedded with (backbone.pt, sha256 {ref.sha256[:12]})"


def test_search_embeds_one_photo_or_refuses_a_folder_without_any(raw, model, detector, tmp_path, monkeypatch, caplog):
    gallery = tmp_path / "gallery"
    embed.run(EMBED, raw, model, gallery, workers=1, progress=False)
    calls = _spies(monkeypatch)
    caplog.clear()  # the gallery's embed
    params = EMBED.model_copy(update={"top_k": 1, "search_method": "exact"})
    photo = raw / "ann" / "2.png"
    summary = search.run(params, gallery, photo, model=model)
    assert calls[1] == ("embed_files", [photo], embed.Work(str(photo), FACES, resolve_model(model, "torch"), "cpu", True, 2, False))
    assert [(r["probe"], r["face"], r["identity"], [m["path"] for m in r["matches"]]) for r in summary["results"]] == [("2.png", 0, None, ["ann/2.png"])]
    probes = search._embed_photos(photo, calls[1][2])
    assert (probes.raw, [r["path"] for r in probes.rows], probes.matrix.shape) == (raw / "ann", ["2.png"], (1, 8))
    caplog.set_level(logging.WARNING, logger="facepipe.search")
    none = search._embed_photos(raw / "bob" / "1.png", calls[1][2])
    assert (none.rows, none.matrix.shape, none.matrix.dtype, none.raw) == ([], (0, 8), np.float32, raw / "bob")
    assert [r.getMessage() for r in caplog.records] == ["search: probe 1.png has no usable face (no_face: detector found no face)"]
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "notes.txt").write_text("")
    with pytest.raises(FacepipeError) as error:
        search.run(params, gallery, tmp_path / "text", model=model)
    assert str(error.value) == f"no images found under {tmp_path / 'text'}"
    with pytest.raises(FacepipeError, match=r"^prepare.min_face_size is 30 in the params given"):
        search.run(params, gallery, photo, model=model, faces_params=FACES.model_copy(update={"min_face_size": 30}))
    links = tmp_path / "links"
    (links / "ann").mkdir(parents=True)
    os.symlink(raw / "ann" / "1.png", links / "ann" / "1.png")
    followed = search.run(params, gallery, links, model=model, faces_params=FACES.model_copy(update={"follow_symlinks": True}))
    assert [r["probe"] for r in followed["results"]] == ["ann/1.png"]
    with pytest.raises(FacepipeError, match="^no images found under"):
        search.run(params, gallery, links, model=model)
