"""A small, offline, multi-identity raw face dataset made from real photographs that packages ship.

Two real faces are the bases: Grace Hopper (matplotlib's ``sample_data/grace_hopper.jpg``) and the
astronaut Eileen Collins (scikit-image's ``data/astronaut.png``). Each base is first aligned into a
448 x 576 (w x h) *canonical frame* with known landmarks. An **identity** is a deterministic variant of one
base in that frame: a smooth geometric deformation (eye distance and size, face width, nose, mouth,
chin, brows), skin and hair recolouring and a few accessories (glasses, moustache, beard, hat, mole,
scar...). An **image** of an identity is that variant under a random pose (rotation, scale, slight
perspective), placed on a random background, relit, blurred, noised and encoded. Everything is drawn
from ``numpy.random.default_rng`` streams keyed by ``(seed, what, identity, image)``, so the same
seed gives byte-identical files, and identity ``k`` does not depend on how many identities are made.

**The same bytes on every machine.** Pixel arithmetic is kept on code paths that do not depend on the
CPU: OpenCV runs with its run-time SIMD dispatch off (:func:`cpu_independent`: the baseline code every
x86-64 build runs), transcendental functions are evaluated in float64 (numpy's AVX2 and AVX-512 float32
``exp`` need not agree in the last bit, and a float32 last bit flips a rounded byte now and then), and
no float32 product goes through BLAS (whose kernel OpenBLAS picks by CPU: FMA or not). Elementwise
``+ - * /`` are correctly rounded IEEE operations on every CPU. ``tests/test_sample_determinism.py``
generates under every dispatch level this machine can switch off and compares the bytes.

The output is the LFW layout ``OUT/<identity>/<identity>_NNNN.<ext>`` and nothing else. File formats
and modes vary on purpose (PNG, BMP, WebP, grey, RGBA, CMYK, an EXIF-rotated JPEG, 16-bit PNG), and
``bad_files`` adds one file of each kind a raw crawl contains (see :data:`BAD_KINDS`).
"""

from __future__ import annotations

import importlib
import io
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import cv2
import numpy as np
from PIL import Image

from facepipe.alignment import ARCFACE_TEMPLATE_112, umeyama
from facepipe.config import SampleDataParams
from facepipe.errors import FacepipeError
from facepipe.io.atomic import atomic_output_dir

#: Width and height of the canonical frame in which identities are built, pixels (a head-and-shoulders bust).
CANON_W, CANON_H = 448, 576
#: The 5 landmarks (eyes, nose, mouth corners; x, y) of every base face in the canonical frame:
#: the ArcFace template scaled x2 (eye-to-mouth distance ~81 px), eyes at y ~200, centred in x.
CANON_LANDMARKS = ARCFACE_TEMPLATE_112 * 2.0 + np.array([112.0, 97.0])
#: Where an MTCNN box falls in the canonical frame (measured on both bases): x0, y0, x1, y1.
CANON_FACE_BOX = np.array([134.0, 115.0, 314.0, 350.0])

#: The image kinds that exercise a reader; each appears once when there are enough image slots.
SPECIAL_KINDS = ("png", "bmp", "webp", "grey", "rgba", "cmyk", "exif", "png16")
#: The kinds of bad file written when ``bad_files`` is on, one file each.
BAD_KINDS = (
    "truncated",  # a JPEG cut off half way: the header parses, the pixels do not
    "empty",  # 0 bytes
    "not_image",  # text with an image extension
    "no_face",  # a real photo with no face in it
    "tiny",  # a face image too small to hold a detectable face
    "duplicate_within",  # byte copy of another image of the same identity
    "duplicate_across",  # byte copy of an image of another identity
)
_EXTENSIONS = {
    "jpg": "jpg",
    "png": "png",
    "bmp": "bmp",
    "webp": "webp",
    "grey": "jpg",
    "rgba": "png",
    "cmyk": "jpg",
    "exif": "jpg",
    "png16": "png",
}


@dataclass(frozen=True)
class _BaseSpec:
    """Where a base face comes from, where its landmarks are, and the shape of the bust in the frame."""

    name: str
    landmarks: tuple[tuple[float, float], ...]  # in the original photo, measured once with MTCNN
    ellipses: tuple[tuple[int, int, int, int], ...]  # (cx, cy, ax, ay) whose union is the bust, canonical frame


_BASES = (
    _BaseSpec(
        "hopper",
        ((221.7, 192.2), (309.8, 186.1), (269.4, 239.2), (232.7, 279.6), (306.6, 275.9)),
        ellipses=((220, 182, 106, 128), (222, 262, 96, 96), (222, 360, 75, 60), (224, 700, 260, 370)),
    ),
    _BaseSpec(
        "astronaut",
        ((205.0, 101.7), (246.8, 103.7), (224.7, 129.0), (201.7, 139.2), (245.3, 141.9)),
        ellipses=((222, 154, 128, 104), (224, 250, 82, 100), (224, 640, 225, 350)),
    ),
)


@dataclass(frozen=True)
class Identity:
    """One synthetic person: an RGBA bust in the canonical frame plus where its landmarks ended up."""

    name: str
    base: str
    rgba: np.ndarray = field(repr=False)  # [CANON_H, CANON_W, 4] uint8; alpha 0 outside the bust
    landmarks: np.ndarray = field(repr=False)  # [5, 2] float64, canonical frame
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SampleImage:
    """A good image that was written. ``landmarks`` are the true 5 points in the upright image."""

    path: str  # relative to OUT, POSIX
    identity: str
    kind: str  # "jpg" or one of SPECIAL_KINDS
    size: tuple[int, int]  # (width, height) upright, i.e. after honouring EXIF orientation
    landmarks: np.ndarray = field(repr=False)  # [5, 2] float64 (x, y) pixels


@dataclass(frozen=True)
class BadFile:
    """A file a reader or the detector must reject; ``detail`` says what it is."""

    path: str
    kind: str  # one of BAD_KINDS
    detail: str = ""


