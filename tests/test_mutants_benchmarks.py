"""Fast tests of the benchmark readers and protocols (``facepipe/io/insightface_bin.py``,
``facepipe/evaluation/insightface_protocol.py``, ``facepipe/evaluation/templates.py``,
``facepipe/io/ijb.py``) for the mutation run: refusals matched whole, the documented edges."""

from __future__ import annotations

import codecs
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from facepipe.errors import ForeignFileError
from facepipe.io.insightface_bin import read_bin_set

# --- insightface .bin sets: files forged by hand -------------------------------------------------------

_reconstruct = np._core.multiarray._reconstruct
_frombuffer = np._core.numeric._frombuffer
FACES = [b"\xff\xd8a", b"\xff\xd8b", b"\x89PNGc", b"\x89PNGd"]  # two pairs (the reader does not decode)


class Forge:
    """Pickles as ``fn(*args)`` (then ``__setstate__(state)``) without ``fn`` ever running here."""

    def __init__(self, fn: Any, args: tuple, state: Any = None) -> None:
        self.fn, self.args, self.state = fn, args, state

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (self.fn, self.args) if self.state is None else (self.fn, self.args, self.state)


def dtype(typestr: str, state: Any = (3, "<", None, None, None, -1, -1, 0)) -> Forge:
    return Forge(np.dtype, (typestr, False, True), state)


def array(shape: Any, kind: Any, raw: Any, *, fortran: bool = False) -> Forge:
    return Forge(_reconstruct, (np.ndarray, (0,), b"b"), (1, shape, kind, fortran, raw))


def write(path: Path, value: Any, *, protocol: int = 2, rename: tuple[bytes, bytes] | None = None) -> Path:
    data = pickle.dumps(value, protocol=protocol)
    if rename:
        data = data.replace(*rename)
    path.write_bytes(data)
    return path


def refusal(path: Path) -> str:
    """read_bin_set's one-line error, less the path it starts with."""
    with pytest.raises(ForeignFileError) as error:
        read_bin_set(path)
    message = str(error.value)
    assert message.startswith(f"{path}: "), message
    return message.removeprefix(f"{path}: ")


def labels_of(path: Path) -> list[bool]:
    return read_bin_set(path).same.tolist()


def test_a_missing_set_is_named_whole(tmp_path: Path) -> None:
    with pytest.raises(ForeignFileError) as error:
        read_bin_set(tmp_path / "lfw.bin")
    assert str(error.value) == f"validation set not found: {tmp_path / 'lfw.bin'}"
    (tmp_path / "dir.bin").mkdir()
    with pytest.raises(ForeignFileError, match="^validation set not found: "):
        read_bin_set(tmp_path / "dir.bin")


@pytest.mark.parametrize("order", ["|", "<", ">", "="])
def test_plain_dtypes_of_every_byte_order_are_read(tmp_path: Path, order: str) -> None:
    typestr, raw = ("b1", b"\x01\x00") if order == "|" else ("i2", (1).to_bytes(2, "big" if order == ">" else "little") * 2)
    if order == "|":
        state: tuple = (3, "|", None, None, None, -1, -1, 0)
    else:
        state = (3, order)  # a state of two entries is enough
    path = write(tmp_path / "s.bin", (FACES, array((2,), dtype(typestr, state), raw)))
    assert labels_of(path) == ([True, False] if order == "|" else [True, True])


def test_big_and_little_endian_are_told_apart(tmp_path: Path) -> None:
    raw = (1).to_bytes(2, "little") + (0).to_bytes(2, "little")
    assert labels_of(write(tmp_path / "le.bin", (FACES, array((2,), dtype("i2", (3, "<")), raw)))) == [True, False]
    # the same bytes read big-endian are 256 and 0: not a label
    assert refusal(write(tmp_path / "be.bin", (FACES, array((2,), dtype("i2", (3, ">")), raw)))) == (
        "its labels hold 256; expected bools (or 0/1)"
    )


@pytest.mark.parametrize("typestr", ["b1", "?", "i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8"])
def test_every_plain_label_dtype_is_read(tmp_path: Path, typestr: str) -> None:
    size = np.dtype(typestr).itemsize
    raw = (1).to_bytes(size, "little") + bytes(size)
    state = (3, "|") if size == 1 else (3, "<")
    assert labels_of(write(tmp_path / "s.bin", (FACES, array((2,), dtype(typestr, state), raw)))) == [True, False]


