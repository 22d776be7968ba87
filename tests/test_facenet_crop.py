"""``prepare.crop: facenet``: facenet-pytorch's ``extract_face`` (box grown by the margin, clipped,
resized to 160, no rotation), against facenet-pytorch's own ``MTCNN(image_size=160, margin=14,
post_process=False)`` on the sample photos, with ``detector: facenet_pytorch`` (its own cascade; facepipe's
``mtcnn`` finds the same faces with boxes a few pixels apart: tests/test_detection.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from facepipe.alignment import facenet_crop
from facepipe.config import PrepareParams
from facepipe.io import ShardSet
from facepipe.io.manifest import shard_set_crop
from facepipe.io.records import encode_image
from facepipe.shardset import manifest_params
from facepipe.stages import prepare
from rawdata import in_process

MARGIN, SIZE = 14, 160
# detect_size above the photos' sides: the detector sees them whole, as facenet-pytorch's MTCNN does
PARAMS = PrepareParams(
    detector="facenet_pytorch", crop="facenet", margin=MARGIN, image_size=SIZE, detect_size=1024, min_face_size=20
)


@pytest.fixture(scope="module")
def reference():
    from facenet_pytorch import MTCNN

    return MTCNN(image_size=SIZE, margin=MARGIN, post_process=False, device="cpu")  # min_face_size 20


@pytest.fixture(scope="module")
def facenet_set(sample_raw: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("facenet") / "set"
    prepare.run(PARAMS, sample_raw, out, workers=1, submit=in_process(sample_raw, PARAMS), progress=False)
    return out


def photo(raw: Path, path: str) -> Image.Image:
    """The photo as prepare decodes it (EXIF orientation applied, 16-bit and alpha images mapped to 8-bit
    RGB), handed to facenet-pytorch as the PIL image its MTCNN takes."""
    from facepipe.data.decode import load_image_reduced

    return Image.fromarray(load_image_reduced((raw / path).read_bytes(), max_pixels=40_000_000, longest=None).image)


def test_the_crop_is_extract_face_pixel_for_pixel(sample_raw: Path, reference) -> None:
    """Given the same box, the crop is facenet-pytorch's to the bit (the box from its detector here)."""
    from facenet_pytorch.models.utils.detect_face import extract_face

    checked = 0
    for path in sorted(p.relative_to(sample_raw).as_posix() for p in sample_raw.glob("*/*"))[:12]:
        try:
            image = photo(sample_raw, path)
        except Exception:  # noqa: BLE001 - the sample's deliberately broken files
            continue
        boxes, _ = reference.detect(image)
        if boxes is None:
            continue
        box = boxes[0]
        theirs = extract_face(image, box, image_size=SIZE, margin=MARGIN)  # [3, S, S] float pixel values
        ours = facenet_crop(np.asarray(image), box, image_size=SIZE, margin=MARGIN)
        assert ours.shape == (SIZE, SIZE, 3) and ours.dtype == np.uint8
        assert np.array_equal(ours, theirs.permute(1, 2, 0).numpy().astype(np.uint8)), path
        checked += 1
    assert checked >= 4
    # a box at the photo's corner is clipped, as extract_face clips it
    image = np.asarray(photo(sample_raw, "hopper_000/hopper_000_0002.jpg"))
    corner = np.array([-20.0, -30.0, 60.0, 70.0])
    theirs = extract_face(Image.fromarray(image), corner, image_size=SIZE, margin=MARGIN)
    ours = facenet_crop(image, corner, image_size=SIZE, margin=MARGIN)
    assert np.array_equal(ours, theirs.permute(1, 2, 0).numpy().astype(np.uint8))


@pytest.mark.slow
def test_prepare_crop_facenet_gives_facenet_pytorchs_faces(sample_raw: Path, facenet_set: Path, reference) -> None:
    shard_set = ShardSet(facenet_set)
    assert shard_set_crop(shard_set.manifest) == "facenet"
    params = shard_set.manifest["params"]
    assert (params["crop"], params["margin"], params["image_size"]) == ("facenet", MARGIN, SIZE)
    box_errors, pixel_errors = [], []
    for index in range(len(shard_set)):
        record = shard_set.record(index)
        image = photo(sample_raw, record.path)
        boxes, _ = reference.detect(image)
        assert boxes is not None, record.path  # the same faces: every face we kept, facenet-pytorch finds
        theirs_box = boxes[0]  # select_largest: the largest first, as face_selection: largest
        box_errors.append(np.abs(np.asarray(record.header["box"]) - theirs_box).max())
        theirs = reference(image).permute(1, 2, 0).numpy()  # post_process=False: pixel values
        pixel_errors.append(np.abs(record.image().astype(np.float64) - theirs).mean())
        # the JPEG error is all there is: their face through prepare's own encoder is the stored face, to the byte
        stored = encode_image(theirs.astype(np.uint8), encoding=PARAMS.encoding, quality=PARAMS.quality)
        assert stored == record.payload, record.path
    box_errors, pixel_errors = np.array(box_errors), np.array(pixel_errors)
    measured = {"faces": len(box_errors), "box_max_px": float(box_errors.max()), "pixel_mean_abs_max": float(pixel_errors.max())}
    print(json.dumps(measured))  # shown with -s
    assert len(box_errors) >= 20
    assert box_errors.max() <= 1.0, box_errors
    assert pixel_errors.max() <= 2.5, pixel_errors  # JPEG quality 95 of a 160 px face: measured up to 1.95


def test_an_arcface_set_keeps_its_manifest_without_crop_keys() -> None:
    """Sets prepared before the choice existed stay byte-identical: arcface records no crop or margin."""
    assert "crop" not in manifest_params(PrepareParams())
    assert "margin" not in manifest_params(PrepareParams())
    assert shard_set_crop({"params": {}}) == "arcface" and shard_set_crop({}) == "arcface"


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"margin": 14}, "margin is for crop: facenet"),
        ({"crop": "facenet", "margin": 160, "image_size": 160}, "margin (160) must be smaller than image_size (160)"),
        ({"crop": "facenet", "detector": "none"}, "crop: facenet needs a detector's box"),
    ],
)
def test_bad_crop_params(fields, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        PrepareParams(**fields)


def test_the_defaults_are_facenet_pytorchs_160_pixels_and_no_margin() -> None:
    """MTCNN(image_size=160, margin=0) are facenet-pytorch's defaults, and so are facenet_crop's."""
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (240, 200, 3), dtype=np.uint8)
    box = np.array([40.3, 50.7, 150.2, 190.9])
    crop = facenet_crop(image, box)
    assert crop.shape == (160, 160, 3) and crop.dtype == np.uint8
    assert np.array_equal(crop, facenet_crop(image, box, image_size=160, margin=0))
    assert not np.array_equal(crop, facenet_crop(image, box, image_size=160, margin=1))