@dataclass(frozen=True)
class SampleReport:
    """What :func:`make_sample_dataset` wrote."""

    out: Path
    identities: tuple[str, ...]
    images: tuple[SampleImage, ...]
    bad_files: tuple[BadFile, ...]

    def counts(self) -> dict[str, int]:
        """``{"identities", "images", "bad_files", "files"}`` (files = images + bad files)."""
        return {
            "identities": len(self.identities),
            "images": len(self.images),
            "bad_files": len(self.bad_files),
            "files": len(self.images) + len(self.bad_files),
        }

    def summary(self) -> str:
        c = self.counts()
        return f"{c['identities']} identities, {c['images']} images, {c['bad_files']} bad files in {self.out}"


@contextmanager
def cpu_independent() -> Iterator[None]:
    """OpenCV without its run-time CPU dispatch (AVX2, AVX-512, ...) inside the block, restored after.

    OpenCV picks SIMD kernels for float filters, warps and resizes by CPU at run time, and they round
    differently; with optimisations off every machine runs the same baseline code (and IPP is off too).
    The flag is process-wide: other threads' OpenCV calls run slower, never differently, meanwhile.
    """
    previous = cv2.useOptimized()
    cv2.setUseOptimized(False)
    try:
        yield
    finally:
        cv2.setUseOptimized(previous)


def _luma(rgb: np.ndarray) -> np.ndarray:
    """ITU-R 601 luma of [..., 3] pixels as elementwise products and sums in a fixed order: a matrix
    product would go through BLAS, whose kernel (and so whose rounding) depends on the CPU."""
    return rgb[..., 0] * 0.299 + rgb[..., 1] * 0.587 + rgb[..., 2] * 0.114


# ---------------------------------------------------------------------------------------------- bases


def _package_file(package: str, *parts: str) -> Path:
    """A data file inside an installed package, read from disk (never downloaded)."""
    module = importlib.import_module(package)
    path = Path(str(module.__file__)).parent.joinpath(*parts)
    if not path.is_file():
        raise FacepipeError(f"sample data needs {path}, which the installed {package} does not ship")
    return path


@cache
def _photo(name: str) -> np.ndarray:
    """A photo that an installed package ships, as [H, W, 3] uint8 RGB (cached, read-only)."""
    if name == "hopper":
        path = _package_file("matplotlib", "mpl-data", "sample_data", "grace_hopper.jpg")
    else:
        path = _package_file("skimage", "data", f"{name}.png" if name != "rocket" else "rocket.jpg")
    with Image.open(path) as pil:
        array = np.asarray(pil.convert("RGB"))
    array.setflags(write=False)
    return array


@cache
def _canonical_base(index: int) -> tuple[np.ndarray, np.ndarray]:
    """Base ``index`` in the canonical frame: ([CANON_H, CANON_W, 3] uint8, [CANON_H, CANON_W] float32 alpha)."""
    spec = _BASES[index]
    matrix = umeyama(np.array(spec.landmarks), CANON_LANDMARKS)
    rgb = cv2.warpAffine(
        _photo(spec.name), matrix, (CANON_W, CANON_H), flags=cv2.INTER_CUBIC, borderMode=cv2.BORDER_REFLECT
    )
    mask = np.zeros((CANON_H, CANON_W), np.uint8)
    for cx, cy, ax, ay in spec.ellipses:
        cv2.ellipse(mask, (cx, cy), (ax, ay), 0, 0, 360, 255, -1)
    alpha = cv2.GaussianBlur(mask.astype(np.float32) / 255.0, (0, 0), 5.0)
    # The bust fades out at the bottom, where the photo would go on below the frame.
    alpha *= np.clip((CANON_H - 8 - np.arange(CANON_H, dtype=np.float32)) / 90.0, 0, 1)[:, None]
    rgb.setflags(write=False)
    alpha.setflags(write=False)
    return rgb, alpha


# ------------------------------------------------------------------------------------------ identities


def _gauss(xx: np.ndarray, yy: np.ndarray, centre: np.ndarray, sigma: float) -> np.ndarray:
    return np.exp(-((xx - centre[0]) ** 2 + (yy - centre[1]) ** 2) / (2.0 * sigma * sigma))


def _displacement(xx: np.ndarray, yy: np.ndarray, lm: np.ndarray, g: dict[str, float]) -> tuple[np.ndarray, np.ndarray]:
    """How far content at (xx, yy) moves, in pixels: a sum of smooth local pushes and magnifications.

    ``lm`` are the canonical [5, 2] landmarks, ``g`` the identity's geometry parameters.
    """
    left, right, nose, mouth_l, mouth_r = lm
    mouth = (mouth_l + mouth_r) / 2
    cx = (left[0] + right[0]) / 2
    chin = np.array([cx, mouth[1] + 50.0])
    ux = np.zeros_like(xx)
    uy = np.zeros_like(xx)
    # Face width: a horizontal stretch about the midline, strongest at cheek/jaw height.
    ux += g["face_width"] * (xx - cx) * np.exp(-((yy - mouth[1] + 20) ** 2) / (2 * 75.0**2))
    for eye, side in ((left, -1.0), (right, 1.0)):
        w = _gauss(xx, yy, eye, 22.0)
        ux += side * g["eye_spacing"] * w
        w_small = _gauss(xx, yy, eye, 13.0)
        ux += g["eye_size"] * (xx - eye[0]) * w_small
        uy += g["eye_size"] * (yy - eye[1]) * w_small
        uy += g["brow_raise"] * _gauss(xx, yy, eye - np.array([0.0, 22.0]), 13.0)
    w = _gauss(xx, yy, nose, 16.0)
    uy += g["nose_shift"] * w
    ux += g["nose_width"] * (xx - nose[0]) * w
    uy += g["mouth_shift"] * _gauss(xx, yy, mouth, 20.0)
    for corner, side in ((mouth_l, -1.0), (mouth_r, 1.0)):
        ux += side * g["mouth_width"] * _gauss(xx, yy, corner, 12.0)
    uy += g["chin_length"] * _gauss(xx, yy, chin, 32.0)
    uy += g["forehead"] * _gauss(xx, yy, np.array([cx, 95.0]), 50.0)
    return ux, uy