def forged_refusals() -> dict[str, tuple[Any, str]]:
    """name -> (what the file holds, the whole message)."""
    good_labels = array((2,), dtype("b1", (3, "|")), b"\x01\x00")
    return {
        "object dtype": ((FACES, array((2,), dtype("O8"), b"")), "holds an object array (numpy dtype 'O')"),
        "float dtype": (
            (FACES, array((2,), dtype("f4"), bytes(8))),
            "holds a numpy array of dtype 'f4'; only bool and integer arrays are read",
        ),
        "dtype name not a string": ((FACES, array((2,), dtype(4), b"")), "expected a string, found int"),
        "dtype state of one entry": ((FACES, array((2,), dtype("b1", (3,)), b"\x01\x00")), "holds a malformed numpy dtype"),
        "dtype state a list": ((FACES, array((2,), dtype("b1", [3, "|"]), b"\x01\x00")), "holds a malformed numpy dtype"),
        "dtype byte order x": ((FACES, array((2,), dtype("b1", (3, "x")), b"\x01\x00")), "holds a numpy dtype of byte order 'x'"),
        "array without a dtype": ((FACES, array((2,), "b1", b"\x01\x00")), "holds a numpy array without a plain dtype"),
        "array data a list": (
            (FACES, array((2,), dtype("b1", (3, "|")), [1, 0])),
            "holds a numpy array whose data is a list, not bytes",
        ),
        "negative shape": ((FACES, array((-2,), dtype("b1", (3, "|")), b"")), "holds a numpy array of malformed shape"),
        "shape a list": ((FACES, array([2], dtype("b1", (3, "|")), b"\x01\x00")), "holds a numpy array of malformed shape"),
        "shape of floats": ((FACES, array((2.0,), dtype("b1", (3, "|")), b"\x01\x00")), "holds a numpy array of malformed shape"),
        "short data": (
            (FACES, array((3,), dtype("i2", (3, "<")), b"\x01\x00\x00\x00")),
            "holds a numpy array of shape (3,) with 4 bytes of data",
        ),
        "short data, C order": (
            (FACES, array((2, 3), dtype("b1", (3, "|")), b"\x01\x00")),
            "holds a numpy array of shape (2, 3) with 2 bytes of data",
        ),
        "short data, Fortran order": (
            (FACES, array((2, 3), dtype("b1", (3, "|")), b"\x01\x00", fortran=True)),
            "holds a numpy array of shape (3, 2) with 2 bytes of data",
        ),
        "array state of four": (
            (FACES, Forge(_reconstruct, (np.ndarray, (0,), b"b"), (1, (2,), dtype("b1", (3, "|")), False))),
            "holds a malformed numpy array",
        ),
        "array state a list": (
            (FACES, Forge(_reconstruct, (np.ndarray, (0,), b"b"), [1, (2,), dtype("b1", (3, "|")), False, b"\x01\x00"])),
            "holds a malformed numpy array",
        ),
        "reconstruct of a dtype": (
            (FACES, Forge(_reconstruct, (np.dtype, (0,), b"b"), (1, (2,), None, False, b""))),
            "rebuilds a numpy array of a type other than numpy.ndarray",
        ),
        "array never filled, as labels": ((FACES, Forge(_reconstruct, (np.ndarray, (0,), b"b"))), "holds a numpy array that was never filled"),
        "array never filled, as the set": (Forge(_reconstruct, (np.ndarray, (0,), b"b")), "holds a numpy array that was never filled"),
        "array never filled, as an image": (
            ([FACES[0], Forge(_reconstruct, (np.ndarray, (0,), b"b"))], [True]),
            "holds a numpy array that was never filled",
        ),
        "frombuffer, C order": (
            (FACES, Forge(_frombuffer, (b"\x01\x00", dtype("b1", (3, "|")), (2, 3), "C"))),
            "holds a numpy array of shape (2, 3) with 2 bytes of data",
        ),
        "frombuffer, Fortran order": (
            (FACES, Forge(_frombuffer, (b"\x01\x00", dtype("b1", (3, "|")), (2, 3), "F"))),
            "holds a numpy array of shape (3, 2) with 2 bytes of data",
        ),
        "encode of utf-8": (([Forge(codecs.encode, ("ab", "utf-8")), FACES[1]], [True]), "calls _codecs.encode with something other than latin-1 text"),
        "encode, no codec": (([Forge(codecs.encode, ("ab",)), FACES[1]], [True]), "calls _codecs.encode with something other than latin-1 text"),
        "encode of bytes": (([Forge(codecs.encode, (b"ab", "latin1")), FACES[1]], [True]), "calls _codecs.encode with something other than latin-1 text"),
        "a global": ((FACES, Forge(np.ones, (2,))), "refers to numpy.ones, which is not plain data (refused, nothing run)"),
        "list of three": ([FACES, [True, False], []], "does not hold an (images, labels) pair"),
        "a string": ("ab", "does not hold an (images, labels) pair"),
        "images a dict": (({"a": 1}, [True]), "its images are a dict, not a list"),
        "image an int8 array": (
            ([FACES[0], array((2,), dtype("i1", (3, "|")), b"ab"), *FACES[2:]], [True, False]),
            "image 1 is a ndarray, not encoded image bytes",
        ),
        "image a 2-D uint8 array": (
            ([*FACES[:3], array((1, 2), dtype("u1", (3, "|")), b"ab")], [True, False]),
            "image 3 is a ndarray, not encoded image bytes",
        ),
        "image a string": (([FACES[0], "ab"], [True]), "image 1 is a str, not encoded image bytes"),
        "labels 2-D": ((FACES, array((1, 2), dtype("b1", (3, "|")), b"\x01\x00")), "its labels are a 2-D array, not a list"),
        "labels a dict": ((FACES, {0: True}), "its labels are a dict, not a list of bools"),
        "label 1.0": ((FACES, [1.0, 0]), "its labels hold 1.0; expected bools (or 0/1)"),
        "label -1": ((FACES, [True, -1]), "its labels hold -1; expected bools (or 0/1)"),
        "label a string": ((FACES, [True, "1"]), "its labels hold a str; expected bools (or 0/1)"),
        "label None": ((FACES, [None, True]), "its labels hold a NoneType; expected bools (or 0/1)"),
        "too few images": ((FACES[:3], [True, False]), "holds 3 images for 2 pairs (expected 4)"),
        "too many images": ((FACES, [True]), "holds 4 images for 1 pairs (expected 2)"),
        "no pairs": (([], []), "holds no pairs"),
        "no pairs, an empty array": (([], array((0,), dtype("b1", (3, "|")), b"")), "holds no pairs"),
        "good labels, too few images": ((FACES[:2], good_labels), "holds 2 images for 2 pairs (expected 4)"),
    }


