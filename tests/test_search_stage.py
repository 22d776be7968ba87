"""facepipe search on a real (small) trained model: top-1 equals a brute-force numpy cosine search,
photo probes equal embedded probes, the page and the JSONL, the refusals."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from embed_helpers import EMBED, Pipeline, copy_tree, photos_of

from facepipe.cli import main
from facepipe.gallery import store
from facepipe.stages import embed, search

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def split_raw(trained_pipeline: Pipeline, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Gallery photos (all but the last photo of each identity) and probe photos (the last ones)."""
    root = tmp_path_factory.mktemp("search")
    gallery, probes = root / "gallery_raw", root / "probe_raw"
    for identity in sorted(p for p in trained_pipeline.raw.iterdir() if p.is_dir()):
        photos = [p for p in photos_of(trained_pipeline.raw, identity.name) if p.suffix.lower() in (".jpg", ".png", ".webp", ".bmp")]
        for photo in photos[:-1]:
            (gallery / identity.name).mkdir(parents=True, exist_ok=True)
            shutil.copy2(photo, gallery / identity.name / photo.name)
        (probes / identity.name).mkdir(parents=True, exist_ok=True)
        shutil.copy2(photos[-1], probes / identity.name / photos[-1].name)
    return gallery, probes


@pytest.fixture(scope="module")
def folders(trained_pipeline: Pipeline, split_raw, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("search_embedded")
    gallery_raw, probe_raw = split_raw
    embed.run(EMBED, gallery_raw, trained_pipeline.model, root / "gallery", workers=1, progress=False)
    embed.run(EMBED, probe_raw, trained_pipeline.model, root / "probes", workers=1, progress=False)
    return root / "gallery", root / "probes"


def brute_force_top1(gallery: store.Embeddings, probes: np.ndarray) -> list[tuple[str, float]]:
    """Each probe's best identity by plain numpy: cosine against every row, the best row per identity."""
    scores = probes.astype(np.float64) @ gallery.matrix.astype(np.float64).T
    keys = np.array(gallery.keys)
    best = []
    for row in scores:
        per_identity = {key: row[keys == key].max() for key in sorted(set(gallery.keys))}
        best.append(min(per_identity.items(), key=lambda kv: (-kv[1], kv[0])))
    return best


def test_top1_equals_a_brute_force_numpy_search(folders):
    gallery_dir, probes_dir = folders
    gallery, probes = store.load_embeddings(gallery_dir), store.load_embeddings(probes_dir)
    expected = brute_force_top1(gallery, probes.matrix)
    for method in ("exact", "faiss"):
        summary = search.run(EMBED.model_copy(update={"search_method": method, "top_k": 3}), gallery_dir, probes_dir)
        assert [r["matches"][0]["identity"] for r in summary["results"]] == [identity for identity, _ in expected]
        assert np.allclose([r["matches"][0]["score"] for r in summary["results"]], [score for _, score in expected], atol=1e-5)
        assert all(len(r["matches"]) == 3 for r in summary["results"])
    assert summary["top1_checked"] == len(probes.rows) and summary["top1_correct"] >= len(probes.rows) // 2


def test_photo_probes_equal_embedded_probes(trained_pipeline, folders, split_raw):
    gallery_dir, probes_dir = folders
    from_folder = search.run(EMBED, gallery_dir, probes_dir)
    from_photos = search.run(EMBED, gallery_dir, split_raw[1], model=trained_pipeline.model)
    strip = lambda s: [(r["probe"], r["face"], [(m["identity"], m["path"]) for m in r["matches"]]) for r in s["results"]]  # noqa: E731
    assert strip(from_photos) == strip(from_folder)
    for a, b in zip(from_photos["results"], from_folder["results"]):
        assert np.allclose([m["score"] for m in a["matches"]], [m["score"] for m in b["matches"]], atol=1e-5)
    one = next(p for p in sorted(split_raw[1].rglob("*")) if p.is_file())
    single = search.run(EMBED, gallery_dir, one, model=trained_pipeline.model)
    assert [r["probe"] for r in single["results"]] == [one.name]
    assert single["results"][0]["matches"][0]["identity"] == from_folder["results"][0]["matches"][0]["identity"]


def test_cli_writes_the_jsonl_and_a_self_contained_page(trained_pipeline, folders, split_raw, tmp_path, capsys):
    import base64

    from facepipe.gallery.thumbs import face_thumbnail

    gallery_dir, probes_dir = folders
    jsonl, page = tmp_path / "matches.jsonl", tmp_path / "search.html"
    thresholds = trained_pipeline.evaluation / "thresholds.json"
    code = main(["search", str(gallery_dir), str(probes_dir), "--top-k", "2", "--jsonl", str(jsonl), "--html", str(page), "--thresholds", str(thresholds)])
    out = capsys.readouterr().out
    assert code == 0 and out.splitlines()[-1].startswith("search: ") and "top-1 correct for" in out
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert len(lines) == len(store.load_embeddings(probes_dir).rows) and all(len(line["matches"]) == 2 for line in lines)
    text = page.read_text()
    images = re.findall(r'src="data:image/jpeg;base64,', text)
    assert len(images) == 3 * len(lines)  # every probe and both its matches, cut from the photos embed read
    for line in lines:  # the face, not the whole photo: the probe's box, the matches' boxes in the gallery's photos
        probe = face_thumbnail(split_raw[1], line["probe"], line["box"])
        match = face_thumbnail(split_raw[0], line["matches"][0]["path"], line["matches"][0]["box"])
        assert base64.b64encode(probe).decode() in text and base64.b64encode(match).decode() in text
    assert "http://" not in text.replace("http://www.w3.org", "") and "https://" not in text


def test_refusals_are_one_line(trained_pipeline, folders, split_raw, tmp_path, capsys):
    gallery_dir, probes_dir = folders
    onnx_probes = tmp_path / "onnx_probes"
    embed.run(EMBED.model_copy(update={"runtime": "onnx"}), split_raw[1], trained_pipeline.export, onnx_probes, workers=1, progress=False)
    cases = [
        ([str(gallery_dir), str(onnx_probes)], "embedded by another model file"),
        ([str(gallery_dir), str(split_raw[1])], "photos as probes need --model"),
        ([str(gallery_dir), str(split_raw[1]), "--model", str(trained_pipeline.export)], "holds no PyTorch weights"),
        ([str(gallery_dir), str(tmp_path / "nothing")], "probes not found"),
        ([str(tmp_path), str(probes_dir)], "not an embedding folder"),
        ([str(gallery_dir), str(probes_dir), "--html", str(tmp_path / "page.txt")], "ending in .html"),
        ([str(gallery_dir), str(probes_dir), "--top-k", "0"], "--top-k must be >= 1"),
    ]
    for argv, message in cases:
        code = main(["search", *argv])
        err = capsys.readouterr().err.strip()
        assert code == 2 and message in err and len(err.splitlines()) == 1, (argv, err)


def test_library_search(folders):
    import facepipe

    gallery_dir, probes_dir = folders
    summary = facepipe.search(gallery_dir, probes_dir, top_k=1)
    assert summary["probes"] == len(store.load_embeddings(probes_dir).rows) and all(len(r["matches"]) == 1 for r in summary["results"])
