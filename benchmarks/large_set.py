"""A benchmark set of large multi-face photos, composed from the sample identities.

Real datasets are not 300-px single faces: scraped photos are 1-3 MP and many are group photos. Each
image here is a 1920 x 1280 (2.5 MP) JPEG of 3-10 sample-data photos (one face each, 250-700 px,
scaled 0.6-1.3x) pasted into distinct cells of a 4 x 3 grid on a smooth random background, so it has
3-10 faces of roughly 50-280 px. Images go into ``OUT/<identity>/`` after the identity of their
largest pasted photo, the layout ``facepipe prepare`` reads. Deterministic for a given seed.

    python benchmarks/large_set.py SAMPLE_RAW OUT [--images 48] [--seed 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import cv2
import numpy as np
from PIL import Image

from facepipe.data.decode import Reject, load_image
from facepipe.errors import FacepipeError

WIDTH, HEIGHT = 1920, 1280
GRID = (4, 3)  # columns, rows


def _background(rng: np.random.Generator) -> np.ndarray:
    """[HEIGHT, WIDTH, 3] uint8: low-frequency colour noise, like an out-of-focus scene."""
    coarse = rng.integers(40, 215, (6, 9, 3), dtype=np.uint8)
    return cv2.resize(coarse, (WIDTH, HEIGHT), interpolation=cv2.INTER_CUBIC)


def compose(photos: list[tuple[str, np.ndarray]], rng: np.random.Generator) -> tuple[np.ndarray, str]:
    """One group photo from 3-10 of ``photos`` ((identity, [H, W, 3] uint8)); returns it and the
    identity of its largest pasted photo."""
    canvas = _background(rng)
    cell_w, cell_h = WIDTH // GRID[0], HEIGHT // GRID[1]
    count = int(rng.integers(3, 11))
    cells = rng.choice(GRID[0] * GRID[1], size=count, replace=False)
    largest, owner = 0, ""
    for cell in cells:
        identity, photo = photos[int(rng.integers(len(photos)))]
        scale = float(rng.uniform(0.6, 1.3))
        scale = min(scale, cell_w / photo.shape[1], cell_h / photo.shape[0])  # stays inside its cell
        pasted = cv2.resize(photo, None, fx=scale, fy=scale, interpolation=cv2.INTER_AREA)
        h, w = pasted.shape[:2]
        x = (cell % GRID[0]) * cell_w + int(rng.integers(0, cell_w - w + 1))
        y = (cell // GRID[0]) * cell_h + int(rng.integers(0, cell_h - h + 1))
        canvas[y : y + h, x : x + w] = pasted
        if h * w > largest:
            largest, owner = h * w, identity
    return canvas, owner


def make_large_set(sample_raw: Path, out: Path, *, images: int = 48, seed: int = 0) -> int:
    """Write ``images`` group photos composed from the JPEG photos of ``sample_raw`` into ``out``;
    returns how many were written."""
    photos = []
    for path in sorted(sample_raw.glob("*/*.jpg")):
        try:
            photos.append((path.parent.name, load_image(path.read_bytes(), max_pixels=10**8)))
        except Reject:  # the planted bad files
            continue
    if not photos:
        raise FacepipeError(f"no sample photos in {sample_raw} (JPEGs in identity folders; facepipe sample-data writes them)")
    rng = np.random.default_rng(seed)
    for index in range(images):
        canvas, identity = compose(photos, rng)
        target = out / identity / f"group_{index:04d}.jpg"
        target.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(canvas).save(target, format="JPEG", quality=90)
    return images


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sample_raw", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--images", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        written = make_large_set(args.sample_raw, args.out, images=args.images, seed=args.seed)
    except FacepipeError as error:
        parser.exit(2, f"large_set.py: {error}\n")
    print(written, "images written")


if __name__ == "__main__":
    main()