def test_forged_sets_are_refused_with_their_whole_message(tmp_path: Path) -> None:
    wrong = {}
    for name, (value, message) in forged_refusals().items():
        got = refusal(write(tmp_path / "forged.bin", value, protocol=4))  # protocol 2 pickles b"" as a call
        if got != message:
            wrong[name] = got
    assert wrong == {}


def test_the_other_good_shapes_are_read(tmp_path: Path) -> None:
    good = array((2,), dtype("b1", (3, "|")), b"\x01\x00")
    cases = {
        "a list pair": [FACES, [True, 0]],
        "a tuple of images, labels a tuple": (tuple(FACES), (1, False)),
        "latin-1 text": ([Forge(codecs.encode, (FACES[0].decode("latin-1"), "Latin-1")), *FACES[1:]], [True, False]),
        "latin1 text": ([Forge(codecs.encode, (FACES[0].decode("latin-1"), "latin1")), *FACES[1:]], [True, False]),
        "a pair array": ([Forge(_frombuffer, (bytearray(FACES[0]), dtype("u1", (3, "|")), (3,), "C")), *FACES[1:]], good),
        "Fortran frombuffer": (FACES, Forge(_frombuffer, (b"\x01\x00", dtype("b1", (3, "|")), (2,), "F"))),
    }
    for name, value in cases.items():
        read = read_bin_set(write(tmp_path / "lfw.bin", value, protocol=5))  # 5: a bytearray without a global
        assert (read.name, read.images, read.same.tolist(), read.num_pairs) == ("lfw", tuple(FACES), [True, False], 2), name


