"""The sample raw dataset: layout, determinism, file variety, bad files, real MTCNN detection, CLI."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps, UnidentifiedImageError

from facepipe.cli import main
from facepipe.config import ParamsError, SampleDataParams, parse_section
from facepipe.data.decode import load_image
from facepipe.errors import FacepipeError
from facepipe.synthetic import photos
from facepipe.synthetic.photos import BAD_KINDS, SPECIAL_KINDS, SampleReport, make_sample_dataset

SMALL = SampleDataParams(identities=4, images_per_identity=3, seed=0)


def _hashes(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> SampleReport:
    return make_sample_dataset(tmp_path_factory.mktemp("small") / "raw", SMALL)


@pytest.fixture(scope="module")
def detector():
    from facenet_pytorch import MTCNN

    return MTCNN(keep_all=True, device="cpu")


def _faces(detector, rgb: np.ndarray) -> list[tuple[float, np.ndarray, np.ndarray]]:
    """MTCNN faces as (probability, [4] box, [5, 2] landmarks); numpy 2 needs explicit conversion."""
    boxes, probs, points = detector.detect(Image.fromarray(rgb), landmarks=True)
    if boxes is None:
        return []
    boxes, probs, points = (np.asarray(x, dtype=np.float32) for x in (boxes, probs, points))
    return list(zip(probs.tolist(), boxes, points))


def test_layout_and_counts(small: SampleReport) -> None:
    root = small.out
    assert small.counts() == {"identities": 4, "images": 12, "bad_files": len(BAD_KINDS), "files": 12 + len(BAD_KINDS)}
    # LFW layout and nothing else: one folder per identity, files directly inside.
    assert sorted(p.name for p in root.iterdir()) == sorted(small.identities)
    assert all(p.is_dir() for p in root.iterdir())
    files = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}
    assert files == {im.path for im in small.images} | {bad.path for bad in small.bad_files}
    for name in small.identities:
        assert sum(im.identity == name for im in small.images) == 3
    # Both base faces are used, and the temporary sibling is gone.
    assert {name.split("_")[0] for name in small.identities} == {"hopper", "astronaut"}
    assert [p.name for p in root.parent.iterdir()] == [root.name]


def test_same_seed_gives_identical_bytes(small: SampleReport, tmp_path: Path) -> None:
    again = make_sample_dataset(tmp_path / "raw", SMALL)
    assert _hashes(again.out) == _hashes(small.out)


def test_other_seed_differs(small: SampleReport, tmp_path: Path) -> None:
    other = make_sample_dataset(tmp_path / "raw", SMALL.model_copy(update={"seed": 1}))
    assert other.identities == small.identities
    # The same slots (file extensions may differ: the kinds are drawn from the seed too), new pixels.
    assert [im.path.rsplit(".", 1)[0] for im in other.images] == [im.path.rsplit(".", 1)[0] for im in small.images]
    assert not set(_hashes(small.out).values()) & set(_hashes(other.out).values()) - {hashlib.sha256(b"").hexdigest()}
    assert sum(a.size != b.size for a, b in zip(small.images, other.images)) >= len(small.images) - 1


def test_an_identity_is_a_function_of_its_index_and_seed_alone() -> None:
    """make_identity takes no dataset size, so the same index and seed give the same face in any dataset."""
    a, b = photos.make_identity(3, seed=5), photos.make_identity(3, seed=5)
    assert a.name == "astronaut_003" and np.array_equal(a.rgba, b.rgba)
    assert not np.array_equal(a.rgba, photos.make_identity(3, seed=6).rgba)


def test_formats_and_modes_vary(small: SampleReport) -> None:
    kinds = {im.kind: im for im in small.images}
    assert set(SPECIAL_KINDS) <= kinds.keys()
    assert sum(im.kind == "jpg" for im in small.images) >= 2
    expected_mode = {"grey": "L", "rgba": "RGBA", "cmyk": "CMYK", "png16": "I;16", "jpg": "RGB", "bmp": "RGB"}
    expected_format = {"png": "PNG", "bmp": "BMP", "webp": "WEBP", "rgba": "PNG", "png16": "PNG", "cmyk": "JPEG"}
    for kind, image in kinds.items():
        with Image.open(small.out / image.path) as pil:
            assert pil.mode == expected_mode.get(kind, pil.mode), kind
            assert pil.format == expected_format.get(kind, pil.format), kind
            orientation = pil.getexif().get(0x0112)
            assert (orientation in (3, 6, 8)) if kind == "exif" else orientation is None
            assert ImageOps.exif_transpose(pil).size == image.size
    sizes = np.array([im.size for im in small.images])
    assert sizes.min() >= SMALL.min_side and sizes.max() <= SMALL.max_side
    assert (sizes[:, 0] != sizes[:, 1]).any()


def test_bad_files_are_bad_in_the_expected_way(small: SampleReport) -> None:
    bad = {b.kind: b for b in small.bad_files}
    assert sorted(bad) == sorted(BAD_KINDS)
    data = {kind: (small.out / b.path).read_bytes() for kind, b in bad.items()}
    assert data["empty"] == b""
    with pytest.raises(UnidentifiedImageError):
        Image.open(io.BytesIO(data["not_image"]))
    with pytest.raises(OSError), Image.open(io.BytesIO(data["truncated"])) as pil:
        pil.load()
    with Image.open(io.BytesIO(data["tiny"])) as pil:
        assert max(pil.size) <= 32
    good = {im.path: (small.out / im.path).read_bytes() for im in small.images}
    for kind, same_identity in (("duplicate_within", True), ("duplicate_across", False)):
        sources = [p for p, b in good.items() if b == data[kind]]
        assert len(sources) == 1
        assert (sources[0].split("/")[0] == bad[kind].path.split("/")[0]) is same_identity
        assert sources[0] < bad[kind].path  # in sorted order the original comes first, the copy is the reject
    assert "/" in bad["no_face"].path and load_image(data["no_face"], max_pixels=10**8).shape[2] == 3


def test_bad_files_off(tmp_path: Path) -> None:
    report = make_sample_dataset(tmp_path / "raw", SMALL.model_copy(update={"identities": 2, "bad_files": False}))
    assert report.bad_files == () and len(list(report.out.rglob("*.*"))) == 6


def test_mtcnn_finds_and_aligns_the_faces(small: SampleReport, detector) -> None:
    """Real detection with the reader prepare uses: >= 95% of the good images have a face with
    p >= 0.95, shorter box side >= 40 px, and landmarks near the true ones."""
    found = 0
    # Every special kind (EXIF, CMYK, 16-bit, RGBA, ...) first, then plain JPEGs: 10 images in all.
    chosen = sorted(small.images, key=lambda im: im.kind == "jpg")[:10]
    assert {im.kind for im in chosen} >= set(SPECIAL_KINDS)
    for image in chosen:
        rgb = load_image((small.out / image.path).read_bytes(), max_pixels=10**8)
        assert rgb.shape[1::-1] == image.size
        iod = float(np.linalg.norm(image.landmarks[1] - image.landmarks[0]))
        for prob, box, points in _faces(detector, rgb):
            side = float(min(box[2] - box[0], box[3] - box[1]))
            error = float(np.linalg.norm(points - image.landmarks, axis=1).mean()) / iod
            if prob >= 0.95 and side >= 40 and error < 0.35:
                assert 0.2 <= side / min(image.size) <= 0.65
                found += 1
                break
    assert found >= 0.95 * len(chosen)


def test_mtcnn_finds_no_face_in_the_non_face_files(small: SampleReport, detector) -> None:
    for bad in small.bad_files:
        if bad.kind in ("no_face", "tiny"):
            rgb = load_image((small.out / bad.path).read_bytes(), max_pixels=10**8)
            assert not [f for f in _faces(detector, rgb) if f[0] >= 0.95 and min(f[1][2:] - f[1][:2]) >= 40]


def test_refuses_non_empty_output_and_files(tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x.txt").write_text("keep me")
    with pytest.raises(FacepipeError, match="not empty"):
        make_sample_dataset(tmp_path / "full", SMALL)
    assert (tmp_path / "full" / "x.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("")
    with pytest.raises(FacepipeError, match="not a folder"):
        make_sample_dataset(tmp_path / "file", SMALL)
    (tmp_path / "empty").mkdir()
    assert make_sample_dataset(tmp_path / "empty", SMALL.model_copy(update={"identities": 2})).counts()["images"] == 6


def test_failure_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(photos, "encode", boom)
    with pytest.raises(RuntimeError):
        make_sample_dataset(tmp_path / "raw", SMALL)
    assert list(tmp_path.iterdir()) == []


def test_params_validation() -> None:
    with pytest.raises(ParamsError, match="min_side"):
        parse_section(SampleDataParams, "sample_data", {"min_side": 600, "max_side": 300})
    with pytest.raises(ParamsError, match="unknown key"):
        parse_section(SampleDataParams, "sample_data", {"identites": 3})


def test_cli_writes_dataset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    params = tmp_path / "params.yaml"
    params.write_text("sample_data:\n  identities: 3\n  images_per_identity: 5\n  bad_files: false\n")
    out = tmp_path / "raw"
    code = main(["sample-data", str(out), "--params", str(params), "--images-per-identity", "2", "--seed", "7"])
    assert code == 0
    assert sorted(p.name for p in out.iterdir()) == ["astronaut_001", "hopper_000", "hopper_002"]
    assert len(list(out.rglob("*.*"))) == 6
    assert capsys.readouterr().out.strip().splitlines() == [
        f"sample-data: wrote 3 identities, 6 images, 0 bad files in {out}"
    ]


@pytest.mark.parametrize(
    ("setup", "extra", "message"),
    [
        ("file", [], "not a folder"),
        ("full", [], "not empty"),
        ("none", ["--identities", "0"], "sample_data.identities"),
        ("none", ["--images-per-identity", "0"], "sample_data.images_per_identity"),
        ("none", ["--seed", "-1"], "sample_data.seed"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], setup: str, extra: list[str], message: str
) -> None:
    out = tmp_path / "raw"
    if setup == "file":
        out.write_text("")
    elif setup == "full":
        out.mkdir()
        (out / "something").write_text("")
    (tmp_path / "empty.yaml").write_text("")
    code = main(["sample-data", str(out), "--params", str(tmp_path / "empty.yaml"), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("facepipe sample-data: error:") and message in err[0]


def test_conftest_fixture(sample_raw: Path) -> None:
    identities = sorted(p.name for p in sample_raw.iterdir())
    assert len(identities) == 6
    assert sum(1 for _ in sample_raw.rglob("*.*")) == 6 * 4 + len(BAD_KINDS)
