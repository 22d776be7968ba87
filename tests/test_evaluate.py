"""The evaluate stage: embedding, pair files (split's and LFW's) and clear errors on bad input."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from facepipe import cli
from facepipe.config import EvaluateParams, SplitParams
from facepipe.evaluation.embed import embed_images, to_model_input
from facepipe.evaluation.pairs import NamedPair, lfw_image_key, parse_lfw_pairs
from facepipe.evaluation.verification import verification_metrics
from facepipe.io.manifest import build_manifest, write_metadata
from facepipe.io.model_dir import ModelSpec, Normalization, save_model_dir, write_model_spec
from facepipe.io.records import encode_image, encode_record
from facepipe.io.shards import ShardSet, ShardWriter, sha256_file
from facepipe.synthetic.shards import write_synthetic_shard_set
from facepipe.models import create_backbone
from facepipe.models.backbone import Backbone
from facepipe.models.registry import BACKBONES
from facepipe.stages import evaluate, split

SIZE = 32  # small faces keep the real backbone fast on a CPU


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    spec = ModelSpec(backbone="mobilefacenet", embedding_size=32, image_size=SIZE)
    backbone = create_backbone(spec.backbone, embedding_size=spec.embedding_size, image_size=spec.image_size)
    out = tmp_path_factory.mktemp("evaluate") / "model"
    save_model_dir(out, backbone, spec)
    return out


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("evaluate") / "prepared"
    return write_synthetic_shard_set(root, num_identities=10, samples_per_identity=6, image_size=SIZE)


@pytest.fixture(scope="module")
def pairs_file(prepared: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("evaluate") / "split"
    split.run(SplitParams(val_identities=4, num_pairs=40, seed=0), prepared, out)
    return out / "pairs.jsonl"


PARAMS = EvaluateParams(batch_size=16, device="cpu")


# --- embedding --------------------------------------------------------------------------------------


def test_to_model_input_layout_and_range() -> None:
    images = np.zeros((2, 4, 5, 3), np.uint8)
    images[1, :, :, 0] = 255
    x = to_model_input(images)
    assert x.shape == (2, 3, 4, 5) and x.dtype == torch.float32
    assert x[0].eq(-1).all() and x[1, 0].eq(1).all() and x[1, 1:].eq(-1).all()


def test_to_model_input_takes_the_models_normalisation() -> None:
    from facenet_pytorch import fixed_image_standardization

    pixels = np.random.default_rng(0).integers(0, 256, size=(2, 4, 4, 3), dtype=np.uint8)
    expected = fixed_image_standardization(torch.from_numpy(pixels).permute(0, 3, 1, 2).float())
    assert torch.equal(to_model_input(pixels, mean=127.5, std=128.0), expected)
    assert torch.equal(to_model_input(pixels), to_model_input(pixels, mean=127.5, std=127.5))


def test_a_model_of_the_other_crop_is_refused_in_one_line(
    model_dir: Path, prepared: Path, pairs_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    facenet = tmp_path / "model"
    facenet.mkdir()
    (facenet / "backbone.pt").write_bytes((model_dir / "backbone.pt").read_bytes())
    spec = ModelSpec(backbone="mobilefacenet", embedding_size=32, image_size=SIZE, crop="facenet")
    write_model_spec(facenet, spec, weights_sha256=sha256_file(facenet / "backbone.pt"))
    out = tmp_path / "eval"
    argv = ["evaluate", str(facenet), str(prepared), str(out), "--pairs", str(pairs_file)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"model was trained on facenet crops, shard set {prepared} holds arcface crops (prepare.crop)" in err
    assert not out.exists()


def test_evaluate_feeds_the_model_its_recorded_normalisation(
    model_dir: Path, prepared: Path, pairs_file: Path, tmp_path: Path
) -> None:
    """The same weights recorded with facenet's normalisation see other inputs, so other metrics."""
    facenet = tmp_path / "model"
    facenet.mkdir()
    (facenet / "backbone.pt").write_bytes((model_dir / "backbone.pt").read_bytes())
    spec = ModelSpec(
        backbone="mobilefacenet", embedding_size=32, image_size=SIZE, normalization=Normalization.of("facenet")
    )
    write_model_spec(facenet, spec, weights_sha256=sha256_file(facenet / "backbone.pt"))
    seen = []
    original = evaluate.embed_images

    def recording(*args, **kwargs):
        seen.append(kwargs["normalization"])
        return original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(evaluate, "embed_images", recording)
        evaluate.run(PARAMS, facenet, prepared, tmp_path / "eval", pairs=pairs_file, progress=False)
        evaluate.run(PARAMS, model_dir, prepared, tmp_path / "eval2", pairs=pairs_file, progress=False)
    assert seen == [(127.5, 128.0), (127.5, 127.5)]


