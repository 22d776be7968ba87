"""IJB-B/C 1:1 verification on a synthetic IJB folder in insightface's layout, against a direct
computation written here: each face aligned and embedded with its mirror one at a time, media
averaged, templates summed and normalised, TAR read off every threshold by counting."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from facepipe import cli
from facepipe.alignment import align_face, template
from facepipe.config import IjbParams
from facepipe.errors import FacepipeError
from facepipe.evaluation.embed import to_model_input
from facepipe.io.model_dir import ModelSpec, load_backbone, save_model_dir
from facepipe.models import create_backbone
from facepipe.stages import ijb
from test_insightface_ijb import nearest_by_loop, roc_by_loop

SIZE = 32
PARAMS = IjbParams(batch_size=5, device="cpu", workers=3, far_targets=(1e-2, 1e-1, 0.25))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    spec = ModelSpec(backbone="mobilefacenet", embedding_size=16, image_size=SIZE)
    backbone = create_backbone(spec.backbone, embedding_size=spec.embedding_size, image_size=spec.image_size)
    out = tmp_path_factory.mktemp("ijb") / "model"
    save_model_dir(out, backbone, spec)
    return out


def write_ijb(root: Path, *, identities: int = 8, seed: int = 0) -> Path:
    """IJBC layout: per identity 2-3 templates, each of 1-3 media of 1-2 faces; faces are noisy
    copies of an identity pattern, placed at a random scale and shift in a loose crop."""
    rng = np.random.default_rng(seed)
    (root / "meta").mkdir(parents=True)
    (root / "loose_crop").mkdir()
    faces, points, templates_of = [], [], {}
    tid = media = image = 0
    for identity in range(identities):
        pattern = rng.integers(0, 256, size=(8, 8, 3)).astype(np.float64)
        for _ in range(rng.integers(2, 4)):
            tid += 1
            templates_of.setdefault(identity, []).append(tid)
            for _ in range(rng.integers(1, 4)):
                media += 1
                for _ in range(rng.integers(1, 3)):
                    image += 1
                    scale, shift = rng.uniform(0.6, 1.0), rng.uniform(0, 20, size=2)
                    side = 80
                    crop = rng.integers(0, 60, size=(side, side, 3)).astype(np.float64)
                    face = np.kron(pattern, np.ones((14, 14, 1)))[: int(112 * scale), : int(112 * scale)]
                    face = np.asarray(Image.fromarray(face.astype(np.uint8)).resize((int(56 * scale),) * 2))
                    y, x = int(shift[1]), int(shift[0])
                    crop[y : y + face.shape[0], x : x + face.shape[1]] = face + rng.normal(0, 20, face.shape)
                    name = f"{image}.jpg"
                    buffer = io.BytesIO()
                    Image.fromarray(np.clip(crop, 0, 255).astype(np.uint8)).save(buffer, format="JPEG", quality=95)
                    (root / "loose_crop" / name).write_bytes(buffer.getvalue())
                    landmarks = template(112) * scale * 0.5 + shift + rng.normal(0, 0.5, (5, 2))
                    faces.append(f"{name} {tid} {media}")
                    points.append(" ".join([name, *(f"{v:.3f}" for v in landmarks.ravel()), f"{rng.uniform(0.5, 1):.4f}"]))
    pairs = []
    ids = sorted(templates_of)
    for identity in ids:
        t = templates_of[identity]
        pairs += [f"{a} {b} 1" for i, a in enumerate(t) for b in t[i + 1 :]]
        for other in ids[identity + 1 :]:
            pairs += [f"{a} {b} 0" for a in t for b in templates_of[other]]
    rng.shuffle(faces)  # the meta files need not share an order
    (root / "meta" / "ijbc_face_tid_mid.txt").write_text("\n".join(faces) + "\n")
    (root / "meta" / "ijbc_name_5pts_score.txt").write_text("\n".join(points) + "\n")
    (root / "meta" / "ijbc_template_pair_label.txt").write_text("\n".join(pairs) + "\n")
    return root


@pytest.fixture(scope="module")
def ijb_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_ijb(tmp_path_factory.mktemp("ijb") / "IJBC")


def direct(
    model_dir: Path, root: Path, *, detector_score: bool, fars: tuple[float, ...]
) -> tuple[dict[float, float], dict[float, float]]:
    """TAR at each FAR by facepipe's rule and by insightface's (the nearest point of scikit-learn's ROC,
    computed by the loops of test_insightface_ijb.py), straight from the files."""
    model, spec = load_backbone(model_dir)
    meta = root / "meta"
    points = {}
    for line in (meta / "ijbc_name_5pts_score.txt").read_text().split("\n")[:-1]:
        name, *values = line.split(" ")
        points[name] = (np.array(values[:10], dtype=float).reshape(5, 2), float(values[10]))
    template_media: dict[int, dict[int, list[np.ndarray]]] = {}
    for line in (meta / "ijbc_face_tid_mid.txt").read_text().split("\n")[:-1]:
        name, tid, mid = line.split(" ")
        image = np.asarray(Image.open(root / "loose_crop" / name).convert("RGB"))
        landmarks, score = points[name]
        face = align_face(image, landmarks, SIZE)
        with torch.no_grad():
            raw = model(to_model_input(face[None])) + model(to_model_input(face[None, :, ::-1]))
        feature = (raw / raw.norm()).numpy()[0].astype(np.float64) * (score if detector_score else 1.0)
        template_media.setdefault(int(tid), {}).setdefault(int(mid), []).append(feature)
    features = {}
    for tid, media in template_media.items():
        pooled = sum(np.mean(faces, axis=0) for faces in media.values())
        features[tid] = pooled / np.linalg.norm(pooled)
    scores, labels = [], []
    for line in (meta / "ijbc_template_pair_label.txt").read_text().split("\n")[:-1]:
        a, b, label = map(int, line.split(" "))
        scores.append(float(features[a] @ features[b]))
        labels.append(label == 1)
    scores, labels = np.array(scores), np.array(labels)
    result = {}
    for far in fars:
        best = 0.0
        for threshold in scores:
            accepted = scores >= threshold - 1e-9
            if np.mean(accepted[~labels]) <= far:
                best = max(best, np.mean(accepted[labels]))
        result[far] = best
    fpr, tpr = roc_by_loop(scores.tolist(), labels.tolist())
    return result, {far: nearest_by_loop(fpr, tpr, far) for far in fars}


@pytest.mark.parametrize("detector_score", [False, True])
def test_tar_at_far_equals_the_direct_computation(model_dir: Path, ijb_root: Path, tmp_path: Path, detector_score: bool) -> None:
    params = PARAMS.model_copy(update={"detector_score": detector_score})
    metrics = ijb.run(params, model_dir, ijb_root, tmp_path / "out", progress=False)
    expected, nearest = direct(model_dir, ijb_root, detector_score=detector_score, fars=params.far_targets)
    got = {key.removeprefix("tar_at_far_"): value for key, value in metrics.items() if key.startswith("tar_at_far_")}
    assert got == pytest.approx({"1e-2": expected[1e-2], "1e-1": expected[1e-1], "2.5e-1": expected[0.25]}, abs=1e-9)
    theirs = {k.removeprefix("insightface_tar_at_far_"): v for k, v in metrics.items() if k.startswith("insightface_tar_at_far_")}
    assert theirs == pytest.approx({"1e-2": nearest[1e-2], "1e-1": nearest[1e-1], "2.5e-1": nearest[0.25]}, abs=1e-6)
    assert 0 < got["1e-1"] < 1  # the synthetic set is neither trivial nor hopeless
    assert metrics["num_templates"] == len({line.split()[1] for line in (ijb_root / "meta/ijbc_face_tid_mid.txt").read_text().splitlines()})
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"metrics.json", "roc.csv", "roc.png", "thresholds.json"}
    assert json.loads((tmp_path / "out" / "metrics.json").read_text()) == metrics


def _copy(ijb_root: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(ijb_root, tmp_path / "IJBC"))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda r: (r / "meta/ijbc_template_pair_label.txt").unlink(), "no <ijbb|ijbc>_template_pair_label.txt; pass --target"),
        (lambda r: (r / "meta/ijbc_name_5pts_score.txt").write_text("1.jpg 1 2 3\n"), "ijbc_name_5pts_score.txt:1: 4 fields, expected 12"),
        (lambda r: (r / "meta/ijbc_template_pair_label.txt").write_text("1 99999 1\n1 2 0\n"), "1 templates have no face"),
        (lambda r: (r / "meta/ijbc_template_pair_label.txt").write_text("1 2 x\n"), "invalid literal"),
        (lambda r: (r / "loose_crop/1.jpg").write_bytes(b"not a jpeg"), "1.jpg: not_an_image"),
        (lambda r: (r / "loose_crop/2.jpg").unlink(), "cannot read"),
    ],
    ids=["no pairs file", "short line", "unknown template", "bad label", "bad image", "missing image"],
)
def test_a_damaged_ijb_folder_is_a_one_line_error_and_writes_nothing(
    model_dir: Path, ijb_root: Path, tmp_path: Path, damage, message: str
) -> None:
    root = _copy(ijb_root, tmp_path)
    damage(root)
    with pytest.raises(FacepipeError) as caught:
        ijb.run(PARAMS, model_dir, root, tmp_path / "out", progress=False)
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert not (tmp_path / "out").exists()


def test_ijb_cli(model_dir: Path, ijb_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    params = tmp_path / "params.yaml"
    params.write_text("ijb:\n  device: cpu\n  workers: 2\n  far_targets: [1.0e-2, 1.0e-1]\n")
    out = tmp_path / "out"
    assert cli.main(["ijb", str(model_dir), str(ijb_root), str(out), "--params", str(params)]) == 0
    assert "ijb: ijbc TAR@FAR 1e-2" in capsys.readouterr().out
    assert json.loads((out / "thresholds.json").read_text())["thresholds"].keys() == {"1e-2", "1e-1"}
    (tmp_path / "empty").mkdir()
    assert cli.main(["ijb", str(model_dir), str(tmp_path / "empty"), str(tmp_path / "x"), "--params", str(params)]) == 2
    assert "pass --target" in capsys.readouterr().err
