"""insightface's validation sets (``lfw.bin``, ``cfp_fp.bin``, ``agedb_30.bin`` …), read without
running anything the file asks for.

A ``.bin`` set is a pickle of ``(images, same)``: ``images`` a list of 2·P encoded faces (JPEG or
PNG bytes, aligned 112×112; some files hold them as 1-D uint8 numpy arrays), pair ``p`` being
images ``2p`` and ``2p + 1``; ``same`` P bools (a list, or a numpy bool/int array). Files come
pickled by Python 2 (``str`` payloads) or 3 (protocol 2 encodes ``bytes`` through
``_codecs.encode``; 4 and 5 do not).

Pickle can call any importable function while loading; :class:`_PlainDataUnpickler` resolves
only the handful of globals plain bytes and numpy bool/int arrays need, each to a stand-in that
builds the value itself (no numpy constructor runs on the file's arguments), and refuses any
other global by name. The result is then checked for shape and type, so a file that loads is a
well-formed set.
"""

from __future__ import annotations

import hashlib
import io
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from facepipe.errors import ForeignFileError

#: numpy dtypes a ``.bin`` set may hold (labels; payloads as uint8): kind + item size, no objects.
_PLAIN_DTYPES = frozenset({"b1", "?", *(f"{kind}{size}" for kind in "iu" for size in (1, 2, 4, 8))})
_RECONSTRUCT = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct")}
_FROMBUFFER = {("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer")}


class _Refused(Exception):
    """The file asks for something that is not plain data (one line, says what)."""


def _text(value: Any) -> str:
    if isinstance(value, bytes):  # Python 2 files, loaded with encoding="bytes"
        return value.decode("ascii", "replace")
    if not isinstance(value, str):
        raise _Refused(f"expected a string, found {type(value).__name__}")
    return value


class _NdarrayType:
    """Stands for ``numpy.ndarray`` as the first argument of ``_reconstruct``; never instantiated."""


class _DtypeStub:
    """``numpy.dtype(typestr, align, copy)`` followed by ``__setstate__``: only plain bool/int kinds."""

    def __init__(self, typestr: Any, *_: Any) -> None:
        typestr = _text(typestr)
        if typestr.startswith("O"):
            raise _Refused("holds an object array (numpy dtype 'O')")
        if typestr not in _PLAIN_DTYPES:
            raise _Refused(f"holds a numpy array of dtype {typestr!r}; only bool and integer arrays are read")
        self.typestr, self.byteorder = typestr, "|"

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, tuple) or len(state) < 2:
            raise _Refused("holds a malformed numpy dtype")
        self.byteorder = _text(state[1])
        if self.byteorder not in ("|", "<", ">", "="):
            raise _Refused(f"holds a numpy dtype of byte order {self.byteorder!r}")

    def resolve(self) -> np.dtype:
        return np.dtype(("" if self.byteorder == "|" else self.byteorder) + self.typestr)


def _array(raw: Any, dtype: Any, shape: Any) -> np.ndarray:
    if not isinstance(dtype, _DtypeStub):
        raise _Refused("holds a numpy array without a plain dtype")
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise _Refused(f"holds a numpy array whose data is a {type(raw).__name__}, not bytes")
    if not isinstance(shape, tuple) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise _Refused("holds a numpy array of malformed shape")
    resolved = dtype.resolve()
    if len(raw) != resolved.itemsize * int(np.prod(shape, dtype=np.int64)):
        raise _Refused(f"holds a numpy array of shape {shape} with {len(raw)} bytes of data")
    return np.frombuffer(bytes(raw), dtype=resolved).reshape(shape).copy()


class _ArrayStub:
    """``_reconstruct(ndarray, (0,), b'b')`` followed by ``__setstate__((version, shape, dtype, fortran, raw))``."""

    def __init__(self) -> None:
        self.value: np.ndarray | None = None

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, tuple) or len(state) != 5:
            raise _Refused("holds a malformed numpy array")
        _, shape, dtype, fortran, raw = state
        array = _array(raw, dtype, shape[::-1] if fortran else shape)
        self.value = array.T if fortran else array


def _reconstruct(cls: Any, *_: Any) -> _ArrayStub:
    if cls is not _NdarrayType:
        raise _Refused("rebuilds a numpy array of a type other than numpy.ndarray")
    return _ArrayStub()


def _frombuffer(raw: Any, dtype: Any, shape: Any, order: Any) -> np.ndarray:
    array = _array(raw, dtype, tuple(shape)[::-1] if _text(order) == "F" else tuple(shape))
    return array.T if _text(order) == "F" else array


