"""Issue 19, item 4: ``facepipe import`` of an insightface folder brings its ``.bin`` validation sets along
(OUT/validation/, listed and hashed in the manifest, checked by verify), compact and update leave them
as they are, and train validates on the sets its shard set carries.

The .bin files are written here as insightface's are (a pickle of ``(images, same)``), beside a small
RecordIO pack written as tests/test_import.py writes them.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_import import crop, write_pack
from train_helpers import linear_model, synthetic_set, tiny_params

from facepipe.cli import main
from facepipe.config import PrepareParams
from facepipe.errors import FacepipeError, ForeignFileError
from facepipe.io.manifest import check_shard_set, dumps
from facepipe.io.shards import ShardSet, ShardSetError
from facepipe.io.validation_sets import MANIFEST_KEY, check_bin_files, copy_bin_files
from facepipe.stages import compact, import_rec, prepare
from facepipe.stages.inspect import verify
from facepipe.stages.train import run as train
from facepipe.training.validation import validation_files

PARAMS = PrepareParams(samples_per_shard=5)


def png(seed: int, size: int = 112) -> bytes:
    return crop(seed, size, fmt="PNG")


def write_bin(path: Path, pairs: int, *, seed: int = 0, protocol: int = 2) -> Path:
    """insightface's layout: 2 x ``pairs`` encoded faces and one bool per pair."""
    images = [png(seed + i) for i in range(2 * pairs)]
    path.write_bytes(pickle.dumps((images, [i % 2 == 0 for i in range(pairs)]), protocol=protocol))
    return path