@pytest.mark.parametrize("module", [b"numpy.core.multiarray", b"numpy._core.multiarray"])
def test_both_numpy_module_names_of_reconstruct_are_read(tmp_path: Path, module: bytes) -> None:
    path = write(tmp_path / "s.bin", (FACES, np.array([True, False])), rename=(b"numpy._core.multiarray", module))
    assert module in path.read_bytes() and labels_of(path) == [True, False]


@pytest.mark.parametrize("module", [b"numpy.core.numeric", b"numpy._core.numeric"])
def test_both_numpy_module_names_of_frombuffer_are_read(tmp_path: Path, module: bytes) -> None:
    data = pickle.dumps((FACES, np.array([1, 0], dtype=np.int32)), protocol=5)
    assert data[2:3] == b"\x95"  # one frame: its length follows, and the name is length-prefixed
    body = data[11:].replace(b"\x8c\x13numpy._core.numeric", bytes([0x8C, len(module)]) + module)
    path = tmp_path / "s.bin"
    path.write_bytes(data[:3] + len(body).to_bytes(8, "little") + body)
    assert module in path.read_bytes() and labels_of(path) == [True, False]


def test_a_persistent_reference_is_refused(tmp_path: Path) -> None:
    class Persistent(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return "faces" if obj is FACES else None

    path = tmp_path / "p.bin"
    with path.open("wb") as handle:
        Persistent(handle, protocol=2).dump((FACES, [True, False]))
    assert refusal(path) == "holds a persistent reference, which is not plain data"


def test_unreadable_and_truncated_pickles(tmp_path: Path) -> None:
    (tmp_path / "t.bin").write_bytes(pickle.dumps((FACES, [True, False]), protocol=2)[:-5])  # 4 and 5: framed, "truncated" comes from pickle
    assert refusal(tmp_path / "t.bin") == "is truncated (the pickle ends early)"
    (tmp_path / "u.bin").write_bytes(b"\xfenot a pickle")
    assert refusal(tmp_path / "u.bin") == "is not a readable pickle (UnpicklingError: invalid load key, '\\xfe'.)"


# --- IJB-B/C meta files (facepipe/io/ijb.py) ---------------------------------------------------------

from facepipe.io.ijb import find_target, read_ijb

FACES_TXT = "a.jpg 1 10\n\nb.jpg 1 11\nc.jpg 2 10\n"
POINTS_TXT = "".join(
    f"{name} {' '.join(str(10 * i + k) for k in range(10))} 0.{i + 5}\n" for i, name in enumerate(["c.jpg", "a.jpg", "b.jpg"])
)
PAIRS_TXT = "1 2 0\n2 2 1\n"


def ijb_folder(root: Path, target: str = "ijbc", **files: str) -> Path:
    texts = {"face_tid_mid": FACES_TXT, "name_5pts_score": POINTS_TXT, "template_pair_label": PAIRS_TXT, **files}
    (root / "meta").mkdir(parents=True, exist_ok=True)
    for kind, text in texts.items():
        if text is not None:
            (root / "meta" / f"{target}_{kind}.txt").write_text(text)
    return root


def ijb_refusal(root: Path, **kwargs: Any) -> str:
    with pytest.raises(ForeignFileError) as error:
        read_ijb(root, **kwargs)
    return str(error.value)


def test_the_three_meta_files_are_read_in_the_faces_order(tmp_path: Path) -> None:
    root = ijb_folder(tmp_path / "IJBC")
    protocol = read_ijb(str(root))
    assert (protocol.target, protocol.root, protocol.images) == ("ijbc", root, ("a.jpg", "b.jpg", "c.jpg"))
    rows = {1: "a.jpg", 2: "b.jpg", 0: "c.jpg"}  # line of each in the points file
    for face, name in enumerate(protocol.images):
        line = next(i for i, n in rows.items() if n == name)
        expected = np.arange(10, dtype=np.float64).reshape(5, 2) + 10 * line
        np.testing.assert_array_equal(protocol.landmarks[face], expected)
    assert protocol.landmarks.shape == (3, 5, 2) and protocol.landmarks.dtype == np.float64
    assert protocol.scores.tolist() == [0.6, 0.7, 0.5] and protocol.scores.dtype == np.float64
    assert protocol.templates.tolist() == [1, 1, 2] and protocol.medias.tolist() == [10, 11, 10]
    assert protocol.templates.dtype == protocol.medias.dtype == protocol.pairs.dtype == np.int64
    assert protocol.pairs.tolist() == [[1, 2], [2, 2]] and protocol.same.tolist() == [False, True]
    assert protocol.same.dtype == bool
    assert protocol.image_path(2) == root / "loose_crop" / "c.jpg"


def test_the_target_is_the_one_whose_files_are_there(tmp_path: Path) -> None:
    assert find_target(ijb_folder(tmp_path / "B", "ijbb")) == "ijbb"
    assert read_ijb(tmp_path / "B").target == "ijbb"
    assert find_target(str(ijb_folder(tmp_path / "C", "ijbc"))) == "ijbc"
    both = ijb_folder(ijb_folder(tmp_path / "both", "ijbb"), "ijbc")
    assert ijb_refusal(both) == f"{both / 'meta'}: both IJB-B and IJB-C; pass --target"
    assert read_ijb(both, target="ijbb").target == "ijbb" and read_ijb(both, target="ijbc").target == "ijbc"
    (tmp_path / "none" / "meta" / "ijbc_template_pair_label.txt").mkdir(parents=True)  # a folder is not the file
    assert ijb_refusal(tmp_path / "none") == f"{tmp_path / 'none' / 'meta'}: no <ijbb|ijbc>_template_pair_label.txt; pass --target"
    assert ijb_refusal(both, target="ijba") == "unknown IJB target 'ijba'; expected one of ijbb, ijbc"


def test_damaged_meta_files_are_refused_whole(tmp_path: Path) -> None:
    meta = tmp_path / "IJBC" / "meta"
    faces, points, pairs = (meta / f"ijbc_{kind}.txt" for kind in ("face_tid_mid", "name_5pts_score", "template_pair_label"))
    cases = {
        "no faces file": ({"face_tid_mid": None}, f"IJB meta file not found: {faces}"),
        "a short line after a blank": ({"face_tid_mid": "a.jpg 1 10\n\nb.jpg 1\n"}, f"{faces}:3: 2 fields, expected 3"),
        "a long points line": ({"name_5pts_score": POINTS_TXT + "d.jpg" + " 1" * 12 + "\n"}, f"{points}:4: 13 fields, expected 12"),
        "blank faces": ({"face_tid_mid": "\n \n"}, f"{faces}: empty"),
        "empty pairs": ({"template_pair_label": ""}, f"{pairs}: empty"),
        "a label x": ({"template_pair_label": "1 2 x\n"}, f"{pairs}: invalid literal for int() with base 10: 'x'"),
        "a point y": (
            {"name_5pts_score": POINTS_TXT.replace(" 0.5\n", " y\n")},
            f"{points}: could not convert string to float: 'y'",
        ),
        "a template id 1.5": ({"face_tid_mid": FACES_TXT.replace("c.jpg 2", "c.jpg 1.5")}, f"{faces}: invalid literal for int() with base 10: '1.5'"),
        "a template id past int64": (
            {"face_tid_mid": FACES_TXT.replace("c.jpg 2", "c.jpg 100000000000000000000")},
            f"{faces}: Python int too large to convert to C long",
        ),
        "an image twice": ({"face_tid_mid": FACES_TXT + "a.jpg 2 12\n"}, f"{faces}: an image is listed twice"),
        "an image without points": (
            {"face_tid_mid": FACES_TXT + "d.jpg 2 12\n"},
            f"{faces} and {points} list different images (e.g. d.jpg)",
        ),
        "points of another image": (
            {"name_5pts_score": POINTS_TXT + "e.jpg" + " 1" * 11 + "\n"},
            f"{faces} and {points} list different images (e.g. e.jpg)",
        ),
        "a label 2": ({"template_pair_label": "1 2 0\n1 1 2\n"}, f"{pairs}: labels must be 0 or 1"),
        "a label -1": ({"template_pair_label": "1 2 -1\n"}, f"{pairs}: labels must be 0 or 1"),
        "unknown templates": (
            {"template_pair_label": "1 98 0\n97 2 1\n98 1 0\n"},
            f"{pairs}: 2 templates have no face in {faces} (e.g. 97)",
        ),
    }
    wrong = {}
    for name, (files, message) in cases.items():
        root = tmp_path / "IJBC"
        if root.exists():
            import shutil

            shutil.rmtree(root)
        ijb_folder(root, **files)
        got = ijb_refusal(root, target="ijbc")
        if got != message:
            wrong[name] = got
    assert wrong == {}


# --- template features (facepipe/evaluation/templates.py) --------------------------------------------

from facepipe.evaluation.templates import pair_scores, template_features


def test_template_features_average_media_then_sum_and_normalise() -> None:
    rng = np.random.default_rng(0)
    features = rng.normal(size=(7, 3)).astype(np.float32)
    templates = np.array([5, 2, 5, 5, 2, 9, 5])
    medias = np.array([1, 1, 1, 3, 7, 1, 1])  # media 1 in templates 5, 2 and 9: three media
    ids, pooled = template_features(features, templates, medias)
    assert ids.tolist() == [2, 5, 9] and pooled.dtype == np.float64
    f = features.astype(np.float64)
    expected = {
        2: f[1] + f[4],
        5: (f[0] + f[2] + f[6]) / 3 + f[3],
        9: f[5],
    }
    for row, tid in enumerate(ids.tolist()):
        np.testing.assert_allclose(pooled[row], expected[tid] / np.linalg.norm(expected[tid]), rtol=1e-12, atol=0)
    # a template whose features cancel stays zero instead of dividing by zero
    ids, pooled = template_features(np.array([[1.0, 2.0], [-1.0, -2.0], [3.0, 4.0]]), np.array([1, 1, 2]), np.array([1, 2, 1]))
    assert pooled.tolist() == [[0.0, 0.0], [0.6, 0.8]]


def test_pair_scores_are_the_cosines_of_the_named_templates() -> None:
    ids = np.array([2, 5, 9])
    features = np.array([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]])
    scores = pair_scores(ids, features, np.array([[5, 9], [2, 5], [9, 9], [2, 9]]))
    np.testing.assert_allclose(scores, [0.8, 0.6, 1.0, 0.0], rtol=0, atol=1e-15)