def _latin1(text: Any, encoding: Any = "utf-8") -> bytes:
    """``_codecs.encode``: how Python 3 pickles ``bytes`` at protocol 2 (text code points 0-255)."""
    if not isinstance(text, str) or _text(encoding).lower().replace("-", "") != "latin1":
        raise _Refused("calls _codecs.encode with something other than latin-1 text")
    return text.encode("latin-1")


class _PlainDataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key in _RECONSTRUCT:
            return _reconstruct
        if key in _FROMBUFFER:
            return _frombuffer
        if key == ("numpy", "ndarray"):
            return _NdarrayType
        if key == ("numpy", "dtype"):
            return _DtypeStub
        if key == ("_codecs", "encode"):
            return _latin1
        raise _Refused(f"refers to {module}.{name}, which is not plain data (refused, nothing run)")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("holds a persistent reference, which is not plain data")


def _unstub(value: Any) -> Any:
    """An array stand-in's array; anything else unchanged (only the places a set holds arrays are
    looked at: no recursion into what a hostile file may nest deeply)."""
    if isinstance(value, _ArrayStub):
        if value.value is None:
            raise _Refused("holds a numpy array that was never filled")
        return value.value
    return value


@dataclass(frozen=True)
class BinSet:
    """One insightface validation set: ``images`` [2P] encoded faces, ``same`` [P] bool."""

    name: str
    images: tuple[bytes, ...]
    same: np.ndarray

    @property
    def num_pairs(self) -> int:
        return len(self.same)


def _payload(item: Any, index: int) -> bytes:
    if isinstance(item, bytes):
        return item
    if isinstance(item, np.ndarray) and item.dtype == np.uint8 and item.ndim == 1:
        return item.tobytes()
    raise _Refused(f"image {index} is a {type(item).__name__}, not encoded image bytes")


def _labels(value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise _Refused(f"its labels are a {value.ndim}-D array, not a list")
        values = value.tolist()
    elif isinstance(value, (list, tuple)):
        values = list(value)
    else:
        raise _Refused(f"its labels are a {type(value).__name__}, not a list of bools")
    bad = [v for v in values if isinstance(v, float) or not isinstance(v, (bool, int)) or v not in (0, 1)]
    if bad:
        shown = repr(bad[0]) if isinstance(bad[0], (int, float)) else f"a {type(bad[0]).__name__}"
        raise _Refused(f"its labels hold {shown}; expected bools (or 0/1)")
    return np.asarray(values, dtype=bool)


def parse_bin_set(data: bytes, *, name: str) -> BinSet:
    """Unpickle the bytes of a ``.bin`` set with plain-data globals only, then check its shape.

    Raises ``_Refused`` (one line, no file name) on anything else; :func:`read_bin_set` adds the path.
    """
    try:
        loaded = _PlainDataUnpickler(io.BytesIO(data), encoding="bytes").load()
    except _Refused:
        raise
    except EOFError:
        raise _Refused("is truncated (the pickle ends early)") from None
    except (
        pickle.UnpicklingError, ValueError, TypeError, AttributeError, IndexError, KeyError, MemoryError, RecursionError
    ) as error:
        raise _Refused(f"is not a readable pickle ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})") from None
    loaded = _unstub(loaded)
    if not isinstance(loaded, (tuple, list)) or len(loaded) != 2:
        raise _Refused("does not hold an (images, labels) pair")
    images, labels = (_unstub(item) for item in loaded)
    if not isinstance(images, (list, tuple)):
        raise _Refused(f"its images are a {type(images).__name__}, not a list")
    images = [_unstub(item) for item in images]
    same = _labels(labels)
    if len(images) != 2 * len(same):
        raise _Refused(f"holds {len(images)} images for {len(same)} pairs (expected {2 * len(same)})")
    if not len(same):
        raise _Refused("holds no pairs")
    return BinSet(name=name, images=tuple(_payload(item, i) for i, item in enumerate(images)), same=same)


def read_bin_set(path: str | Path, *, sha256: str | None = None) -> BinSet:
    """Read an insightface ``.bin`` validation set; its name is the file's stem (``lfw``, ``cfp_fp``).

    ``sha256``: the hash a manifest lists for the file (a set a shard set carries); bytes that hash
    otherwise are refused before they are unpickled."""
    path = Path(path)
    if not path.is_file():
        raise ForeignFileError(f"validation set not found: {path}")
    data = path.read_bytes()
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise ForeignFileError(f"{path}: sha256 differs from the manifest (see facepipe verify)")
    return load_bin_set(data, path=path)


def load_bin_set(data: bytes, *, path: Path) -> BinSet:
    """:func:`parse_bin_set` of the bytes of the file at ``path``: a refusal is a one-line
    ForeignFileError naming the file."""
    try:
        return parse_bin_set(data, name=path.stem)
    except _Refused as refused:
        raise ForeignFileError(f"{path}: {refused}") from None
