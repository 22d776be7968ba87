"""Faces and accuracy of insightface ``.bin`` validation sets: shared by ``evaluate`` and validation
during training."""

from __future__ import annotations

import numpy as np

from facepipe.data.decode import Reject, load_image
from facepipe.errors import FacepipeError
from facepipe.io.insightface_bin import BinSet

#: Pixels a .bin face may have (they are 112x112; bigger ones are not faces of a validation set).
_MAX_PIXELS = 1024 * 1024


def decode_bin_faces(bin_set: BinSet, *, image_size: int) -> np.ndarray:
    """[2P, S, S, 3] uint8 RGB faces of a .bin set, decoded as stored; each must be ``image_size`` square."""
    faces = np.empty((len(bin_set.images), image_size, image_size, 3), np.uint8)
    for index, data in enumerate(bin_set.images):
        try:
            face = load_image(data, max_pixels=_MAX_PIXELS)
        except Reject as reject:
            raise FacepipeError(f"{bin_set.name}.bin: image {index}: {reject.reason} ({reject.detail})") from None
        if face.shape[:2] != (image_size, image_size):
            raise FacepipeError(
                f"{bin_set.name}.bin: image {index} is {face.shape[1]}x{face.shape[0]}, "
                f"the model expects {image_size}x{image_size} aligned faces"
            )
        faces[index] = face
    return faces
