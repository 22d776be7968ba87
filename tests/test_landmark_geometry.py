"""Where landmarks land: pixel centres at integers through every resize and reduced decode, and each
detector's points mirrored with the photo (issue 21, item 5).

Alignment (cv2.warpAffine) puts pixel i's centre at i. A position found in a smaller image (a 1/r JPEG
decode, or the detector's downscaled input) must come back as the same position in the photo: reduced
pixel x covers full pixels r*x .. r*x + r - 1, so it maps to r*x + (r - 1)/2, not r*x. Before this was
fixed, landmarks of photos decoded at 1/4 came back 1.5 px up and left; MTCNN's also sat one detector
pixel right and down (its networks place points 1-based, like the reference MATLAB code). The mirror
test measures both without a ground truth: a photo's left-eye x plus its mirror's right-eye x is W - 1
when the points are right, whatever the detector's noise.
"""

from __future__ import annotations

import io

import cv2
import numpy as np
import pytest
from PIL import Image

from facepipe.config import PrepareParams, SampleDataParams
from facepipe.data.decode import Reject, load_image, load_image_reduced
from facepipe.data.extract import process_chunk
from facepipe.detection.base import to_source
from facepipe.synthetic.photos import make_sample_dataset

TRUE_CENTRE = (517.3, 301.6)  # (x, y), full-resolution pixels


def blob(size: tuple[int, int] = (1024, 768), centre: tuple[float, float] = TRUE_CENTRE, sigma: float = 9.0) -> np.ndarray:
    """[H, W, 3] uint8: a bright Gaussian spot at a sub-pixel ``centre`` on grey."""
    ys, xs = np.mgrid[0 : size[1], 0 : size[0]].astype(np.float64)
    spot = np.exp(-((xs - centre[0]) ** 2 + (ys - centre[1]) ** 2) / (2 * sigma**2))
    return np.repeat((60 + 190 * spot).round().astype(np.uint8)[..., None], 3, axis=2)


def centroid(image: np.ndarray) -> np.ndarray:
    """(x, y) of the spot: the intensity-weighted mean of the pixels above the grey, centres at integers."""
    weight = np.clip(image[..., 0].astype(np.float64) - 60, 0, None)
    weight[weight < 0.05 * weight.max()] = 0
    ys, xs = np.mgrid[0 : image.shape[0], 0 : image.shape[1]]
    return np.asarray([(xs * weight).sum(), (ys * weight).sum()]) / weight.sum()


@pytest.mark.parametrize("reduction", [2, 4, 8])
def test_a_reduced_decode_maps_back_to_full_resolution_centres(reduction):
    buffer = io.BytesIO()
    Image.fromarray(blob()).save(buffer, format="JPEG", quality=100, subsampling=0)
    full = load_image_reduced(buffer.getvalue(), max_pixels=10**8, longest=None)
    reduced = load_image_reduced(buffer.getvalue(), max_pixels=10**8, longest=1024 // reduction)
    assert full.reduction == 1 and reduced.reduction == reduction
    np.testing.assert_allclose(centroid(full.image), TRUE_CENTRE, atol=0.05)  # the measure itself
    found = centroid(reduced.image)
    np.testing.assert_allclose(reduced.to_full(found), TRUE_CENTRE, atol=0.2)  # the spot is ~1 px wide at 1/8
    assert np.abs(found * reduction - TRUE_CENTRE).min() > (reduction - 1) / 2 - 0.1  # the old mapping's error
    np.testing.assert_allclose(reduced.from_full(reduced.to_full(found)), found, atol=1e-12)


@pytest.mark.parametrize("side", [900, 640, 341])
def test_a_resized_detector_input_maps_back_to_source_centres(side):
    """The detectors' downscale (OpenCV area resampling, sides rounded): per-axis ratios, centres."""
    image = blob()
    scale = side / 1024
    small = cv2.resize(image, (side, round(768 * scale)), interpolation=cv2.INTER_AREA)
    found = centroid(small)
    np.testing.assert_allclose(to_source(found, image.shape, small.shape), TRUE_CENTRE, atol=0.1)
    if side < 640:
        assert np.abs(found / scale - TRUE_CENTRE).max() > 0.5  # dividing by the scale is not enough


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """(image, mirrored image) pairs of the sample photos, widths a multiple of 16 so that their JPEGs
    mirror block for block; also 4x larger ones, which prepare decodes at 1/4 for detection."""
    raw = tmp_path_factory.mktemp("mirror") / "raw"
    make_sample_dataset(raw, SampleDataParams(identities=10, images_per_identity=3, seed=3, bad_files=False))
    images = []
    for path in sorted(raw.glob("*/*.jpg")):
        try:
            images.append(load_image(path.read_bytes(), max_pixels=10**8))
        except Reject:
            continue
    return images


def mirror_offsets(detector: str, images: list[np.ndarray], factor: int, folder) -> np.ndarray:
    """Per photo, the mean over the 5 points of (x in the photo + x of the mirrored point in the
    mirror - (W - 1)) / 2: 0 when the points are where they should be, through prepare's own path."""
    paths, widths = [], []
    for index, image in enumerate(images):
        if factor > 1:
            image = cv2.resize(image, None, fx=factor, fy=factor, interpolation=cv2.INTER_CUBIC)
        image = np.ascontiguousarray(image[:, : image.shape[1] // 16 * 16])
        for tag, pixels in (("a", image), ("m", np.ascontiguousarray(image[:, ::-1]))):
            path = folder / f"x{factor}" / f"{index:03d}{tag}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels).save(path, quality=100, subsampling=0)
        paths.append((f"x{factor}/{index:03d}a.jpg", f"x{factor}/{index:03d}m.jpg"))
        widths.append(image.shape[1])
    params = PrepareParams(detector=detector, min_face_size=40)
    flat = [path for pair in paths for path in pair]
    done = {o.path: o for start in range(0, len(flat), 16) for o in process_chunk(flat[start : start + 16], str(folder), params, "cpu")}
    offsets = []
    for (a, m), width in zip(paths, widths):
        if done[a].accepted and done[m].accepted:
            left = np.asarray(done[a].header["landmarks"])[:, 0]
            right = np.asarray(done[m].header["landmarks"])[[1, 0, 2, 4, 3], 0]  # the mirror's left eye is the right one
            offsets.append(((left + right - (width - 1)) / 2).mean())
    return np.asarray(offsets)


@pytest.mark.parametrize("detector", ["retinaface", "mtcnn"])
def test_mirrored_photos_give_mirrored_landmarks(photos, tmp_path, detector):
    """Median over ~30 photos at their own size (250-700 px). Before the fix MTCNN's was +1.3 px
    (RetinaFace's +0.1). On larger photos the two networks' noise grows with the detector's
    downscaling (a few px per photo at 4x), so the mapping through reduced decodes and downscaled
    inputs is held by the two exact tests above instead. MTCNN keeps a bias of about +0.5 detector
    pixels on faces under ~100 detector pixels, a property of its networks (docs/parameters.md)."""
    offsets = mirror_offsets(detector, photos, 1, tmp_path)
    assert len(offsets) >= 0.8 * len(photos)
    assert abs(np.median(offsets)) <= 0.5, (np.median(offsets), offsets.round(2).tolist())
