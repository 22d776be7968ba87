"""insightface .bin validation sets: read with plain-data globals only, evaluated like the same faces
given as pairs, hostile files refused in one line."""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from facepipe import cli
from facepipe.config import EvaluateParams, SplitParams
from facepipe.errors import ForeignFileError
from facepipe.io.insightface_bin import read_bin_set
from facepipe.io.model_dir import ModelSpec, save_model_dir
from facepipe.io.shards import ShardSet
from facepipe.synthetic.shards import write_synthetic_shard_set
from facepipe.models import create_backbone
from facepipe.stages import evaluate, split

SIZE = 32
PARAMS = EvaluateParams(batch_size=16, device="cpu")


def png(face: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(face).save(buffer, format="PNG")
    return buffer.getvalue()


def write_bin(path: Path, images: list, labels, *, protocol: int = 4) -> Path:
    path.write_bytes(pickle.dumps((images, labels), protocol=protocol))
    return path


FACES = [np.full((SIZE, SIZE, 3), level, np.uint8) for level in range(0, 240, 20)]  # 12 faces, 6 pairs
LABELS = [True, False, True, False, False, True]


# --- reading ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", [2, 4, 5])
@pytest.mark.parametrize(
    "labels",
    [LABELS, np.array(LABELS), np.array(LABELS, dtype=np.int64), np.array(LABELS, dtype=">i4")],
    ids=["list", "numpy-bool", "numpy-int64", "numpy-big-endian-int32"],
)
def test_good_sets_read_back_whatever_the_protocol_and_label_type(tmp_path: Path, protocol: int, labels) -> None:
    payloads = [png(face) for face in FACES]
    read = read_bin_set(write_bin(tmp_path / "lfw.bin", payloads, labels, protocol=protocol))
    assert read.name == "lfw" and read.images == tuple(payloads) and read.num_pairs == 6
    assert read.same.dtype == bool and read.same.tolist() == LABELS


def test_images_held_as_uint8_arrays_are_read_as_bytes(tmp_path: Path) -> None:
    payloads = [png(face) for face in FACES]
    arrays = [np.frombuffer(p, np.uint8) for p in payloads]
    read = read_bin_set(write_bin(tmp_path / "cfp_fp.bin", arrays, LABELS, protocol=2))
    assert read.images == tuple(payloads)


def test_a_python2_pickle_of_str_payloads_is_read_as_bytes(tmp_path: Path) -> None:
    # Python 2's pickle of (['<jpeg>', ...], [True, ...]): SHORT_BINSTRING payloads, no globals at all
    payloads = [b"\xff\xd8a", b"\xff\xd8b"]
    body = b"\x80\x02]q\x00(" + b"".join(b"U" + bytes([len(p)]) + p for p in payloads) + b"e]q\x01\x88a\x86q\x02."
    read = read_bin_set(tmp_path.joinpath("agedb_30.bin").write_bytes(body) and tmp_path / "agedb_30.bin")
    assert read.images == tuple(payloads) and read.same.tolist() == [True]


class _Evil:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _deeply_nested_label(depth: int) -> bytes:
    """(["a", "b"], [[[[...]]]]): a label nested ``depth`` lists deep, by opcodes (pickle.dumps recurses)."""
    images = b"](U\x01aU\x01be"
    labels = b"]" + b"]" * depth + b"a" * (depth - 1) + b"a"
    return b"\x80\x02" + images + labels + b"\x86."


def _hostile(tmp_path: Path) -> dict[str, tuple[bytes, str]]:
    """name -> (file bytes, what the one-line error must say)."""
    marker = tmp_path / "ran"
    good = pickle.dumps(([png(f) for f in FACES], LABELS), protocol=4)
    return {
        "os.system": (pickle.dumps((_Evil(f"touch {marker}"), LABELS), protocol=2), "refers to posix.system"),
        "os.system in a label": (pickle.dumps(([png(f) for f in FACES], [_Evil(f"touch {marker}")]), protocol=4), "posix.system"),
        "object array": (pickle.dumps(([png(f) for f in FACES], np.array(LABELS, dtype=object)), protocol=2), "object array"),
        "object array of images": (pickle.dumps((np.array([png(f) for f in FACES], dtype=object), LABELS), protocol=4), "object array"),
        "float labels": (pickle.dumps(([png(f) for f in FACES], np.array(LABELS, dtype=np.float32)), protocol=4), "dtype 'f4'"),
        "truncated": (good[: len(good) // 2], "truncated"),
        "too few images": (pickle.dumps(([png(f) for f in FACES[:-1]], LABELS), protocol=4), "holds 11 images for 6 pairs"),
        "too many labels": (pickle.dumps(([png(f) for f in FACES], LABELS + [True]), protocol=4), "holds 12 images for 7 pairs"),
        "label 2": (pickle.dumps(([png(f) for f in FACES], [2, 0, 1, 0, 0, 1]), protocol=4), "labels hold 2"),
        "no pair": (pickle.dumps({"images": []}, protocol=4), "does not hold an (images, labels) pair"),
        "str images": (pickle.dumps((["a"] * 12, LABELS), protocol=4), "image 0 is a str"),
        "not a pickle": (b"\x89PNG not a pickle", "not a readable pickle"),
        "empty": (b"", "truncated"),
        "deeply nested label": (_deeply_nested_label(100_000), "labels hold a list"),
    }


def test_hostile_sets_are_one_line_errors_and_run_nothing(tmp_path: Path) -> None:
    for name, (data, expected) in _hostile(tmp_path).items():
        path = tmp_path / "hostile.bin"
        path.write_bytes(data)
        with pytest.raises(ForeignFileError) as caught:
            read_bin_set(path)
        message = str(caught.value)
        assert message.startswith(f"{path}: ") and expected in message and "\n" not in message, (name, message)
    assert not (tmp_path / "ran").exists()


def test_the_evil_file_runs_under_plain_pickle(tmp_path: Path) -> None:
    """The hostile file is real: plain pickle.load runs the command that read_bin_set refuses."""
    pickle.loads(pickle.dumps(_Evil(f"touch {tmp_path / 'ran'}"), protocol=2))
    assert (tmp_path / "ran").exists()


# --- evaluating ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    spec = ModelSpec(backbone="mobilefacenet", embedding_size=32, image_size=SIZE)
    backbone = create_backbone(spec.backbone, embedding_size=spec.embedding_size, image_size=spec.image_size)
    out = tmp_path_factory.mktemp("bin") / "model"
    save_model_dir(out, backbone, spec)
    return out


@pytest.fixture(scope="module")
def pairs_and_bin(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A shard set, split's pairs.jsonl of it, and a .bin of the same faces in the same pair order."""
    root = tmp_path_factory.mktemp("bin")
    prepared = write_synthetic_shard_set(root / "prepared", num_identities=10, samples_per_identity=6, image_size=SIZE)
    split.run(SplitParams(val_identities=5, num_pairs=60, seed=0), prepared, root / "split")
    pairs = [json.loads(line) for line in (root / "split" / "pairs.jsonl").read_text().splitlines()]
    shard_set = ShardSet(prepared)
    images = [png(shard_set.record(p[key]).image()) for p in pairs for key in ("index1", "index2")]
    labels = np.array([p["same"] for p in pairs])
    return prepared, root / "split" / "pairs.jsonl", write_bin(root / "lfw.bin", images, labels, protocol=2)


@pytest.mark.parametrize("flip", [True, False])
def test_a_bin_set_gives_the_accuracy_of_the_same_faces_given_as_pairs(
    model_dir: Path, pairs_and_bin: tuple[Path, Path, Path], tmp_path: Path, flip: bool
) -> None:
    prepared, pairs, bin_path = pairs_and_bin
    params = PARAMS.model_copy(update={"flip": flip})
    as_pairs = evaluate.run(params, model_dir, prepared, tmp_path / "pairs", pairs=pairs, progress=False)
    as_bin = evaluate.run_bin_sets(params, model_dir, [bin_path], tmp_path / "bin", progress=False)["sets"]["lfw"]
    for key in ("accuracy_mean", "accuracy_std", "fold_accuracies", "num_same", "num_different"):
        assert as_bin[key] == as_pairs[key], key
    for key in ("auc", "best_threshold"):
        assert as_bin[key] == pytest.approx(as_pairs[key], abs=1e-5), key
    assert as_bin["pairs_format"] == "insightface_bin" and as_bin["num_pairs"] == 60
    assert 0 <= as_bin["insightface_accuracy_mean"] <= 1 and len(as_bin["insightface_fold_accuracies"]) == 10
    assert "insightface_val_at_far_1e-3" in as_bin
    written = json.loads((tmp_path / "bin" / "metrics.json").read_text())
    assert written["sets"]["lfw"] == as_bin
    assert {p.name for p in (tmp_path / "bin" / "lfw").iterdir()} == {"roc.csv", "roc.png", "thresholds.json"}
    for folder, metrics in ((tmp_path / "bin" / "lfw", as_bin), (tmp_path / "pairs", as_pairs)):
        thresholds = json.loads((folder / "thresholds.json").read_text())["thresholds"]
        assert list(thresholds) == ["1e-3", "1e-4"]
        for far, threshold in thresholds.items():
            expected = metrics[f"threshold_at_far_{far}"]  # None here: 30 different pairs measure no FAR of 1e-3
            assert threshold is None if expected is None else threshold == pytest.approx(expected, abs=1e-6)


def test_evaluate_cli_takes_several_sets_and_refuses_a_hostile_one_writing_nothing(
    model_dir: Path, pairs_and_bin: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, _, lfw = pairs_and_bin
    other = tmp_path / "cfp_fp.bin"
    other.write_bytes(lfw.read_bytes())
    params = tmp_path / "params.yaml"
    params.write_text("evaluate:\n  device: cpu\n  batch_size: 16\n")
    out = tmp_path / "out"
    assert cli.main(["evaluate", str(model_dir), str(lfw), str(other), str(out), "--params", str(params)]) == 0
    printed = capsys.readouterr().out
    assert "lfw accuracy" in printed and "cfp_fp accuracy" in printed and "(insightface)" in printed
    sets = json.loads((out / "metrics.json").read_text())["sets"]
    assert sorted(sets) == ["cfp_fp", "lfw"] and sets["lfw"] == sets["cfp_fp"]
    hostile = tmp_path / "agedb_30.bin"
    hostile.write_bytes(pickle.dumps((_Evil(f"touch {tmp_path / 'ran'}"), LABELS), protocol=2))
    again = tmp_path / "again"
    assert cli.main(["evaluate", str(model_dir), str(lfw), str(hostile), str(again), "--params", str(params)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"facepipe evaluate: error: {hostile}: refers to posix.system, which is not plain data (refused, nothing run)"
    assert not again.exists() and not (tmp_path / "ran").exists()
    assert cli.main(["evaluate", str(model_dir), str(lfw), str(tmp_path), str(again), "--params", str(params)]) == 2
    assert "either one shard set" in capsys.readouterr().err


def test_faces_of_another_size_than_the_model_are_refused(model_dir: Path, tmp_path: Path) -> None:
    big = [png(np.zeros((112, 112, 3), np.uint8))] * 40
    path = write_bin(tmp_path / "lfw.bin", big, [True, False] * 10)
    with pytest.raises(Exception, match=r"lfw.bin: image 0 is 112x112, the model expects 32x32 aligned faces"):
        evaluate.run_bin_sets(PARAMS, model_dir, [path], tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def _saved_as(model_dir: Path, out: Path, **spec_changes: object) -> Path:
    """The same weights as ``model_dir`` under another model.json."""
    from facepipe.io.model_dir import load_backbone

    backbone, spec = load_backbone(model_dir, device="cpu")
    save_model_dir(out, backbone, spec.model_copy(update=spec_changes))
    return out


def test_bin_sets_are_embedded_with_the_normalisation_model_json_records(
    model_dir: Path, pairs_and_bin: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """The same weights recorded with facenet's (x - 127.5) / 128 give other scores than with arcface's:
    the recorded normalisation reaches the .bin path (it embedded with arcface's whatever model.json said)."""
    from facepipe.io.model_dir import Normalization

    *_, lfw = pairs_and_bin
    facenet = _saved_as(model_dir, tmp_path / "facenet", normalization=Normalization.of("facenet"))
    evaluate.run_bin_sets(PARAMS, model_dir, [lfw], tmp_path / "a", progress=False)
    evaluate.run_bin_sets(PARAMS, facenet, [lfw], tmp_path / "f", progress=False)
    a = (tmp_path / "a" / "lfw" / "roc.csv").read_text()
    f = (tmp_path / "f" / "lfw" / "roc.csv").read_text()
    assert a != f


def test_a_model_of_another_crop_is_refused_on_bin_sets(
    model_dir: Path, pairs_and_bin: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    *_, lfw = pairs_and_bin
    facenet = _saved_as(model_dir, tmp_path / "facenet", crop="facenet")
    with pytest.raises(Exception, match=r"^insightface \.bin sets hold ArcFace-aligned faces; this model was trained on facenet crops"):
        evaluate.run_bin_sets(PARAMS, facenet, [lfw], tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