# --- insightface's accuracy convention (facepipe/evaluation/insightface_protocol.py) -------------------

from facepipe.evaluation import insightface_protocol as protocol


def test_consecutive_folds_need_as_many_pairs_as_folds() -> None:
    assert [f.tolist() for f in protocol.consecutive_folds(3, 3)] == [[0], [1], [2]]
    assert [f.tolist() for f in protocol.consecutive_folds(11, 2)] == [list(range(6)), list(range(6, 11))]
    with pytest.raises(ValueError) as error:
        protocol.consecutive_folds(9, 10)
    assert str(error.value) == "10 folds need at least 10 pairs, have 9"


def test_squared_distances_of_any_float_rows_in_float64() -> None:
    a = np.array([[0.6, 0.8], [1.0, 0.0]], dtype=np.float32)
    b = np.array([[0.6, -0.8], [0.0, 1.0]], dtype=np.float32)
    distances = protocol.squared_distances(a, b)
    assert distances.dtype == np.float64
    np.testing.assert_allclose(distances, [4 * np.float64(np.float32(0.8)) ** 2, 2.0], rtol=1e-15)


def test_the_threshold_at_a_far_is_read_off_the_piecewise_linear_curve() -> None:
    thresholds = np.array([0.0, 1.0, 2.0, 3.0])
    # FAR 0, 0.1, 0.3, 0.3: 0.2 lies halfway between thresholds 1 and 2
    far = np.array([0.0, 0.1, 0.3, 0.3])
    assert protocol._threshold_at_far(far, thresholds, 0.2) == pytest.approx(1.5, abs=1e-15)
    assert protocol._threshold_at_far(far, thresholds, 0.1) == 1.0  # on a knot: that knot's threshold
    assert protocol._threshold_at_far(far, thresholds, 0.0) == 0.0
    assert protocol._threshold_at_far(far, thresholds, 0.05) == pytest.approx(0.5, abs=1e-15)  # on the first segment
    assert protocol._threshold_at_far(far, thresholds, 0.3) == 3.0  # the last of equal FARs
    assert protocol._threshold_at_far(far, thresholds, 0.31) == 0.0  # never reached
    assert protocol._threshold_at_far(np.array([0.1, 0.2, 0.4, 0.6]), thresholds, 0.05) == 0.0  # below the first
    assert protocol._threshold_at_far(np.array([0.1, 0.2, 0.4, 0.6]), thresholds, 0.5) == pytest.approx(2.5, abs=1e-15)
    assert protocol._threshold_at_far(far, thresholds / 2, 0.2) == pytest.approx(0.75, abs=1e-15)  # a grid step of 0.5
    assert protocol._threshold_at_far(np.array([0.1, 0.2, 0.4, 0.6]), np.array([5.0, 6.0, 7.0, 8.0]), 0.05) == 5.0


