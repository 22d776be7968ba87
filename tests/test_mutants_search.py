"""Fast tests that kill mutants of facepipe/gallery/thumbs.py and facepipe/stages/search.py: thumbnails
of small generated photos, and the search stage on hand-made embedding folders (no model)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from facepipe.config import EmbedParams
from facepipe.errors import FacepipeError
from facepipe.gallery import store, thumbs
from facepipe.quality.render import img_tag
from facepipe.stages import search

# ----------------------------------------------------------------------------- thumbnails


def _photo(path: Path, width: int = 80, height: int = 60) -> np.ndarray:
    """A JPEG of smooth colour ramps at ``path``; returns the pixels as decoded back."""
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // width, y * 255 // height, (x + y) * 255 // (width + height)], axis=-1).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, format="JPEG", quality=95)
    return np.asarray(Image.open(path).convert("RGB"))


def _jpeg(pixels: np.ndarray, size: int) -> bytes:
    pil = Image.fromarray(np.ascontiguousarray(pixels))
    pil.thumbnail((size, size))
    buffer = io.BytesIO()
    pil.save(buffer, format="JPEG", quality=85)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("box", "context", "expected"),
    [
        ((20, 10, 40, 30), 0.25, (slice(5, 35), slice(15, 45))),  # grown by 5 on each side
        ((20.5, 10.5, 40.2, 30.2), 0.0, (slice(10, 31), slice(20, 41))),  # floor the start, ceil the end
        ((2, 3, 30, 50), 0.25, (slice(0, 60), slice(0, 37))),  # clipped at the top, left and bottom
        ((50, 40, 79, 59), 0.5, (slice(30, 60), slice(35, 80))),  # clipped at the right and bottom
        ((10, 10, 30, 20), 0.5, (slice(5, 25), slice(0, 40))),  # x and y grow by their own sizes
    ],
)
def test_crop_geometry_is_exact(box, context, expected):
    image = np.arange(60 * 80 * 3, dtype=np.int64).reshape(60, 80, 3)
    crop = thumbs._crop(image, box, context)
    assert np.array_equal(crop, image[expected])
    assert crop.flags.c_contiguous


@pytest.mark.parametrize("box", [(90, 10, 120, 30), (10, 70, 30, 90), (30, 10, 30, 20), (30, 20, 40, 20)])
def test_a_box_outside_or_empty_gives_the_whole_photo(box):
    image = np.arange(60 * 80 * 3, dtype=np.int64).reshape(60, 80, 3)
    assert thumbs._crop(image, box, 0.0) is image


def test_thumbnail_of_a_face_in_a_scanned_photo(tmp_path):
    pixels = _photo(tmp_path / "raw" / "alice" / "a b.jpg")
    got = thumbs.face_thumbnail(tmp_path / "raw", "alice/a b.jpg", [20, 10, 40, 30])
    assert got == _jpeg(pixels[5:35, 15:45], 96)
    assert thumbs.face_thumbnail(str(tmp_path / "raw"), "alice/a b.jpg", [20, 10, 40, 30], size=16, context=0.5) == _jpeg(pixels[0:40, 10:50], 16)
    assert Image.open(io.BytesIO(thumbs.face_thumbnail(tmp_path / "raw", "alice/a b.jpg", [20, 10, 40, 30], size=16))).size == (16, 16)
    # no box: the whole photo, longest side 96 at most (80 x 60 is not enlarged), or `size`
    assert thumbs.face_thumbnail(tmp_path / "raw", "alice/a b.jpg", None) == _jpeg(pixels, 96)
    assert Image.open(io.BytesIO(thumbs.face_thumbnail(tmp_path / "raw", "alice/a b.jpg", None, size=40))).size == (40, 30)
    large = _photo(tmp_path / "raw" / "large.jpg", width=200, height=150)
    assert thumbs.face_thumbnail(tmp_path / "raw", "large.jpg", None) == _jpeg(large, 96)
    assert Image.open(io.BytesIO(thumbs.face_thumbnail(tmp_path / "raw", "large.jpg", [0, 0, 160, 120], context=0))).size == (96, 72)
    # an absolute path without a photo folder
    assert thumbs.face_thumbnail(None, str(tmp_path / "raw" / "alice" / "a b.jpg"), [20, 10, 40, 30]) == _jpeg(pixels[5:35, 15:45], 96)


def test_thumbnail_refusals(tmp_path):
    _photo(tmp_path / "raw" / "alice" / "1.jpg")
    _photo(tmp_path / "elsewhere.jpg")
    (tmp_path / "raw" / "broken.jpg").write_bytes(b"not an image")
    (tmp_path / "raw" / "link.jpg").symlink_to(tmp_path / "elsewhere.jpg")
    assert thumbs.face_thumbnail(tmp_path / "raw", "../elsewhere.jpg", None) is None  # outside the folder
    assert thumbs.face_thumbnail(tmp_path / "raw", "link.jpg", None) is None  # a link out of it
    assert thumbs.face_thumbnail(tmp_path / "raw", "alice/gone.jpg", None) is None
    assert thumbs.face_thumbnail(None, str(tmp_path / "gone.jpg"), None) is None
    assert thumbs.face_thumbnail(tmp_path / "raw", "broken.jpg", None) is None
    assert thumbs.face_thumbnail(None, str(tmp_path / "raw" / "broken.jpg"), None) is None
    assert thumbs._read(tmp_path / "raw", "alice/1.jpg") == (tmp_path / "raw" / "alice" / "1.jpg").read_bytes()
    with pytest.raises(ValueError, match="^outside the photo folder$"):
        thumbs._read(tmp_path / "raw", "../elsewhere.jpg")


@pytest.mark.parametrize("in_folder", [True, False])
def test_a_photo_over_max_bytes_gives_no_thumbnail(tmp_path, monkeypatch, in_folder):
    _photo(tmp_path / "raw" / "a.jpg")
    size = (tmp_path / "raw" / "a.jpg").stat().st_size
    (tmp_path / "raw" / "b.jpg").write_bytes((tmp_path / "raw" / "a.jpg").read_bytes() + b"\0")  # one byte more
    monkeypatch.setattr(thumbs, "MAX_BYTES", size)
    call = (lambda name: thumbs.face_thumbnail(tmp_path / "raw", name, None)) if in_folder else (
        lambda name: thumbs.face_thumbnail(None, str(tmp_path / "raw" / name), None)
    )
    assert call("a.jpg") is not None
    assert call("b.jpg") is None
    if not in_folder:
        with pytest.raises(ValueError, match="^too large for a thumbnail$"):
            thumbs._read(None, str(tmp_path / "raw" / "b.jpg"))


# ----------------------------------------------------------------------------- the search stage

SHA = "a" * 64
PARAMS = EmbedParams(search_method="exact", top_k=2)


def _unit(*values: float) -> list[float]:
    vector = np.asarray(values, np.float64)
    return (vector / np.linalg.norm(vector)).tolist()


def _face(x: float) -> dict:
    return {"box": [x, 1.0, x + 10, 11.0], "landmarks": [[0.0, 0.0]] * 5, "score": 0.99}


def _folder(folder: Path, photos: list[tuple[str, list[list[float]]]], *, sha: str = SHA, raw: Path | None = None) -> Path:
    """A committed embedding folder: ``photos`` (scan path, its faces' embeddings), one part."""
    (folder / store.PARTS).mkdir(parents=True)
    files = [{"path": path, "sha256": f"s{i}", "size": 1, "mtime_ns": 1, "faces": [_face(10 * j) for j in range(len(faces))]}
             for i, (path, faces) in enumerate(photos)]  # fmt: skip
    matrix = np.asarray([e for _, faces in photos for e in faces], np.float32).reshape(-1, 3)
    store.write_part(folder, "part-00000", "s", files, matrix)
    header, _ = store.read_part_lines(folder, "part-00000")
    manifest = {
        "format": store.FORMAT,
        "version": store.VERSION,
        "model": {"runtime": "torch", "file": "backbone.pt", "sha256": sha, "embedding_size": 3},
        "embed": {"flip": False, "all_faces": False, "batch_size": 3},
        "settings": "s",
        "parts": [{"name": "part-00000", "photos": len(files), "faces": len(matrix), "sha256": header["embeddings_sha256"]}],
        "index_sha256": store.write_jsonl(folder / store.INDEX, store.index_lines(files)),
    }
    store.commit(folder, manifest)
    if raw is not None:
        (folder / store.REPORT).write_text(json.dumps({"raw": str(raw)}), encoding="utf-8")
    return folder


@pytest.fixture
def gallery(tmp_path) -> Path:
    return _folder(
        tmp_path / "gallery",
        [("alice/1.jpg", [_unit(1, 0, 0)]), ("alice/2.jpg", [_unit(1, 0.2, 0)]), ("bob/1.jpg", [_unit(0, 1, 0)]), ("carol.jpg", [_unit(0, 0, 1)])],
    )


@pytest.fixture
def probes(tmp_path) -> Path:
    return _folder(
        tmp_path / "probes",
        [
            ("alice/p.jpg", [_unit(1, 0.1, 0)]),  # right
            ("bob/p.jpg", [_unit(1, 0, 0.5), _unit(0, 1, 0.1)]),  # face 0 wrong (alice), face 1 right
            ("dave/p.jpg", [_unit(0, 0.1, 1)]),  # not in the gallery: not counted
            ("top.jpg", [_unit(0, 0.9, 1)]),  # no identity: not counted
        ],
    )


def _match(identity, vector_a, vector_b, path, face=0, x=0.0):
    return {"identity": identity, "score": round(float(np.float32(np.dot(vector_a, vector_b))), 6), "path": path, "face": face, "box": [x, 1.0, x + 10, 11.0]}


def test_search_results_jsonl_and_summary(tmp_path, gallery, probes):
    summary = search.run(PARAMS, gallery, probes, jsonl=tmp_path / "out.jsonl")
    first = summary["results"][0]
    assert first == {"probe": "alice/p.jpg", "face": 0, "identity": "alice", "box": [0.0, 1.0, 10.0, 11.0], "matches": first["matches"]}
    assert [(m["identity"], m["path"], m["face"], m["box"]) for m in first["matches"]] == [
        ("alice", "alice/2.jpg", 0, [0.0, 1.0, 10.0, 11.0]), ("bob", "bob/1.jpg", 0, [0.0, 1.0, 10.0, 11.0])]  # fmt: skip
    expected = np.dot(_unit(1, 0.1, 0), _unit(1, 0.2, 0))
    assert abs(first["matches"][0]["score"] - expected) < 1e-6 and first["matches"][0]["score"] == round(first["matches"][0]["score"], 6)
    assert [(r["probe"], r["face"], r["identity"], [m["identity"] for m in r["matches"]]) for r in summary["results"]] == [
        ("alice/p.jpg", 0, "alice", ["alice", "bob"]),
        ("bob/p.jpg", 0, "bob", ["alice", "carol.jpg"]),
        ("bob/p.jpg", 1, "bob", ["bob", "alice"]),
        ("dave/p.jpg", 0, "dave", ["carol.jpg", "bob"]),
        ("top.jpg", 0, None, ["carol.jpg", "bob"]),
    ]
    assert summary["results"][2]["box"] == [10.0, 1.0, 20.0, 11.0]
    lines = (tmp_path / "out.jsonl").read_text(encoding="utf-8").splitlines()
    assert lines == [json.dumps(r, sort_keys=True) for r in summary["results"]]
    assert {key: value for key, value in summary.items() if key != "results"} == {
        "gallery": {"rows": 4, "identities": 3},
        "probes": 5,
        "top_k": 2,
        "method": "exact",
        "threshold": None,
        "far": None,
        "top1_correct": 2,
        "top1_checked": 3,
    }
    assert search.summary_line(summary) == (
        "search: 5 probe face(s) in 4 face(s) of 3 identities (exact); top-1 correct for 2 of 3 probes of known identity"
    )
    assert search.summary_line({**summary, "top1_checked": 0}) == "search: 5 probe face(s) in 4 face(s) of 3 identities (exact)"
    assert search.table(summary).splitlines()[:2] == [
        f"alice/p.jpg: alice {first['matches'][0]['score']:.3f}, bob {first['matches'][1]['score']:.3f}",
        f"bob/p.jpg: alice {summary['results'][1]['matches'][0]['score']:.3f}, carol.jpg {summary['results'][1]['matches'][1]['score']:.3f}",
    ]
    assert search.table(summary).splitlines()[2].startswith("bob/p.jpg#1: bob ")
    assert len(search.table(summary).splitlines()) == 5
    assert search.table(summary, limit=5) == search.table(summary)
    assert search.table(summary, limit=2).splitlines()[2:] == ["... 3 more (--jsonl FILE writes them all)"]
    assert len(search.table(summary, limit=2).splitlines()) == 3
    assert search.table(summary, limit=4).splitlines()[4:] == ["... 1 more (--jsonl FILE writes them all)"]


def test_search_with_thresholds(tmp_path, gallery, probes):
    (tmp_path / "thresholds.json").write_text(json.dumps({"thresholds": {"0.001": 0.5, "0.01": 0.4}}), encoding="utf-8")
    summary = search.run(PARAMS, gallery, probes, thresholds=tmp_path / "thresholds.json", far=0.01)
    assert (summary["threshold"], summary["far"]) == (0.4, 0.01) and "why_no_threshold" not in summary
    (tmp_path / "none.json").write_text(json.dumps({"thresholds": {"0.001": None}, "measured_on": {"num_different": 3}}), encoding="utf-8")
    summary = search.run(PARAMS, gallery, probes, thresholds=tmp_path / "none.json")
    assert (summary["threshold"], summary["far"]) == (None, None)
    assert summary["why_no_threshold"].endswith("3 different pairs are too few to measure it")


def test_search_refusals(tmp_path, gallery, probes):
    empty = _folder(tmp_path / "empty", [("a/1.jpg", [])])
    with pytest.raises(FacepipeError, match=f"^the gallery {empty} holds no face: there is nothing to search$"):
        search.run(PARAMS, empty, probes)
    with pytest.raises(FacepipeError, match=f"^the output {gallery / 'x.jsonl'} lies inside the gallery {gallery}$"):
        search.run(PARAMS, gallery, probes, jsonl=gallery / "x.jsonl")
    with pytest.raises(FacepipeError, match=f"^the output {probes / 'x.html'} lies inside the probes {probes}$"):
        search.run(PARAMS, gallery, probes, html=probes / "x.html")
    other = _folder(tmp_path / "other", [("a/1.jpg", [_unit(1, 0, 0)])], sha="b" * 64)
    with pytest.raises(FacepipeError) as error:
        search.run(PARAMS, gallery, other)
    assert str(error.value) == (
        f"{other} was embedded by another model file (sha256 bbbbbbbbbbbb) than the gallery (aaaaaaaaaaaa): their embeddings cannot be compared"
    )
    with pytest.raises(FacepipeError) as error:
        search.run(PARAMS, gallery, tmp_path / "gone")
    assert str(error.value) == f"probes not found: {tmp_path / 'gone'} (an embedding folder, a photo or a folder of photos)"
    (tmp_path / "photos").mkdir()
    with pytest.raises(FacepipeError) as error:
        search.run(PARAMS, gallery, tmp_path / "photos")
    assert str(error.value) == "photos as probes need --model: the gallery's model (a model folder, or an export folder with --runtime onnx)"
    assert not (tmp_path / "x.jsonl").exists()


# ----------------------------------------------------------------------------- gallery/search.py survivors


def test_gallery_empty_message_and_default_seed():
    from facepipe.gallery.search import Gallery

    with pytest.raises(FacepipeError, match="^the gallery is empty: there is nothing to search$"):
        Gallery(np.zeros((0, 3), np.float32), [])
    assert Gallery(np.eye(3, dtype=np.float32), ["a", "b", "c"]).seed == 0  # ivf's training rows: reproducible by default


def test_search_page_with_thumbnails(tmp_path):
    raw = tmp_path / "raw"
    for name in ("alice/1.jpg", "bob/1.jpg"):
        _photo(raw / name)
    gallery = _folder(tmp_path / "gallery", [("alice/1.jpg", [_unit(1, 0, 0)]), ("bob/1.jpg", [_unit(0, 1, 0)])], raw=raw)
    probes = _folder(tmp_path / "probes", [("alice/1.jpg", [_unit(1, 0.1, 0)]), ("x.jpg", [_unit(0, 1, 0.1)])], raw=raw)
    page = tmp_path / "page.html"
    search.run(PARAMS, gallery, probes, html=page)
    text = page.read_text(encoding="utf-8")
    assert "<title>search: 2 probe face(s) in a gallery of 2 face(s)</title>" in text
    assert text.count("<img") == 5 and text.count("no thumbnail") == 1  # x.jpg is not in the probes' photos
    assert ">alice/1.jpg<br>identity: alice<" in text and ">x.jpg<" in text
    thumbnail = thumbs.face_thumbnail(raw, "alice/1.jpg", _face(0)["box"])
    assert text.count(img_tag(thumbnail, alt="alice")) == 2 and text.count(img_tag(thumbnail, alt="alice/1.jpg")) == 1  # both probes list alice
    # the gallery's photos named, the probes' folder gone: placeholders for the probes
    (probes / store.REPORT).write_text(json.dumps({"raw": str(tmp_path / "gone")}), encoding="utf-8")
    search.run(PARAMS, gallery, probes, html=page, gallery_raw=raw)
    assert page.read_text(encoding="utf-8").count("<img") == 4
    (gallery / store.REPORT).unlink()
    search.run(PARAMS, gallery, probes, html=page)
    assert page.read_text(encoding="utf-8").count("<img") == 0
    assert search._photos_of(probes) is None and search._photos_of(tmp_path / "nothing") is None
    (gallery / store.REPORT).write_text("[]", encoding="utf-8")
    assert search._photos_of(gallery) is None


def test_reading_an_absolute_path_stops_one_byte_past_max_bytes(tmp_path, monkeypatch):
    _photo(tmp_path / "a.jpg")
    sizes = []

    class Spy(io.BytesIO):
        def read(self, size=-1):
            sizes.append(size)
            return super().read(size)

    monkeypatch.setattr(thumbs, "open", lambda path, mode: Spy(Path(path).read_bytes()), raising=False)
    assert thumbs._read(None, str(tmp_path / "a.jpg")) == (tmp_path / "a.jpg").read_bytes()
    assert sizes == [thumbs.MAX_BYTES + 1]  # a huge file is never read whole


def test_page_rows_one_probe_a_line():
    from facepipe.gallery.page import MatchView, ProbeView, render_page

    page = render_page([ProbeView("a.jpg", None, None, (MatchView("x", 0.5),)), ProbeView("b.jpg", None, None, (MatchView("y", 0.25),))], title="t")
    assert "</figure></div>\n<div class=\"probe\"><figure>" in page and "XX" not in page
    assert "All 2 probes shown." in page


def test_gallery_search_defaults_top5_auto():
    from facepipe.gallery.search import Gallery

    gallery = Gallery(np.eye(7, dtype=np.float32), list("abcdefg"))
    assert [m.identity for m in gallery.search(np.eye(7, dtype=np.float32)[:1])[0]] == ["a", "b", "c", "d", "e"]


def test_a_probe_row_whole_with_and_without_a_threshold():
    from facepipe.gallery.page import MAX_MATCHES, MatchView, ProbeView, _probe

    assert MAX_MATCHES == 10
    matches = (MatchView("bob", 0.5), MatchView("ann", 0.25), *(MatchView(f"m{i}", 0.125) for i in range(9)))
    none = "<div class=\"none\">no thumbnail</div>"

    def figure(kind: str, identity: str, score: str, mark: str = "") -> str:
        return f"<figure class=\"{kind}\">{none}<figcaption>{identity}<br>{score}{mark}</figcaption></figure>"

    same, different = " <span class=\"mark same\">same</span>", " <span class=\"mark different\">different</span>"
    head = f"<div class=\"probe\"><figure>{none}<figcaption>p.jpg<br>identity: ann</figcaption></figure>"
    # the top-1 (bob) is wrong, the truth (ann) second, 11 matches: the first 10 drawn, 1 left out
    row = _probe(ProbeView("p.jpg", "ann", None, matches), 0.25)
    expected = figure("wrong", "bob", "0.500", same) + figure("truth", "ann", "0.250", same)
    expected += "".join(figure("match", f"m{i}", "0.125", different) for i in range(8))
    assert row == head + expected + "<p class=\"note\">1 more matches not shown</p></div>"
    # exactly MAX_MATCHES matches: no note; no threshold: no marks
    row = _probe(ProbeView("p.jpg", "ann", None, matches[:10]), None)
    expected = figure("wrong", "bob", "0.500") + figure("truth", "ann", "0.250") + "".join(figure("match", f"m{i}", "0.125") for i in range(8))
    assert row == head + expected + "</div>"


def test_a_thumbnail_of_exactly_max_thumbnail_bytes_is_inlined():
    from facepipe.gallery.page import MAX_THUMBNAIL_BYTES, _picture

    at = b"\xff\xd8" + b"x" * (MAX_THUMBNAIL_BYTES - 2)
    assert _picture(at, alt="a") == img_tag(at, alt="a")
    assert _picture(at + b"x", alt="a") == "<div class=\"none\">thumbnail over 24 KiB, not inlined</div>"


def test_the_table_shows_the_first_50_probes_by_default():
    results = [{"probe": f"p{i}.jpg", "face": 0, "matches": [{"identity": "a", "score": 0.5}]} for i in range(51)]
    lines = search.table({"results": results}).splitlines()
    assert lines[49:] == ["p49.jpg: a 0.500", "... 1 more (--jsonl FILE writes them all)"]



def test_the_photos_of_an_embedding_folder_read_as_utf8_under_the_ascii_locale(tmp_path, ascii_locale):
    raw, folder = tmp_path / "José", tmp_path / "folder"
    raw.mkdir()
    folder.mkdir()
    (folder / store.REPORT).write_text(json.dumps({"raw": str(raw)}, ensure_ascii=False), encoding="utf-8")
    assert search._photos_of(folder) == raw


def test_the_page_names_each_face_and_cuts_no_probe_from_the_working_folder(tmp_path, monkeypatch):
    raw = tmp_path / "raw"
    for name in ("alice/1.jpg", "bob/1.jpg"):
        _photo(raw / name)
    gallery = _folder(tmp_path / "gallery", [("alice/1.jpg", [_unit(1, 0, 0)]), ("bob/1.jpg", [_unit(0, 1, 0)])], raw=raw)
    probes = _folder(tmp_path / "probes", [("alice/1.jpg", [_unit(1, 0.1, 0), _unit(0.1, 1, 0)])])  # no report.json: photos unknown
    monkeypatch.chdir(raw)  # the probe's scan path names a photo here, which is not the probes' photo
    search.run(PARAMS, gallery, probes, html=tmp_path / "page.html")
    text = (tmp_path / "page.html").read_text(encoding="utf-8")
    assert ">alice/1.jpg<br>identity: alice<" in text and ">alice/1.jpg#1<br>identity: alice<" in text
    assert text.count("<img") == 4 and text.count("no thumbnail") == 2  # the matches' thumbnails; placeholders for the probes
    assert "same identity when" not in text
    (gallery / store.REPORT).unlink()  # the gallery's photos unknown too: no thumbnail at all
    (tmp_path / "thresholds.json").write_text(json.dumps({"thresholds": {"0.01": 0.5}}), encoding="utf-8")
    search.run(PARAMS, gallery, probes, html=tmp_path / "page.html", thresholds=tmp_path / "thresholds.json")
    text = (tmp_path / "page.html").read_text(encoding="utf-8")
    assert text.count("<img") == 0 and text.count("no thumbnail") == 6
    assert "same identity when the score is at least 0.500, different below." in text
    search.run(PARAMS, gallery, probes, html=tmp_path / "page.html", gallery_raw=str(raw))  # named: the matches' thumbnails again
    assert (tmp_path / "page.html").read_text(encoding="utf-8").count("<img") == 4


def test_search_asks_the_gallery_for_the_params_top_k_and_method(gallery, probes, monkeypatch):
    from facepipe.gallery.search import Gallery

    asked = []

    class Recording(Gallery):
        def search(self, probes, **kwargs):
            asked.append(kwargs)
            return super().search(probes, **kwargs)

    monkeypatch.setattr(search, "Gallery", Recording)
    summary = search.run(PARAMS.model_copy(update={"search_method": "faiss", "top_k": 1}), gallery, probes)
    assert asked == [{"k": 1, "method": "faiss"}] and summary["method"] == "faiss"
    assert [[m["identity"] for m in r["matches"]] for r in summary["results"]] == [["alice"], ["alice"], ["bob"], ["carol.jpg"], ["carol.jpg"]]
