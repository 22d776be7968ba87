"""Small raw datasets of real faces (photos that installed packages ship) plus real bad files."""

from __future__ import annotations

import io
import os
import shutil
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import matplotlib.cbook
import numpy as np
import skimage.data
from PIL import Image

from facepipe.config import PrepareParams
from facepipe.data.extract import process_chunk


def hopper() -> np.ndarray:
    with Image.open(matplotlib.cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)) as pil:
        return np.asarray(pil.convert("RGB"))


def astronaut() -> np.ndarray:
    return skimage.data.astronaut()


def variant(image: np.ndarray, *, angle: float = 0.0, scale: float = 1.0, pad: int = 0) -> np.ndarray:
    pil = Image.fromarray(image)
    if scale != 1.0:
        pil = pil.resize((round(pil.width * scale), round(pil.height * scale)), Image.BICUBIC)
    if pad:
        canvas = Image.new("RGB", (pil.width + 2 * pad, pil.height + 2 * pad), (90, 120, 150))
        canvas.paste(pil, (pad, pad))
        pil = canvas
    if angle:
        pil = pil.rotate(angle, resample=Image.BICUBIC, fillcolor=(90, 120, 150))
    return np.asarray(pil)


def save(image: np.ndarray, path: Path, **kw) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(path, **kw)


def make_faces_raw(root: Path) -> dict[str, str]:
    """Three real-face identities and one bad file per reject reason; returns {path: expected reason}."""
    faces = {"hopper": hopper(), "astro": astronaut()}
    for name, image in faces.items():
        save(image, root / name / "0001.jpg", quality=92)
        save(variant(image, angle=8), root / name / "0002.jpg", quality=90)
        save(variant(image, scale=0.8, pad=60), root / name / "0003.png")
    save(variant(faces["astro"], angle=-6, scale=0.9), root / "zz_astro2" / "0001.jpg", quality=88)
    expected = {}
    # an exact copy inside the same identity, and one across identities
    shutil.copy(root / "hopper" / "0001.jpg", root / "hopper" / "0009.jpg")
    expected["hopper/0009.jpg"] = "duplicate"
    shutil.copy(root / "astro" / "0002.jpg", root / "zz_astro2" / "0002.jpg")
    expected["zz_astro2/0002.jpg"] = "duplicate"
    (root / "astro" / "empty.jpg").write_bytes(b"")
    expected["astro/empty.jpg"] = "empty_file"
    data = (root / "hopper" / "0002.jpg").read_bytes()
    (root / "hopper" / "truncated.jpg").write_bytes(data[: len(data) // 3])
    expected["hopper/truncated.jpg"] = "unreadable"
    (root / "hopper" / "notes.jpg").write_text("not an image at all\n")
    expected["hopper/notes.jpg"] = "not_an_image"
    save(skimage.data.coffee(), root / "astro" / "coffee.jpg", quality=85)
    expected["astro/coffee.jpg"] = "no_face"
    save(variant(faces["hopper"], scale=0.05), root / "hopper" / "tiny.png")
    expected["hopper/tiny.png"] = "image_too_small"
    save(np.full((1100, 1000, 3), 127, np.uint8), root / "astro" / "huge.png")
    expected["astro/huge.png"] = "too_many_pixels"
    os.symlink(root / "does-not-exist.jpg", root / "astro" / "dangling.jpg")
    expected["astro/dangling.jpg"] = "io_error"
    save(faces["hopper"], root / "stray.jpg")
    expected["stray.jpg"] = "outside_identity_folder"
    return expected


TEST_PARAMS = {"max_pixels": 1_000_000, "chunk_size": 4, "samples_per_shard": 3}


def jpeg_bytes(image: np.ndarray, **kw) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", **kw)
    return buffer.getvalue()


class StandInDetector:
    """Finds one centred face in every image, and records the images of each call: for tests of
    everything around detection (accounting, batching, memory) that need no real detector."""

    def __init__(self) -> None:
        self.calls: list[list[tuple[int, ...]]] = []

    def detect(self, images: list[np.ndarray], *, reductions=None) -> list[list]:
        from facepipe.alignment import template
        from facepipe.detection import Face

        self.calls.append([image.shape for image in images])
        faces = []
        for image in images:
            side = min(image.shape[:2])
            points = template(112) * (side / 112.0)
            faces.append([Face(box=np.array([0.0, 0.0, side, side]), score=0.99, landmarks=points)])
        return faces


def in_process(raw: Path, params: PrepareParams) -> Callable[[list[list[str]]], Future]:
    """A ``submit`` for ``prepare.run`` that runs the chunk worker in this process (no Dask cluster: a
    fast, real prepare), each group of chunks as a done future (one list of outcomes per chunk)."""
    def submit(group: list[list[str]]) -> Future:
        future: Future = Future()
        future.set_result([process_chunk(paths, str(raw), params, "cpu") for paths in group])
        return future

    return submit