def test_val_and_far_count_strictly_below_the_threshold() -> None:
    distances = np.array([0.5, 1.0, 1.5, 1.0, 2.0])
    same = np.array([True, True, False, False, True])
    val, far = protocol._val_far(distances, same, np.array([1.0, 1.5, 2.5]))
    np.testing.assert_allclose(val, [1 / 3, 2 / 3, 1.0], rtol=1e-15)
    np.testing.assert_allclose(far, [0.0, 0.5, 1.0], rtol=1e-15)
    # one pair of each kind: divided by 1
    val, far = protocol._val_far(np.array([0.5, 1.0]), np.array([True, False]), np.array([0.75, 1.5]))
    assert (val.tolist(), far.tolist()) == ([1.0, 1.0], [0.0, 1.0])
    # no different pairs (or no same ones): divided by 1, not by 0
    val, far = protocol._val_far(distances[:2], same[:2], np.array([2.0]))
    assert (val.tolist(), far.tolist()) == ([1.0], [0.0])
    same = np.array([True, True, False, False, False])
    accuracy = protocol._accuracies(distances, same, np.array([0.5, 1.0, 2.5]))  # at 0.5 the 0.5 is rejected
    np.testing.assert_allclose(accuracy, [3 / 5, 4 / 5, 2 / 5], rtol=1e-15)