@pytest.fixture
def insightface_folder(tmp_path: Path) -> Path:
    """A pack of 2 identities with lfw.bin (3 pairs) and cfp_fp.bin (2 pairs) beside it, plus files that are no
    validation sets (a hidden .bin, a folder named like one, a text file)."""
    folder = tmp_path / "faces_emore"
    write_pack(folder, [(0, crop(1)), (0, crop(2)), (1, crop(3))], header=True)
    write_bin(folder / "lfw.bin", 3)
    write_bin(folder / "cfp_fp.bin", 2, seed=50, protocol=4)
    (folder / ".lfw.bin").write_bytes(b"an editor's swap file")
    (folder / "agedb_30.bin").mkdir()
    (folder / "notes.txt").write_text("not a set")
    return folder


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_import_copies_the_bin_sets_lists_and_hashes_them(insightface_folder: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "set"
    assert main(["import", str(insightface_folder), str(out), "--workers", "1"]) == 0
    assert "validation sets: cfp_fp.bin (2 pairs), lfw.bin (3 pairs)" in capsys.readouterr().out
    assert sorted(p.name for p in (out / "validation").iterdir()) == ["cfp_fp.bin", "lfw.bin"]
    listed = json.loads((out / "manifest.json").read_text())[MANIFEST_KEY]
    expected = []
    for name, pairs in (("cfp_fp.bin", 2), ("lfw.bin", 3)):
        data = (insightface_folder / name).read_bytes()
        assert (out / "validation" / name).read_bytes() == data  # a byte-equal copy
        expected.append({"file": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "num_pairs": pairs})
    assert listed == expected
    assert verify(out) == []
    assert main(["inspect", str(out)]) == 0
    assert "validation/cfp_fp.bin         2 pairs" in capsys.readouterr().out
    manifest = (out / "manifest.json").read_bytes()
    # an existing set with validation sets is recognised as a shard set, replaced, and comes out the same
    assert main(["import", str(insightface_folder / "train.rec"), str(out), "--workers", "1"]) == 0
    assert (out / "manifest.json").read_bytes() == manifest


def test_a_pack_without_bin_sets_has_the_manifest_it_had(tmp_path: Path) -> None:
    write_pack(tmp_path / "pack", [(0, crop(1)), (1, crop(2))], header=True)
    import_rec.run(PARAMS, tmp_path / "pack", tmp_path / "set", workers=1, progress=False)
    assert MANIFEST_KEY not in json.loads((tmp_path / "set" / "manifest.json").read_text())
    assert not (tmp_path / "set" / "validation").exists() and verify(tmp_path / "set") == []


def _tamper(out: Path, how: str) -> str:
    """Damage the imported set's validation sets; returns what verify's line must say."""
    lfw = out / "validation" / "lfw.bin"
    if how == "missing":
        lfw.unlink()
        return "validation/lfw.bin: missing"
    if how == "longer":
        lfw.write_bytes(lfw.read_bytes() + b"\0")
        return f"validation/lfw.bin: {lfw.stat().st_size} bytes, manifest says {lfw.stat().st_size - 1}"
    if how == "same size":
        data = bytearray(lfw.read_bytes())
        data[-3] ^= 0xFF
        lfw.write_bytes(bytes(data))
        return "validation/lfw.bin: sha256 differs from the manifest"
    write_bin(out / "validation" / "agedb_30.bin", 1)
    return "validation/agedb_30.bin: not listed in the manifest"


@pytest.mark.parametrize("how", ["missing", "longer", "same size", "unlisted"])
def test_verify_fails_in_one_line_naming_the_file(insightface_folder: Path, tmp_path: Path, capsys, how: str) -> None:
    out = tmp_path / "set"
    import_rec.run(PARAMS, insightface_folder, out, workers=1, progress=False)
    message = _tamper(out, how)
    assert verify(out) == [message]
    capsys.readouterr()
    assert main(["verify", str(out)]) == 1
    assert f"{out}: {message}\n" in capsys.readouterr().out
    if how == "same size":
        check_shard_set(out)  # the cheap checks read no file: verify (and train's read of the set) hash it
    else:
        with pytest.raises(ShardSetError, match=message):  # train and evaluate stop before they start
            check_shard_set(out)


class _Evil:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


@pytest.mark.parametrize("case", ["code", "truncated", "not a pickle", "no pairs", "dangling link"])
def test_a_hostile_or_damaged_bin_is_one_line_exit_2_and_nothing_is_written(
    insightface_folder: Path, tmp_path: Path, capsys, case: str
) -> None:
    marker = tmp_path / "ran"
    good = (insightface_folder / "lfw.bin").read_bytes()
    data, says = {
        "code": (pickle.dumps((_Evil(f"touch {marker}"), [True]), protocol=2), "refers to posix.system"),
        "truncated": (good[: len(good) // 2], "truncated"),
        "not a pickle": (b"\x89PNG not a pickle", "not a readable pickle"),
        "no pairs": (pickle.dumps(([], []), protocol=4), "holds no pairs"),
        "dangling link": (None, "cannot be read (No such file or directory)"),
    }[case]
    if data is None:
        (insightface_folder / "calfw.bin").symlink_to(tmp_path / "gone.bin")
    else:
        (insightface_folder / "calfw.bin").write_bytes(data)
    before = _tree(tmp_path)
    assert main(["import", str(insightface_folder), str(tmp_path / "set"), "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"error: {insightface_folder / 'calfw.bin'}: " in err and says in err, err
    assert _tree(tmp_path) == before and not marker.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["faces_emore"]  # no temporary folder left either


def test_compact_and_update_refuse_the_imported_set_and_leave_its_sets(insightface_folder: Path, tmp_path: Path) -> None:
    """An imported set has one generation and no raw folder: neither rebuilds it, so nothing can drop its .bin sets."""
    out = tmp_path / "set"
    import_rec.run(PARAMS, insightface_folder, out, workers=1, progress=False)
    before = _tree(out)
    raw = tmp_path / "raw" / "ann"
    raw.mkdir(parents=True)
    (raw / "1.jpg").write_bytes(crop(9))
    with pytest.raises(FacepipeError, match="imported from a pack"):
        compact.run(out, progress=False)
    for update in (True, "auto"):
        with pytest.raises(FacepipeError, match="imported from a pack"):
            prepare.run(PARAMS.model_copy(update={"detector": "none"}), raw.parent, out, update=update, progress=False)
    assert _tree(out) == before and verify(out) == []


# --- train ------------------------------------------------------------------------------------------------


def _face_png(face: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(face).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def carrying_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 16-px training set (4 identities x 12) that carries lfw.bin: 20 pairs of its own faces, as an import of
    an insightface folder leaves it (copied, listed, hashed by the import's own functions)."""
    root = tmp_path_factory.mktemp("carrying")
    out = synthetic_set(root / "set")
    shard_set = ShardSet(out)
    images = [_face_png(shard_set.record(i).image()) for i in range(40)]
    source = root / "lfw.bin"
    source.write_bytes(pickle.dumps((images, [True, False] * 10), protocol=2))  # 10 folds: 10 of each kind
    entries = check_bin_files([source])
    copy_bin_files([source], entries, out)
    manifest = json.loads((out / "manifest.json").read_text()) | {MANIFEST_KEY: entries}
    (out / "manifest.json").write_text(dumps(manifest))
    assert verify(out) == []
    return out


def _validated_steps(out: Path) -> list[int]:
    path = out / "plots" / "metrics" / "val" / "lfw" / "accuracy.tsv"
    if not path.is_file():
        return []
    with open(path, newline="") as handle:
        return [int(float(row["step"])) for row in csv.DictReader(handle, delimiter="\t")]


@pytest.mark.parametrize(
    "validation, steps",
    [(None, [4]), ({"sets": "auto", "every_steps": 2}, [2, 4]), ({"sets": []}, [])],
    ids=["absent", "auto", "none"],
)
def test_train_validates_on_the_sets_its_shard_set_carries(carrying_set: Path, tmp_path: Path, validation, steps) -> None:
    """Absent train.validation or sets: auto: the carried sets (every 2000 steps by default: here the last step
    only); sets: [] switches it off."""
    out = tmp_path / "model"
    train(tiny_params(validation=validation), carrying_set, out, max_steps=4, model_factory=linear_model)
    assert _validated_steps(out) == steps
    summary = json.loads((out / "metrics.json").read_text())
    assert ("val" in summary) == bool(steps)


def test_without_carried_sets_auto_means_no_validation(tmp_path: Path) -> None:
    plain = synthetic_set(tmp_path / "set")
    assert validation_files(None, shard_set=ShardSet(plain)) == []
    assert validation_files(tiny_params(validation={"sets": "auto"}).validation, shard_set=ShardSet(plain)) == []
    named = validation_files(tiny_params(validation={"sets": ["a/lfw.bin"]}).validation, shard_set=ShardSet(plain))
    assert [(f.path, f.sha256) for f in named] == [(Path("a/lfw.bin"), None)]
    train(tiny_params(), plain, tmp_path / "model", max_steps=2, model_factory=linear_model)
    assert "val" not in json.loads((tmp_path / "model" / "metrics.json").read_text())


def test_a_carried_set_changed_since_import_stops_train_before_it_starts(carrying_set: Path, tmp_path: Path) -> None:
    changed = tmp_path / "set"
    changed.mkdir()
    for path in carrying_set.rglob("*"):
        if path.is_file():
            (changed / path.relative_to(carrying_set)).parent.mkdir(parents=True, exist_ok=True)
            (changed / path.relative_to(carrying_set)).write_bytes(path.read_bytes())
    lfw = changed / "validation" / "lfw.bin"
    data = bytearray(lfw.read_bytes())
    data[-3] ^= 0xFF  # same size: the cheap checks pass, the hash does not
    lfw.write_bytes(bytes(data))
    with pytest.raises(ForeignFileError, match="lfw.bin: sha256 differs from the manifest"):
        train(tiny_params(), changed, tmp_path / "model", max_steps=2, model_factory=linear_model)