def test_embed_images_fuses_the_mirror_and_ignores_batching() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 5)).eval()  # not mirror-invariant
    images = np.random.default_rng(0).integers(0, 256, size=(7, 4, 4, 3), dtype=np.uint8)
    fused = embed_images(model, iter(images), count=7, batch_size=3, flip=True, progress=False)
    with torch.no_grad():
        x = to_model_input(images)
        expected = nn.functional.normalize(model(x) + model(x.flip(3)), dim=1).numpy()
    np.testing.assert_allclose(fused, expected, atol=1e-6)
    np.testing.assert_allclose(
        embed_images(model, iter(images), count=7, batch_size=1, flip=True, progress=False), fused, atol=1e-6
    )
    plain = embed_images(model, iter(images), count=7, batch_size=4, flip=False, progress=False)
    with torch.no_grad():
        np.testing.assert_allclose(plain, nn.functional.normalize(model(x), dim=1).numpy(), atol=1e-6)
    assert fused.shape == (7, 5) and fused.dtype == np.float32


# --- split pairs ------------------------------------------------------------------------------------


def test_evaluate_on_split_pairs(
    model_dir: Path, prepared: Path, pairs_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counts = []

    def counting_embed(model: nn.Module, images, *, count: int, **kwargs) -> np.ndarray:
        images = list(images)
        counts.append((count, len(images)))
        return embed_images(model, images, count=count, **kwargs)

    monkeypatch.setattr(evaluate, "embed_images", counting_embed)
    metrics = evaluate.run(PARAMS, model_dir, prepared, tmp_path / "out", pairs=pairs_file, progress=False)

    pairs = [json.loads(line) for line in pairs_file.read_text().splitlines()]
    distinct = {p["index1"] for p in pairs} | {p["index2"] for p in pairs}
    assert counts == [(len(distinct), len(distinct))]  # each image embedded once
    assert json.loads((tmp_path / "out" / "metrics.json").read_text()) == metrics
    assert metrics["num_pairs"] == 40 and metrics["num_same"] == 20 and metrics["num_different"] == 20
    assert metrics["num_images"] == len(distinct) and metrics["pairs_format"] == "facepipe"
    assert 0 <= metrics["accuracy_mean"] <= 1 and 0 <= metrics["auc"] <= 1 and len(metrics["fold_accuracies"]) == 10
    assert metrics["tar_at_far_1e-3"] is None and metrics["tar_at_far_1e-4"] is None
    assert any("needs >= 1000 different pairs, have 20" in note for note in metrics["notes"])
    with open(tmp_path / "out" / "roc.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == ["fpr", "tpr", "threshold"] and rows[0]["threshold"] == "inf"
    assert (float(rows[0]["fpr"]), float(rows[-1]["tpr"])) == (0.0, 1.0)


def test_evaluate_is_deterministic_and_cli_prints_a_summary(
    model_dir: Path, prepared: Path, pairs_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    params = tmp_path / "params.yaml"
    params.write_text(f"evaluate:\n  pairs: {pairs_file}\n  device: cpu\n  flip: false\n")
    for out in ("a", "b"):
        assert cli.main(["evaluate", str(model_dir), str(prepared), str(tmp_path / out), "--params", str(params)]) == 0
    assert "evaluate: accuracy" in capsys.readouterr().out
    for name in ("metrics.json", "roc.csv"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert json.loads((tmp_path / "a" / "metrics.json").read_text())["flip"] is False


def test_metrics_dict_reports_tar_where_measurable_and_a_note_where_not() -> None:
    rng = np.random.default_rng(0)
    same = np.arange(3000) < 1000  # 2000 different pairs: enough for FAR 1e-3, not for 1e-4
    scores = np.where(same, rng.uniform(0.3, 1.0, 3000), rng.uniform(-1.0, 0.5, 3000))
    result = verification_metrics(scores, same, folds=10, far_targets=(1e-3, 1e-4))
    metrics = evaluate.metrics_dict(result, num_pairs=3000)
    assert 0 < metrics["tar_at_far_1e-3"] < 1 and metrics["threshold_at_far_1e-3"] is not None
    assert metrics["tar_at_far_1e-4"] is None and metrics["threshold_at_far_1e-4"] is None
    assert metrics["notes"] == ["TAR@FAR=1e-4 not measurable: needs >= 10000 different pairs, have 2000"]
    assert metrics["num_pairs"] == 3000
    json.dumps(metrics, allow_nan=False)  # plain JSON: no inf or nan


# --- LFW pairs.txt ----------------------------------------------------------------------------------


def write_lfw_shard_set(
    root: Path, images: dict[str, int], *, prefix: str = "lfw/", grey_levels: list[int] | None = None
) -> Path:
    """A shard set whose records come from ``{prefix}name/name_000N.jpg``, N = 1 .. images[name].

    Faces are random noise, or with ``grey_levels`` uniform grey, sample ``i`` (in write order) at
    ``grey_levels[i]``.
    """
    rng = np.random.default_rng(0)
    index = 0
    with ShardWriter(root / "shards", samples_per_shard=8) as writer:
        for label, (name, count) in enumerate(images.items()):
            for number in range(1, count + 1):
                if grey_levels is None:
                    face = rng.integers(0, 256, size=(SIZE, SIZE, 3), dtype=np.uint8)
                else:
                    face = np.full((SIZE, SIZE, 3), grey_levels[index], np.uint8)
                index += 1
                payload = encode_image(face)
                header = {"label": label, "path": prefix + lfw_image_key(name, number), "encoding": "jpeg"}
                writer.write(encode_record(header, payload), label=label)
        shards = writer.close()
    total = sum(images.values())
    manifest = build_manifest(
        shards,
        image={"size": SIZE, "encoding": "jpeg", "quality": 95, "template": "arcface"},
        num_identities=len(images),
        counts={"scanned": total, "accepted": total, "rejected": 0},
        params={},
    )
    write_metadata(root, manifest=manifest, identities=list(images))
    return root


LFW_NAMES = {"Ann_Lee": 4, "Bo_Yang": 3, "Cy_Twombly": 2, "Di_Maria": 1}


def lfw_pairs_text(*, missing: bool = False) -> str:
    """LFW layout, ten sets of one same and one different pair ('10 1')."""
    same = [("Ann_Lee", i, j) for i, j in ((1, 2), (1, 3), (1, 4), (2, 3), (2, 4), (3, 4))]
    same += [("Bo_Yang", 1, 2), ("Bo_Yang", 1, 3), ("Bo_Yang", 2, 3), ("Cy_Twombly", 1, 2)]
    different = [("Ann_Lee", k % 4 + 1, "Di_Maria", 1) for k in range(5)]
    different += [("Bo_Yang", k % 3 + 1, "Cy_Twombly", k % 2 + 1) for k in range(5)]
    if missing:
        same[0] = ("Ann_Lee", 1, 7)
        different[0] = ("Ann_Lee", 1, "Nobody_Here", 1)
    lines = ["10\t1"]
    for s, d in zip(same, different):
        lines += ["\t".join(map(str, s)), "\t".join(map(str, d))]
    return "\n".join(lines) + "\n"


def test_evaluate_lfw_pairs(model_dir: Path, tmp_path: Path) -> None:
    prepared = write_lfw_shard_set(tmp_path / "lfw_prepared", LFW_NAMES)
    pairs = tmp_path / "pairs.txt"
    pairs.write_text(lfw_pairs_text())
    metrics = evaluate.run(PARAMS, model_dir, prepared, tmp_path / "out", pairs=pairs, progress=False)
    assert metrics["pairs_format"] == "lfw"
    assert (metrics["num_pairs"], metrics["num_same"], metrics["num_different"]) == (20, 10, 10)
    assert metrics["num_images"] == sum(LFW_NAMES.values())


def test_lfw_pairs_with_missing_images_fail_with_a_count(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prepared = write_lfw_shard_set(tmp_path / "lfw_prepared", LFW_NAMES)
    pairs = tmp_path / "pairs.txt"
    pairs.write_text(lfw_pairs_text(missing=True))
    argv = ["evaluate", str(model_dir), str(prepared), str(tmp_path / "out"), "--pairs", str(pairs)]
    (tmp_path / "none.yaml").write_text("")  # all defaults (a named params file must exist)
    assert cli.main([*argv, "--params", str(tmp_path / "none.yaml")]) == 2
    err = capsys.readouterr().err
    assert "2 of 12 images are not in" in err and "Ann_Lee/Ann_Lee_0007.jpg" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_parse_lfw_pairs() -> None:
    text = "2 1\nA 1 2\nA 1 B 3\nC 4 5\nB 2 C 1\n"
    assert parse_lfw_pairs(text) == [
        NamedPair("A", 1, "A", 2),
        NamedPair("A", 1, "B", 3),
        NamedPair("C", 4, "C", 5),
        NamedPair("B", 2, "C", 1),
    ]
    assert [p.same for p in parse_lfw_pairs("1\nA 1 2\nA 1 B 1\n")] == [True, False]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "line 1: expected a header"),
        ("10 300 2\n", "line 1: expected a header"),
        ("1 1\nA 1 2\n", "promises 2 pairs, found 1"),
        ("1 1\nA 1 2\nA x B 2\n", "line 3: expected"),
        ("1 1\nA 1\nA 1 B 2\n", "line 2: expected"),
        ("1 1\nA 0 2\nA 1 B 2\n", "line 2: image numbers start at 1"),
    ],
)
def test_parse_lfw_pairs_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_lfw_pairs(text)


# --- known embeddings: metrics against an independent computation ---------------------------------
#
# A planted backbone maps each face of the LFW-style set to a known unit vector at angle ANGLES[i]
# (sample i in write order), so every pair's score is cos(angle difference), known in advance. The
# angle differences are distinct (no ties between kinds), and one different pair (Ann_Lee 4 vs
# Di_Maria 1, 5 degrees apart) outranks every same pair, so the metrics are neither 0 nor 1.
#   same-pair differences:      7 19 40 12 33 21 11 34 23 44
#   different-pair differences: 45 38 26 5 45 110 143 76 154 99
# AUC: same pairs closer than each different pair, summed: 0+6+8+10+10+50 = 84 of 100 -> 0.84.
# Best split: accept differences <= 44 degrees: 10 same + 7 different rejected = 17 of 20 -> 0.85.

ANGLES = [0, 7, 19, 40, 90, 101, 124, 200, 244, 45]  # Ann_Lee 1-4, Bo_Yang 1-3, Cy_Twombly 1-2, Di_Maria 1
GREY_BASE, GREY_STEP = 20, 20  # sample i is a uniform face of grey GREY_BASE + i * GREY_STEP


class GreyLookup(Backbone):
    """[B, 3, S, S] uniform grey faces -> the planted vector of their grey level ([B, E] rows of ``table``).

    Levels are GREY_STEP apart, far more than JPEG moves a uniform face, and a mirror is the same face.
    """

    def __init__(self, *, embedding_size: int, image_size: int) -> None:
        super().__init__(embedding_size=embedding_size, image_size=image_size)
        self.table = nn.Parameter(torch.zeros(len(ANGLES), embedding_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        level = (x.mean(dim=(1, 2, 3)) + 1) * 127.5
        index = torch.round((level - GREY_BASE) / GREY_STEP).long().clamp(0, len(ANGLES) - 1)
        return self.table[index]


def planted_vectors() -> np.ndarray:
    """[10, 2] float64 unit vectors at ANGLES (degrees)."""
    radians = np.deg2rad(ANGLES)
    return np.stack([np.cos(radians), np.sin(radians)], axis=1)


@pytest.fixture
def planted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """(model folder of a GreyLookup with planted vectors, LFW-style shard set of grey faces).

    The model goes through the real save / load path (``model.json`` + weights_only state dict).
    """
    monkeypatch.setitem(BACKBONES._entries, "grey_lookup", GreyLookup)
    spec = ModelSpec(backbone="grey_lookup", embedding_size=2, image_size=SIZE)
    model = GreyLookup(embedding_size=2, image_size=SIZE)
    with torch.no_grad():
        model.table.copy_(torch.from_numpy(planted_vectors()))
    save_model_dir(tmp_path / "model", model, spec)
    levels = [GREY_BASE + i * GREY_STEP for i in range(len(ANGLES))]
    prepared = write_lfw_shard_set(tmp_path / "prepared", LFW_NAMES, grey_levels=levels)
    return tmp_path / "model", prepared


def lfw_pair_indexes() -> tuple[np.ndarray, np.ndarray]:
    """([20, 2] sample indexes, [20] same) of ``lfw_pairs_text()``, resolved by hand from LFW_NAMES."""
    first = {name: sum(list(LFW_NAMES.values())[:k]) for k, name in enumerate(LFW_NAMES)}
    rows = [line.split("\t") for line in lfw_pairs_text().splitlines()[1:]]
    indexes, same = [], []
    for row in rows:
        if len(row) == 3:
            row = [row[0], row[1], row[0], row[2]]
        indexes.append((first[row[0]] + int(row[1]) - 1, first[row[2]] + int(row[3]) - 1))
        same.append(row[0] == row[2])
    return np.asarray(indexes), np.asarray(same)


def pairs_jsonl(prepared: Path, indexes: np.ndarray, same: np.ndarray) -> str:
    shard_set = ShardSet(prepared)
    rows = [
        {"index1": int(a), "path1": shard_set.record(int(a)).path, "index2": int(b),
         "path2": shard_set.record(int(b)).path, "same": bool(s)}
        for (a, b), s in zip(indexes, same)
    ]
    return "".join(json.dumps(row) + "\n" for row in rows)


def brute_best(scores: np.ndarray, same: np.ndarray) -> tuple[float, float]:
    """(lowest accepted score, accuracy) of the best rule "same iff score >= t", t over every score
    and +inf; ties go to the lowest t (the documented rule)."""
    candidates = sorted(set(scores.tolist())) + [np.inf]
    accuracies = [np.mean((scores >= t) == same) for t in candidates]
    best = int(np.argmax(accuracies))
    return candidates[best], float(accuracies[best])


def expected_metrics(indexes: np.ndarray, same: np.ndarray, *, folds: int = 10) -> dict[str, object]:
    """What evaluate must report for these pairs of the planted set, computed without facepipe."""
    vectors = planted_vectors()
    scores = np.sum(vectors[indexes[:, 0]] * vectors[indexes[:, 1]], axis=1)
    positives, negatives = scores[same], scores[~same]
    # AUC as the Mann-Whitney statistic: the chance a same pair outscores a different one.
    auc = np.mean([(p > n) + 0.5 * (p == n) for p in positives for n in negatives])
    lowest_accepted, best_accuracy = brute_best(scores, same)
    below = scores[scores < lowest_accepted]
    threshold = (below.max() + lowest_accepted) / 2 if len(below) else lowest_accepted - 1
    fold = np.empty(len(same), int)
    for kind in (True, False):
        members = np.flatnonzero(same == kind)
        fold[members] = np.arange(len(members)) * folds // len(members)
    accuracies = []
    for k in range(folds):
        t, _ = brute_best(scores[fold != k], same[fold != k])
        accuracies.append(np.mean((scores[fold == k] >= t) == same[fold == k]))
    return {
        "auc": round(float(auc), 6),
        "best_accuracy": round(best_accuracy, 6),
        "best_threshold": round(float(threshold), 6),
        "fold_accuracies": [round(float(a), 6) for a in accuracies],
        "accuracy_mean": round(float(np.mean(accuracies)), 6),
        "num_same": int(same.sum()),
        "num_different": int((~same).sum()),
    }


def test_planted_embeddings_give_the_hand_computed_metrics_on_both_pair_formats(
    planted: tuple[Path, Path], tmp_path: Path
) -> None:
    model, prepared = planted
    indexes, same = lfw_pair_indexes()
    expected = expected_metrics(indexes, same)
    # The hand count in the comment above, so that the brute force itself is checked once.
    assert expected["auc"] == 0.84 and expected["best_accuracy"] == 0.85
    cos44, cos45 = np.cos(np.deg2rad(44)), np.cos(np.deg2rad(45))
    assert expected["best_threshold"] == round((cos44 + cos45) / 2, 6)

    (tmp_path / "pairs.txt").write_text(lfw_pairs_text())
    (tmp_path / "pairs.jsonl").write_text(pairs_jsonl(prepared, indexes, same))
    for name, kind in (("pairs.txt", "lfw"), ("pairs.jsonl", "facepipe")):
        metrics = evaluate.run(PARAMS, model, prepared, tmp_path / name.replace(".", "_"), pairs=tmp_path / name,
                               progress=False)
        assert metrics["pairs_format"] == kind
        assert {key: metrics[key] for key in expected} == expected, name
        roc = np.loadtxt(tmp_path / name.replace(".", "_") / "roc.csv", delimiter=",", skiprows=2, usecols=(0, 1))
        assert np.trapezoid(roc[:, 1], roc[:, 0]) == pytest.approx(0.84, abs=1e-6)  # roc.csv is the same curve


def test_one_mismatched_pair_changes_the_metrics_as_computed(planted: tuple[Path, Path], tmp_path: Path) -> None:
    model, prepared = planted
    indexes, same = lfw_pair_indexes()
    (tmp_path / "pairs.jsonl").write_text(pairs_jsonl(prepared, indexes, same))
    before = evaluate.run(PARAMS, model, prepared, tmp_path / "before", pairs=tmp_path / "pairs.jsonl", progress=False)
    # The different pair 5 degrees apart (Ann_Lee 4, Di_Maria 1) now pairs Ann_Lee 4 with Bo_Yang 1: 50 degrees.
    row = next(k for k, (a, b) in enumerate(indexes) if {a, b} == {3, 9})
    indexes[row] = (3, 4)
    (tmp_path / "pairs.jsonl").write_text(pairs_jsonl(prepared, indexes, same))
    after = evaluate.run(PARAMS, model, prepared, tmp_path / "after", pairs=tmp_path / "pairs.jsonl", progress=False)
    expected = expected_metrics(indexes, same)
    assert {key: after[key] for key in expected} == expected
    assert after["auc"] == 0.94 and before["auc"] == 0.84  # one different pair no longer outranks all same ones
    assert after["best_accuracy"] != before["best_accuracy"] or after["best_threshold"] != before["best_threshold"]


# --- errors -----------------------------------------------------------------------------------------


def _bad_model_dir(tmp_path: Path, model_dir: Path, kind: str) -> Path:
    bad = tmp_path / "bad_model"
    bad.mkdir()
    if kind == "no_spec":
        (bad / "backbone.pt").write_bytes((model_dir / "backbone.pt").read_bytes())
    elif kind == "wrong_size":
        (bad / "backbone.pt").write_bytes((model_dir / "backbone.pt").read_bytes())
        spec = {"backbone": "mobilefacenet", "embedding_size": 64, "image_size": SIZE}
        (bad / "model.json").write_text(json.dumps(spec))
    elif kind == "extra_key":
        (bad / "model.json").write_text(json.dumps({"backbone": "x", "embedding_size": 8, "image_size": 32, "lr": 1}))
    return bad


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing_model", "model folder not found"),
        ("no_spec", "no model.json"),
        ("wrong_size", "do not fit"),
        ("extra_key", "lr: Extra inputs are not permitted"),
        ("missing_prepared", "shard set not found"),
        ("missing_pairs", "pairs file not found"),
        ("unknown_images", "2 of"),
        ("bad_params", "unknown key 'evaluate.flips'"),
        ("few_pairs", "10 folds need at least 10 same and 10 different pairs, have 3 and 3"),
        ("image_size", "model expects 32px faces, shard set"),
    ],
)
def test_evaluate_cli_errors(
    model_dir: Path,
    prepared: Path,
    pairs_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    case: str,
    message: str,
) -> None:
    model, shards, pairs = model_dir, prepared, pairs_file
    params = tmp_path / "params.yaml"
    params.write_text("evaluate:\n  device: cpu\n")
    if case == "missing_model":
        model = tmp_path / "nope"
    elif case in ("no_spec", "wrong_size", "extra_key"):
        model = _bad_model_dir(tmp_path, model_dir, case)
    elif case == "missing_prepared":
        shards = tmp_path / "nope"
    elif case == "missing_pairs":
        pairs = tmp_path / "nope.jsonl"
    elif case == "unknown_images":
        lines = [json.loads(line) for line in pairs_file.read_text().splitlines()]
        lines[0]["path1"] = "somebody/else.jpg"
        lines[1]["index2"] = 10_000
        pairs = tmp_path / "pairs.jsonl"
        pairs.write_text("".join(json.dumps(line) + "\n" for line in lines))
    elif case == "bad_params":
        params.write_text("evaluate:\n  flips: true\n")
    elif case == "few_pairs":
        lines = pairs_file.read_text().splitlines()
        kept = [line for line in lines if '"same": true' in line][:3]
        kept += [line for line in lines if '"same": false' in line][:3]
        pairs = tmp_path / "pairs.jsonl"
        pairs.write_text("\n".join(kept) + "\n")
    elif case == "image_size":
        shards = write_synthetic_shard_set(tmp_path / "big", num_identities=10, samples_per_identity=6, image_size=48)
    argv = ["evaluate", str(model), str(shards), str(tmp_path / "out"), "--pairs", str(pairs)]
    assert cli.main([*argv, "--params", str(params)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("facepipe evaluate: error:") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()