def test_the_result_names_its_target_and_every_fold() -> None:
    rng = np.random.default_rng(0)
    e = rng.normal(size=(40, 4))
    e /= np.linalg.norm(e, axis=1, keepdims=True)
    same = np.arange(20) % 2 == 0
    e2 = np.where(same[:, None], e[:20], e[20:])
    result = protocol.insightface_verification(e[:20], e2, same, folds=4, far_target=0.25)
    assert result.far_target == 0.25 and len(result.fold_accuracies) == 4
    assert result.accuracy_mean == pytest.approx(np.mean(result.fold_accuracies), abs=1e-15)
    assert result.accuracy_std == pytest.approx(np.std(result.fold_accuracies), abs=1e-15)
    assert result.fold_accuracies == (1.0, 1.0, 1.0, 1.0) and result.val == 1.0
    assert protocol.ACCURACY_THRESHOLDS[[0, 1, -1]].tolist() == pytest.approx([0.0, 0.01, 3.99], abs=1e-12)
    assert protocol.VAL_THRESHOLDS[[0, 1, -1]].tolist() == pytest.approx([0.0, 0.001, 3.999], abs=1e-12)
    assert len(protocol.ACCURACY_THRESHOLDS) == 400 and len(protocol.VAL_THRESHOLDS) == 4000 and protocol.VAL_FAR == 1e-3


