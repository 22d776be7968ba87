"""insightface's IJB-B / IJB-C folder layout (``recognition/_evaluation_/ijb``), read and checked.

::

    ROOT/meta/<t>_face_tid_mid.txt          "<image> <template id> <media id>" per face
    ROOT/meta/<t>_name_5pts_score.txt       "<image> x1 y1 ... x5 y5 <detector score>" per face
    ROOT/meta/<t>_template_pair_label.txt   "<template 1> <template 2> <1 same | 0 different>" per pair
    ROOT/loose_crop/<image>                 the face photo the 5 points are in

``<t>`` is ``ijbb`` or ``ijbc``. Points are left eye, right eye, nose, left and right mouth corner,
in the loose crop's pixels.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from facepipe.errors import ForeignFileError

TARGETS = ("ijbb", "ijbc")
META = "meta"
CROPS = "loose_crop"


@dataclass(frozen=True)
class IjbProtocol:
    """One IJB 1:1 protocol: F faces, P template pairs."""

    target: str
    root: Path
    images: tuple[str, ...]  # [F] file names under loose_crop/
    landmarks: np.ndarray  # [F, 5, 2] float64 pixels
    scores: np.ndarray  # [F] float64 detector scores
    templates: np.ndarray  # [F] int64 template id of each face
    medias: np.ndarray  # [F] int64 media id of each face
    pairs: np.ndarray  # [P, 2] int64 template ids
    same: np.ndarray  # [P] bool

    def image_path(self, index: int) -> Path:
        return self.root / CROPS / self.images[index]


def find_target(root: str | Path) -> str:
    """``ijbb`` or ``ijbc``: the one whose meta files ROOT holds."""
    root = Path(root)
    found = [t for t in TARGETS if (root / META / f"{t}_template_pair_label.txt").is_file()]
    if len(found) != 1:
        what = "both IJB-B and IJB-C" if found else "no <ijbb|ijbc>_template_pair_label.txt"
        raise ForeignFileError(f"{root / META}: {what}; pass --target")
    return found[0]


def _rows(path: Path, columns: int) -> list[list[str]]:
    if not path.is_file():
        raise ForeignFileError(f"IJB meta file not found: {path}")
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split()
        if len(fields) != columns:
            raise ForeignFileError(f"{path}:{number}: {len(fields)} fields, expected {columns}")
        rows.append(fields)
    if not rows:
        raise ForeignFileError(f"{path}: empty")
    return rows


def _numbers(path: Path, rows: list[list[str]], kind: type) -> np.ndarray:
    try:
        return np.asarray([[kind(v) for v in row] for row in rows], dtype=np.float64 if kind is float else np.int64)
    except (ValueError, OverflowError) as error:  # not a number; an id past int64
        raise ForeignFileError(f"{path}: {error}") from None


def read_ijb(root: str | Path, *, target: str | None = None) -> IjbProtocol:
    """Read and cross-check the three meta files; every face must have points and every pair templates."""
    root = Path(root)
    target = target or find_target(root)
    if target not in TARGETS:
        raise ForeignFileError(f"unknown IJB target {target!r}; expected one of {', '.join(TARGETS)}")
    faces_path = root / META / f"{target}_face_tid_mid.txt"
    points_path = root / META / f"{target}_name_5pts_score.txt"
    pairs_path = root / META / f"{target}_template_pair_label.txt"
    faces = _rows(faces_path, 3)
    points = _rows(points_path, 12)
    pairs = _numbers(pairs_path, _rows(pairs_path, 3), int)
    names = tuple(row[0] for row in faces)
    if len(set(names)) != len(names):
        raise ForeignFileError(f"{faces_path}: an image is listed twice")
    point_rows = {row[0]: row[1:] for row in points}
    missing = [name for name in names if name not in point_rows]
    if missing or len(point_rows) != len(names):
        example = missing[0] if missing else next(n for n in point_rows if n not in set(names))
        raise ForeignFileError(f"{faces_path} and {points_path} list different images (e.g. {example})")
    ids = _numbers(faces_path, [row[1:] for row in faces], int)
    values = _numbers(points_path, [point_rows[name] for name in names], float)
    if not set(np.unique(pairs[:, 2]).tolist()) <= {0, 1}:
        raise ForeignFileError(f"{pairs_path}: labels must be 0 or 1")
    unknown = np.setdiff1d(pairs[:, :2], ids[:, 0])
    if len(unknown):
        raise ForeignFileError(f"{pairs_path}: {len(unknown)} templates have no face in {faces_path} (e.g. {unknown[0]})")
    return IjbProtocol(
        target=target,
        root=root,
        images=names,
        landmarks=values[:, :10].reshape(-1, 5, 2),
        scores=values[:, 10],
        templates=ids[:, 0],
        medias=ids[:, 1],
        pairs=pairs[:, :2],
        same=pairs[:, 2].astype(bool),
    )