def _sample_geometry(rng: np.random.Generator) -> dict[str, float]:
    """Identity-level deformation parameters, pixels (or ratios) in the canonical frame."""
    return {
        "face_width": float(rng.uniform(-0.12, 0.15)),
        "eye_spacing": float(rng.uniform(-6.0, 4.0)),
        "eye_size": float(rng.uniform(-0.18, 0.25)),
        "brow_raise": float(rng.uniform(-5.0, 5.0)),
        "nose_shift": float(rng.uniform(-6.0, 6.0)),
        "nose_width": float(rng.uniform(-0.15, 0.3)),
        "mouth_shift": float(rng.uniform(-6.0, 7.0)),
        "mouth_width": float(rng.uniform(-4.0, 6.0)),
        "chin_length": float(rng.uniform(-8.0, 14.0)),
        "forehead": float(rng.uniform(-10.0, 10.0)),
    }


def _deform(
    rgb: np.ndarray, alpha: np.ndarray, lm: np.ndarray, geometry: dict[str, float]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Apply the identity's smooth warp; returns the warped image, alpha and [5, 2] landmarks."""
    yy, xx = np.mgrid[0:CANON_H, 0:CANON_W].astype(np.float64)  # float64: exp below (module docstring)
    ux, uy = _displacement(xx, yy, lm, geometry)
    # Backward map: the pixel at p comes from p - u(p) (first order inverse of "content moves by u").
    map_x, map_y = (xx - ux).astype(np.float32), (yy - uy).astype(np.float32)
    rgb = cv2.remap(rgb, map_x, map_y, cv2.INTER_LINEAR, borderMode=cv2.BORDER_REFLECT)
    alpha = cv2.remap(alpha, map_x, map_y, cv2.INTER_LINEAR, borderMode=cv2.BORDER_CONSTANT, borderValue=0)
    # Forward landmarks: solve q - u(q) = p by fixed point iteration (u is smooth and small).
    q = lm.copy()
    for _ in range(8):
        qx, qy = _displacement(q[:, 0], q[:, 1], lm, geometry)
        q = lm + np.stack([qx, qy], axis=1)
    return rgb, alpha, q


def _face_mask(lm: np.ndarray, *, sigma: float = 12.0) -> np.ndarray:
    """Soft [CANON_H, CANON_W] float32 mask of the skin of the face (forehead to chin)."""
    left, right, _, mouth_l, mouth_r = lm
    iod = float(np.linalg.norm(right - left))
    centre = (left + right + mouth_l + mouth_r) / 4
    mask = np.zeros((CANON_H, CANON_W), np.float32)
    axes = (int(iod * 1.2), int(iod * 1.75))
    cv2.ellipse(mask, (int(centre[0]), int(centre[1] - 0.15 * iod)), axes, 0, 0, 360, 1.0, -1)
    return cv2.GaussianBlur(mask, (0, 0), sigma)


def _recolour(rgb: np.ndarray, alpha: np.ndarray, lm: np.ndarray, colours: dict[str, Any]) -> np.ndarray:
    """Skin tone inside the face, a tint on hair (or hat) above it, another on the clothes below."""
    img = rgb.astype(np.float32)
    face = _face_mask(lm)[..., None]
    eye_y = float(lm[:2, 1].mean())
    yy = np.arange(CANON_H, dtype=np.float64)[:, None, None]  # float64: exp (module docstring)
    above = (1.0 / (1.0 + np.exp((yy - (eye_y - 25.0)) / 8.0))).astype(np.float32)  # smooth "above the brows"
    below = (1.0 / (1.0 + np.exp(-(yy - (lm[3:, 1].mean() + 75.0)) / 8.0))).astype(np.float32)  # below the chin
    hair = np.clip(alpha[..., None] * above * (1.0 - face), 0, 1)
    clothes = np.clip(alpha[..., None] * below * (1.0 - face), 0, 1)
    skin = img * np.asarray(colours["skin_gain"], np.float32)
    img = img * (1 - face) + skin * face
    # Tint by luminance so that texture (strands, folds) survives the colour change.
    luma = _luma(img)
    for region, key in ((hair, "hair"), (clothes, "clothes")):
        tinted = luma[..., None] * (np.asarray(colours[key], np.float32) / 128.0)
        img = img * (1 - region * 0.8) + tinted * region * 0.8
    return np.clip(img, 0, 255).astype(np.uint8)


class _Pen:
    """cv2 drawing with float coordinates and lengths (quarter-pixel precision) into a uint8 mask."""

    _SHIFT = 2  # cv2 fixed point: coordinates and radii are in units of 1/4 pixel

    def __init__(self, mask: np.ndarray) -> None:
        self.mask = mask

    @staticmethod
    def _p(point: Sequence[float] | np.ndarray) -> tuple[int, int]:
        return round(float(point[0]) * 4), round(float(point[1]) * 4)

    def ellipse(
        self,
        centre: Any,
        axes: tuple[float, float],
        *,
        arc: tuple[int, int] = (0, 360),
        thickness: int = -1,
        value: int = 255,
    ) -> None:
        size = (round(axes[0] * 4), round(axes[1] * 4))
        cv2.ellipse(self.mask, self._p(centre), size, 0, arc[0], arc[1], value, thickness, cv2.LINE_AA, self._SHIFT)

    def circle(self, centre: Any, radius: float, *, thickness: int = -1) -> None:
        cv2.circle(self.mask, self._p(centre), round(radius * 4), 255, thickness, cv2.LINE_AA, self._SHIFT)

    def rect(self, corner: Any, opposite: Any, *, thickness: int = -1) -> None:
        cv2.rectangle(self.mask, self._p(corner), self._p(opposite), 255, thickness, cv2.LINE_AA, self._SHIFT)

    def polyline(self, points: Sequence[Any], *, thickness: int, closed: bool = False, fill: bool = False) -> None:
        pts = np.array([self._p(p) for p in points], np.int32)
        if fill:
            cv2.fillPoly(self.mask, [pts], 255, cv2.LINE_AA, self._SHIFT)
        else:
            cv2.polylines(self.mask, [pts], closed, 255, thickness, cv2.LINE_AA, self._SHIFT)


def _overlay(
    img: np.ndarray,
    draw: Callable[[_Pen], None],
    colour: Sequence[float],
    opacity: float,
    *,
    blur: float = 0.0,
    texture: np.ndarray | None = None,
) -> None:
    """Draw a shape with ``draw(pen)`` and blend ``colour`` over ``img`` in place.

    ``img`` is [H, W, 3] float32; ``texture`` an optional [H, W] float32 multiplier of the colour.
    """
    mask = np.zeros(img.shape[:2], np.uint8)
    draw(_Pen(mask))
    # Blend only inside the shape's bounding box (plus the blur's reach): shapes are small, frames not.
    x, y, w, h = cv2.boundingRect(mask)
    if w == 0 or h == 0:
        return
    pad = int(np.ceil(3 * blur)) + 1 if blur > 0 else 0
    y0, y1 = max(y - pad, 0), min(y + h + pad, img.shape[0])
    x0, x1 = max(x - pad, 0), min(x + w + pad, img.shape[1])
    weight = mask[y0:y1, x0:x1].astype(np.float32) * (opacity / 255.0)
    if blur > 0:
        weight = cv2.GaussianBlur(weight, (0, 0), blur)
    paint = np.asarray(colour, np.float32)[None, None, :]
    if texture is not None:
        paint = paint * texture[y0:y1, x0:x1, None]
    roi = img[y0:y1, x0:x1]
    roi += (paint - roi) * weight[..., None]


@dataclass(frozen=True)
class _Face:
    """Reference points of a face in the canonical frame; accessory sizes are in units of ``iod``."""

    left: np.ndarray  # [2] eye centres, nose tip, mouth centre (x, y)
    right: np.ndarray
    nose: np.ndarray
    mouth: np.ndarray
    iod: float  # inter-ocular distance, pixels

    @classmethod
    def from_landmarks(cls, lm: np.ndarray) -> _Face:
        return cls(lm[0], lm[1], lm[2], (lm[3] + lm[4]) / 2, float(np.linalg.norm(lm[1] - lm[0])))

    def at(self, origin: np.ndarray, dx: float, dy: float) -> np.ndarray:
        """``origin`` moved by (dx, dy) inter-ocular distances."""
        return origin + self.iod * np.array([dx, dy])

    @property
    def brow_mid(self) -> np.ndarray:
        return (self.left + self.right) / 2


#: draw(img, face, spec, hair colour, rng): paints one accessory described by ``spec`` onto ``img`` in place.
Accessory = Callable[[np.ndarray, _Face, Any, Any, np.random.Generator], None]


def _beard(img: np.ndarray, f: _Face, opacity: float, hair: Any, rng: np.random.Generator) -> None:
    stubble = rng.uniform(0.55, 1.0, img.shape[:2]).astype(np.float32)

    def draw(pen: _Pen) -> None:
        pen.ellipse(f.at(f.mouth, 0, 0.22), (1.1 * f.iod, 0.9 * f.iod), arc=(0, 180))
        pen.ellipse(f.mouth, (0.4 * f.iod, 0.175 * f.iod), value=0)  # the lips stay clear

    _overlay(img, draw, hair, opacity, blur=5.0, texture=stubble)


def _moustache(img: np.ndarray, f: _Face, width: float, hair: Any, rng: np.random.Generator) -> None:
    top = f.nose + (f.mouth - f.nose) * 0.55
    _overlay(
        img, lambda pen: pen.ellipse(top, (0.55 * width * f.iod, 0.175 * f.iod), arc=(180, 360)), hair, 0.9, blur=1.5
    )


def _lipstick(img: np.ndarray, f: _Face, colour: Any, hair: Any, rng: np.random.Generator) -> None:
    _overlay(img, lambda pen: pen.ellipse(f.mouth, (0.36 * f.iod, 0.1 * f.iod)), colour, 0.45, blur=2.0)


def _freckles(img: np.ndarray, f: _Face, spots: Any, hair: Any, rng: np.random.Generator) -> None:
    def draw(pen: _Pen) -> None:
        for dx, dy in spots:
            pen.circle(f.at(f.nose, dx, dy), 2.5)

    _overlay(img, draw, (120, 70, 40), 0.5, blur=0.8)


def _mole(img: np.ndarray, f: _Face, where: Any, hair: Any, rng: np.random.Generator) -> None:
    _overlay(img, lambda pen: pen.circle(f.at(f.nose, *where), 4.0), (45, 25, 15), 0.95, blur=0.7)


def _scar(img: np.ndarray, f: _Face, points: Any, hair: Any, rng: np.random.Generator) -> None:
    path = [f.at(f.nose, dx, dy) for dx, dy in points]
    _overlay(img, lambda pen: pen.polyline(path, thickness=3), (175, 80, 80), 0.85, blur=0.6)


def _eyebrows(img: np.ndarray, f: _Face, _: Any, hair: Any, rng: np.random.Generator) -> None:
    def draw(pen: _Pen) -> None:
        for eye in (f.left, f.right):
            pen.ellipse(f.at(eye, 0, -0.22), (0.26 * f.iod, 0.125 * f.iod), arc=(200, 340), thickness=7)

    _overlay(img, draw, hair, 0.9, blur=1.0)


def _glasses(img: np.ndarray, f: _Face, g: dict[str, Any], hair: Any, rng: np.random.Generator) -> None:
    half_w = 0.36 if g["round"] else 0.4  # lens half width, iod

    def lens(pen: _Pen, eye: np.ndarray, thickness: int) -> None:
        if g["round"]:
            pen.circle(eye, 0.36 * f.iod, thickness=thickness)
        else:
            pen.rect(f.at(eye, -0.4, -0.27), f.at(eye, 0.4, 0.27), thickness=thickness)

    def frame(pen: _Pen) -> None:
        t = g["thickness"]
        for eye in (f.left, f.right):
            lens(pen, eye, t)
        pen.polyline([f.at(f.left, half_w, 0), f.at(f.right, -half_w, 0)], thickness=t)  # bridge
        pen.polyline([f.at(f.left, -half_w, 0), f.at(f.left, -0.75, 0.05)], thickness=t)  # temples
        pen.polyline([f.at(f.right, half_w, 0), f.at(f.right, 0.75, 0.05)], thickness=t)

    def tint(pen: _Pen) -> None:
        for eye in (f.left, f.right):
            lens(pen, eye, -1)

    if g["lens"] > 0:
        _overlay(img, tint, g["lens_colour"], g["lens"])
    _overlay(img, frame, g["colour"], 1.0)


def _hat(img: np.ndarray, f: _Face, h: dict[str, Any], hair: Any, rng: np.random.Generator) -> None:
    brim = f.at(f.brow_mid, 0, -0.95)
    shade = rng.uniform(0.85, 1.0, img.shape[:2]).astype(np.float32)

    def draw(pen: _Pen) -> None:
        if h["style"] == "beanie":
            pen.ellipse(f.at(brim, 0, 0.1), (1.45 * f.iod, 1.35 * f.iod), arc=(180, 360))
            pen.rect(f.at(brim, -1.5, -0.1), f.at(brim, 1.5, 0.3))
        else:
            pen.ellipse(brim, (2.0 * f.iod, 0.28 * f.iod))
            pen.rect(f.at(brim, -1.15, -h["height"]), f.at(brim, 1.15, 0))

    _overlay(img, draw, h["colour"], 1.0, blur=1.0, texture=shade)
    if h["band"] is not None:
        _overlay(img, lambda pen: pen.rect(f.at(brim, -1.15, -0.3), f.at(brim, 1.15, -0.08)), h["band"], 1.0)


def _headband(img: np.ndarray, f: _Face, colour: Any, hair: Any, rng: np.random.Generator) -> None:
    arc = (1.35 * f.iod, 1.05 * f.iod)
    _overlay(
        img,
        lambda pen: pen.ellipse(f.at(f.brow_mid, 0, 0.05), arc, arc=(200, 340), thickness=round(0.22 * f.iod)),
        colour,
        0.95,
        blur=0.8,
    )


#: Accessories in drawing order (later ones cover earlier ones): name -> draw(img, face, spec, hair, rng).
_ACCESSORY_DRAW: dict[str, Accessory] = {
    "beard": _beard,
    "moustache": _moustache,
    "lipstick": _lipstick,
    "freckles": _freckles,
    "mole": _mole,
    "scar": _scar,
    "eyebrows": _eyebrows,
    "glasses": _glasses,
    "hat": _hat,
    "headband": _headband,
}


def _draw_accessories(img: np.ndarray, lm: np.ndarray, acc: dict[str, Any], rng: np.random.Generator) -> None:
    """Draw the identity's accessories onto ``img`` ([CANON_H, CANON_W, 3] float32, 0..255) in place."""
    face = _Face.from_landmarks(lm)
    for name, draw in _ACCESSORY_DRAW.items():
        if name in acc:
            draw(img, face, acc[name], acc["hair_colour"], rng)


def _colour(rng: np.random.Generator, low: int = 0, high: int = 255) -> tuple[float, float, float]:
    return tuple(float(v) for v in rng.integers(low, high + 1, size=3))  # type: ignore[return-value]


_HAIR = ((25, 20, 18), (70, 45, 25), (120, 80, 40), (200, 165, 100), (150, 60, 25), (160, 160, 160), (235, 230, 220))
_ACCESSORIES = ("glasses", "moustache", "beard", "hat", "mole", "scar", "eyebrows", "headband", "lipstick", "freckles")
_ACCESSORY_WEIGHTS = np.array([1.6, 1.0, 0.9, 1.0, 1.2, 0.8, 1.0, 0.6, 0.7, 0.7])


def _sample_looks(rng: np.random.Generator) -> tuple[dict[str, Any], dict[str, Any]]:
    """Identity-level colours and accessories. Every identity gets 2-4 accessories so that two
    variants of the same base never differ only by a subtle warp."""
    tone = rng.uniform(0.7, 1.2)
    warmth = rng.uniform(-0.1, 0.12)
    colours = {
        "skin_gain": (tone * (1 + warmth), tone, tone * (1 - warmth)),
        "hair": _HAIR[rng.integers(len(_HAIR))],
        "clothes": _colour(rng, 20, 235),
    }
    chosen = set(
        rng.choice(
            len(_ACCESSORIES),
            size=int(rng.integers(2, 5)),
            replace=False,
            p=_ACCESSORY_WEIGHTS / _ACCESSORY_WEIGHTS.sum(),
        ).tolist()
    )
    names = {_ACCESSORIES[i] for i in chosen}
    if {"hat", "headband"} <= names:
        names.discard("headband")
    acc: dict[str, Any] = {"hair_colour": colours["hair"]}
    if "glasses" in names:
        acc["glasses"] = {
            "round": bool(rng.random() < 0.5),
            "thickness": int(rng.integers(2, 4)),
            "colour": _colour(rng, 0, 200),
            "lens": float(rng.choice([0.0, 0.0, 0.15, 0.3])),
            "lens_colour": _colour(rng, 0, 120),
        }
    if "moustache" in names:
        acc["moustache"] = float(rng.uniform(0.75, 1.1))
    if "beard" in names:
        acc["beard"] = float(rng.uniform(0.35, 0.65))
    if "hat" in names:
        acc["hat"] = {
            "style": str(rng.choice(["beanie", "brimmed"])),
            "colour": _colour(rng, 10, 245),
            "height": float(rng.uniform(0.8, 1.4)),
            "band": _colour(rng) if rng.random() < 0.5 else None,
        }
    if "mole" in names:
        acc["mole"] = (float(rng.choice([-1, 1]) * rng.uniform(0.5, 0.9)), float(rng.uniform(-0.2, 0.9)))
    if "scar" in names:
        side = float(rng.choice([-1, 1]))
        x0, y0 = side * rng.uniform(0.45, 0.7), rng.uniform(-0.9, 0.3)
        acc["scar"] = ((x0, y0), (x0 + side * 0.15, y0 + 0.3), (x0 + side * 0.05, y0 + 0.6))
    if "eyebrows" in names:
        acc["eyebrows"] = True
    if "headband" in names:
        acc["headband"] = _colour(rng, 0, 255)
    if "lipstick" in names:
        acc["lipstick"] = (float(rng.uniform(150, 230)), float(rng.uniform(10, 60)), float(rng.uniform(40, 110)))
    if "freckles" in names:
        acc["freckles"] = tuple((float(rng.uniform(-0.9, 0.9)), float(rng.uniform(-0.4, 0.2))) for _ in range(14))
    return colours, acc


@cpu_independent()
def make_identity(index: int, *, seed: int) -> Identity:
    """Identity ``index`` for ``seed``: a deformed, recoloured, accessorised variant of base ``index % 2``."""
    rng = np.random.default_rng([seed, 1, index])
    spec = _BASES[index % len(_BASES)]
    rgb, alpha = _canonical_base(index % len(_BASES))
    geometry = _sample_geometry(rng)
    colours, acc = _sample_looks(rng)
    rgb, alpha, lm = _deform(rgb, alpha, CANON_LANDMARKS, geometry)
    img = _recolour(rgb, alpha, lm, colours).astype(np.float32)
    _draw_accessories(img, lm, acc, rng)
    rgba = np.dstack([np.clip(img, 0, 255), alpha * 255.0]).round().astype(np.uint8)
    attributes = {"geometry": geometry, "accessories": sorted(k for k in acc if k != "hair_colour")}
    return Identity(f"{spec.name}_{index:03d}", spec.name, rgba, lm, attributes)


# -------------------------------------------------------------------------------------------- images


def _texture(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """A crop of a face-free photo or texture that scikit-image ships, resized; [H, W, 3] float32 0..255."""
    name = str(rng.choice(["coffee", "rocket", "chelsea", "brick", "grass", "gravel"]))
    photo = _photo(name)
    ph, pw = photo.shape[:2]
    cw, ch = int(pw * rng.uniform(0.4, 1.0)), int(ph * rng.uniform(0.4, 1.0))
    x0, y0 = int(rng.integers(0, pw - cw + 1)), int(rng.integers(0, ph - ch + 1))
    crop = cv2.resize(photo[y0 : y0 + ch, x0 : x0 + cw], (width, height), interpolation=cv2.INTER_LINEAR)
    crop = crop.astype(np.float32)
    if name in ("brick", "grass", "gravel"):  # grey textures: give them a colour
        crop = crop * (np.asarray(_colour(rng, 60, 255), np.float32) / 200.0)
    return crop


def _background(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """A random background, [height, width, 3] float32 in 0..255: gradient, texture or noise, plus clutter."""
    kind = rng.choice(["linear", "radial", "texture", "noise"], p=[0.3, 0.15, 0.35, 0.2])
    xx = np.arange(width, dtype=np.float32)[None, :]
    yy = np.arange(height, dtype=np.float32)[:, None]
    if kind == "texture":
        bg = _texture(rng, width, height)
    elif kind == "noise":
        # Blotches around one muted colour: real out-of-focus backgrounds are rarely rainbow-coloured.
        base = np.asarray(_colour(rng, 30, 225), np.float32)
        shape = (int(rng.integers(3, 12)), int(rng.integers(3, 12)), 3)
        coarse = base + rng.normal(0, rng.uniform(15, 50), size=shape).astype(np.float32)
        bg = cv2.resize(coarse, (width, height), interpolation=cv2.INTER_CUBIC)
    else:
        a, b = np.asarray(_colour(rng), np.float32), np.asarray(_colour(rng), np.float32)
        if kind == "linear":
            angle = rng.uniform(0, 2 * np.pi)
            t = (xx * np.cos(angle) + yy * np.sin(angle)) / max(width, height)
            t = (t - t.min()) / max(float(t.max() - t.min()), 1e-6)
        else:
            cx, cy = rng.uniform(0, width), rng.uniform(0, height)
            t = np.clip(np.hypot(xx - cx, yy - cy) / max(width, height), 0, 1)
        bg = a + (b - a) * t[..., None]
    bg = bg + rng.standard_normal(size=(height, width, 1), dtype=np.float32) * np.float32(rng.uniform(0, 10))
    for _ in range(int(rng.integers(2, 12))):
        _clutter(bg, rng)
    return np.clip(bg, 0, 255)


def _clutter(img: np.ndarray, rng: np.random.Generator) -> None:
    """One random shape (rectangle, disc, line, polygon) painted into ``img`` in place."""
    h, w = img.shape[:2]
    p = (int(rng.integers(0, w)), int(rng.integers(0, h)))
    size = int(rng.uniform(0.03, 0.25) * min(w, h))
    kind = rng.integers(4)
    colour = _colour(rng)

    def draw(pen: _Pen) -> None:
        if kind == 0:
            pen.rect(p, (p[0] + size, p[1] + size * rng.uniform(0.3, 2)))
        elif kind == 1:
            pen.circle(p, size / 2)
        elif kind == 2:
            pen.polyline([p, (rng.integers(0, w), rng.integers(0, h))], thickness=int(rng.integers(1, 8)))
        else:
            pen.polyline(
                np.array(p) + rng.integers(-size, size + 1, size=(int(rng.integers(3, 7)), 2)), thickness=0, fill=True
            )

    _overlay(img, draw, colour, float(rng.uniform(0.4, 1.0)))


def _canvas_size(rng: np.random.Generator, min_side: int, max_side: int) -> tuple[int, int]:
    """(width, height) like real photos: long side in range, aspect 1:1 to 3:2 either way."""
    long = int(rng.integers(min_side, max_side + 1))
    short = max(min_side, round(long / rng.uniform(1.0, 1.5)))
    return (long, short) if rng.random() < 0.45 else (short, long)


def _pose(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """[3, 3] float64 homography canonical frame -> canvas: rotation within +-15 degrees, slight
    perspective and aspect change, face box 30-55% of the shorter side, face wholly inside."""
    c = (CANON_FACE_BOX[:2] + CANON_FACE_BOX[2:]) / 2
    jitter = rng.uniform(-0.035, 0.035, size=(4, 2)) * CANON_W
    square = np.array([[0, 0], [CANON_W, 0], [CANON_W, CANON_H], [0, CANON_H]], np.float32)
    persp = cv2.getPerspectiveTransform(square, (square + jitter).astype(np.float32)).astype(np.float64)
    angle = np.deg2rad(rng.uniform(-15, 15))
    box_w = CANON_FACE_BOX[2] - CANON_FACE_BOX[0]
    scale = rng.uniform(0.3, 0.55) * min(width, height) / box_w
    stretch = rng.uniform(0.94, 1.06)
    rot = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
    linear = rot @ np.diag([scale * stretch, scale / stretch])
    h = np.eye(3)
    h[:2, :2] = linear
    h = h @ persp
    corners = np.array([[CANON_FACE_BOX[i], CANON_FACE_BOX[j]] for i, j in ((0, 1), (2, 1), (2, 3), (0, 3))])
    placed = _apply_h(h, corners) - _apply_h(h, c[None])[0]
    lo, hi = placed.min(axis=0), placed.max(axis=0)
    margin = 0.02 * min(width, height)
    # Shrink if the rotated box cannot fit (only for extreme aspect/scale draws).
    fit = min(1.0, (width - 2 * margin) / (hi[0] - lo[0]), (height - 2 * margin) / (hi[1] - lo[1]))
    if fit < 1.0:
        h = np.diag([fit, fit, 1.0]) @ h
        lo, hi = lo * fit, hi * fit
    low, high = margin - lo, np.array([width, height]) - margin - hi
    # Portraits mostly run off the bottom edge: prefer heights where the shoulders reach it.
    shoulders = _apply_h(h, np.array([[CANON_W / 2, CANON_H - 70.0]]))[0, 1] - _apply_h(h, c[None])[0, 1]
    if rng.random() < 0.75:
        low[1] = min(max(low[1], height - shoulders), high[1])
    centre = rng.uniform(low, high)
    shift = centre - _apply_h(h, c[None])[0]
    return np.array([[1, 0, shift[0]], [0, 1, shift[1]], [0, 0, 1]]) @ h


def _apply_h(h: np.ndarray, points: np.ndarray) -> np.ndarray:
    """Map [N, 2] points through a [3, 3] homography."""
    p = np.c_[points, np.ones(len(points))] @ h.T
    return p[:, :2] / p[:, 2:3]


def _relight(img: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """White balance, a directional light gradient, contrast, brightness, gamma, blur and sensor noise.

    ``img`` is [H, W, 3] float32 in 0..255; returns uint8.
    """
    h, w = img.shape[:2]
    gains = rng.uniform(0.88, 1.12, size=3).astype(np.float32)
    angle, strength = rng.uniform(0, 2 * np.pi), rng.uniform(0, 0.6)
    contrast, brightness = rng.uniform(0.75, 1.2), rng.uniform(-0.1, 0.1)
    gamma = rng.uniform(0.75, 1.35)
    blur = rng.uniform(0.4, 1.6) if rng.random() < 0.6 else 0.0
    noise = rng.uniform(0, 5.0)
    xs = (np.arange(w, dtype=np.float32) - w / 2) * np.float32(np.cos(angle) / max(w, h))
    ys = (np.arange(h, dtype=np.float32) - h / 2) * np.float32(np.sin(angle) / max(w, h))
    light = 1.0 + strength * (xs[None, :] + ys[:, None])  # [H, W] directional light
    # x -> (x * gain * light - 0.5) * contrast + 0.5 + brightness, in 0..255 and in place.
    x = img * (gains * np.float32(contrast))
    x *= light[..., None]
    x += np.float32(255.0 * (0.5 - 0.5 * contrast + brightness))
    x = np.clip(x + 0.5, 0, 255).astype(np.uint8)
    lut = np.clip(255.0 * (np.arange(256) / 255.0) ** gamma + 0.5, 0, 255).astype(np.uint8)
    x = cv2.LUT(x, lut)
    if blur > 0:
        x = cv2.GaussianBlur(x, (0, 0), blur)
    if noise > 0.5:
        grain = rng.standard_normal(size=x.shape, dtype=np.float32) * np.float32(noise)
        x = np.clip(x + grain + 0.5, 0, 255).astype(np.uint8)
    return x


@cpu_independent()
def render_image(
    identity: Identity, rng: np.random.Generator, *, min_side: int, max_side: int
) -> tuple[np.ndarray, np.ndarray]:
    """One photo of ``identity``: ([H, W, 3] uint8 RGB, [5, 2] float64 landmarks in that image)."""
    width, height = _canvas_size(rng, min_side, max_side)
    bg = _background(rng, width, height)
    h = _pose(rng, width, height)
    bust = cv2.warpPerspective(
        identity.rgba,
        h,
        (width, height),
        flags=cv2.INTER_LINEAR,
        borderMode=cv2.BORDER_CONSTANT,
        borderValue=(0, 0, 0, 0),
    ).astype(np.float32)
    a = bust[..., 3:] / 255.0
    composite = bust[..., :3] * a + bg * (1 - a)
    return _relight(composite, rng), _apply_h(h, identity.landmarks)


# ------------------------------------------------------------------------------------------ encoding


def _save(pil: Image.Image, fmt: str, **options: Any) -> bytes:
    buffer = io.BytesIO()
    pil.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def _rgba(rgb: np.ndarray) -> np.ndarray:
    """RGB plus an alpha that rounds the corners away (like a cut-out sticker); the face stays opaque."""
    h, w = rgb.shape[:2]
    r = int(0.15 * min(w, h))
    mask = np.zeros((h, w), np.uint8)
    cv2.rectangle(mask, (r, 0), (w - 1 - r, h - 1), 255, -1)
    cv2.rectangle(mask, (0, r), (w - 1, h - 1 - r), 255, -1)
    for cx, cy in ((r, r), (w - 1 - r, r), (r, h - 1 - r), (w - 1 - r, h - 1 - r)):
        cv2.circle(mask, (cx, cy), r, 255, -1, cv2.LINE_AA)
    return np.dstack([rgb, mask])


#: EXIF orientation -> how the upright image is stored so that honouring the tag restores it.
_EXIF_STORE = {3: Image.Transpose.ROTATE_180, 6: Image.Transpose.ROTATE_90, 8: Image.Transpose.ROTATE_270}


def encode(rgb: np.ndarray, kind: str, rng: np.random.Generator) -> bytes:
    """File bytes of the upright [H, W, 3] uint8 image ``rgb`` as ``kind`` (fixed encoder settings,
    no timestamps or other metadata, so equal inputs give equal bytes)."""
    pil = Image.fromarray(rgb)
    quality = int(rng.integers(70, 96))
    if kind == "jpg":
        return _save(pil, "JPEG", quality=quality)
    if kind == "png":
        return _save(pil, "PNG", compress_level=6)
    if kind == "bmp":
        return _save(pil, "BMP")
    if kind == "webp":
        return _save(pil, "WEBP", quality=85, method=4)
    if kind == "grey":
        return _save(pil.convert("L"), "JPEG", quality=quality)
    if kind == "rgba":
        return _save(Image.fromarray(_rgba(rgb)), "PNG", compress_level=6)
    if kind == "cmyk":
        return _save(pil.convert("CMYK"), "JPEG", quality=quality)
    if kind == "exif":
        orientation = int(rng.choice([6, 8, 3]))
        exif = Image.Exif()
        exif[0x0112] = orientation
        return _save(pil.transpose(_EXIF_STORE[orientation]), "JPEG", quality=quality, exif=exif.tobytes())
    if kind == "png16":
        grey = _luma(rgb.astype(np.float64))
        return _save(Image.fromarray(np.round(grey * 257.0).astype(np.uint16)), "PNG", compress_level=6)
    raise ValueError(f"unknown image kind {kind!r}")


# ------------------------------------------------------------------------------------------- dataset


def _assign_kinds(seed: int, identities: int, per_identity: int) -> dict[tuple[int, int], str]:
    """Image kind per (identity, image) slot: each special kind once (while slots last), ~8% PNG, rest JPEG."""
    rng = np.random.default_rng([seed, 0])
    slots = [(i, j) for i in range(identities) for j in range(per_identity)]
    order = rng.permutation(len(slots))
    kinds = {slot: ("png" if rng.random() < 0.08 else "jpg") for slot in slots}
    for kind, position in zip(SPECIAL_KINDS, order):
        kinds[slots[int(position)]] = kind
    return kinds


def _file_name(identity: str, number: int, ext: str) -> str:
    return f"{identity}/{identity}_{number:04d}.{ext}"


def _bad_bytes(
    kind: str, owner: Identity, source: SampleImage, rng: np.random.Generator, root: Path, params: SampleDataParams
) -> tuple[str, bytes, str]:
    """(extension, file bytes, detail) of one bad file of ``kind`` for identity ``owner``; ``source``
    is the good image that a duplicate copies (already written under ``root``)."""
    sides = {"min_side": params.min_side, "max_side": params.max_side}
    if kind == "truncated":
        data = encode(render_image(owner, rng, **sides)[0], "jpg", rng)
        return "jpg", data[: len(data) * 45 // 100], f"first 45% of a {len(data)}-byte JPEG"
    if kind == "empty":
        return "jpg", b"", "0 bytes"
    if kind == "not_image":
        return "jpg", f"Not an image: a text file named like one (sample-data seed {params.seed}).\n".encode(), "text"
    if kind == "no_face":
        name = str(rng.choice(["coffee", "rocket", "brick", "gravel"]))
        width, height = _canvas_size(rng, params.min_side, params.max_side)
        photo = cv2.resize(_photo(name), (width, height), interpolation=cv2.INTER_AREA)
        return "jpg", _save(Image.fromarray(photo), "JPEG", quality=88), f"scikit-image {name}, no face"
    if kind == "tiny":
        rgb = render_image(owner, rng, **sides)[0]
        size = (32, 24) if rgb.shape[1] > rgb.shape[0] else (24, 32)
        small = cv2.resize(rgb, size, interpolation=cv2.INTER_AREA)
        return "jpg", _save(Image.fromarray(small), "JPEG", quality=90), "{}x{} pixels".format(*size)
    if kind in ("duplicate_within", "duplicate_across"):
        return source.path.rsplit(".", 1)[1], (root / source.path).read_bytes(), f"copy of {source.path}"
    raise ValueError(f"unknown bad file kind {kind!r}")


def _bad_files(
    identities: Sequence[Identity], images: Sequence[SampleImage], params: SampleDataParams, root: Path
) -> list[BadFile]:
    """Write one file of each of :data:`BAD_KINDS` into random identity folders under ``root``."""
    rng = np.random.default_rng([params.seed, 3])
    n = len(identities)
    next_number = {ident.name: params.images_per_identity + 1 for ident in identities}
    written: list[BadFile] = []
    for kind in BAD_KINDS:
        # A duplicate copies an image of its own identity, or of another one (identities >= 2) whose
        # name sorts first, so that a reader walking in sorted order meets the original before the copy.
        if kind == "duplicate_across":
            donor, owner = sorted((identities[k] for k in rng.choice(n, size=2, replace=False)), key=lambda i: i.name)
        else:
            donor = owner = identities[int(rng.integers(n))]
        donor_images = [im for im in images if im.identity == donor.name]
        source = donor_images[int(rng.integers(len(donor_images)))]
        ext, data, detail = _bad_bytes(kind, owner, source, rng, root, params)
        path = _file_name(owner.name, next_number[owner.name], ext)
        next_number[owner.name] += 1
        (root / path).write_bytes(data)
        written.append(BadFile(path, kind, detail))
    return written


def _check_output(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise FacepipeError(f"output exists and is not a folder: {out}")
    if out.is_dir() and any(out.iterdir()):
        raise FacepipeError(f"output folder is not empty: {out} (remove it or choose another path)")


@cpu_independent()
def make_sample_dataset(
    out: str | Path, params: SampleDataParams, *, progress: Callable[[int], None] | None = None
) -> SampleReport:
    """Write the sample raw dataset to ``out`` (which must not exist or be empty) and report it.

    The folder appears all at once (written into a temporary sibling, renamed at the end).
    ``progress(n)`` is called after each identity with the number of images it added.
    """
    out = Path(out)
    _check_output(out)
    kinds = _assign_kinds(params.seed, params.identities, params.images_per_identity)
    identities: list[Identity] = []
    images: list[SampleImage] = []
    with atomic_output_dir(out) as tmp:
        for i in range(params.identities):
            identity = make_identity(i, seed=params.seed)
            identities.append(identity)
            (tmp / identity.name).mkdir()
            for j in range(params.images_per_identity):
                rng = np.random.default_rng([params.seed, 2, i, j])
                rgb, landmarks = render_image(identity, rng, min_side=params.min_side, max_side=params.max_side)
                kind = kinds[(i, j)]
                path = _file_name(identity.name, j + 1, _EXTENSIONS[kind])
                (tmp / path).write_bytes(encode(rgb, kind, rng))
                images.append(SampleImage(path, identity.name, kind, (rgb.shape[1], rgb.shape[0]), landmarks))
            if progress is not None:
                progress(params.images_per_identity)
        bad: list[BadFile] = []
        if params.bad_files:
            bad = _bad_files(identities, images, params, tmp)
    return SampleReport(out, tuple(ident.name for ident in identities), tuple(images), tuple(bad))


__all__ = [
    "BAD_KINDS",
    "SPECIAL_KINDS",
    "BadFile",
    "Identity",
    "SampleImage",
    "SampleReport",
    "cpu_independent",
    "encode",
    "make_identity",
    "make_sample_dataset",
    "render_image",
]