def test_python2_style_byte_strings_in_dtypes_orders_and_codecs(tmp_path: Path) -> None:
    """Python 2 files are loaded with encoding="bytes": dtype names, byte orders, array orders and
    codec names arrive as bytes and are read as ASCII (anything else shown, not crashed on)."""
    labels = array((2,), dtype(b"i1", (3, b"|")), b"\x01\x00")  # type: ignore[arg-type]
    assert labels_of(write(tmp_path / "a.bin", (FACES, labels), protocol=4)) == [True, False]
    fortran = Forge(_frombuffer, (b"\x01\x00", dtype(b"b1", (3, b"|")), (2,), b"F"))  # type: ignore[arg-type]
    assert labels_of(write(tmp_path / "f.bin", (FACES, fortran), protocol=4)) == [True, False]
    latin = [Forge(codecs.encode, (FACES[0].decode("latin-1"), b"latin-1")), *FACES[1:]]
    assert read_bin_set(write(tmp_path / "l.bin", (latin, [True, False]), protocol=4)).images == tuple(FACES)
    odd = array((2,), dtype(b"\xff1", (3, b"|")), b"\x01\x00")  # type: ignore[arg-type]
    assert refusal(write(tmp_path / "o.bin", (FACES, odd), protocol=4)) == (
        "holds a numpy array of dtype '\ufffd1'; only bool and integer arrays are read"
    )


def test_a_dtype_without_a_state_is_byte_order_free(tmp_path: Path) -> None:
    labels = array((2,), dtype("b1", None), b"\x01\x00")  # numpy.dtype("b1", False, True), no __setstate__
    assert labels_of(write(tmp_path / "s.bin", (FACES, labels), protocol=4)) == [True, False]


def test_an_error_without_a_message_is_named_by_its_type(tmp_path: Path) -> None:
    """A memo index near 2**31 makes the unpickler grow its memo past a 3 GiB address-space limit:
    a MemoryError, whose message is empty. Run in a child process (the limit must not reach pytest)."""
    import subprocess
    import sys

    (tmp_path / "memo.bin").write_bytes(b"\x80\x02Nr\xff\xff\xff\x7f.")  # None, LONG_BINPUT 2**31 - 1
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))\n"
        "from facepipe.io.insightface_bin import read_bin_set\n"
        "try:\n"
        "    read_bin_set(sys.argv[1])\n"
        "except Exception as error:\n"
        "    print(type(error).__name__, str(error))\n"
    )
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "memo.bin")], capture_output=True, text=True, timeout=120)
    expected = f"ForeignFileError {tmp_path / 'memo.bin'}: is not a readable pickle (MemoryError: )"
    assert result.stdout.strip() == expected, result.stdout + result.stderr[-2000:]


def test_labels_are_bools_whatever_they_were_stored_as(tmp_path: Path) -> None:
    for name, labels in {"list": [True, 0], "int array": np.array([1, 0], dtype=np.int64), "tuple": (1, 0)}.items():
        same = read_bin_set(write(tmp_path / "s.bin", (FACES, labels), protocol=4)).same
        assert same.dtype == bool and same.tolist() == [True, False], name


def test_a_python2_pickle_of_non_ascii_str_payloads(tmp_path: Path) -> None:
    # Python 2's pickle.dumps((['\xff\xd8\xe9', 'ab'], [True]), 2): SHORT_BINSTRING payloads, read as bytes
    payloads = [b"\xff\xd8\xe9", b"ab"]
    body = b"\x80\x02]q\x00(" + b"".join(b"U" + bytes([len(p)]) + p for p in payloads) + b"e]q\x01\x88a\x86q\x02."
    (tmp_path / "py2.bin").write_bytes(body)
    assert read_bin_set(tmp_path / "py2.bin").images == tuple(payloads)


def test_a_small_set_equals_the_reference_with_the_default_ten_folds_and_int_labels() -> None:
    """60 noisy pairs against test_insightface_protocol's reference (insightface's loops), and the
    same labels given as 0/1 integers."""
    from test_insightface_protocol import _structured, reference

    embeddings, issame = _structured(60, seed=5, noise=0.9)
    result = protocol.insightface_verification(embeddings[0::2], embeddings[1::2], issame)
    assert len(result.fold_accuracies) == 10 and result.far_target == 1e-3
    got = (result.accuracy_mean, result.accuracy_std, result.val, result.val_std, result.far)
    np.testing.assert_allclose(got, reference(embeddings, issame), rtol=0, atol=1e-12)
    assert 0.5 < result.accuracy_mean < 1
    as_ints = protocol.insightface_verification(embeddings[0::2], embeddings[1::2], issame.astype(np.int64))
    assert as_ints == result
